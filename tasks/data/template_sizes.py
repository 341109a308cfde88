"""Size checks made *before* a template operation runs, so that no single operation builds a value larger than the
render's output budget, or an integer too large to compute at once.

Why before: `7 ** 10**9`, `s * 10**9` or `'x'.ljust(10**10)` is one C call that holds the GIL until it finishes, so
neither the render's time limit (raised between bytecodes) nor a SIGTERM handler (run between bytecodes of the main
thread) can stop it once it has started. Each operation that can build a large value is sized from its operands
first, and refused when the result would be over budget; what is left runs in time linear in the budget.

    operation                                       estimated result                        refused when over
    a ** b, a * b (integers)                        b * log2|a|, bits(a) + bits(b) bits     MAX_INT_BITS
    a + b, a ~ b, seq * n                           size(a) + size(b), size(seq) * n        the output budget
    fmt % args, fmt.format(..), |format             len(fmt) + fields * (largest arg + width)
    s.center/ljust/rjust/zfill(w), n.to_bytes(w)    w
    |join, |replace, |indent, |wordwrap, |center,   per filter (see `_FILTER_SIZES`)
    |batch, |slice, |sum, |tojson(indent=..)
    {{ x }}, a macro's or block's text, any call's  size(result)
    or filter's result

`size` is what `str()` would print, at least: a string's length, a list's items' sizes plus separators, counted by a
walk that stops once past the budget (a list holding one string many times counts it each time, as `str()` prints it).
"""

from __future__ import annotations

import functools
import math
import re

from jinja2.runtime import Macro
from jinja2.utils import Namespace

from sftflow.tasks.data.template_limits import RenderLimitError, current_budget

# Integers from data are at most 4300 decimal digits (Python's own limit on parsing them); 65536 bits leaves room for
# any arithmetic a template needs, and an operation on such integers takes microseconds.
MAX_INT_BITS = 1 << 16


def size_of(value, limit: int, indent: int = 0) -> int:
    """Characters `str(value)` prints, at least (with `indent`: `tojson(indent=...)`); counting stops past `limit`."""
    if type(value) in _SCALARS:  # most values a template handles: no walk
        return len(value) if type(value) is str else 8
    total, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (str, bytes)):
            total += len(item)
        elif isinstance(item, bool) or item is None:
            total += 4
        elif isinstance(item, int):
            total += item.bit_length() // 4 + 1
        elif isinstance(item, dict):
            total += 2 + (4 + indent * (depth + 1)) * len(item)
            if total <= limit:
                stack.extend((x, depth + 1) for pair in item.items() for x in pair)
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 2 + (2 + indent * (depth + 1)) * len(item)
            if total > limit:
                break
            if set(map(type, item)) <= {str}:  # a list of strings, sized at C speed (doubling one walks it often)
                total += sum(map(len, item))
            else:
                stack.extend((x, depth + 1) for x in item)
        elif isinstance(item, Namespace):  # str() prints its attributes
            stack.append((item._Namespace__attrs, depth))  # noqa: SLF001 (Jinja keeps them under a mangled name)
        else:
            total += 1
        if total > limit:
            break
    return total


_SCALARS = frozenset({str, bool, float, type(None)})


def _refuse_over(size: float, what: str, budget: int | None = None) -> None:
    budget = current_budget() if budget is None else budget
    if size > budget:
        raise RenderLimitError(f"{what} would make about {int(size)} characters, over the output budget of {budget}")


def checked_result(value, what: str):
    """`value`, refused when it prints larger than the output budget."""
    budget = current_budget()
    if type(value) is str:
        if len(value) > budget:
            _refuse_over(len(value), what, budget)
        return value
    _refuse_over(size_of(value, budget), what, budget)
    return value


