"""Where the rows of metrics.jsonl go besides that file: TensorBoard, Weights & Biases, MLflow.

`ObserveConfig.trackers` names them (any of TRACKERS); process 0 opens one Tracker per name when
the run starts and hands it every row the MetricsWriter writes (jaxtrain/observe/metrics.py):
scalars keyed `<kind>/<metric>` at the row's step, the finite ones only, as TensorBoard always
had them. metrics.jsonl stays the record; a tracker is a view of it.

A tracker is told the run's config once, at open: the Experiment's config dataclasses as plain
values and the operative gin text. Its run continues across resumes of the same workdir: the ids
are kept in `<workdir>/trackers.json`.

wandb and mlflow are pip extras (`jaxtrain[wandb]`, `jaxtrain[mlflow]`); their own environment
variables choose where runs go (WANDB_MODE, WANDB_PROJECT, WANDB_DIR; MLFLOW_TRACKING_URI,
MLFLOW_EXPERIMENT_NAME).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import time

from jaxtrain.extras import require

IDS_FILE = "trackers.json"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What a tracker is told about the run when it opens."""
    workdir: str
    config: dict  # {part: {field: plain value}}: the Experiment's config dataclasses (config_values)
    gin: str | None = None  # the operative gin config, as the workdir's config.gin keeps it

    @property
    def name(self) -> str:
        return os.path.basename(os.path.normpath(self.workdir))


class Tracker:
    """One destination of the metrics rows. Opened with the run's info (its config logged there
    once), then fed rows, then closed."""
    package: str | None = None  # the module of a pip extra it needs (jaxtrain.extras.require names the extra)

    def scalars(self, step: int, kind: str, values: dict[str, float]) -> None:
        """The finite scalars of one metrics.jsonl row, each logged as `<kind>/<name>` at `step`."""
        raise NotImplementedError

    def samples(self, step: int, samples: list[dict]) -> None:
        """Generated samples ({"prompt", "text"} each); a tracker without a place for text skips them."""

    def close(self, failed: bool = False) -> None:
        raise NotImplementedError


class TensorBoardTracker(Tracker):
    def __init__(self, run: RunInfo, ids: "TrackerIds"):
        from tensorboardX import SummaryWriter
        self.writer = SummaryWriter(os.path.join(run.workdir, "tensorboard"))

    def scalars(self, step, kind, values):
        for k, v in values.items():
            self.writer.add_scalar(f"{kind}/{k}", v, step)

    def samples(self, step, samples):
        for i, sample in enumerate(samples):
            self.writer.add_text(f"samples/{i}", f"**{sample['prompt']}**{sample['text']}", step)

    def close(self, failed=False):
        self.writer.close()


class WandbTracker(Tracker):
    """A wandb run named after the workdir, resumed by the id trackers.json keeps. Files go to
    WANDB_DIR, else the workdir; console capture is off unless WANDB_CONSOLE says otherwise (the
    trainer's own output stays as it is)."""
    package = "wandb"

    def __init__(self, run: RunInfo, ids: "TrackerIds"):
        import wandb

        run_id = ids.get("wandb", "id") or _new_id(run.workdir)
        kwargs = {} if os.environ.get("WANDB_PROJECT") else {"project": "jaxtrain"}
        if not os.environ.get("WANDB_DIR"):
            kwargs["dir"] = run.workdir
        settings = {} if os.environ.get("WANDB_CONSOLE") else {"console": "off"}
        config = {**run.config, **({"gin": run.gin} if run.gin else {})}
        self.run = wandb.init(id=run_id, resume="allow", name=run.name, config=config,
                              settings=wandb.Settings(**settings), **kwargs)
        ids.put("wandb", id=run_id)

    def scalars(self, step, kind, values):
        # wandb's steps only increase: the steps a resumed run replays past its checkpoint were logged
        # before (metrics.jsonl drops the old rows, wandb keeps them)
        if values and step >= self.run.starting_step:
            self.run.log({f"{kind}/{k}": v for k, v in values.items()}, step=step)

    def close(self, failed=False):
        self.run.finish(exit_code=1 if failed else 0)


