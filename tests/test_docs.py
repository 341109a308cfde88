"""The documentation: the site builds with `mkdocs build --strict` (a broken link or anchor fails it), and every
relative link of the README reaches a file, and a heading of it where the link names one."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _anchors(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify

    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slugify(re.sub(r"[`*]", "", h), "-") for h in re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)}


def test_the_site_builds_strictly(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "reference" / "config" / "index.html").is_file()


def test_every_page_under_docs_is_in_the_nav():
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def files(item):
        if isinstance(item, str):
            yield item
        elif isinstance(item, dict):
            for value in item.values():
                yield from files(value)
        elif isinstance(item, list):
            for value in item:
                yield from files(value)

    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert pages == set(files(nav))


def test_the_readmes_links_reach_their_files_and_headings():
    readme = ROOT / "README.md"
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        page = ROOT / path if path else readme
        if not page.exists() or (anchor and anchor not in _anchors(page)):
            broken.append(target)
    assert not broken, f"README.md links to what does not exist: {broken}"
