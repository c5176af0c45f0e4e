"""The element types of every `dot` in compiled HLO text: (result, (lhs, rhs)), e.g.
("f32", ("bf16", "bf16")). On XLA:CPU float32 operands in a bf16 model mark a widened matmul,
one that runs at about half the speed of its bf16 kernels (pallas_kernels/low_precision_dot.py)."""
from __future__ import annotations

from jaxtrain.observe.hlo_module import parse_module


def element_type(shape: str) -> str:
    """"bf16[4,8]{1,0}" -> "bf16"; "?" for a tuple or an unknown name."""
    return shape.split("[", 1)[0] if "[" in shape and not shape.startswith("(") else "?"


def dot_dtypes(hlo_text: str) -> list[tuple[str, tuple[str, str]]]:
    """(result type, (lhs type, rhs type)) of each dot instruction, each counted once (a loop body
    once, however many trips), operands read from their definitions in the same computation."""
    out = []
    for comp in parse_module(hlo_text).computations.values():
        for ins in comp.instructions.values():
            if ins.op == "dot":
                operands = tuple(element_type(comp.instructions[n].shape) if n in comp.instructions else "?"
                                 for n in ins.operands[:2])
                out.append((element_type(ins.shape), operands))
    return out