class MlflowTracker(Tracker):
    """An MLflow run named after the workdir in MLflow's tracking store (MLFLOW_TRACKING_URI, in
    MLFLOW_EXPERIMENT_NAME or the default experiment), resumed by the run id trackers.json keeps.
    The config goes in as params (`part.field`; a param keeps its first value across resumes) and
    the gin text as the artifact config.gin."""
    package = "mlflow"

    def __init__(self, run: RunInfo, ids: "TrackerIds"):
        from mlflow.tracking import MlflowClient

        self.client = client = MlflowClient()
        run_id = ids.get("mlflow", "run_id")
        if run_id is not None and not self._exists(run_id):
            run_id = None  # another tracking store, or the run was deleted: a new one
        if run_id is None:
            run_id = client.create_run(self._experiment_id(), run_name=run.name,
                                       tags={"workdir": run.workdir}).info.run_id
            ids.put("mlflow", run_id=run_id)
        else:
            client.update_run(run_id, status="RUNNING")
        self.run_id = run_id
        self._log_config(run)

    def _exists(self, run_id: str) -> bool:
        from mlflow.exceptions import MlflowException
        try:
            return self.client.get_run(run_id).info.lifecycle_stage == "active"
        except MlflowException:
            return False

    def _experiment_id(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
        if not name:
            return os.environ.get("MLFLOW_EXPERIMENT_ID", "0")
        found = self.client.get_experiment_by_name(name)
        return found.experiment_id if found is not None else self.client.create_experiment(name)

    def _log_config(self, run: RunInfo) -> None:
        from mlflow.entities import Param
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        logged = self.client.get_run(self.run_id).data.params
        params = [Param(key, value[:MAX_PARAM_VAL_LENGTH]) for key, value in flat_params(run.config).items()
                  if key not in logged]
        if params:
            self.client.log_batch(self.run_id, params=params)
        if run.gin:
            self.client.log_text(self.run_id, run.gin, "config.gin")

    def scalars(self, step, kind, values):
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(mlflow_key(f"{kind}/{k}"), v, now, step) for k, v in values.items()]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, failed=False):
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


TRACKERS: dict[str, type[Tracker]] = {"tensorboard": TensorBoardTracker, "wandb": WandbTracker,
                                      "mlflow": MlflowTracker}


def check_trackers(names) -> None:
    """ValueError (one line) for a name not in TRACKERS, a name given twice, or a tracker whose
    package is not installed (jaxtrain.extras.MissingExtra: what to pip install)."""
    for i, name in enumerate(names):
        if name not in TRACKERS:
            raise ValueError(f"ObserveConfig.trackers: unknown tracker {name!r}; the choices are "
                             f"{', '.join(map(repr, TRACKERS))}")
        if name in names[:i]:
            raise ValueError(f"ObserveConfig.trackers names {name!r} twice")
        if TRACKERS[name].package is not None:
            require(TRACKERS[name].package, f"ObserveConfig.trackers {name!r}")


def open_trackers(names, run: RunInfo) -> list[Tracker]:
    """One open Tracker per name, in order. One that cannot open is a ValueError naming it (one
    line); those opened before it are closed again."""
    ids, opened = TrackerIds(run.workdir), []
    try:
        for name in names:
            try:
                opened.append(TRACKERS[name](run, ids))
            except Exception as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(f"ObserveConfig.trackers {name!r} could not open a run: {first}") from e
    except BaseException:
        for tracker in opened:
            tracker.close(failed=True)
        raise
    return opened


class TrackerIds:
    """`<workdir>/trackers.json`: {tracker: {key: id}}, so a resumed run logs to the same runs."""

    def __init__(self, workdir: str):
        self.path = os.path.join(workdir, IDS_FILE)
        try:
            with open(self.path) as f:
                self.ids = json.load(f)
        except (FileNotFoundError, ValueError):  # none yet, or torn: new runs
            self.ids = {}

    def get(self, tracker: str, key: str):
        return self.ids.get(tracker, {}).get(key)

    def put(self, tracker: str, **ids) -> None:
        self.ids.setdefault(tracker, {}).update(ids)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.ids, f, indent=1)
        os.replace(tmp, self.path)


def _new_id(workdir: str) -> str:
    """A run id from the workdir's path and the time of its first start: stable for the workdir's life
    (kept in trackers.json), new for a workdir made again at the same path."""
    return hashlib.sha256(f"{os.path.abspath(workdir)}\n{time.time_ns()}".encode()).hexdigest()[:16]


def config_values(obj):
    """A config as plain values a tracker can store: dataclasses as {field: value} (the fields
    their repr shows), tuples and lists as lists, numbers, strings, booleans and None as they are,
    anything else as its repr."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: config_values(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.repr}
    if isinstance(obj, (list, tuple)):
        return [config_values(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): config_values(v) for k, v in obj.items()}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return repr(obj)


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """{"part.field": value text} of config_values' nesting (MLflow's params are flat strings)."""
    out = {}
    for key, value in config.items():
        name = mlflow_key(f"{prefix}{key}")
        if isinstance(value, dict) and value:
            out.update(flat_params(value, name + "."))
        else:
            out[name] = json.dumps(value) if not isinstance(value, str) else value
    return out


_NOT_MLFLOW = re.compile(r"[^/\w.\- ]")


def mlflow_key(key: str) -> str:
    """A metric or param key MLflow accepts: characters other than alphanumerics, `_ - . / space`
    become `_` (lm-eval's "task/acc,none", for one)."""
    return _NOT_MLFLOW.sub("_", key)[:250]
