"""Step metrics to the terminal (progress bar), metrics.jsonl and the trackers of
ObserveConfig.trackers (TensorBoard event files by default; jaxtrain/observe/trackers.py).

Only process 0 writes. Values arrive as device arrays one step late, so fetching them never
stalls the device queue (see Trainer).
"""
from __future__ import annotations

import json
import math
import os
import sys

import jax

from jaxtrain.observe.trackers import RunInfo, open_trackers


def device_memory() -> dict:
    """Bytes in use / peak on local device 0, where the backend reports it (not on CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # backends without memory stats raise or return None
        stats = None
    if not stats:
        return {}
    out = {"memory_in_use_gb": stats.get("bytes_in_use", 0) / 2**30}
    if "peak_bytes_in_use" in stats:
        out["memory_peak_gb"] = stats["peak_bytes_in_use"] / 2**30
    return out


class MetricsWriter:
    def __init__(self, workdir: str, total_steps: int, start_step: int = 0, enabled: bool = True,
                 trackers: tuple[str, ...] = ("tensorboard",), config: dict | None = None, gin: str | None = None):
        """`trackers`: the names of ObserveConfig.trackers, opened here (process 0) and told the run's
        `config` (jaxtrain.observe.trackers.config_values of its parts) and `gin` text once."""
        self.enabled = enabled
        self.bar = None
        if not enabled:
            return
        os.makedirs(workdir, exist_ok=True)
        self.path = os.path.join(workdir, "metrics.jsonl")
        self.jsonl = None
        self.rewind(start_step)
        try:
            self.trackers = open_trackers(trackers, RunInfo(workdir, config or {}, gin))
        except BaseException:
            self.jsonl.close()
            raise
        if sys.stderr.isatty():
            from tqdm import tqdm
            self.bar = tqdm(total=total_steps, initial=start_step, dynamic_ncols=True)

    def rewind(self, step: int) -> None:
        """Forget rows after `step` (a resume or a rollback replays those steps): the file stays
        one row per step and kind. Rewritten atomically, so a crash keeps the old file whole."""
        if not self.enabled:
            return
        if self.jsonl is not None:
            self.jsonl.close()
        if os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if _row_step(line) <= step]
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(kept)
            os.replace(tmp, self.path)
        self.jsonl = open(self.path, "a")

    def write(self, step: int, metrics: dict, kind: str = "train", echo: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: (float(v) if v is not None else None) for k, v in metrics.items()}
        self.jsonl.write(json.dumps({"step": step, "kind": kind, **clean}) + "\n")
        self.jsonl.flush()
        finite = {k: v for k, v in clean.items() if v is not None and math.isfinite(v)}
        for tracker in self.trackers:
            tracker.scalars(step, kind, finite)
        headline = ("loss", "perplexity", "tokens_per_sec", "mfu")
        summary = " ".join(f"{k}={v:.4g}" for k, v in clean.items()
                           if (k in headline or kind == "tasks") and v is not None)
        if self.bar is not None:
            if kind == "train":
                self.bar.update(step - self.bar.n)
            self.bar.set_postfix_str(summary if kind == "train" else f"[{kind}] {summary}")
            if kind != "train":
                self.bar.write(f"step {step} [{kind}] {summary}")
        elif echo:
            print(f"step {step} [{kind}] {summary}", flush=True)

    def write_samples(self, step: int, samples: list[dict]) -> None:
        """Generated samples ({"prompt", "text"} each): one metrics.jsonl row, TensorBoard text."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"step": step, "kind": "sample", "samples": samples}) + "\n")
        self.jsonl.flush()
        for tracker in self.trackers:
            tracker.samples(step, samples)

    def close(self, failed: bool = False) -> None:
        """`failed`: the run ends by an error (the trackers that record an outcome mark it failed)."""
        if not self.enabled:
            return
        self.enabled = False  # closing twice (an error path, then the end of the run) is harmless
        if self.bar is not None:
            self.bar.close()
        self.jsonl.close()
        for tracker in self.trackers:
            tracker.close(failed)


def _row_step(line: str) -> float:
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):  # a line torn by a crash mid-write: drop it
        return math.inf
