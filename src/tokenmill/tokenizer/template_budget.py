"""A chat template's render held to a budget of work and of memory.

Chat templates come inside model files, and a client may push the file (POST /api/blobs) or send a
TEMPLATE with /api/create. Jinja's sandbox keeps a template away from Python's internals, but not
from looping 10**10 times (two nested `range(100000)`), recursing with fan-out, or building a string
of a gigabyte (`'x' * 10**9`, a string doubled forty times): measured on this server, each held the
event loop (no answer even to /api/version) or grew it past 6 GB. So every render runs under a
RenderBudget:

- steps: one for each loop iteration, call, attribute or item lookup, filter and operator, and one
  for each element a size estimate walks;
- bytes: what the operations build, counted *before* an operation that can build much more than
  it is given (repetition, padding, replacing, joining, formatting, printing a container) and after
  the others, and every piece of output, literal text included;
- a deadline, for the one cost a step does not bound (a search through a long string).

Running out raises TemplateBudgetError (a SecurityError), which ChatTemplate reports as the
template's error. A template outside a render (compiling) is not limited: nothing there runs.

This module holds the budget and the size estimates; template_sandbox.py applies them: hooks Jinja
offers a sandbox (call, getattr, getitem, intercepted operators), filters wrapped at the environment,
and a rewrite of the parsed template that sends every loop's iterable,
`~`, slice and printed value through metering filters (tokenmill_metered_*). What is left unchecked is
what costs no more than its inputs, bounded by the above: the Jinja maintainers' advice is that no
in-process limit can be complete, so these cover every amplifier found (tests/tokenizer/
test_template_budget.py lists them)."""
from __future__ import annotations

import contextlib
import re
import sys
import time
from collections.abc import Iterator, Mapping, MappingView, Sized
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.utils import Namespace, generate_lorem_ipsum

# A chat template's work grows with the conversation it renders: a fixed allowance plus so much per
# byte of input. Measured here: ChatML takes 9 steps a message, Gemma's 15, the tool-calling test
# template ~40, and each builds about 3 times its input; a hostile template stops within the fixed
# allowance, 200,000 steps (0.7 s of macro calls on this machine) and 64 MiB.
BASE_STEPS = 200_000
STEPS_PER_INPUT_BYTE = 4
BASE_BYTES = 64 << 20
BYTES_PER_INPUT_BYTE = 16
BASE_SECONDS = 2.0
SECONDS_PER_INPUT_MB = 1.0

# What printing a container may cost beyond the sizes of its parts: repr() escapes a character as up
# to 10 (\U0001f600), JSON with ensure_ascii as 12 (a surrogate pair).
REPR_FACTOR = 12
MAX_INT_BITS = 1 << 20  # an integer an operator may build (a 315,000-digit number)


class TemplateBudgetError(SecurityError):
    """The render ran out of its budget; the message says which part and what used it."""


CLOCK_EVERY = 256  # steps between looks at the clock


