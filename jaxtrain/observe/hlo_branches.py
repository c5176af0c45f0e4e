"""How often each branch of a conditional in a loop body runs, when the program fixes it.

A layer scan over kinds (models/layers/layer_scan.py) switches on `kind_ids[i]` at trip i, a
constant array: the forward loop slices the constant (XLA sinks it into the body); the backward
loop slices a stacked copy of it that the forward loop wrote one element per trip (the scan's
residual). Over a loop of n trips that reads each element of an n-long array once, branch k runs
as often as k appears in the array, in whatever order the loop reads it. Anything else (a
predicate computed from the data: the non-finite guard's `lax.cond`) is not static: None.

Values are followed through the few instructions that carry them unchanged (bitcast, copy,
reshape, convert, the clamp `lax.switch` adds), into and out of fusions and calls (XLA:CPU wraps
small loops in a call), across a while loop's tuple (an element the body passes on unchanged is
its initial value) and out of a loop that stacks a constant's elements.
"""
from __future__ import annotations

import re

import numpy as np

from jaxtrain.observe.hlo_module import Computation, Instruction, Module

_PASS_THROUGH = ("bitcast", "copy", "reshape", "convert")
_LITERAL_INT = re.compile(r"-?\d+")
_DIMS = re.compile(r"^[a-z0-9]+\[(?P<dims>[0-9,]*)\]")
_DEPTH = 24  # links followed before giving up: real chains are a handful long


def branch_histogram(module: Module, body: Computation, conditional: Instruction, trips: int | None) -> np.ndarray | None:
    """Runs of each branch of `conditional` (in `body`, a loop of `trips` trips) per entry of
    the loop, or None when which branch runs is not fixed by the program."""
    if not trips:
        return None
    values = _element_of(module, body, conditional.operands[0], _DEPTH)
    if values is None or values.size != trips:
        return None
    branches = len(conditional.branches())
    index = np.where((values < 0) | (values >= branches), branches - 1, values)  # HLO: out of range runs the last
    return np.bincount(index, minlength=branches)


def _element_of(module: Module, comp: Computation, name: str, depth: int) -> np.ndarray | None:
    """The array whose elements `name` takes one per trip: `name` is `array[i]` (a dynamic-slice
    of one element), through pass-through ops, fusions and calls."""
    instr = comp.instructions.get(name)
    if instr is None or depth <= 0:
        return None
    if instr.op in _PASS_THROUGH:
        return _element_of(module, comp, instr.operands[0], depth - 1)
    if instr.op == "clamp":
        return _element_of(module, comp, instr.operands[1], depth - 1)
    if instr.op in ("fusion", "call"):
        inner = module.computations.get(instr.callee("calls") or instr.callee("to_apply"))
        return None if inner is None else _element_of(module, inner, inner.root, depth - 1)
    if instr.op == "parameter":
        outer = _argument(module, comp, int(instr.args))
        return None if outer is None else _element_of(module, *outer, depth - 1)
    if instr.op == "dynamic-slice" and _dims(instr.shape) in ((1,), ()):
        array = _array_of(module, comp, instr.operands[0], depth - 1)
        return None if array is None or array.ndim != 1 else array
    return None


def _array_of(module: Module, comp: Computation, name: str, depth: int) -> np.ndarray | None:
    """The integer array `name` holds, when the program fixes it."""
    instr = comp.instructions.get(name)
    if instr is None or depth <= 0:
        return None
    if instr.op == "constant":
        values = np.asarray([int(v) for v in _LITERAL_INT.findall(instr.args)], np.int64)
        return values if values.size == int(np.prod(_dims(instr.shape))) else None
    if instr.op in _PASS_THROUGH:
        return _array_of(module, comp, instr.operands[0], depth - 1)
    if instr.op == "parameter":
        outer = _argument(module, comp, int(instr.args))
        return None if outer is None else _array_of(module, *outer, depth - 1)
    if instr.op == "get-tuple-element":
        return _tuple_element(module, comp, instr.operands[0], instr.tuple_index, depth - 1)
    return None


def _tuple_element(module: Module, comp: Computation, name: str, index: int, depth: int) -> np.ndarray | None:
    """Element `index` of the tuple `name` holds, when the program fixes it."""
    instr = comp.instructions.get(name)
    if instr is None or depth <= 0:
        return None
    if instr.op == "tuple":
        return _array_of(module, comp, instr.operands[index], depth - 1)
    if instr.op == "while":
        return _after_loop(module, comp, instr, index, depth - 1)
    if instr.op in ("call", "fusion"):
        inner = module.computations.get(instr.callee("calls") or instr.callee("to_apply"))
        return None if inner is None else _tuple_element(module, inner, inner.root, index, depth - 1)
    if instr.op == "parameter":
        loop = _loop_of(module, comp)
        if loop is not None:
            return _loop_invariant(module, comp, *loop, index, depth - 1)
        outer = _argument(module, comp, int(instr.args))
        return None if outer is None else _tuple_element(module, *outer, index, depth - 1)
    return None


