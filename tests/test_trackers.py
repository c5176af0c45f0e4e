"""ObserveConfig.trackers: the rows of metrics.jsonl, read back from wandb (offline, its own run
file) and MLflow (a file store) after a 10-step CLI run on one process and on two (where process 1
must open no run), the runs continued by a resumed workdir, and the one-line errors for an unknown
tracker and a missing package."""
import glob
import json
import math
import os
import pathlib
import struct
import sys

import gin
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "faults"))
from cli_runs import TINY, rows, train  # noqa: E402
from jaxtrain.cli import train as train_cli  # noqa: E402
from ports import reserved_port  # noqa: E402
from processes import start_train_processes, wait_for  # noqa: E402

pytestmark = [pytest.mark.slow]

ALL = "ObserveConfig.trackers=('tensorboard', 'wandb', 'mlflow')"


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb offline and MLflow on a file store, both under tmp_path (children inherit them)."""
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 refuses a file store otherwise
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    for name in ("WANDB_PROJECT", "WANDB_CONSOLE", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID"):
        monkeypatch.delenv(name, raising=False)
    return wandb_dir, f"file:{tmp_path / 'mlruns'}"


# -- reading the trackers back ---------------------------------------------------------------

def wandb_records(path):
    """The protobuf records of a wandb run file (`run-<id>.wandb`): a 7-byte header (":W&B", magic,
    version), then LevelDB-log blocks of 32 KiB whose records (checksum, length, type: full, first,
    middle, last) carry serialized `Record`s."""
    from wandb.proto import wandb_internal_pb2

    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += block - pos % block
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or the last piece
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def wandb_runs(wandb_dir):
    """{run file: (history {(key, step): value}, config {key: value})} of every offline run."""
    out = {}
    for path in sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        history, config = {}, {}
        for record in wandb_records(path):
            which = record.WhichOneof("record_type")
            if which == "history":
                step = record.history.step.num
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # wandb's own _step, _runtime, _timestamp
                        history[(key, step)] = json.loads(item.value_json)
            elif which in ("run", "config"):
                updates = record.run.config.update if which == "run" else record.config.update
                config.update({u.key: json.loads(u.value_json) for u in updates})
        out[path] = (history, config)
    return out


def mlflow_history(uri, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    return {(m.key, m.step): m.value for key in client.get_run(run_id).data.metrics
            for m in client.get_metric_history(run_id, key)}


def expected(workdir):
    """{("<kind>/<metric>", step): value} of metrics.jsonl's scalars, the finite ones."""
    out = {}
    for kind in ("train", "eval"):
        for row in rows(workdir, kind):
            for k, v in row.items():
                if k not in ("step", "kind") and v is not None and math.isfinite(v):
                    out[(f"{kind}/{k}", row["step"])] = v
    return out


def assert_same(got, want, what):
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want))[:10])
    bad = [(k, got[k], v) for k, v in want.items() if not math.isclose(got[k], v, rel_tol=1e-6, abs_tol=1e-12)]
    assert not bad, (what, bad[:10])


def check_trackers(workdir, wandb_dir, uri):
    """Each tracker holds exactly metrics.jsonl's scalars of a 10-step run and its config, in one run."""
    from mlflow.tracking import MlflowClient

    want = expected(workdir)
    assert sorted({step for (key, step) in want if key.startswith("train/")}) == list(range(1, 11))
    assert ("eval/loss", 10) in want  # the final eval, logged as kind "eval"
    ids = json.loads((workdir / "trackers.json").read_text())

    runs = wandb_runs(wandb_dir)
    assert [os.path.basename(p) for p in runs] == [f"run-{ids['wandb']['id']}.wandb"], list(runs)
    (history, config), = runs.values()
    assert_same(history, want, "wandb")
    assert config["train"]["steps"] == 10 and config["observe"]["trackers"] == ["tensorboard", "wandb", "mlflow"]
    assert "TrainConfig.steps = 10" in config["gin"]

    client = MlflowClient(uri)
    assert [r.info.run_id for r in client.search_runs(["0"])] == [ids["mlflow"]["run_id"]]
    run_id = ids["mlflow"]["run_id"]
    assert_same(mlflow_history(uri, run_id), want, "mlflow")
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == workdir.name
    assert run.data.params["train.steps"] == "10" and run.data.params["model.embed"] == "32"
    saved = client.download_artifacts(run_id, "config.gin", str(workdir.parent / "artifacts"))
    assert pathlib.Path(saved).read_text() == (workdir / "config.gin").read_text()
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(workdir / "tensorboard"))


# -- runs ------------------------------------------------------------------------------------

