"""The GPU check's one summary table, from the JSON lines its stages left in the results directory.

  python benchmarks/gpu_summary.py RESULTS_DIR

Rows: the kernel tests' counts; every kernel benchmark row (Pallas ms, XLA ms, XLA/Pallas, % of
roofline, and the row's own target); the dense and MoE train steps at sequence 4096 (tokens/s,
MFU); long-context attention (Pallas flash against the XLA paths); the four targets of the check;
and each stage's exit status and time. Also written to RESULTS_DIR/summary.txt.

Exit 1 when something expected left no result (a stage that crashed, ran out of time or never ran),
0 otherwise: a target not met is a finding the table reports, not a failure of the check.
"""
from __future__ import annotations

import json
import math
import os
import sys

# The check's targets: (label, minimum).
TARGETS = {
    "dense_mfu": ("dense train step MFU, seq 4096 bf16", 0.55),
    "moe_mfu": ("MoE train step MFU, seq 4096 bf16", 0.40),
    "ssd_vs_xla": ("SSD scan vs XLA (every ssd row)", 2.0),
    "gmm_vs_dense": ("grouped matmul vs dense of same FLOPs", 0.70),
}
KERNEL_SECTIONS = ("gmm", "route", "ssd", "conv", "flash")
LONG_CONTEXT = ("pallas", "blockwise", "materialized")  # attention= layouts; pallas first
TRAIN_FILES = {"train_dense": ("dense_mfu", "train step dense (gpu_dense_4k.gin)"),
               "train_moe": ("moe_mfu", "train step MoE (gpu_moe_4k.gin)")}

COLUMNS = (("item", 46, "<"), ("pallas ms", 10, ">"), ("xla ms", 10, ">"), ("xla/pallas", 10, ">"),
           ("% roof", 7, ">"), ("met", 4, "<"), ("target", 22, "<"), ("result", 0, "<"))


