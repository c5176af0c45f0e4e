"""Counts and bytes of the collectives in compiled HLO text (per device, per step)."""
from __future__ import annotations

import re

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


_HEADER = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(")
_CALLEE = re.compile(r"(?:calls|to_apply|condition|true_computation|false_computation)=%(?P<name>[\w.\-]+)")
_BODY = re.compile(r"body=%(?P<name>[\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{(?P<names>[^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(?P<n>\d+)"\}')


def executed_collective_stats(hlo_text: str) -> dict[str, dict[str, int]]:
    """Like `collective_stats`, but every instruction counted as often as it runs: a collective
    in a loop body (a layer scan, the context ring) counts once per trip, nested loops multiply.
    Loops without a known trip count count once; every branch of a conditional counts each time
    it could run (which runs is decided at run time): a `lax.switch` over layer kinds inside a
    layer scan (models/layers/pattern_stack.py) is overcounted by about the number of kinds."""
    bodies: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and line.rstrip().endswith("{"):
            current = header.group("name")
            bodies[current] = []
            if line.startswith("ENTRY"):
                entry = current
        elif current is not None:
            bodies[current].append(line)
    calls: dict[str, list[tuple[str, int]]] = {name: [] for name in bodies}
    for name, lines in bodies.items():
        for line in lines:
            trip = _TRIP.search(line)
            for m in _BODY.finditer(line):
                calls[name].append((m.group("name"), int(trip.group("n")) if trip else 1))
            for m in _CALLEE.finditer(line):
                calls[name].append((m.group("name"), 1))
            for m in _BRANCHES.finditer(line):
                calls[name] += [(n.strip().lstrip("%"), 1) for n in m.group("names").split(",") if n.strip()]
    # Callers before callees (HLO call graphs are acyclic), then push run counts down.
    order, seen = [], set()

    def post(name: str) -> None:
        seen.add(name)
        for callee, _ in calls.get(name, ()):
            if callee not in seen:
                post(callee)
        order.append(name)

    post(entry)
    times = {name: 0 for name in order}
    times[entry] = 1
    for name in reversed(order):
        for callee, trips in calls.get(name, ()):
            times[callee] += times[name] * trips
    stats = {op: {"count": 0, "bytes": 0} for op in COLLECTIVES}
    for name, lines in bodies.items():
        for line in lines:
            found = _collective(line)
            if found:
                stats[found[0]]["count"] += times.get(name, 0)
                stats[found[0]]["bytes"] += times.get(name, 0) * found[1]
    return stats


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