def _argument(module: Module, comp: Computation, number: int) -> tuple[Computation, str] | None:
    """(computation, operand) that parameter `number` of `comp` receives from its one caller, a
    fusion or a call (a loop body's parameter is the loop's tuple: _loop_invariant)."""
    callers = module.callers(comp.name)
    if len(callers) != 1 or callers[0][1].op not in ("fusion", "call"):
        return None
    caller, instr = callers[0]
    return module.computations[caller], instr.operands[number]


def _loop_of(module: Module, body: Computation) -> tuple[Computation, Instruction] | None:
    """(computation, while instruction) of the one loop whose body is `body`."""
    callers = [(c, i) for c, i in module.callers(body.name) if i.op == "while" and i.callee("body") == body.name]
    return (module.computations[callers[0][0]], callers[0][1]) if len(callers) == 1 else None


def _loop_invariant(module: Module, body: Computation, caller: Computation, loop: Instruction, index: int,
                    depth: int) -> np.ndarray | None:
    """Tuple element `index` of a loop body's parameter, when the body hands it on unchanged:
    its value entering the loop."""
    root = body.instructions.get(body.root)
    if root is None or root.op != "tuple" or not _is_element(body, root.operands[index], index):
        return None
    return _tuple_element(module, caller, loop.operands[0], index, depth - 1)


def _after_loop(module: Module, comp: Computation, loop: Instruction, index: int, depth: int) -> np.ndarray | None:
    """Tuple element `index` of a while loop's result: its initial value if the body passes it
    on, or the array X when the body writes X's element i at position i on every trip
    (dynamic-update-slice of dynamic-slice, same index) for as many trips as X is long."""
    body = module.computations.get(loop.callee("body"))
    root = None if body is None else body.instructions.get(body.root)
    if root is None or root.op != "tuple":
        return None
    element = root.operands[index]
    if _is_element(body, element, index):
        return _tuple_element(module, comp, loop.operands[0], index, depth - 1)
    stacked = _stacked_source(module, body, element, body, index, depth - 1)
    return stacked if stacked is not None and stacked.size == loop.trip_count else None


def _stacked_source(module: Module, comp: Computation, name: str, body: Computation, index: int,
                    depth: int) -> np.ndarray | None:
    """X when `name` is dynamic-update-slice(the loop body's element `index`, X[i], i)."""
    instr = comp.instructions.get(name)
    if instr is None or depth <= 0:
        return None
    if instr.op == "fusion":
        inner = module.computations.get(instr.callee("calls"))
        return None if inner is None else _stacked_source(module, inner, inner.root, body, index, depth - 1)
    if instr.op != "dynamic-update-slice" or len(instr.operands) != 3:
        return None
    buffer, update, start = instr.operands
    if not _is_loop_element(module, comp, buffer, body, index):
        return None
    sliced = comp.instructions.get(update)
    while sliced is not None and sliced.op in _PASS_THROUGH + ("clamp",):  # the switch's clamp, stacked
        sliced = comp.instructions.get(sliced.operands[1 if sliced.op == "clamp" else 0])
    if sliced is None or sliced.op != "dynamic-slice" or sliced.operands[1:] != [start]:
        return None
    return _array_of(module, comp, sliced.operands[0], depth - 1)


def _is_loop_element(module: Module, comp: Computation, name: str, body: Computation, index: int) -> bool:
    """Whether `name` is the loop body's parameter element `index` (through fusion parameters)."""
    instr = comp.instructions.get(name)
    if comp is body:
        return _is_element(body, name, index)
    if instr is None or instr.op != "parameter":
        return False
    outer = _argument(module, comp, int(instr.args))
    return outer is not None and _is_loop_element(module, *outer, body, index)


def _is_element(body: Computation, name: str, index: int) -> bool:
    """Whether `name` is get-tuple-element `index` of the body's parameter (through copies)."""
    instr = body.instructions.get(name)
    while instr is not None and instr.op in _PASS_THROUGH:
        instr = body.instructions.get(instr.operands[0])
    if instr is None or instr.op != "get-tuple-element" or instr.tuple_index != index:
        return False
    source = body.instructions.get(instr.operands[0])
    return source is not None and source.op == "parameter"


def _dims(shape: str) -> tuple[int, ...]:
    m = _DIMS.match(shape)
    return tuple(int(d) for d in m.group("dims").split(",") if d) if m else ()
