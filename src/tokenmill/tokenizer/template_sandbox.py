"""Jinja's immutable sandbox with every render held to the RenderBudget in effect (template_budget.py
says what is counted and why): the sandbox's hooks (call, getattr, getitem, intercepted operators)
take steps and count what they build, every filter is wrapped to do the same, and a rewrite of the
parsed template sends every loop's iterable, `~`, slice and printed value through metering filters
(tokenmill_metered_*), which Jinja compiles to plain Python out of the hooks' reach."""
from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

from jinja2 import nodes
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import _PassArg, pass_context
from jinja2.visitor import NodeTransformer

from tokenmill.tokenizer.template_budget import (LAZY_FILTERS, RenderBudget, binop_size, current_budget,
                                                 filter_size, is_str_join, join_size, method_size, printed_size,
                                                 size_of)


# --- the template rewrite -----------------------------------------------------------------------------

def _metered(name: str, node: nodes.Expr, args: list, lineno: int) -> nodes.Filter:
    # A filter compiles to a plain call of the function (the sandbox's call hook would cost as much
    # again); taking the context keeps Jinja from running it at compile time on a constant.
    return nodes.Filter(node, _METERING_FILTERS[name], args, [], None, None, lineno=lineno)


class _Metering(NodeTransformer):
    """Sends every loop's iterable, `~`, slice and printed value through the metering filters (Jinja
    compiles them to plain Python, out of reach of the sandbox's hooks)."""

    def visit_For(self, node: nodes.For) -> nodes.Node:
        node = self.generic_visit(node)
        node.iter = _metered("iter", node.iter, [], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        node = self.generic_visit(node)
        return _metered("concat", nodes.Tuple(list(node.nodes), "load", lineno=node.lineno), [], node.lineno)

    def visit_Getitem(self, node: nodes.Getitem) -> nodes.Node:
        node = self.generic_visit(node)
        if not isinstance(node.arg, nodes.Slice):  # a plain lookup goes through the sandbox's getitem
            return node
        bounds = [nodes.Const(None) if part is None else part
                  for part in (node.arg.start, node.arg.stop, node.arg.step)]
        return _metered("slice", node.node, bounds, node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        node = self.generic_visit(node)
        node.nodes = [_metered("output", child, [], child.lineno or node.lineno) for child in node.nodes]
        return node


class _Counted:
    """An iterable whose iteration takes a step per item (keeps len() for loop.length)."""

    def __init__(self, iterable: Any, budget: RenderBudget):
        self._iterable = iterable
        self._budget = budget

    def __len__(self) -> int:
        return len(self._iterable)

    def __iter__(self) -> Iterator[Any]:
        step = self._budget.step
        for item in self._iterable:
            step()
            yield item


class BudgetedSandbox(ImmutableSandboxedEnvironment):
    """Jinja's immutable sandbox, with every render limited by the RenderBudget in effect."""

    intercepted_binops = frozenset({"+", "*", "%", "**"})

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.meter_filters()

    def meter_filters(self) -> None:
        """Wrap every filter (call again after adding filters) so that it takes a step and counts
        what it may build. Wrapped filters take the context, which also keeps Jinja from running them
        at compile time on constant arguments, outside any budget."""
        for name, fn in list(self.filters.items()):
            if not getattr(fn, "_metered", False):
                self.filters[name] = _metered_filter(name, fn)
        for kind, name in _METERING_FILTERS.items():
            self.filters[name] = _METERING[kind]

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _Metering().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    # -- the sandbox's hooks ------------------------------------------------------------------------
    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
        budget = current_budget()
        if budget is None:
            return super().call(__context, __obj, *args, **kwargs)
        budget.step()
        if isinstance(__obj, (Macro, LoopContext)):
            # What a macro, caller() or a recursive loop returns is output its body already counted.
            if isinstance(__obj, LoopContext) and args:  # the loop's next level is counted as any loop
                args = (_Counted(args[0], budget), *args[1:])
            return super().call(__context, __obj, *args, **kwargs)
        estimate = method_size(__obj, args, kwargs, budget)
        if estimate is None and args and is_str_join(__obj):
            parts = list(_Counted(args[0], budget))
            estimate = join_size(__obj.__self__, parts, budget)
            args = (parts, *args[1:])
        if estimate is not None:
            budget.spend(estimate, __obj)
            return super().call(__context, __obj, *args, **kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        budget.spend(size_of(result, budget, limit=budget.bytes), __obj)
        return result

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = current_budget()
        if budget is not None:
            budget.step()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = current_budget()
        if budget is None:
            return super().getitem(obj, argument)
        budget.step()
        result = super().getitem(obj, argument)
        if isinstance(argument, slice):  # a copy
            budget.spend(size_of(result, budget, limit=budget.bytes), "a slice")
        return result

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        if budget is not None:
            budget.step()
            budget.spend(binop_size(operator, left, right, budget), _OPERATORS[operator])
        return self.binop_table[operator](left, right)

def _metered_filter(name: str, fn: Any) -> Any:
    pass_arg = _PassArg.from_obj(fn)

    @pass_context
    def metered(context: Any, *args: Any, **kwargs: Any) -> Any:
        budget = current_budget()
        if budget is not None:
            budget.step()
            if args and isinstance(args[0], Iterator) and name not in LAZY_FILTERS:
                # A generator (map, select, ...) is read here, counted, so that its size is known.
                args = (list(_Counted(args[0], budget)), *args[1:])
            budget.spend(filter_size(name, args, kwargs, budget), f"the {name} filter")
        if pass_arg is _PassArg.context:
            result = fn(context, *args, **kwargs)
        elif pass_arg is _PassArg.eval_context:
            result = fn(context.eval_ctx, *args, **kwargs)
        elif pass_arg is _PassArg.environment:
            result = fn(context.environment, *args, **kwargs)
        else:
            result = fn(*args, **kwargs)
        if budget is not None and isinstance(result, (list, tuple, dict)):
            budget.spend(8 * len(result), f"the {name} filter")
        return result

    metered._metered = True
    metered.__name__ = getattr(fn, "__name__", name)
    return metered



_OPERATORS = {op: f"the {op} operator" for op in ("+", "-", "*", "/", "//", "%", "**")}


# --- what the rewrite inserts ---------------------------------------------------------------------------

@pass_context
def _metered_iter(context: Any, iterable: Any) -> Any:
    budget = current_budget()
    return iterable if budget is None else _Counted(iterable, budget)


@pass_context
def _metered_concat(context: Any, parts: tuple) -> str:
    budget = current_budget()
    if budget is not None:
        budget.step()
        budget.spend(sum(printed_size(p, budget) for p in parts), "the ~ operator")
    return "".join(map(str, parts))


@pass_context
def _metered_slice(context: Any, obj: Any, start: Any, stop: Any, step: Any) -> Any:
    return context.environment.getitem(obj, slice(start, stop, step))


@pass_context
def _metered_output(context: Any, value: Any) -> Any:
    budget = current_budget()
    if budget is not None:
        budget.spend(sys.getsizeof(value) if type(value) is str else printed_size(value, budget), "output")
    return value


_METERING = {"iter": _metered_iter, "concat": _metered_concat, "slice": _metered_slice, "output": _metered_output}
_METERING_FILTERS = {kind: f"tokenmill_metered_{kind}" for kind in _METERING}
for _fn in _METERING.values():
    _fn._metered = True