@pytest.mark.end_to_end
def test_one_process_logs_every_metrics_row_to_each_tracker(tmp_path, offline):
    wandb_dir, uri = offline
    workdir = tmp_path / "run"
    proc = train(workdir, "TrainConfig.steps=10", ALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_trackers(workdir, wandb_dir, uri)


# In test-extended for its time (two CLI processes); the one-process run above is its twin in the suite.
@pytest.mark.end_to_end
@pytest.mark.multiprocess
@pytest.mark.extended
def test_two_processes_log_from_process_0_only(tmp_path, offline):
    """Both processes see the same tracker settings; process 1 opens no run (one wandb run file, one
    MLflow run, each holding process 0's rows)."""
    wandb_dir, uri = offline
    workdir = tmp_path / "run"
    with reserved_port() as port:
        procs = start_train_processes(workdir, [*TINY, "TrainConfig.steps=10", ALL], port)
        outputs = wait_for(procs)
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-2000:] for o in outputs)
    check_trackers(workdir, wandb_dir, uri)


def test_a_resumed_workdir_logs_to_the_same_runs(tmp_path, offline):
    """Opened again on the same workdir (a resume, with a changed config), the trackers continue the
    runs trackers.json names: one MLflow run holding every step (params keep their first value,
    config.gin is the newest), wandb's offline runs under the one id. Keys MLflow refuses are cleaned."""
    import wandb
    from mlflow.tracking import MlflowClient

    from jaxtrain.observe.trackers import RunInfo, open_trackers

    wandb_dir, uri = offline
    workdir = tmp_path / "run"
    try:
        for steps, first in ((3, 1), (5, 4)):
            run = RunInfo(str(workdir), {"train": {"steps": steps, "seed": 0}}, f"TrainConfig.steps = {steps}\n")
            trackers = open_trackers(("wandb", "mlflow"), run)
            for step in range(first, steps + 1):
                for tracker in trackers:
                    tracker.scalars(step, "train", {"loss": 1.0 / step})
                    tracker.scalars(step, "tasks", {"arc_easy/acc,none": 0.5})
            for tracker in trackers:
                tracker.close()
    finally:
        wandb.teardown()
    ids = json.loads((workdir / "trackers.json").read_text())
    run_id = ids["mlflow"]["run_id"]
    client = MlflowClient(uri)
    assert [r.info.run_id for r in client.search_runs(["0"])] == [run_id]
    want = {**{("train/loss", s): 1.0 / s for s in range(1, 6)}, **{("tasks/arc_easy/acc_none", s): 0.5 for s in range(1, 6)}}
    assert_same(mlflow_history(uri, run_id), want, "mlflow")
    assert client.get_run(run_id).data.params == {"train.steps": "3", "train.seed": "0"}
    saved = client.download_artifacts(run_id, "config.gin", str(tmp_path / "artifacts"))
    assert pathlib.Path(saved).read_text() == "TrainConfig.steps = 5\n"

    runs = wandb_runs(wandb_dir)
    assert len(runs) == 2 and all(p.endswith(f"run-{ids['wandb']['id']}.wandb") for p in runs), list(runs)
    history = {k: v for h, _ in runs.values() for k, v in h.items()}
    assert_same(history, {**{("train/loss", s): 1.0 / s for s in range(1, 6)},
                          **{("tasks/arc_easy/acc,none", s): 0.5 for s in range(1, 6)}}, "wandb")


# -- errors ----------------------------------------------------------------------------------

IN_PROCESS = ["LlamaConfig.embed=32", "LlamaConfig.layers=2", "LlamaConfig.mlp=64", "LlamaConfig.heads=4",
              "LlamaConfig.kv_heads=2", "TrainConfig.seq_len=32", "MeshConfig.data=8"]


def in_process(workdir, capsys, *bindings):
    """The train CLI in this process (16 simulated devices); its exit status and stderr."""
    gin.clear_config()
    try:
        with pytest.raises(SystemExit) as exit_info:
            train_cli.main([f"--workdir={workdir}", *[f"--gin_param={b}" for b in (*IN_PROCESS, *bindings)]])
    finally:
        gin.clear_config()
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("trackers, module, message", [
    ("('tensorboard', 'neptune')", None,
     "ObserveConfig.trackers: unknown tracker 'neptune'; the choices are 'tensorboard', 'wandb', 'mlflow'"),
    ("('wandb', 'wandb')", None, "ObserveConfig.trackers names 'wandb' twice"),
    ("('wandb',)", "wandb", "ObserveConfig.trackers 'wandb' needs wandb, which is not installed: "
                            "pip install 'jaxtrain[wandb]'"),
    ("('tensorboard', 'mlflow')", "mlflow", "ObserveConfig.trackers 'mlflow' needs mlflow, which is not installed: "
                                            "pip install 'jaxtrain[mlflow]'"),
], ids=["unknown", "twice", "no_wandb", "no_mlflow"])
def test_a_tracker_that_cannot_run_is_one_line_at_start(tmp_path, capsys, monkeypatch, trackers, module, message):
    if module is not None:
        monkeypatch.setitem(sys.modules, module, None)  # import <module> -> ImportError
    code, err = in_process(tmp_path / "run", capsys, f"ObserveConfig.trackers={trackers}")
    assert code == 2 and err.strip() == f"error: {message}", err
    assert not (tmp_path / "run").exists()  # before anything is written
