"""Counts and bytes of the collectives in compiled HLO text (per device, per step)."""
from __future__ import annotations

import re

from jaxtrain.observe.hlo_branches import branch_histogram
from jaxtrain.observe.hlo_module import parse_module

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_INSTRUCTION = re.compile(r"=\s*(?P<shape>\(?[^=]*?\)?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")


_COMMENT = re.compile(r"/\*.*?\*/")  # XLA annotates long tuples with /*index=5*/: not an `=` of the line


def _collective(line: str):
    """(op, output bytes) of a collective's start (not its -done), or None."""
    line = _COMMENT.sub("", line)
    m = _INSTRUCTION.search(line)
    if m is None or "-done" in line.split("=")[1][:40]:
        return None
    return m.group("op"), _shape_bytes(m.group("shape"))


def _shape_bytes(shape: str) -> int:
    total = 0
    for m in _ARRAY.finditer(shape):
        n = 1
        for d in filter(None, m.group("dims").split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES.get(m.group("dtype"), 4)
    return total


def collective_stats(hlo_text: str) -> dict[str, dict[str, int]]:
    """{op: {"count": n, "bytes": output bytes}} over the module's instructions."""
    stats = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for line in hlo_text.splitlines():
        found = _collective(line)
        if found:
            stats[found[0]]["count"] += 1
            stats[found[0]]["bytes"] += found[1]
    return stats


def executed_collective_stats(hlo_text: str) -> dict[str, dict[str, int]]:
    """Like `collective_stats`, but every instruction counted as often as it runs: a collective
    in a loop body (a layer scan, the context ring) counts once per trip, nested loops multiply.
    Loops without a known trip count count once.

    A conditional runs one branch. Where the program fixes which (a `lax.switch` on a constant
    kind per layer inside a layer scan, and the backward loop's stacked copy of it:
    hlo_branches.py), each branch counts as often as it runs. Where the data decides (the
    non-finite guard's `lax.cond`), the step's count is a range: "count"/"bytes" are the most
    (the largest branch each time), "min_count"/"min_bytes" the least; they are equal when no
    conditional is left open."""
    module = parse_module(hlo_text)
    if module.entry is None:
        return {op: _exact(0, 0) for op in COLLECTIVES}
    memo: dict[str, _Tally] = {}
    total = _computation_tally(module, module.entry, memo)
    return {op: {"count": total.hi[op][0], "bytes": total.hi[op][1],
                 "min_count": total.lo[op][0], "min_bytes": total.lo[op][1]} for op in COLLECTIVES}


def _exact(count: int, nbytes: int) -> dict[str, int]:
    return {"count": count, "bytes": nbytes, "min_count": count, "min_bytes": nbytes}


class _Tally:
    """Executed (count, bytes) per collective op, as a range: lo (the least) and hi (the most)."""

    def __init__(self):
        self.lo = {op: [0, 0] for op in COLLECTIVES}
        self.hi = {op: [0, 0] for op in COLLECTIVES}

    def add(self, other: "_Tally", times: int = 1) -> None:
        for side, theirs in ((self.lo, other.lo), (self.hi, other.hi)):
            for op in COLLECTIVES:
                side[op][0] += times * theirs[op][0]
                side[op][1] += times * theirs[op][1]

    @staticmethod
    def either(options: list["_Tally"]) -> "_Tally":
        """One of `options` runs: the least and the most of them, per op and per figure."""
        out = _Tally()
        for op in COLLECTIVES:
            for k in (0, 1):
                out.lo[op][k] = min(t.lo[op][k] for t in options)
                out.hi[op][k] = max(t.hi[op][k] for t in options)
        return out


def _computation_tally(module, name: str, memo: dict, static: frozenset = frozenset()) -> _Tally:
    """What one run of computation `name` executes; conditionals named in `static` are left out
    (their enclosing loop counts them by branch)."""
    key = (name, static)
    if key in memo:
        return memo[key]
    tally = _Tally()
    computation = module.computations.get(name)
    for instr in (computation.instructions.values() if computation else ()):
        found = _collective(instr.line)
        if found:
            for side in (tally.lo, tally.hi):
                side[found[0]][0] += 1
                side[found[0]][1] += found[1]
        if instr.op == "while":
            tally.add(_loop_tally(module, instr, memo))
            condition = instr.callee("condition")
            if condition:
                tally.add(_computation_tally(module, condition, memo))
        elif instr.op == "conditional":
            if instr.name not in static:
                tally.add(_Tally.either([_computation_tally(module, b, memo) for b in instr.branches()]))
        else:
            for _, callee in instr.callees():
                tally.add(_computation_tally(module, callee, memo))
    memo[key] = tally
    return tally


def _loop_tally(module, loop, memo: dict) -> _Tally:
    """All trips of a while loop: the body times its trips, each conditional whose branches the
    program fixes counted by branch (hlo_branches.branch_histogram)."""
    body_name, trips = loop.callee("body"), loop.trip_count or 1
    body = module.computations.get(body_name)
    if body is None:
        return _Tally()
    fixed = {}
    for instr in body.instructions.values():
        if instr.op == "conditional":
            runs = branch_histogram(module, body, instr, loop.trip_count)
            if runs is not None:
                fixed[instr.name] = (instr, runs)
    tally = _Tally()
    tally.add(_computation_tally(module, body_name, memo, frozenset(fixed)), trips)
    for instr, runs in fixed.values():
        for branch, n in zip(instr.branches(), runs):
            tally.add(_computation_tally(module, branch, memo), int(n))
    return tally


def compiled_hlo_text(compiled) -> str:
    """A jax `Compiled`'s HLO text with every constant written out. `as_text()` elides constants
    past a few elements as `{...}`, and with them the kind array a stage's switch reads
    (hlo_branches): a 29-slot hybrid stage's collectives came out as a range, its cheapest to its
    dearest branch at every slot. Falls back to `as_text()` where jaxlib lacks the print options."""
    try:
        from jaxlib import _hlo  # HloPrintOptions: no public jax name
        options = _hlo.HloPrintOptions()
        options.print_large_constants = True
        modules = compiled.runtime_executable().hlo_modules()
    except (ImportError, AttributeError, TypeError):
        return compiled.as_text()
    return modules[0].to_string(options) if len(modules) == 1 else compiled.as_text()


def compile_with_partitioned_hlo(lowered):
    """(compiled, the HLO text right after SPMD partitioning) of a jax `Lowered`.

    The compiled text's collective dtypes are the backend's, not the program's: XLA:CPU's
    all-reduce promotion and bf16 float normalization run after partitioning and turn every bf16
    collective into a float32 one. The partitioned module keeps the dtypes a GPU would move
    (its loops carry no trip counts yet: count it with `collective_stats`)."""
    import glob
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        compiled = lowered.compile(compiler_options={"xla_dump_to": d,
                                                     "xla_dump_hlo_pass_re": "spmd-partitioning"})
        found = glob.glob(os.path.join(d, "*after_spmd-partitioning*"))
        text = open(max(found, key=os.path.getsize)).read() if found else ""
    return compiled, text


def collectives_by_dtype(hlo_text: str) -> dict[tuple[str, str], dict[str, int]]:
    """{(op, dtype): {"count", "bytes"}}, each instruction once (e.g. ("all-gather", "bf16"))."""
    stats: dict[tuple[str, str], dict[str, int]] = {}
    for line in hlo_text.splitlines():
        found = _collective(line)
        if found:
            m = _INSTRUCTION.search(_COMMENT.sub("", line))
            dtype = _ARRAY.search(m.group("shape")).group("dtype")
            entry = stats.setdefault((found[0], dtype), {"count": 0, "bytes": 0})
            entry["count"] += 1
            entry["bytes"] += found[1]
    return stats
