"""ObserveConfig.profile_steps writes a jax.profiler trace of those steps into the workdir."""
import pytest
import gzip
import json
import os
import subprocess
import sys

from processes import child_env
from test_cli import REPO, TINY

pytestmark = [pytest.mark.slow, pytest.mark.end_to_end, pytest.mark.extended]


def test_profile_steps_write_a_trace_of_the_train_step(tmp_path):
    workdir = tmp_path / "run"
    env = child_env()
    proc = subprocess.run([sys.executable, "-m", "jaxtrain.cli.train", f"--workdir={workdir}", *TINY,
                           "--gin_param=TrainConfig.steps=4", "--gin_param=ObserveConfig.profile_steps=(2, 3)"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    traces = [os.path.join(r, f) for r, _, files in os.walk(workdir / "profile" / "process_0") for f in files]
    assert any(t.endswith(".xplane.pb") for t in traces), traces  # TensorBoard's profile plugin reads these
    [perfetto] = [t for t in traces if t.endswith("perfetto_trace.json.gz")]
    events = json.loads(gzip.decompress(open(perfetto, "rb").read()))
    names = {e.get("name", "") for e in (events["traceEvents"] if isinstance(events, dict) else events)}
    assert any("step" in n for n in names), sorted(names)[:50]  # the jitted train step ran inside the trace