def read_jsonl(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:  # a line cut by a kill: the rest still counts
                    pass
    return rows


def last_error(log_path: str) -> str:
    """The last line of a log that looks like an error, else its last line."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return "no log"
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    return (errors or lines or ["empty log"])[-1][:200]


def _num(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _ms(x) -> str:
    return f"{x:.3f}" if _num(x) else ""


def _met(value, minimum) -> str:
    if not _num(value):
        return "no"
    return "yes" if value >= minimum else "no"


class Table:
    def __init__(self):
        self.rows: list[tuple] = []
        self.missing: list[str] = []

    def add(self, item, pallas="", xla="", ratio="", roof="", met="-", target="", result=""):
        self.rows.append((item, pallas, xla, ratio, roof, met, target, result))

    def rule(self):
        self.rows.append(None)

    def lack(self, item, why, target=""):
        """A row for something expected that left no result; the check then exits 1."""
        self.missing.append(item)
        self.add(item, met="no", target=target, result=f"MISSING: {why}")

    def render(self) -> str:
        def line(cells):
            return " ".join(f"{str(c):{align}{width}}" if width else str(c)
                            for c, (_, width, align) in zip(cells, COLUMNS)).rstrip()

        head = line([name for name, _, _ in COLUMNS])
        out = [head, "-" * max(len(head), 120)]
        for row in self.rows:
            out.append("-" * max(len(head), 120) if row is None else line(row))
        return "\n".join(out)


def kernel_tests(table: Table, results: str, why, dry: bool):
    records = read_jsonl(os.path.join(results, "kernel_tests.jsonl"))
    tests = [r for r in records if r.get("kind") == "test"]
    collected = sum(r["count"] for r in records if r.get("kind") == "collected")
    collect_errors = [r for r in records if r.get("kind") == "collect_error"]
    finished = any(r.get("kind") == "finished" for r in records)
    if not tests and not collect_errors:
        table.lack("kernel tests", why("kernel_tests"), "all pass")
        return
    counts = {}
    for r in tests:
        counts[r["outcome"]] = counts.get(r["outcome"], 0) + 1
    bad = counts.get("failed", 0) + counts.get("error", 0) + counts.get("xpassed", 0) + len(collect_errors)
    text = (f"{counts.get('passed', 0)} passed, {counts.get('failed', 0)} failed, {counts.get('error', 0)} errors, "
            f"{counts.get('skipped', 0)} skipped of {collected} collected")
    if collect_errors:
        text += f", {len(collect_errors)} files failed to import"
    not_run = collected - len(tests)
    if not finished or not_run > 0:
        text += f"; stopped early, {max(not_run, 0)} not run"
    complete = bad == 0 and finished and not_run <= 0 and counts.get("passed", 0) > 0
    table.add("kernel tests (-k bad: one per file)" if dry else "kernel tests (native)", met="yes" if complete else "no",
              target="all pass", result=text)
    shown = [r for r in tests if r["outcome"] in ("failed", "error", "xpassed")] + collect_errors
    for r in shown[:12]:
        name = r.get("test") or r.get("path")
        table.add(f"  FAILED {name[-44:]}", met="no", result=r.get("message", "")[:160])
    if len(shown) > 12:
        table.add(f"  ... and {len(shown) - 12} more failures", met="no")


def kernel_rows(table: Table, results: str, why) -> dict[str, list[float]]:
    """Rows per kernel benchmark; returns the values that bear on the check's targets."""
    records = read_jsonl(os.path.join(results, "kernels.jsonl"))
    plan = next((r["sections"] for r in records if r.get("kind") == "plan"), list(KERNEL_SECTIONS))
    status = {r["section"]: r["status"] for r in records if r.get("kind") == "section"}
    kernels = [r for r in records if r.get("kind") == "kernel"]
    roofline = next((r for r in records if r.get("kind") == "roofline"), None)
    if roofline:
        table.add("roofline: measured copy bw, bf16 matmul" if roofline.get("measured") else
                  "roofline: spec sheet (probes failed)",
                  result=f"{roofline['bandwidth'] / 1e12:.2f} TB/s, {roofline['matmul_flops'] / 1e12:.0f} TFLOP/s")
    toward = {"ssd_vs_xla": [], "gmm_vs_dense": []}
    for section in plan:
        rows = [r for r in kernels if r["section"] == section]
        if not rows:
            table.lack(f"{section}: no result", status.get(section) or why("kernel_bench"))
            continue
        for r in rows:
            p, x, roof, dense = r.get("pallas_ms"), r.get("xla_ms"), r.get("roof_ms"), r.get("dense_ms")
            ratio = x / p if _num(p) and _num(x) and p > 0 else None
            roof_frac = roof / p if _num(p) and _num(roof) and p > 0 else None
            vs_dense = dense / p if _num(p) and _num(dense) and p > 0 else None
            goal = r.get("goal") or {}
            met, target, result = "-", "", []
            if vs_dense is not None:
                result.append(f"{100 * vs_dense:.0f}% of dense ({dense:.3f} ms)")
            if goal.get("kind") == "vs_dense":
                met, target = _met(vs_dense, goal["min"]), f">= {100 * goal['min']:.0f}% of dense"
                toward["gmm_vs_dense"].append(vs_dense)
            elif goal.get("kind") == "vs_xla":
                met, target = _met(ratio, goal["min"]), f">= {goal['min']:g}x xla"
                if section == "ssd":
                    toward["ssd_vs_xla"].append(ratio)
            elif goal.get("kind") == "roof":
                met, target = _met(roof_frac, goal["min"]), f">= {100 * goal['min']:.0f}% roofline"
            if r.get("note"):
                result.append(r["note"])
            table.add(f"{section} {r['case']}"[:46], _ms(p), _ms(x), f"{ratio:.2f}x" if ratio is not None else "",
                      f"{100 * roof_frac:.1f}%" if roof_frac is not None else "", met, target, "; ".join(result))
        if section in status and status[section] != "done":
            table.lack(f"{section}: {status[section]}"[:46], status[section])
    return toward


def _count(n: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def _step_text(r: dict) -> str:
    parts = []
    if _num(r.get("params")):
        active = f" ({_count(r['active_params'])} active)" if _num(r.get("active_params")) else ""
        parts.append(f"{_count(r['params'])} params{active}")
    parts.append(f"b{r.get('global_batch')}x{r.get('seq_len')} {r.get('dtype')} remat {r.get('remat')}")
    if _num(r.get("step_time_s")):
        parts.append(f"{1e3 * r['step_time_s']:.1f} ms/step, {r['tokens_per_sec']:,.0f} tok/s")
    parts.append(f"MFU {100 * r['mfu']:.1f}%" if _num(r.get("mfu")) else "MFU n/a (no peak FLOP/s)")
    if _num(r.get("temp_gb")):
        parts.append(f"args {r.get('argument_gb', 0):.1f} + temp {r['temp_gb']:.1f} GB")
    return ", ".join(parts)


def train_rows(table: Table, results: str, why) -> dict[str, float | None]:
    mfu = {}
    for name, (target_key, label) in TRAIN_FILES.items():
        rows = read_jsonl(os.path.join(results, f"{name}.jsonl"))
        minimum = TARGETS[target_key][1]
        target = f">= {100 * minimum:.0f}% MFU"
        if not rows:
            table.lack(label, why(name), target)
            mfu[target_key] = None
            continue
        r = rows[-1]
        if "error" in r:
            table.lack(label, r["error"][:200], target)
            mfu[target_key] = None
            continue
        mfu[target_key] = r.get("mfu")
        table.add(label, met=_met(r.get("mfu"), minimum), target=target, result=_step_text(r))
    return mfu


def long_context_rows(table: Table, results: str, why):
    rows = {}
    for r in read_jsonl(os.path.join(results, "long_context.jsonl")):
        kind = r.get("layout", "").partition("attention=")[2]
        rows["pallas" if kind.startswith("pallas") else kind] = r
    pallas = rows.get("pallas")
    pallas_s = pallas.get("step_time_s") if pallas else None
    seq = next((r.get("seq_len") for r in rows.values()), None)
    for kind in LONG_CONTEXT:
        label = f"long context{f' {seq} tok' if seq else ''}: {kind}" + (" flash" if kind == "pallas" else " vs pallas")
        r = rows.get(kind)
        if r is None:
            table.lack(label, why("long_context"))
        elif "error" in r:
            table.lack(label, r["error"][:200])
        elif kind == "pallas":
            table.add(label, pallas=_ms(1e3 * r["step_time_s"]), result=_step_text(r))
        else:
            this = r.get("step_time_s")
            ratio = f"{this / pallas_s:.2f}x" if _num(this) and _num(pallas_s) and pallas_s > 0 else ""
            table.add(label, pallas=_ms(1e3 * pallas_s) if _num(pallas_s) else "", xla=_ms(1e3 * this),
                      ratio=ratio, result=_step_text(r))


def target_rows(table: Table, mfu: dict, toward: dict):
    for key, (label, minimum) in TARGETS.items():
        if key in mfu:
            value = mfu[key]
            text = f"MFU {100 * value:.1f}%" if _num(value) else "not measured"
            target = f">= {100 * minimum:.0f}% MFU"
        else:
            values = [v for v in toward.get(key, []) if _num(v)]
            value = min(values) if values else None
            if key == "ssd_vs_xla":
                text, target = (f"worst {value:.2f}x over {len(values)} rows" if values else "not measured"), \
                    f">= {minimum:g}x xla"
            else:
                text, target = (f"worst {100 * value:.0f}% over {len(values)} rows" if values else "not measured"), \
                    f">= {100 * minimum:.0f}% of dense"
        table.add(f"TARGET {label}", met=_met(value, minimum), target=target, result=text)


def stage_rows(table: Table, stages: list[str], records: list[dict]):
    by_name = {r["stage"]: r for r in records}
    for name in stages:
        r = by_name.get(name)
        if r is None:
            table.lack(f"stage {name}", "never ran (the check stopped before it)", "exit 0")
            continue
        rc = r["rc"]
        why = {124: " (time limit)", 137: " (killed at time limit)", 125: " (skipped: no time left)"}.get(rc, "")
        log = "" if rc == 125 else f"; log {r['log']}"
        table.add(f"stage {name}", met="yes" if rc == 0 else "no", target="exit 0",
                  result=f"exit {rc}{why} in {r['seconds']} s of {r['limit_s']} s{log}")


def summarize(results: str) -> tuple[str, bool]:
    """(the table's text, whether everything expected left a result)."""
    table = Table()
    run_path = os.path.join(results, "run.json")
    if not os.path.exists(run_path):
        return f"no run.json in {results}: not a gpu_check results directory", False
    with open(run_path) as f:
        run = json.load(f)
    dry = run.get("mode") == "dry-run"
    env = {}
    if os.path.exists(os.path.join(results, "env.json")):
        with open(os.path.join(results, "env.json")) as f:
            env = json.load(f)
    stage_records = read_jsonl(os.path.join(results, "stages.jsonl"))
    by_stage = {r["stage"]: r for r in stage_records}

    def why(stage: str) -> str:
        """Why a stage left no result, from its exit status and the last error line of its log."""
        r = by_stage.get(stage)
        if r is None:
            return "stage did not run"
        if r["rc"] == 125:
            return "stage skipped: the check's time was spent"
        if r["rc"] in (124, 137):
            return f"stage stopped at its time limit ({r['limit_s']} s)"
        return f"stage exit {r['rc']}: {last_error(os.path.join(results, r['log']))}" if r["rc"] else \
            "stage exit 0 but no result written"

    kernel_tests(table, results, why, dry)
    table.rule()
    toward = kernel_rows(table, results, why)
    table.rule()
    mfu = train_rows(table, results, why)
    long_context_rows(table, results, why)
    table.rule()
    target_rows(table, mfu, toward)
    table.rule()
    stage_rows(table, run.get("stages", []), stage_records)
    if not env:
        table.lack("environment", "no env.json")
    banner = ("DRY RUN on CPU at tiny sizes: this checks the script end to end; every number below is "
              "meaningless" if dry else "GPU check")
    device = (f"{env.get('device_kind', '?')} x {env.get('devices', '?')}, jax {env.get('jax', '?')}, "
              f"peak bf16 {env['peak_bf16_flops'] / 1e12:.0f} TFLOP/s" if _num(env.get("peak_bf16_flops"))
              else f"{env.get('device_kind', '?')} x {env.get('devices', '?')}, jax {env.get('jax', '?')}, "
                   f"no peak FLOP/s known")
    lines = [f"== {banner}", f"   {device}; started {run.get('started', '?')}; results in {results}", "",
             table.render()]
    if table.missing:
        lines += ["", f"INCOMPLETE: {len(table.missing)} expected results missing: {', '.join(table.missing)}"]
    if dry:
        lines += ["", "== DRY RUN: numbers meaningless (CPU, tiny sizes, Pallas interpreted)"]
    return "\n".join(lines), not table.missing


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__)
        return 2
    text, complete = summarize(argv[0])
    print(text)
    try:
        with open(os.path.join(argv[0], "summary.txt"), "w") as f:
            f.write(text + "\n")
    except OSError as e:
        print(f"could not write summary.txt: {e}")
    return 0 if complete else 1


if __name__ == "__main__":
    sys.exit(main())
