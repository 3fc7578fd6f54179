"""A Jinja2 sandbox whose renders are bounded in time, memory and output.

``bounded_environment()`` builds an ``ImmutableSandboxedEnvironment`` that fails loudly at the
first unsafe access (``SecurityError``, not Undefined); ``render()`` renders one of its templates
under a ``Budget`` and raises ``Exceeded`` (naming the bound) when the template hits one:

* the output may reach ``max_bytes`` UTF-8 bytes (or, with None, the value cap in characters),
  counted chunk by chunk while rendering (``Template.generate()``);
* no value may grow past the value cap in characters (strings, output buffers of macros and
  ``{% set %}`` blocks), an eighth of it in items (lists, at least 65536) or 65536 bits (ints),
  and all the strings and lists one render builds may total at most 32 times the value cap.
  Every operation that can build a big value is checked, before it allocates wherever the size
  can be known: the intercepted operators ``+ * ** %``, concatenation ``~`` (rewritten in the
  parsed template into a filter that checks), calls (``str.format``, ``.replace``, ``.join``,
  ``.ljust``, ``.split``, ``lipsum()``, and the functions given with a size check ...), every
  filter (integer arguments past the cap are refused, except where they are data, as in
  ``default`` or ``format``; ``center``, ``indent``, ``wordwrap``, ``replace``, ``join``,
  ``format``, ``tojson`` ... are sized first; every result is checked), and ``str()`` of
  containers for output;
* all ``for`` loops of one render together may take at most ``MAX_LOOP_ITERATIONS`` steps;
* the wall-clock budget (``timeout`` seconds) is checked at every loop step, call, operator,
  filter, output buffer and output chunk, so a runaway render ends within about ``timeout``.

  Not bounded: a single C-level operation on structures the template built with exponential
  sharing (``==`` or ``|sort`` on ``[x, x]`` nested 40 deep) runs to its end; ``str()`` and
  ``tojson`` of such structures are refused.

The budget of the render under way lives in a context variable, which the hooks read.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import math
import re
import string
import time
import types
from collections.abc import Callable, ItemsView, KeysView, Mapping, Sequence, Sized, ValuesView
from contextvars import ContextVar
from typing import Any

from _string import formatter_field_name_split
from jinja2 import Template, nodes, pass_environment, pass_eval_context
from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter
from jinja2.runtime import LoopContext, markup_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg, generate_lorem_ipsum
from jinja2.visitor import NodeTransformer

__all__ = ["MAX_LOOP_ITERATIONS", "Budget", "Exceeded", "Sandbox", "bounded_environment", "render",
           "text_size", "utf8_len"]

#: steps all ``for`` loops of one render may take together
MAX_LOOP_ITERATIONS = 10**6

_MIN_ITEM_CAP = 1 << 16         # lists may always reach this many items
_MAX_INT_BITS = 1 << 16         # the largest int a template may compute (about 19 700 digits)
_BUILD_FACTOR = 32              # everything one render builds, in units of the value cap

# --- the render budget ------------------------------------------------------------------------


class Exceeded(Exception):
    """A render bound was hit.  ``bound`` completes "chat template exceeded ..."; ``size`` marks
    the size bounds, which are blamed on the conversation when it is itself large."""

    def __init__(self, bound: str, size: bool = False) -> None:
        super().__init__(bound)
        self.bound = bound
        self.size = size


class Budget:
    """What one render may still spend.  The sandbox hooks call it; it raises ``Exceeded``."""

    def __init__(self, timeout: float | None, value_cap: int, input_size: int) -> None:
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.value_cap = value_cap
        self.item_cap = max(value_cap // 8, _MIN_ITEM_CAP)
        self.build_cap = _BUILD_FACTOR * value_cap
        self.input_size = input_size
        self.built = 0
        self.loops = 0

    def tick(self) -> None:
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise Exceeded(f"its time budget of {self.timeout:g} s")

    def step(self) -> None:
        """One iteration of a for loop."""
        self.loops += 1
        if self.loops > MAX_LOOP_ITERATIONS:
            raise Exceeded(f"its loop limit of {MAX_LOOP_ITERATIONS:,} iterations")
        self.tick()

    def too_big(self, what: str, limit: int) -> Exceeded:
        return Exceeded(f"the sandbox's size limit: {what} (the limit is {limit:,})", size=True)

    def expect_chars(self, n: int) -> None:
        """Refuse, before building it, a string or buffer of about ``n`` characters."""
        if n > self.value_cap:
            raise self.too_big(f"it would build a value of about {n:,} characters", self.value_cap)

    def expect_items(self, n: int) -> None:
        if n > self.item_cap:
            raise self.too_big(f"it would build a list of {n:,} items", self.item_cap)

    def expect_bits(self, bits: float) -> None:
        if bits > _MAX_INT_BITS:
            raise self.too_big(f"it would compute a number of about {int(bits):,} bits",
                               _MAX_INT_BITS)

    def count(self, n: int) -> None:
        """Add ``n`` characters or items to what this render has built."""
        self.built += n
        if self.built > self.build_cap:
            raise self.too_big(f"it built {self.built:,} characters and items in total",
                               self.build_cap)

    def check_built(self, value: Any) -> None:
        """Check (and count) a value an operation has just returned."""
        if isinstance(value, (str, bytes, bytearray)):
            n = len(value)
            if n > self.value_cap:
                raise self.too_big(f"it built a value of {n:,} characters", self.value_cap)
        elif isinstance(value, (list, tuple, dict, set, frozenset)):
            n = len(value)
            if n > self.item_cap:
                raise self.too_big(f"it built a collection of {n:,} items", self.item_cap)
        elif isinstance(value, int):
            self.expect_bits(value.bit_length())
            return
        else:
            return
        self.count(n)


_BUDGET: ContextVar[Budget | None] = ContextVar("moed_chat_template_budget", default=None)


def _active() -> Budget:
    """The budget of the render under way.  Outside a render the only callers are jinja's
    compile-time constant folding: "Impossible" makes it leave the expression to render time."""
    budget = _BUDGET.get()
    if budget is None:
        raise nodes.Impossible()
    return budget


# --- size estimates (upper bounds, computed without building the value) ------------------------

_SEQUENCES = (list, tuple, set, frozenset, KeysView, ValuesView)
_END = object()


def text_size(value: Any, limit: int, indent: int = 0, per_item: int = 2) -> int:
    """About ``len(str(value))`` (or of ``json.dumps(value, indent=indent)``), without building
    it; stops counting once past ``limit``.  Each container is walked once (its size is then
    reused), so a list shared 2**40 times through nesting costs 40 steps, not 2**40."""
    if isinstance(value, str):
        return len(value)
    total = 0
    steps = 0
    known: dict[Any, int] = {}  # container id (with depth when indented) -> its size
    open_keys: set[Any] = set()  # containers being walked: met again, they print as "[...]"
    stack: list[tuple[Any, Any, int]] = [(iter((value,)), None, 0)]
    while stack:
        items, key, start = stack[-1]
        item = next(items, _END)
        if item is _END:
            stack.pop()
            if key is not None:
                known[key] = total - start
                open_keys.discard(key)
            continue
        depth = len(stack)
        total += per_item + indent * depth
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, (bytes, bytearray)):
            total += 4 * len(item) + 3
        elif item is None or isinstance(item, bool):
            total += 5
        elif isinstance(item, int):
            total += item.bit_length() // 3 + 2
        elif isinstance(item, float):
            total += 24
        else:
            children = _children(item)
            if children is None:  # Undefined, generators, macros, cyclers ...: short reprs
                total += 64
            else:
                key = (id(item), depth) if indent else id(item)
                if key in known:
                    total += known[key]
                elif key in open_keys:
                    total += 5
                else:
                    open_keys.add(key)
                    stack.append((children, key, total))
                    total += 14 if isinstance(item, Namespace) else 2
        if total > limit:
            return total
        steps += 1
        if steps & 0xFFFF == 0:
            budget = _BUDGET.get()
            if budget is not None:
                budget.tick()
    return total


def _children(item: Any) -> Any:
    """An iterator over what ``str(item)`` shows of a container (keys and values of a mapping
    in turn: no (key, value) tuples, whose ids would be reused), or None for anything else."""
    if isinstance(item, Namespace):
        item = object.__getattribute__(item, "_Namespace__attrs")
    if isinstance(item, (dict, ItemsView)) or (isinstance(item, Mapping)
                                               and not isinstance(item, type)):
        pairs = item if isinstance(item, ItemsView) else item.items()
        return itertools.chain.from_iterable(pairs)
    if isinstance(item, _SEQUENCES):
        return iter(item)
    return None


def utf8_len(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _joined_size(items: Any, separator: int, limit: int) -> int:
    """Size of ``sep.join(items)`` (items as str()) for a separator of ``separator`` characters."""
    if isinstance(items, str):
        return len(items) + separator * max(len(items) - 1, 0)
    total = separator * max(len(items) - 1, 0)
    for item in items:
        total += text_size(item, limit)
        if total > limit:
            break
    return total


def _materialize(budget: Budget, iterable: Any) -> Any:
    """``iterable`` as a list (strings, lists and tuples as they are), refused past the item cap."""
    if isinstance(iterable, (str, list, tuple)):
        return iterable
    items = []
    for item in iterable:
        items.append(item)
        if len(items) > budget.item_cap:
            budget.expect_items(len(items))
    return items


def _replace_size(text: Any, old: Any, new: Any, count: Any) -> int | None:
    """Size of ``text.replace(old, new, count)``, or None when the types do not fit."""
    kind = type(text) if isinstance(text, (str, bytes)) else None
    if kind is None or not isinstance(old, kind) or not isinstance(new, kind) \
            or not isinstance(count, int):
        return None
    n = text.count(old) if old else len(text) + 1
    if count >= 0:
        n = min(n, count)
    return len(text) + n * max(len(new) - len(old), 0)


def _number(digits: str, limit: int) -> int:
    """A width or precision written in a format (past 18 digits: more than any limit)."""
    return int(digits) if len(digits) <= 18 else limit + 1


_PRINTF_SPEC = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d*))?[hlL]?(.)", re.S)


def _printf_size(fmt: str, values: Any, limit: int) -> int:
    """Size of ``fmt % values``: each conversion adds its value and its width and precision."""
    positional = list(values) if isinstance(values, tuple) else [values]
    mapping = values if isinstance(values, Mapping) else None
    taken = 0

    def take() -> Any:
        nonlocal taken
        taken += 1
        return positional[taken - 1] if taken <= len(positional) else None

    total = len(fmt)
    for key, width, precision, conversion in _PRINTF_SPEC.findall(fmt):
        if conversion == "%" and not (key or width or precision):
            continue
        for part in (width, precision):
            n = take() if part == "*" else _number(part, limit) if part else 0
            if isinstance(n, int):
                total += abs(n)
        value = mapping.get(key) if key and mapping is not None else take()
        total += text_size(value, limit)
        if total > limit:
            break
    return total


_FORMATTER = string.Formatter()


def _format_size(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any], limit: int) -> int:
    """Size of ``fmt.format(*args, **kwargs)``: literal text, each field's value, and the widths
    and precisions of its spec (numbers written in it or taken from nested fields)."""
    auto = itertools.count()

    def field_value(name: str) -> Any:
        first, _rest = formatter_field_name_split(name)  # attributes/items: bounded by the whole
        if first == "":
            first = next(auto)
        if isinstance(first, int):
            return args[first] if first < len(args) else None
        return kwargs.get(first)

    def spec_size(spec: str) -> int:
        size = 0
        for literal, field, _spec, _conversion in _FORMATTER.parse(spec):
            size += sum(_number(digits, limit) for digits in re.findall(r"\d+", literal))
            if field is not None:
                value = field_value(field)
                if isinstance(value, int):
                    size += abs(value)
        return size

    total = 0
    try:
        for literal, field, spec, _conversion in _FORMATTER.parse(fmt):
            total += len(literal)
            if field is not None:
                total += text_size(field_value(field), limit) + (spec_size(spec) if spec else 0)
            if total > limit:
                break
    except ValueError:  # a malformed format: the real call reports it
        return 0
    return total


# --- checks before an operation (raise Exceeded before anything big is allocated) ------------


def _precheck_binop(budget: Budget, op: str, left: Any, right: Any) -> None:
    if op == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            budget.expect_chars(len(left) + len(right))
        elif isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            budget.expect_items(len(left) + len(right))
    elif op == "*":
        if isinstance(left, int) and isinstance(right, int):
            budget.expect_bits(left.bit_length() + right.bit_length())
            return
        for seq, k in ((left, right), (right, left)):
            if isinstance(k, int) and isinstance(seq, (str, bytes)):
                budget.expect_chars(len(seq) * k)
            elif isinstance(k, int) and isinstance(seq, (list, tuple)):
                budget.expect_items(len(seq) * k)
    elif op == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            budget.expect_bits(right)  # first: right may be too big for a float
            budget.expect_bits(math.log2(abs(left)) * right)
    elif op == "%" and isinstance(left, str):
        budget.expect_chars(_printf_size(left, right, budget.value_cap))


def _precheck_text_method(budget: Budget, text: Any, name: str, args: tuple,
                          kwargs: dict) -> tuple:
    """Size a call of a str (or bytes) method; returns the arguments to call it with."""
    if name in ("ljust", "rjust", "center", "zfill"):
        if args and isinstance(args[0], int):
            budget.expect_chars(max(len(text), args[0]))
    elif name == "replace" and len(args) >= 2:
        size = _replace_size(text, args[0], args[1], args[2] if len(args) > 2
                             else kwargs.get("count", -1))
        if size is not None:
            budget.expect_chars(size)
    elif name == "expandtabs":
        tabsize = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tabsize, int):
            tab = "\t" if isinstance(text, str) else b"\t"
            budget.expect_chars(len(text) + text.count(tab) * max(tabsize, 0))
    elif name == "translate" and args and isinstance(args[0], Mapping) and isinstance(text, str):
        widest = max((len(v) for v in args[0].values() if isinstance(v, str)), default=1)
        budget.expect_chars(len(text) * max(widest, 1))
    elif name in ("split", "rsplit") and args and isinstance(args[0], type(text)) and args[0]:
        pieces = text.count(args[0]) + 1
        maxsplit = args[1] if len(args) > 1 else kwargs.get("maxsplit", -1)
        if isinstance(maxsplit, int) and maxsplit >= 0:
            pieces = min(pieces, maxsplit + 1)
        budget.expect_items(pieces)
    elif name == "join" and len(args) == 1:
        items = _materialize(budget, args[0])
        budget.expect_chars(_joined_size(items, len(text), budget.value_cap))
        return (items,)
    return args


_LIPSUM = inspect.signature(generate_lorem_ipsum)

#: a size check for calls of one function: ``check(budget, args, kwargs)``, run before the call
CallCheck = Callable[[Budget, tuple, dict], None]


def _precheck_call(budget: Budget, obj: Any, args: tuple, kwargs: dict,
                   call_checks: Sequence[tuple[Any, CallCheck]]) -> tuple:
    """Size a call made from the template; returns the arguments to call ``obj`` with."""
    if isinstance(obj, types.BuiltinMethodType):
        owner = getattr(obj, "__self__", None)
        if isinstance(owner, (str, bytes, bytearray)):
            return _precheck_text_method(budget, owner, obj.__name__, args, kwargs)
    elif obj is generate_lorem_ipsum:
        try:
            bound = _LIPSUM.bind(*args, **kwargs)
        except TypeError:
            return args
        bound.apply_defaults()
        n, low, high = (bound.arguments[k] for k in ("n", "min", "max"))
        if all(isinstance(x, int) for x in (n, low, high)):
            budget.expect_chars(max(n, 0) * (max(low, high, 0) * 16 + 16))
    else:
        for function, check in call_checks:
            if obj is function:
                check(budget, args, kwargs)
    return args


# --- filters -----------------------------------------------------------------------------------
# Each filter runs inside a wrapper that checks the time, refuses integer arguments past the value
# cap, sizes filters that stringify a container, runs the filter's own check below, and checks
# the result.  A check takes the filter's parameters (same names, minus jinja's pass argument),
# all optional and then any others, so that wrong arguments reach the filter, which reports them;
# it may return a replacement for the value.


def _pre_center(budget: Budget, value: Any, width: Any = 80, *_: Any, **__: Any) -> None:
    if isinstance(width, int):
        budget.expect_chars(max(text_size(value, budget.value_cap), width))


def _pre_indent(budget: Budget, s: Any, width: Any = 4, *_: Any, **__: Any) -> None:
    size = text_size(s, budget.value_cap)
    lines = s.count("\n") + 1 if isinstance(s, str) else size + 1
    pad = width if isinstance(width, int) else text_size(width, budget.value_cap)
    budget.expect_chars(size + lines * max(pad, 0))


def _pre_wordwrap(budget: Budget, s: Any, width: Any = 79, break_long_words: Any = True,
                  wrapstring: Any = None, *_: Any, **__: Any) -> None:
    if not isinstance(width, int) or width <= 0:
        return
    size = text_size(s, budget.value_cap)
    newlines = s.count("\n") if isinstance(s, str) else size
    lines = 2 * size // width + newlines + 2
    separator = 1 if wrapstring is None else text_size(wrapstring, budget.value_cap)
    budget.expect_chars(size + lines * separator)


def _short_text(x: Any) -> Any:
    """``x`` as the str a filter would make of it, when that is cheap and small."""
    if isinstance(x, str):
        return x
    if x is None or isinstance(x, (bool, float)) or (isinstance(x, int) and x.bit_length() < 64):
        return str(x)
    return None


def _pre_replace(budget: Budget, s: Any, old: Any = None, new: Any = None, count: Any = None,
                 *_: Any, **__: Any) -> None:
    size = _replace_size(_short_text(s), _short_text(old), _short_text(new),
                         -1 if count is None else count)
    if size is not None:
        budget.expect_chars(size)


def _pre_join(budget: Budget, value: Any, d: Any = "", *_: Any, **__: Any) -> Any:
    items = _materialize(budget, value)
    budget.expect_chars(_joined_size(items, text_size(d, budget.value_cap), budget.value_cap))
    return items


def _pre_format(budget: Budget, value: Any, *args: Any, **kwargs: Any) -> None:
    if isinstance(value, str):
        budget.expect_chars(_printf_size(value, kwargs or args, budget.value_cap))


# tojson as transformers defines it (json.dumps's arguments), which chat.py installs
def _pre_tojson(budget: Budget, x: Any, ensure_ascii: Any = False, indent: Any = None,
                separators: Any = None, *_: Any, **__: Any) -> None:
    pad = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    per_item = 2
    if isinstance(separators, (tuple, list)) and all(isinstance(x, str) for x in separators):
        per_item += sum(len(x) for x in separators)
    budget.expect_chars(text_size(x, budget.value_cap, indent=max(pad, 0), per_item=per_item))


def _pre_pprint(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    budget.expect_chars(text_size(value, budget.value_cap, indent=1))


def _pre_batch(budget: Budget, value: Any, linecount: Any = None, *_: Any, **__: Any) -> None:
    if isinstance(linecount, int):
        budget.expect_items(linecount)


def _pre_slice(budget: Budget, value: Any, slices: Any = None, *_: Any, **__: Any) -> None:
    if isinstance(slices, int):
        budget.expect_items(slices)


def _pre_list(budget: Budget, value: Any, *_: Any, **__: Any) -> None:
    if isinstance(value, Sized):
        budget.expect_items(len(value))


def _pre_round(budget: Budget, value: Any, precision: Any = 0, method: Any = "common",
               *_: Any, **__: Any) -> None:
    # "ceil"/"floor" compute 10 ** precision, and so does round(int, -precision)
    if isinstance(precision, int) and (method != "common" or precision < 0):
        budget.expect_bits(abs(precision) * 3.33)


def _pre_urlize(budget: Budget, value: Any, trim_url_limit: Any = None, nofollow: Any = False,
                target: Any = None, rel: Any = None, *_: Any, **__: Any) -> None:
    size = text_size(value, budget.value_cap)
    per_link = sum(text_size(x, budget.value_cap) for x in (target, rel) if x is not None)
    budget.expect_chars(3 * size + (size // 4 + 1) * per_link)


_FILTER_CHECKS = {
    "batch": _pre_batch, "center": _pre_center, "format": _pre_format, "indent": _pre_indent,
    "join": _pre_join, "list": _pre_list, "pprint": _pre_pprint, "replace": _pre_replace,
    "round": _pre_round, "slice": _pre_slice, "tojson": _pre_tojson, "urlize": _pre_urlize,
    "wordwrap": _pre_wordwrap,
}

# filters that do not turn their whole input into a string (the others are sized first when
# given a container)
_STRUCTURAL_FILTERS = frozenset({
    "abs", "attr", "batch", "count", "d", "default", "dictsort", "first", "float", "groupby",
    "int", "items", "join", "last", "length", "list", "map", "max", "min", "pprint", "random",
    "reject", "rejectattr", "reverse", "round", "select", "selectattr", "slice", "sort", "sum",
    "tojson", "unique",
})

# filters whose int arguments are data, not sizes (map/select/reject pass them on to filters and
# tests, which check them there)
_TAKES_ANY_VALUE = frozenset({"d", "default", "float", "format", "int", "map", "reject",
                              "rejectattr", "select", "selectattr", "sum"})


def _bounded_filter(name: str, func: Any) -> Any:
    skip = 0 if _PassArg.from_obj(func) is None else 1
    check = _FILTER_CHECKS.get(name)
    stringifies = name not in _STRUCTURAL_FILTERS
    check_ints = name not in _TAKES_ANY_VALUE

    @functools.wraps(func)  # keeps jinja_pass_arg
    def bounded(*args: Any, **kwargs: Any) -> Any:
        budget = _active()
        budget.tick()
        if len(args) > skip:
            value = args[skip]
            if check_ints:
                for arg in itertools.chain(args[skip + 1:], kwargs.values()):
                    if isinstance(arg, int) and abs(arg) > budget.value_cap:
                        raise budget.too_big(f"the {name!r} filter was given {arg:,}",
                                             budget.value_cap)
            if stringifies and not isinstance(value, str):
                budget.expect_chars(text_size(value, budget.value_cap))
            if check is not None:
                replacement = check(budget, *args[skip:], **kwargs)
                if replacement is not None:
                    args = (*args[:skip], replacement, *args[skip + 1:])
        result = func(*args, **kwargs)
        budget.check_built(result)
        return result

    return bounded


def _make_sum(original: Any) -> Any:
    """``sum`` whose ``start`` is a list or tuple: concatenated in one pass, after a size check,
    instead of sum()'s quadratic re-copying."""

    @pass_environment
    def bounded_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
        if not isinstance(start, (list, tuple)):
            return original(environment, iterable, attribute, start)
        budget = _active()
        items = _materialize(budget, iterable)
        if attribute is not None:
            items = list(map(make_attrgetter(environment, attribute), items))
        kind = type(start)
        same = next((i for i, item in enumerate(items) if type(item) is not kind), len(items))
        budget.expect_items(len(start) + sum(len(item) for item in items[:same]))
        joined = kind(itertools.chain(start, *items[:same]))
        return original(environment, items[same:], None, joined)  # the rest raises as sum() does

    return bounded_sum