def _int_bits(what: str, bits: float) -> None:
    if bits > MAX_INT_BITS:
        raise RenderLimitError(f"{what} would make an integer of about {int(bits)} bits, over {MAX_INT_BITS}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def checked_binop(operator: str, left, right):
    """`left <operator> right` for the sandbox's intercepted operators (`*`, `**`, `+`, `%`), sized first."""
    budget = current_budget()
    if operator == "+" and type(left) is str and type(right) is str:  # the common case, kept cheap
        if len(left) + len(right) > budget:
            _refuse_over(len(left) + len(right), "'+'", budget)
        return left + right
    if operator == "**":
        if _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
            _int_bits("'**'", right * math.log2(abs(left)))
        return left**right
    if operator == "*":
        if _is_int(left) and _is_int(right):
            _int_bits("'*'", left.bit_length() + right.bit_length())
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(n) and n > 1:
                _refuse_over(size_of(seq, budget) * n, f"'*' of a {type(seq).__name__} by {n}", budget)
        return left * right
    if operator == "+":
        if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            _refuse_over(size_of(left, budget) + size_of(right, budget), "'+'", budget)
        elif _is_int(left) and _is_int(right):
            _int_bits("'+'", max(left.bit_length(), right.bit_length()) + 1)
        return left + right
    if operator == "%":
        if isinstance(left, str):
            values = right if isinstance(right, tuple) else (right,)
            if isinstance(right, dict):
                values = tuple(right.values())
            _refuse_over(format_size(left, values, "%", budget), "'%' formatting", budget)
        return left % right
    raise AssertionError(operator)


_NUMBER_RE = re.compile(r"\d+")


def format_size(fmt: str, values, style: str, budget: int) -> int:
    """An upper estimate of `fmt % values` (`style` "%") or `fmt.format(*values)` ("{"): each field prints at most
    the largest value, padded to at most the largest width written in the format or, where widths come from the
    arguments (`%*d`, `{:{}}`), passed in it."""
    fields = fmt.count(style)
    if fields == 0:
        return len(fmt)
    widths = [int(n) for n in _NUMBER_RE.findall(fmt)]
    if "*" in fmt or ":{" in fmt:
        widths += [v for v in values if _is_int(v)]
    largest = max((size_of(v, budget) for v in values), default=0)
    return len(fmt) + fields * (largest + max(widths, default=0))


def checked_concat(join, parts: tuple):
    """`~`: `join(parts)` once the parts' printed sizes add up to at most the output budget."""
    budget = current_budget()
    total = 0
    for part in parts:
        total += len(part) if type(part) is str else size_of(part, budget - total)
        _refuse_over(total, "'~'", budget)
    return join(parts)


def bounded_concat(pieces) -> str:
    """The text of a macro, `{% set %}` block or call block: its pieces joined, up to the output budget."""
    budget = current_budget()
    out, total = [], 0
    for piece in pieces:
        total += len(piece)
        _refuse_over(total, "a block's text", budget)
        out.append(piece)
    return "".join(out)


# ------------------------------------------------------------------------------------------------------------ calls

_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill", "to_bytes"})


def checked_call(obj, args: tuple, kwargs: dict, call):
    """A call from the template (`{{ f(x) }}`, `s.method(x)`), sized first where it can grow, and its result after.

    Returns `call(obj, *args, **kwargs)`; a generator given to `join` is read into a list first, to be sized."""
    budget = current_budget()
    target = getattr(obj, "__wrapped__", obj)  # the sandbox wraps str.format
    owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
    if isinstance(owner, (str, bytes, int)) and not isinstance(owner, bool):
        what = f"{type(owner).__name__}.{name}()"
        if name in _WIDTH_METHODS:
            width = args[0] if args else kwargs.get("width", kwargs.get("length", 0))
            _refuse_over(width if _is_int(width) else 0, what, budget)
        elif name == "expandtabs" and isinstance(owner, (str, bytes)):
            tabsize = args[0] if args else kwargs.get("tabsize", 8)
            _refuse_over(len(owner) + owner.count(b"\t" if isinstance(owner, bytes) else "\t") * tabsize, what, budget)
        elif name == "join" and isinstance(owner, (str, bytes)) and args:
            items = list(args[0])
            args = (items, *args[1:])
            _refuse_over(len(owner) * len(items) + size_of(items, budget), what, budget)
        elif name == "replace" and isinstance(owner, (str, bytes)) and len(args) >= 2:
            _refuse_over(replace_size(owner, *args[:3]), what, budget)
        elif name in ("format", "format_map") and isinstance(owner, str):
            values = (*args, *kwargs.values()) if name == "format" else tuple(args[0].values()) if args else ()
            _refuse_over(format_size(owner, values, "{", budget), what, budget)
    result = call(obj, *args, **kwargs)
    what = f"macro {obj.name}" if isinstance(obj, Macro) else f"calling {name or type(obj).__name__}"
    return checked_result(result, what)


def replace_size(s, old, new, count=-1) -> int:
    count = -1 if count is None else count
    found = s.count(old) if old else len(s) + 1
    if count >= 0:
        found = min(found, count)
    return len(s) + found * max(len(new) - len(old), 0)


# ---------------------------------------------------------------------------------------------------------- filters


def _join_size(value, d="", attribute=None, budget=0):
    return size_of(value, budget) + len(d) * len(value)


def _indent_size(s, width=4, first=False, blank=False, budget=0):
    pad = len(width) if isinstance(width, str) else width
    return len(s) + (s.count("\n") + 1) * pad


def _wordwrap_size(s, width=79, break_long_words=True, wrapstring=None, break_on_hyphens=True, budget=0):
    # At most one break per character (width 1), each a `wrapstring` (a newline by default).
    return len(s) * (1 + len(wrapstring or "\n"))


def _fill_size(value, count, fill_with=None, budget=0):
    # batch(n, fill) pads the last batch to n items; slice(n, fill) makes n lists, padding each with one item.
    return size_of(value, budget) + count * (4 + (0 if fill_with is None else size_of(fill_with, budget)))


def _sum_size(iterable, attribute=None, start=0, budget=0):
    # Summing sequences copies the growing result once per item: the work is items x result size.
    if not isinstance(start, (str, list, tuple)):
        return 0
    return (len(iterable) + 1) * (size_of(iterable, budget) + size_of(start, budget))


def _format_filter_size(value, *args, budget=0, **kwargs):
    return format_size(value, (*args, *kwargs.values()), "%", budget) if isinstance(value, str) else 0


def _tojson_size(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False, budget=0):
    step = len(indent) if isinstance(indent, str) else (indent or 0)
    return size_of(x, budget, indent=step + 1 if indent is not None else 0)


# Filters whose result can be larger than their input: the estimate of the result, from the filter's arguments (the
# value first, without Jinja's context argument). `materialize` lists the filters whose value may be a generator, read
# into a list first so that it can be sized (and handed on as that list).
_FILTER_SIZES = {
    "join": _join_size,
    "replace": lambda s, old, new, count=None, budget=0: replace_size(str(s), str(old), str(new), count),
    "indent": _indent_size,
    "wordwrap": _wordwrap_size,
    "center": lambda value, width=80, budget=0: max(len(value), width),
    "batch": _fill_size,
    "slice": _fill_size,
    "sum": _sum_size,
    "format": _format_filter_size,
    "tojson": _tojson_size,
    "string": lambda value, budget=0: size_of(value, budget),
    "pprint": lambda value, budget=0: size_of(value, budget),
    "list": lambda value, budget=0: size_of(value, budget),
    "xmlattr": lambda d, autospace=True, budget=0: size_of(d, budget) * 6,
    "urlencode": lambda value, budget=0: size_of(value, budget) * 3,
}
_MATERIALIZE = frozenset({"join", "batch", "slice", "sum"})
# Filters whose value is a string by contract: a number or list given to them is printed first.
_STRING_VALUE = frozenset({"indent", "wordwrap", "center"})


def checked_filter(name: str, fn):
    """Filter `fn`, sized before it runs (`_FILTER_SIZES`) and its result after."""
    estimate = _FILTER_SIZES.get(name)
    context_args = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(fn)  # keeps `jinja_pass_arg`, so Jinja still passes the context argument
    def checked(*args, **kwargs):
        budget = current_budget()
        if estimate is not None and len(args) > context_args:
            args = list(args)
            value = args[context_args]
            if name in _MATERIALIZE and not isinstance(value, (list, tuple, str, dict)):
                value = args[context_args] = list(value)
            elif name in _STRING_VALUE and not isinstance(value, str):
                value = str(checked_result(value, f"filter {name}"))
            _refuse_over(estimate(value, *args[context_args + 1 :], budget=budget, **kwargs), f"filter {name}", budget)
        return checked_result(fn(*args, **kwargs), f"filter {name}")

    return checked


def lipsum_checked(lipsum):
    def checked(n=5, html=True, min=20, max=100):
        _refuse_over(n * max * 10, f"lipsum(n={n}, max={max})")
        return lipsum(n=n, html=html, min=min, max=max)

    return checked
