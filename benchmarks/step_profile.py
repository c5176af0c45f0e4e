"""Where one layout's train step spends its time and what it moves.

    cd CHECKOUT && OUT=/tmp/prof PYTHON benchmarks/step_profile.py step --gin_file=... --layout L --steps 1
    PYTHON benchmarks/step_profile.py report /tmp/prof [ROWS]

The first form runs `python -m jaxtrain.bench step ARGS` (two warm-up steps, then the timed ones)
and writes into $OUT: the compiled step's per-device HLO (`step.hlo`), the HLO right after SPMD
partitioning (`partitioned.hlo`: the program's own collective dtypes, before XLA:CPU widens bf16),
and a `jax.profiler` trace of the first timed step (`trace/`, perfetto json). With --compile_only
no trace is taken.

`report` prints (1) the leaf ops' time in the trace summed over the simulated devices' threads,
grouped by the jax op that made them (the HLO's `op_name` metadata, shortened to its last parts),
(2) the partitioned program's all-gathers by dtype with their op_name, and (3) the compiled step's
dot GFLOP per device (benchmarks/hlo_dot_flops.py).
"""
from __future__ import annotations

import collections
import glob
import gzip
import json
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def run(out: str, argv: list[str]) -> int:
    sys.path.insert(0, os.getcwd())  # the checkout's jaxtrain
    flag = "--xla_force_host_platform_device_count=16"
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    import jax

    import jaxtrain.observe.hlo_stats as hlo_stats

    os.makedirs(out, exist_ok=True)
    count, partition = hlo_stats.executed_collective_stats, hlo_stats.compile_with_partitioned_hlo

    def saved_count(hlo):
        open(os.path.join(out, "step.hlo"), "w").write(hlo)
        return count(hlo)

    def saved_partition(lowered):
        compiled, text = partition(lowered)
        open(os.path.join(out, "partitioned.hlo"), "w").write(text)
        return compiled, text

    hlo_stats.executed_collective_stats, hlo_stats.compile_with_partitioned_hlo = saved_count, saved_partition
    wait, calls = jax.block_until_ready, [0]

    def traced(x):  # the bench's loop: warm-up, warm-up, timed...: trace the first timed step
        r = wait(x)
        calls[0] += 1
        if calls[0] == 2:
            jax.profiler.start_trace(os.path.join(out, "trace"), create_perfetto_trace=True)
        elif calls[0] == 3:
            jax.profiler.stop_trace()
        return r

    jax.block_until_ready = traced
    from jaxtrain.cli.bench import main
    return main(["step", *argv])


