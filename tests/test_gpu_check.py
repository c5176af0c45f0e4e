"""benchmarks/gpu_check.sh: its CPU dry run runs every stage end to end (so the GPU day cannot fail
for a missing file or flag) and prints every row of the summary table; the summary judges the
targets and names what is missing; the peak FLOP/s table knows the GPUs the check is run on."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import gpu_summary  # noqa: E402
from processes import child_env  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end, pytest.mark.extended]

# Every row the table must have, whatever the numbers (labels as gpu_summary.py writes them).
ROWS = (["kernel tests", "roofline:"]
        + [f"{section} " for section in gpu_summary.KERNEL_SECTIONS]
        + ["train step dense (gpu_dense_4k.gin)", "train step MoE (gpu_moe_4k.gin)",
           "long context", "pallas flash", "blockwise vs pallas", "materialized vs pallas"]
        + [f"TARGET {label}" for label, _ in gpu_summary.TARGETS.values()]
        + [f"stage {name}" for name in ("environment", "kernel_tests", "kernel_bench", "train_dense", "train_moe",
                                        "long_context")])


def run_dry(results, timeout=400):
    env = child_env(drop=("OUT", "GPU_CHECK_RESULTS"), PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    return subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--results", str(results)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=timeout)


def table_lines(text: str) -> list[str]:
    return text[text.index("== DRY RUN on CPU"):].splitlines()


def test_dry_run_runs_every_stage_and_prints_every_row(tmp_path):
    proc = run_dry(tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "MISSING" not in out and "INCOMPLETE" not in out, out[-6000:]
    lines = table_lines(proc.stdout)
    for row in ROWS:
        assert any(row in line for line in lines), f"no summary row {row!r}:\n" + "\n".join(lines)
    for name in ("environment", "kernel_tests", "kernel_bench", "train_dense", "train_moe", "long_context"):
        assert any(line.startswith(f"stage {name}") and " yes " in line for line in lines), name
    stages = [json.loads(line) for line in (tmp_path / "stages.jsonl").read_text().splitlines()]
    assert [s["stage"] for s in stages][-1] == "summary" and all(s["rc"] == 0 for s in stages)
    # every kernel test file imported and one test of each ran
    tests = [json.loads(line) for line in (tmp_path / "kernel_tests.jsonl").read_text().splitlines()]
    files = {t["test"].split("::")[0] for t in tests if t["kind"] == "test" and t["outcome"] == "passed"}
    assert files == {f"tests/{f}" for f in os.listdir(os.path.join(REPO, "tests")) if f.startswith("test_kernels_")}
    train = json.loads((tmp_path / "train_moe.jsonl").read_text().splitlines()[-1])
    assert train["mfu"] > 0 and train["tokens_per_sec"] > 0
    assert (tmp_path / "summary.txt").read_text().strip() in proc.stdout
    assert "DRY RUN: numbers meaningless" in proc.stdout


def _write_results(path, stages=("environment", "kernel_bench", "train_dense", "train_moe"), **files):
    (path / "run.json").write_text(json.dumps({"mode": "gpu", "started": "now", "stages": list(stages)}))
    (path / "env.json").write_text(json.dumps({"device_kind": "NVIDIA H200", "devices": 1, "jax": "0.11.2",
                                               "peak_bf16_flops": 989e12}))
    (path / "stages.jsonl").write_text("".join(
        json.dumps({"stage": s, "rc": 0, "seconds": 1, "limit_s": 9, "log": f"{s}.log"}) + "\n" for s in stages))
    for name, rows in files.items():
        (path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def _kernel(section, case, pallas, xla, goal=None, dense=None):
    return {"kind": "kernel", "section": section, "case": case, "pallas_ms": pallas, "xla_ms": xla, "roof_ms": 0.5,
            "dense_ms": dense, "target": "", "note": "", "goal": goal}


def _row(lines, start):
    return next(line for line in lines if line.startswith(start))


def test_summary_judges_targets_and_names_missing_results(tmp_path):
    kernels = [{"kind": "plan", "sections": ["gmm", "ssd", "flash"]},
               _kernel("gmm", "up fwd", 1.0, 1.2, {"kind": "vs_dense", "min": 0.7}, dense=0.8),
               _kernel("gmm", "down fwd", 1.0, 1.2, {"kind": "vs_dense", "min": 0.7}, dense=0.75),
               _kernel("ssd", "fwd", 1.0, 2.5, {"kind": "vs_xla", "min": 2.0}),
               _kernel("ssd", "fwd+bwd", 1.0, 1.5, {"kind": "vs_xla", "min": 2.0}),
               {"kind": "section", "section": "flash", "status": "skipped (time budget)"}]
    dense = {"layout": "config", "params": 1.1e9, "global_batch": 8, "seq_len": 4096, "dtype": "bfloat16",
             "step_time_s": 0.5, "tokens_per_sec": 65536.0, "mfu": 0.56, "temp_gb": 60.0, "argument_gb": 13.0}
    _write_results(tmp_path, kernels=kernels, train_dense=[dense])
    text, complete = gpu_summary.summarize(str(tmp_path))
    lines = text.splitlines()
    assert not complete
    assert " yes " in _row(lines, "TARGET grouped matmul") and "worst 75%" in _row(lines, "TARGET grouped matmul")
    assert " no " in _row(lines, "TARGET SSD scan") and "worst 1.50x" in _row(lines, "TARGET SSD scan")
    assert " yes " in _row(lines, "TARGET dense") and "MFU 56.0%" in _row(lines, "TARGET dense")
    assert " no " in _row(lines, "TARGET MoE") and "not measured" in _row(lines, "TARGET MoE")
    assert "2.50x" in _row(lines, "ssd fwd ") and "% of dense" in _row(lines, "gmm up fwd")
    assert "MISSING: skipped (time budget)" in _row(lines, "flash: no result")
    assert "MISSING" in _row(lines, "train step MoE")
    assert "MISSING: stage did not run" in _row(lines, "kernel tests")
    assert "INCOMPLETE" in text and "NVIDIA H200" in text and "DRY RUN" not in text
    # the script's exit status follows: 1 when incomplete
    assert gpu_summary.main([str(tmp_path)]) == 1


def test_summary_counts_kernel_tests_and_lists_failures(tmp_path):
    tests = [{"kind": "collected", "count": 4},
             {"kind": "test", "test": "tests/test_kernels_a.py::test_ok", "outcome": "passed"},
             {"kind": "test", "test": "tests/test_kernels_a.py::test_bad", "outcome": "failed", "message": "boom"},
             {"kind": "test", "test": "tests/test_kernels_b.py::test_skip", "outcome": "skipped"}]
    _write_results(tmp_path, stages=("kernel_tests",), kernel_tests=tests)
    lines = gpu_summary.summarize(str(tmp_path))[0].splitlines()
    row = _row(lines, "kernel tests")
    assert " no " in row and "1 passed, 1 failed, 0 errors, 1 skipped of 4 collected" in row
    assert "stopped early, 1 not run" in row
    assert "boom" in _row(lines, "  FAILED tests/test_kernels_a.py::test_bad")


@pytest.mark.parametrize("kind,peak", [("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12),
                                       ("NVIDIA H100 PCIe", 756e12), ("cpu", None)])
def test_peak_flops_of_the_check_gpus(kind, peak):
    from jaxtrain.observe.flops import peak_flops

    assert peak_flops(kind) == peak