_CONCAT_FILTER = "_moed_concat"
_LOOP_FILTER = "_moed_loop"


@pass_eval_context
def _concat_values(eval_ctx: Any, values: tuple) -> str:
    """``a ~ b ~ c``: sized before joining."""
    budget = _active()
    budget.tick()
    budget.expect_chars(_joined_size(values, 0, budget.value_cap))
    if eval_ctx.autoescape:
        text = markup_join(values)
    else:
        text = "".join([v if isinstance(v, str) else str(v) for v in values])
    budget.check_built(text)
    return text


class _CountedIterable:
    """The iterable of a ``for`` loop: each step counts against the loop and time budget."""

    __slots__ = ("_items", "_budget")

    def __init__(self, items: Any, budget: Budget) -> None:
        self._items = items
        self._budget = budget

    def __iter__(self) -> Any:
        step = self._budget.step
        for item in self._items:
            step()
            yield item

    def __len__(self) -> int:  # loop.length; a TypeError makes jinja count the items instead
        return len(self._items)


def _count_steps(items: Any) -> _CountedIterable:
    return _CountedIterable(items, _active())


def _finalize_output(value: Any) -> Any:
    """Every ``{{ expression }}``: ``str()`` of a container is sized before it is built."""
    if isinstance(value, str):
        return value
    budget = _active()
    budget.expect_chars(text_size(value, budget.value_cap))
    text = str(value)
    budget.check_built(text)
    return text


