"""Run `python -m jaxtrain.train` (or a fault-injecting wrapper) in a subprocess on a tiny model
and read back what it left in the workdir. The processes share the test run's compilation cache
(tests/shared_compiles.py), caching even quick compiles, so the tiny step compiles once, not once per run."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

from processes import child_env

REPO = pathlib.Path(__file__).resolve().parents[2]
# vocab 272 >= the byte tokenizer's 259 ids; constant learning rate, so a run resumed with a
# larger TrainConfig.steps trains exactly as one that was given it from the start.
TINY = ["LlamaConfig.vocab_size=272", "LlamaConfig.embed=32", "LlamaConfig.layers=2", "LlamaConfig.mlp=64",
        "LlamaConfig.heads=4", "LlamaConfig.kv_heads=2", "TrainConfig.seq_len=32", "ObserveConfig.eval_batches=1",
        "ObserveConfig.eval_every=0", "ObserveConfig.log_every=1", "MeshConfig.data=2",
        "OptimizerConfig.decay='constant'", "OptimizerConfig.warmup_steps=0"]


def env() -> dict:
    return child_env(JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                     JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0", PYTHONPATH=str(REPO))


def train_args(workdir, *bindings) -> list[str]:
    return [f"--workdir={workdir}", *[f"--gin_param={b}" for b in (*TINY, *bindings)]]


def train(workdir, *bindings, wrapper: str | None = None, fault_env: dict | None = None,
          timeout: float = 300) -> subprocess.CompletedProcess:
    """Runs the train CLI to completion; `wrapper`: a script in tests/faults/ that patches jaxtrain
    (from the FAULT_* variables in `fault_env`) and then calls jaxtrain.cli.train.main."""
    entry = [str(pathlib.Path(__file__).parent / wrapper)] if wrapper else ["-m", "jaxtrain.cli.train"]
    return subprocess.run([sys.executable, *entry, *train_args(workdir, *bindings)], cwd=REPO,
                          env={**env(), **(fault_env or {})}, capture_output=True, text=True, timeout=timeout)


def rows(workdir, kind: str = "train") -> list[dict]:
    path = pathlib.Path(workdir) / "metrics.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]


def losses(workdir) -> dict[int, float]:
    out = {}
    for r in rows(workdir):
        assert r["step"] not in out, f"step {r['step']} has two rows in metrics.jsonl"
        out[r["step"]] = r["loss"]
    return out


def steps_on_disk(workdir) -> list[int]:
    d = pathlib.Path(workdir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.exists() else []


EVERY_3 = ["CheckpointConfig.checkpoint_every=3", "CheckpointConfig.keep_checkpoints=5"]


def uninterrupted(workdir) -> dict[int, float]:
    """The reference of the recovery tests: 9 steps straight, checkpoints at 3, 6 and 9; its losses."""
    proc = train(workdir, "TrainConfig.steps=9", *EVERY_3)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert steps_on_disk(workdir) == [3, 6, 9]
    ref = losses(workdir)
    assert sorted(ref) == list(range(1, 10)) and all(v == v and abs(v) < float("inf") for v in ref.values())
    return ref