_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r"stack_frame_id=(\d+)")
_INSTR = re.compile(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([a-z][a-z\-]*)\(")
_OURS = ("/models/", "/meshes/", "/pallas_kernels/")
_PLUMBING = ("meshes/weight_gather.py", "models/layers/dense.py", "meshes/rules.py", "models/layers/params.py")


def _frames(hlo: str):
    """stack_frame_id -> the innermost frame in the model or mesh code, as 'file:line function'."""
    table = {}
    for section in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
        m = re.search(rf"^{section}\n(.*?)(?:\n\n|\Z)", hlo, re.S | re.M)
        table[section] = dict(re.match(r"(\d+) (.*)", l).groups() for l in (m.group(1).splitlines() if m else []))
    files = {k: v.strip('"').split("/work/main/")[-1] for k, v in table["FileNames"].items()}
    funcs = {k: v.strip('"') for k, v in table["FunctionNames"].items()}
    locs = {}
    for k, v in table["FileLocations"].items():
        d = dict(re.findall(r"(\w+)=(\d+)", v))
        locs[k] = (files.get(d["file_name_id"], "?"), funcs.get(d["function_name_id"], "?"), d["line"])
    frames = {k: dict(re.findall(r"(\w+)=(\d+)", v)) for k, v in table["StackFrames"].items()}

    def innermost(fid: str) -> str:
        seen = set()
        while fid in frames and fid not in seen:
            seen.add(fid)
            f, fn, line = locs.get(frames[fid]["file_location_id"], ("?", "?", "?"))
            if any(o in "/" + f for o in _OURS) and not f.endswith(_PLUMBING):
                return f"{f}:{line} {fn}"
            fid = frames[fid].get("parent_frame_id")
        return "(outside the model)"
    return innermost


def _pass(op_name: str) -> str:
    return "bwd" if "transpose(" in op_name else "remat" if "rematted" in op_name else "fwd"


def _op_names(hlo: str) -> dict[str, tuple[str, str]]:
    """instruction name -> (opcode, 'pass op where'), where = the model/mesh source line that made it."""
    where = _frames(hlo)
    names = {}
    for line in hlo.splitlines():
        m = _INSTR.match(line)
        if m:
            o, f = _OP_NAME.search(line), _FRAME.search(line)
            op_name = o.group(1) if o else ""
            jax_op = op_name.split("/")[-1] or "?"
            kind = m.group(2) if m.group(2) not in ("fusion", "custom-call") else f"{m.group(2)}:{jax_op}"
            names[m.group(1)] = (m.group(2), f"{_pass(op_name)} {kind} {where(f.group(1)) if f else ''}")
    return names


def report(out: str, rows: int = 40) -> None:
    step = open(os.path.join(out, "step.hlo")).read()
    names = _op_names(step)
    part_text = open(os.path.join(out, "partitioned.hlo")).read() if os.path.exists(os.path.join(out, "partitioned.hlo")) else ""
    part_names = _op_names(part_text) if part_text else {}
    traces = glob.glob(os.path.join(out, "trace", "**", "*.trace.json.gz"), recursive=True)
    if traces:
        events = json.load(gzip.open(max(traces, key=os.path.getmtime)))
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        by_op, total = collections.Counter(), 0.0
        for e in events:
            if e.get("ph") != "X" or "dur" not in e:
                continue
            name = e.get("name", "")
            hlo_op = (e.get("args") or {}).get("hlo_op", name)
            if hlo_op not in names or names[hlo_op][0] in ("while", "conditional", "call"):
                continue  # not a leaf HLO op of the step (python, runtime, a loop holding leaves)
            by_op[names[hlo_op][1]] += e["dur"] / 1e6
            total += e["dur"] / 1e6
        print(f"# leaf ops' time, summed over devices: {total:.1f} s")
        for k, v in by_op.most_common(rows):
            print(f"{v:8.2f} s {100 * v / total:5.1f}%  {k}")
    part = os.path.join(out, "partitioned.hlo")
    if os.path.exists(part):
        from jaxtrain.observe.hlo_stats import _collective  # noqa: E402
        sys.path.insert(0, os.getcwd())
        gathers = collections.Counter()
        for line in part_text.splitlines():
            found = _collective(line)
            if found and found[0] in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute"):
                dtype = re.search(r"=\s*\(?\s*([a-z0-9]+)\[", line)
                m = _INSTR.match(line)
                where = part_names.get(m.group(1), ("", "?"))[1] if m else "?"
                gathers[(found[0], dtype.group(1) if dtype else "?", where)] += found[1]
        print("# partitioned program's collectives (each instruction once): op dtype MiB op_name")
        for (op, dtype, name), b in sorted(gathers.items(), key=lambda kv: -kv[1])[:rows]:
            print(f"{op:<18} {dtype:<5} {b / 2**20:8.2f} MiB  {name}")
    sys.path.insert(0, HERE)
    from hlo_dot_flops import flops_table  # noqa: E402
    t = flops_table(step)
    print(f"# dot GFLOP/device {sum(t.values()) / 1e9:.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "report":
        sys.path.insert(0, os.path.dirname(HERE))
        report(sys.argv[2], *(int(a) for a in sys.argv[3:4]))
    else:
        sys.exit(run(os.environ["OUT"], sys.argv[2:] if sys.argv[1] == "step" else sys.argv[1:]))