@dataclass
class RenderBudget:
    steps: int
    bytes: int
    deadline: float
    next_check: int = 0  # the step count at which the clock is read next

    @classmethod
    def for_input(cls, input_bytes: int) -> "RenderBudget":
        seconds = BASE_SECONDS + SECONDS_PER_INPUT_MB * input_bytes / 1e6
        steps = BASE_STEPS + STEPS_PER_INPUT_BYTE * input_bytes
        return cls(steps, BASE_BYTES + BYTES_PER_INPUT_BYTE * input_bytes, time.monotonic() + seconds,
                   steps - CLOCK_EVERY)

    def step(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < self.next_check:
            if self.steps < 0:
                raise TemplateBudgetError("the chat template ran too many steps (a loop or recursion without end?)")
            if time.monotonic() > self.deadline:
                raise TemplateBudgetError("the chat template ran out of time")
            self.next_check = self.steps - CLOCK_EVERY

    def spend(self, size: int, what: Any) -> None:
        """Count `size` bytes about to be built by `what` (a description, or the callable)."""
        self.bytes -= size
        if self.bytes < 0:
            raise TemplateBudgetError(f"the chat template built too much text ({_describe(what)})")


def _describe(what: Any) -> str:
    return what if isinstance(what, str) else f"{getattr(what, '__name__', 'a call')}()"


_current: ContextVar[RenderBudget | None] = ContextVar("tokenmill_template_budget", default=None)


def current_budget() -> RenderBudget | None:
    """The budget of the render_budget block this thread or task is in, if any."""
    return _current.get()


@contextlib.contextmanager
def render_budget(input_bytes: int) -> Iterator[RenderBudget]:
    """Limit the renders inside the block (this thread or task) to a budget for this much input."""
    budget = RenderBudget.for_input(input_bytes)
    token = _current.set(budget)
    try:
        yield budget
    finally:
        _current.reset(token)


# --- sizes ------------------------------------------------------------------------------------------

_STR_HEADER = sys.getsizeof("")


def _text_bytes(value: Any) -> int:
    """Bytes a string adds each time it is repeated (its characters, without the object's header)."""
    return sys.getsizeof(value) - _STR_HEADER if isinstance(value, str) else size_of(value)


def _int_size(value: int) -> int:
    return value.bit_length() // 3 + 2  # its decimal digits, near enough


def size_of(value: Any, budget: RenderBudget | None = None, *, limit: int | None = None) -> int:
    """Bytes `value` stands for: a string's own, a container's parts each time they appear (printing
    `[s] * 1000` writes s 1000 times). Walks without recursion, one step per element, and stops once
    past `limit`."""
    if isinstance(value, str):
        return sys.getsizeof(value)
    if value is None or isinstance(value, (bool, float)):
        return 8
    if isinstance(value, int):
        return _int_size(value)
    limit = sys.maxsize if limit is None else limit
    total, stack, seen = 0, [value], 0
    while stack and total <= limit:
        item = stack.pop()
        seen += 1
        if isinstance(item, (str, bytes)):
            total += sys.getsizeof(item)
        elif isinstance(item, int) and not isinstance(item, bool):
            total += _int_size(item)
        elif isinstance(item, Mapping):
            total += 8 * len(item) + 8
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            total += 8 * len(item) + 8
            stack.extend(item)
        elif isinstance(item, MappingView):
            stack.append(getattr(item, "_mapping", ()))
        elif isinstance(item, Namespace):
            stack.append(dict(getattr(item, "_Namespace__attrs", {})))
        else:
            total += 16
    if budget is not None:
        budget.step(seen)
    return total


def printed_size(value: Any, budget: RenderBudget) -> int:
    """What str(value) may take: a string's size, a container's parts times REPR_FACTOR."""
    if isinstance(value, str):
        return sys.getsizeof(value)
    return REPR_FACTOR * size_of(value, budget, limit=budget.bytes)


def _largest_int(*values: Any) -> int:
    return max((v for v in values if isinstance(v, int) and not isinstance(v, bool)), default=0)


def _format_size(fmt: str, args: tuple, kwargs: Mapping, budget: RenderBudget, marker: str) -> int:
    """An upper bound on `fmt` formatted (str.format, format_map or %) with these arguments: each
    field may print the largest argument, padded to the largest number in the format or arguments."""
    values = list(args) + list(kwargs.values())
    for value in list(values):
        if isinstance(value, Mapping):  # format_map, or % with a dict
            values.extend(value.values())
    widest = max((printed_size(v, budget) for v in values), default=0)
    pad = max((int(run) if len(run) < 12 else 1 << 40 for run in re.findall(r"[0-9]+", fmt)), default=0)
    pad = max(pad, _largest_int(*values))
    return sys.getsizeof(fmt) + fmt.count(marker) * (widest + 4 * pad)


# --- what an operation may build, before it builds it -------------------------------------------------

def method_size(method: Any, args: tuple, kwargs: Mapping, budget: RenderBudget) -> int | None:
    """Bytes a call of a str method may build when it can build far more than its inputs; None for
    every other callable (its result is counted once it is built)."""
    if method is generate_lorem_ipsum:  # the lipsum() global: n paragraphs of up to `max` words
        n, _, low, high = (list(args) + [5, True, 20, 100])[:4]
        n, high = kwargs.get("n", n), kwargs.get("max", high)
        return 16 * max(_largest_int(n), 0) * max(_largest_int(high, low), 0)
    owner = getattr(method, "__self__", None)
    wrapped = getattr(method, "__wrapped__", None)  # the sandbox's wrapper of str.format/format_map
    if wrapped is not None and isinstance(getattr(wrapped, "__self__", None), str):
        return _format_size(wrapped.__self__, args, kwargs, budget, "{")
    if not isinstance(owner, str):
        return None
    name = getattr(method, "__name__", "")
    own = sys.getsizeof(owner)
    if name in ("center", "ljust", "rjust", "zfill"):
        return own + 4 * max(_largest_int(*args, *kwargs.values()), 0)
    if name == "expandtabs":
        tab = _largest_int(*args, *kwargs.values()) if args or kwargs else 8
        return own + 4 * owner.count("\t") * max(tab, 0)
    if name == "replace":
        old, new = (list(args) + [None, None])[:2]
        if isinstance(old, str) and isinstance(new, str):
            hits = owner.count(old) if old else len(owner) + 1
            return own + hits * _text_bytes(new)
        return None
    if name == "join":
        return None  # counted by join_size when the call is made (the iterable is read once)
    if name == "translate":
        table = args[0] if args else None
        widest = max((_text_bytes(v) for v in table.values()), default=0) if isinstance(table, Mapping) else 4
        return own * max(widest, 4)
    return None


def filter_size(name: str, args: tuple, kwargs: Mapping, budget: RenderBudget) -> int:
    """Bytes filter `name` may build from these arguments (args[0] is the filtered value)."""
    value = args[0] if args else None
    rest = args[1:]
    if name in _SMALL_FILTERS:
        return 0
    if name in ("center", "truncate"):
        return size_of(value) + 4 * max(_largest_int(*rest, *kwargs.values()), 0) + size_of(rest, budget)
    if name == "indent":
        width = (list(rest) + [kwargs.get("width", 4)])[0]
        per_line = sys.getsizeof(width) if isinstance(width, str) else 4 * max(_largest_int(width), 0)
        lines = value.count("\n") + 1 if isinstance(value, str) else 1
        return size_of(value) + lines * per_line
    if name == "wordwrap":
        width = kwargs.get("width", rest[0] if rest else 79)
        wrap = kwargs.get("wrapstring", rest[2] if len(rest) > 2 else "\n")
        breaks = (len(value) if isinstance(value, str) else 0) // max(_largest_int(width), 1) + 1
        return size_of(value) + breaks * _text_bytes(wrap)
    if name == "replace":
        old, new = (list(rest) + [None, None])[:2]
        if isinstance(value, str) and isinstance(old, str) and isinstance(new, str):
            hits = value.count(old) if old else len(value) + 1
            return sys.getsizeof(value) + hits * _text_bytes(new)
    if name == "join":
        separator = kwargs.get("d", rest[0] if rest else "")
        gaps = max(len(value) - 1, 0) if isinstance(value, Sized) else 0
        return size_of(value, budget, limit=budget.bytes) + gaps * _text_bytes(separator)
    if name == "format" and isinstance(value, str):
        return _format_size(value, rest, kwargs, budget, "%")
    if name in ("batch", "slice"):
        count = max(_largest_int(*rest, *kwargs.values()), 0)
        fill = kwargs.get("fill_with", rest[1] if len(rest) > 1 else None)
        fill_size = size_of(fill, budget, limit=budget.bytes)
        return size_of(value, budget, limit=budget.bytes) + count * (8 + fill_size)
    if name == "sum":
        start = kwargs.get("start", rest[1] if len(rest) > 1 else 0)
        if isinstance(start, (int, float)) or not isinstance(value, list):
            return 0
        # Summing sequences copies the growing result at every element.
        items = sum(len(v) for v in value if isinstance(v, Sized)) + (len(start) if isinstance(start, Sized) else 0)
        return 8 * items * len(value)
    if name in _LINEAR_FILTERS:
        return size_of(value, budget, limit=budget.bytes)
    # Printing filters (string, tojson, pprint, escape, urlencode, xmlattr, urlize, ...), and any other.
    indent = kwargs.get("indent", rest[0] if rest and name in ("tojson", "pprint") else None)
    extra = 4 * indent if isinstance(indent, int) and not isinstance(indent, bool) else size_of(indent)
    return (REPR_FACTOR + extra) * size_of((value, rest, dict(kwargs)), budget, limit=budget.bytes)


_SMALL_FILTERS = frozenset({
    "abs", "attr", "count", "d", "default", "filesizeformat", "first", "float", "int", "last", "length", "max",
    "min", "random", "round", "wordcount", "map", "select", "reject", "selectattr", "rejectattr", "items",
})
LAZY_FILTERS = frozenset({"map", "select", "reject", "selectattr", "rejectattr", "items", "default", "d"})
_LINEAR_FILTERS = frozenset({
    "capitalize", "lower", "upper", "title", "trim", "striptags", "safe", "list", "sort", "unique", "reverse",
    "dictsort", "groupby",
})


def join_size(separator: Any, parts: list, budget: RenderBudget) -> int:
    return size_of(parts, budget, limit=budget.bytes) + max(len(parts) - 1, 0) * _text_bytes(separator)


def is_str_join(obj: Any) -> bool:
    return getattr(obj, "__name__", "") == "join" and isinstance(getattr(obj, "__self__", None), str)


def binop_size(operator: str, left: Any, right: Any, budget: RenderBudget) -> int:
    if operator == "*":
        for seq, times in ((left, right), (right, left)):
            if isinstance(times, int) and not isinstance(times, bool):
                if isinstance(seq, str):
                    return _STR_HEADER + (sys.getsizeof(seq) - _STR_HEADER) * max(times, 0)
                if isinstance(seq, (list, tuple)):  # references: what they stand for is counted when printed
                    return 8 * len(seq) * max(times, 0)
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise TemplateBudgetError("the chat template built too large a number")
        return 0
    if operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > MAX_INT_BITS:
                raise TemplateBudgetError("the chat template built too large a number")
        return 0
    if operator == "+":
        if isinstance(left, str) and isinstance(right, str):
            return sys.getsizeof(left) + sys.getsizeof(right)
        if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            return 8 * (len(left) + len(right))
        return 0
    if operator == "%" and isinstance(left, str):
        args = right if isinstance(right, tuple) else (right,)
        return _format_size(left, args, {}, budget, "%")
    return 0
