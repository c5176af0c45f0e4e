"""Matmul FLOPs one device executes in a compiled step: every `dot` of the per-device HLO text,
2 x output elements x contracted size, loop bodies counted once per trip (XLA's cost analysis
counts a loop body once), grouped by (lhs, rhs, out) shapes, largest first, and by operand dtype
(on XLA:CPU float32 operands of a bf16 model are widened dots: pallas_kernels/low_precision_dot.py).
Every branch of a conditional is counted (an upper bound where a switch chooses).

    python benchmarks/hlo_dot_flops.py STEP.hlo [ROWS]

Get STEP.hlo with benchmarks/step_cpu_time.py's bench run and HLO_OUT=PATH (compile only).
"""
import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from jaxtrain.observe.hlo_dots import element_type  # noqa: E402
from jaxtrain.observe.hlo_module import parse_module  # noqa: E402
_DIMS = re.compile(r"[a-z0-9]+\[([0-9,]*)\]")


def dims(shape):
    m = _DIMS.search(shape)
    return tuple(int(d) for d in m.group(1).split(",") if d) if m else ()


def flops_table(text: str) -> collections.Counter:
    """{(lhs dims, rhs dims, out dims, operand dtypes): FLOPs executed per step}."""
    mod = parse_module(text)
    table = collections.Counter()

    def walk(cname, mult):
        comp = mod.computations[cname]
        shapes = {i.name: i.shape for i in comp.instructions.values()}
        for ins in comp.instructions.values():
            if ins.op == "dot":
                lhs, rhs = dims(shapes.get(ins.operands[0], "")), dims(shapes.get(ins.operands[1], ""))
                out = dims(ins.shape)
                m = re.search(r"lhs_contracting_dims=\{([0-9,]*)\}", ins.attrs)
                k = 1
                for d in (m.group(1).split(",") if m and m.group(1) else []):
                    k *= lhs[int(d)]
                n = 1
                for d in out:
                    n *= d
                operands = (element_type(shapes.get(ins.operands[0], "")), element_type(shapes.get(ins.operands[1], "")))
                table[(lhs, rhs, out, operands)] += 2 * n * k * mult
            for key, callee in ins.callees():
                if key in ("to_apply", "condition"):
                    continue
                t = ins.trip_count if key == "body" else 1
                walk(callee, mult * (t or 1))
    walk(mod.entry, 1)
    return table


if __name__ == "__main__":
    t = flops_table(open(sys.argv[1]).read())
    total = sum(t.values())
    print(f"total dot GFLOP/device {total/1e9:.3f}")
    by_dtype = collections.Counter()
    for k, v in t.items():
        by_dtype["x".join(k[3])] += v
    print("by operand dtypes: " + ", ".join(f"{d} {v/1e9:.3f} ({100*v/total:.1f}%)" for d, v in by_dtype.most_common()))
    for k, v in t.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
        print(f"{v/1e9:8.4f} {100*v/total:5.1f}%  lhs{k[0]} rhs{k[1]} out{k[2]} {'x'.join(k[3])}")
