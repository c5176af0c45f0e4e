"""Counts and bytes of the collectives in compiled HLO text (per device, per step)."""
from __future__ import annotations

import re

COLLECTIVES = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
_DTYPE_BYTES = {"f64": 8, "f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1, "pred": 1,
                "s64": 8, "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_INSTRUCTION = re.compile(r"=\s*(?P<shape>\(?[^=]*?\)?)\s+(?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z0-9]+)\[(?P<dims>[0-9,]*)\]")


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
        m = _INSTRUCTION.search(line)
        if m and "-done" not in line.split("=")[1][:40]:
            stats[m.group("op")]["count"] += 1
            stats[m.group("op")]["bytes"] += _shape_bytes(m.group("shape"))
    return stats
