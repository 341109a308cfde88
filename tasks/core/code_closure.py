"""The sftflow modules a stage runs, found from its entry modules' imports, and a fingerprint of their source.

A stage's cache key must change whenever code that can change its output changes. Hand-kept module lists drift
(a kernel, a metrics module or the export were missing from the training stage's list), so the list is derived:
starting from a stage's entry modules, every `import sftflow...` / `from sftflow... import ...` statement in their
source, at any depth (function-level lazy imports included), is followed to the module it names, transitively.
Sources are read from the files, never imported, so a fingerprint has no import side effects (Triton modules
read `TRITON_INTERPRET` when imported).
"""

from __future__ import annotations

import ast
import importlib.util
import threading
from functools import cache

from sftflow.tasks.core.fingerprint import sha256_text

PACKAGE = "sftflow"
# CPython 3.11's parser is not safe to run from several threads at once ("AST constructor recursion depth mismatch"):
# the data stages compute their cache keys on a thread pool, and every thread's first key parses the sources.
_PARSE_LOCK = threading.Lock()


def module_source(name: str) -> str:
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        raise ValueError(f"{name}: no such module (a stage's code fingerprint names it)")
    with open(spec.origin, encoding="utf-8") as f:
        return f.read()


@cache
def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # a parent that is a plain attribute, not a package
        return False


def _parents(name: str) -> list[str]:
    """A module's package `__init__`s run when it is imported: `a.b.c` -> [`a.b`] (the top package has none here)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(2, len(parts))]


@cache
def imported_modules(name: str, source: str) -> frozenset[str]:
    """The sftflow modules `source` (of module `name`) imports anywhere in its body."""
    found: set[str] = set()
    package = name if importlib.util.find_spec(name).submodule_search_locations else name.rpartition(".")[0]
    with _PARSE_LOCK:
        tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == PACKAGE)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up `level - 1` packages
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            if base.split(".")[0] != PACKAGE:
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                found.add(candidate if _is_module(candidate) else base)
    return frozenset(m for module in found for m in (module, *_parents(module)))


def import_closure(entries: tuple[str, ...], source=None) -> tuple[str, ...]:
    """Every sftflow module reachable from `entries` through imports, sorted. `source(name)` reads a module
    (default: `module_source`)."""
    source = source or module_source
    seen: set[str] = set()
    todo = [m for entry in entries for m in (entry, *_parents(entry))]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        todo.extend(imported_modules(name, source(name)) - seen)
    return tuple(sorted(seen))


def code_fingerprint(entries: tuple[str, ...], source=None) -> str:
    """sha256 over the names and sources of `import_closure(entries)`."""
    source = source or module_source
    return sha256_text("\n".join(f"{name}\n{source(name)}" for name in import_closure(entries, source)))


@cache
def cached_code_fingerprint(entries: tuple[str, ...]) -> str:
    """`code_fingerprint` of the installed sources, once per process."""
    return code_fingerprint(entries)