class _BoundLoopsAndConcat(NodeTransformer):
    """Routes what the sandbox does not intercept through filters that count: ``a ~ b`` (a Concat
    node, compiled to a plain join) and the iterable of every ``{% for %}``."""

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        values = nodes.Tuple(node.nodes, "load", lineno=node.lineno)
        return nodes.Filter(values, _CONCAT_FILTER, [], [], None, None, lineno=node.lineno)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, _LOOP_FILTER, [], [], None, None,
                                 lineno=node.iter.lineno)
        return node


class Sandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, failing loudly at the first unsafe access instead of returning
    Undefined, and bounded by the budget of the render under way (see the module docstring)."""

    intercepted_binops = frozenset({"+", "*", "**", "%"})
    call_checks: tuple[tuple[Any, CallCheck], ...] = ()

    def unsafe_undefined(self, obj: Any, attribute: Any) -> Any:
        raise SecurityError(f"access to {attribute!r} of a {type(obj).__name__} object is not "
                            "allowed in a chat template")

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _BoundLoopsAndConcat().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        budget = _active()
        budget.tick()
        if operator_ == "+" and type(left) is str and type(right) is str:  # most of them
            size = len(left) + len(right)
            budget.expect_chars(size)
            budget.count(size)
            return left + right
        _precheck_binop(budget, operator_, left, right)
        result = self.binop_table[operator_](left, right)
        budget.check_built(result)
        return result

    def call(self, context: Any, obj: Any, /, *args: Any, **kwargs: Any) -> Any:
        budget = _active()
        budget.tick()
        if isinstance(obj, LoopContext):  # loop(children) in a recursive for loop
            if args:
                args = (_CountedIterable(args[0], budget), *args[1:])
        else:
            args = _precheck_call(budget, obj, args, kwargs, self.call_checks)
        result = super().call(context, obj, *args, **kwargs)
        budget.check_built(result)
        return result

    def wrap_str_format(self, value: Any) -> Any:
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__
        is_map = value.__name__ == "format_map"

        @functools.wraps(wrapper)
        def bounded(*args: Any, **kwargs: Any) -> str:
            budget = _active()
            if is_map:
                mapping = args[0] if len(args) == 1 and isinstance(args[0], Mapping) else {}
                size = _format_size(fmt, (), mapping, budget.value_cap)
            else:
                size = _format_size(fmt, args, kwargs, budget.value_cap)
            budget.expect_chars(size)
            return wrapper(*args, **kwargs)

        return bounded

    def concat(self, parts: Any) -> str:  # type: ignore[override]
        """Joins every output buffer (macro results, ``{% set %}`` blocks, ``caller()``):
        sized before joining."""
        if not isinstance(parts, list):
            parts = list(parts)
        budget = _BUDGET.get()
        if budget is None:
            return "".join(parts)
        budget.tick()
        budget.expect_chars(sum(map(len, parts)))
        text = "".join(parts)
        budget.count(len(text))
        return text

def bounded_environment(filters: Mapping[str, Any], template_globals: Mapping[str, Any],
                        call_checks: Sequence[tuple[Any, CallCheck]] = (),
                        **options: Any) -> Sandbox:
    """A ``Sandbox`` (``options`` as for ``jinja2.Environment``) with jinja's filters and
    ``filters``, all bounded, and ``template_globals``; each ``(function, check)`` of
    ``call_checks`` sizes the template's calls of ``function`` before they run."""
    env = Sandbox(finalize=_finalize_output, **options)
    env.filters.update(filters)
    env.filters["sum"] = _make_sum(env.filters["sum"])
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters[_CONCAT_FILTER] = _concat_values
    env.filters[_LOOP_FILTER] = _count_steps
    env.globals.update(template_globals)
    env.call_checks = tuple(call_checks)
    return env


def render(template: Template, variables: dict[str, Any], budget: Budget,
           max_bytes: int | None) -> str:
    """Render ``template`` (from a ``bounded_environment``) within ``budget``, chunk by chunk,
    stopping as soon as the output is over ``max_bytes`` UTF-8 bytes (None: over the value cap,
    in characters).  A bound hit raises ``Exceeded``."""
    limit = budget.value_cap if max_bytes is None else max_bytes
    unit = "characters" if max_bytes is None else "bytes"
    too_large = Exceeded(f"the prompt size limit: its output is over {limit:,} {unit}", size=True)
    chunks = []
    size = 0
    token = _BUDGET.set(budget)
    try:
        stream = template.generate(**variables)
        try:
            for chunk in stream:
                size += len(chunk)
                if size > limit:
                    raise too_large
                budget.tick()
                chunks.append(chunk)
        finally:
            stream.close()
    finally:
        _BUDGET.reset(token)
    text = "".join(chunks)
    if max_bytes is not None and size * 4 > max_bytes and utf8_len(text) > max_bytes:
        raise too_large
    return text
