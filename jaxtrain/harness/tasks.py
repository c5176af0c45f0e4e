"""Running lm-evaluation-harness tasks on a jaxtrain model: the tasks checked before anything loads,
evaluated through the harness's own `simple_evaluate`, and its results written as the harness
writes them (so whatever reads lm-eval's output reads ours)."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """What to evaluate: task (or group) names, as `lm_eval --tasks` takes them."""
    tasks: tuple[str, ...]
    include_path: str | None = None   # a folder of task YAMLs beside the harness's own
    limit: float | None = None        # at most this many documents per task (a fraction below 1)
    num_fewshot: int | None = None
    log_samples: bool = False
    apply_chat_template: bool = False
    seed: int = 0

    def __post_init__(self):
        if not self.tasks or any(not t for t in self.tasks):
            raise ValueError("no tasks given: name at least one lm-eval task (e.g. --tasks hellaswag,arc_easy)")
        if self.limit is not None and not self.limit > 0:
            raise ValueError(f"limit must be > 0 (a number of documents, or a fraction below 1), got {self.limit}")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            raise ValueError(f"num_fewshot must be >= 0, got {self.num_fewshot}")
        if self.include_path is not None and not os.path.isdir(self.include_path):
            raise ValueError(f"include_path {self.include_path}: not a directory")


def task_manager(request: TaskRequest):
    """The harness's TaskManager for the requested tasks; ValueError naming any it does not know.
    When `include_path` holds every requested task, only that folder is indexed (the harness's own
    index of some ten thousand task files takes half a minute to build)."""
    from lm_eval.tasks import TaskManager

    def unknown_to(manager):
        known = set(manager.all_tasks)
        return [t for t in request.tasks if t not in known and not manager.match_tasks([t])]

    if request.include_path is not None:
        local = TaskManager(include_path=request.include_path, include_defaults=False)
        if not unknown_to(local):
            return local
    manager = TaskManager(include_path=request.include_path)
    unknown = unknown_to(manager)
    if unknown:
        where = f" (nor in {request.include_path})" if request.include_path else " (add --include_path for your own)"
        raise ValueError(f"unknown task(s) {', '.join(unknown)}: lm-eval has no such task{where}; "
                         "`lm_eval ls tasks` lists them")
    return manager


def output_types(manager, tasks: Sequence[str]) -> set[str]:
    """The request kinds (loglikelihood, multiple_choice, loglikelihood_rolling, generate_until)
    the named tasks and groups issue."""
    return {task.OUTPUT_TYPE for task in manager.load(list(tasks))["tasks"].values()}


def evaluate(lm, request: TaskRequest, manager=None) -> dict:
    """The harness's results dict (`results`, `configs`, `versions`, ... and `samples` when
    `log_samples`) of `lm` on the requested tasks."""
    import lm_eval

    manager = manager or task_manager(request)
    results = lm_eval.simple_evaluate(
        model=lm, tasks=list(request.tasks), task_manager=manager, limit=request.limit,
        num_fewshot=request.num_fewshot, log_samples=request.log_samples,
        apply_chat_template=request.apply_chat_template, random_seed=request.seed,
        numpy_random_seed=request.seed, torch_random_seed=request.seed, fewshot_random_seed=request.seed)
    if results is None:
        raise RuntimeError("lm-eval returned no results")
    return results


def table(results: dict) -> str:
    """The harness's own results table (and its groups table when there are groups)."""
    from lm_eval.utils import make_table

    text = make_table(results)
    if results.get("groups"):
        text += "\n" + make_table(results, "groups")
    return text


def write_results(results: dict, path: str) -> None:
    """The results as the harness serializes them, written whole or not at all."""
    from lm_eval.utils import handle_non_serializable

    text = json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    partial = path + ".partial"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def scalar_scores(results: dict) -> dict[str, float]:
    """{"task/metric": value} of every numeric score (stderr excluded): what a training run logs."""
    scores = {}
    for section in ("results", "groups"):
        for task, metrics in (results.get(section) or {}).items():
            for key, value in metrics.items():
                metric = key.split(",")[0]
                if metric in ("alias", "name", "sample_len", "sample_count") or metric.endswith("_stderr"):
                    continue
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    scores[f"{task}/{metric}"] = float(value)
    return scores
