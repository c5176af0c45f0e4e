"""Task scores while training (`ObserveConfig.eval_tasks`): lm-eval tasks scored from the current
parameters at every eval step (`ObserveConfig.eval_every`) and at the end, on the run's own mesh.
The scoring and generation programs are built at the first evaluation and reused, the parameters
swapped in each time; the train step is not touched. The train CLI hands this class to the Trainer
(`Trainer(..., task_evaluator=TrainingTaskEvaluator)`), which builds it at start, so a task name
or a layout the tasks cannot run on fails before the first step."""
from __future__ import annotations

from jaxtrain.generate.loading import Loaded, canonical_model
from jaxtrain.harness.tasks import TaskRequest, evaluate, output_types, scalar_scores, task_manager


class TrainingTaskEvaluator:
    def __init__(self, trainer):
        from jaxtrain.data.tokenizer import load_tokenizer
        from jaxtrain.generate.engine import check_generation_layout

        observe, exp = trainer.exp.observe, trainer.exp
        self.tr = trainer
        self.request = TaskRequest(tuple(observe.eval_tasks), include_path=observe.eval_tasks_include_path,
                                   limit=observe.eval_tasks_limit)
        self.manager = task_manager(self.request)
        if "generate_until" in output_types(self.manager, self.request.tasks):
            check_generation_layout(trainer.mesh)
        self.tokenizer = load_tokenizer(exp.data.tokenizer)
        if not hasattr(self.tokenizer, "hf_tokenizer"):
            raise ValueError(f"ObserveConfig.eval_tasks needs a Hugging Face tokenizer (DataConfig.tokenizer names its "
                             f"directory); this run's is {exp.data.tokenizer!r}")
        self.lm = None

    def __call__(self, params) -> dict[str, float]:
        """params in the run's layout (pipeline stages included) -> {"task/metric": score}."""
        from jaxtrain.harness.lm import JaxtrainLM

        canonical = self.tr.state_layout.to_disk({"params": params})["params"]
        model = canonical_model(self.tr.exp.model, canonical)
        if self.lm is None:
            loaded = Loaded(model, self.tr.mesh, self.tr.rules, self.tokenizer, None)
            self.lm = JaxtrainLM(loaded=loaded, max_length=self.tr.exp.train.seq_len,
                                 batch_size=self.tr.exp.train.global_batch)
        else:
            self.lm.set_model(model)
        return scalar_scores(evaluate(self.lm, self.request, self.manager))
