"""Samples while training (`ObserveConfig.sample_every` / `sample_prompts`): greedy continuations of
fixed prompts from the current parameters, on the run's own mesh, built once and reused (one
compile of prefill and decode for the whole run). The train CLI hands this class to the Trainer
(`Trainer(..., sampler=TrainingSampler)`), which builds it at start."""
from __future__ import annotations

from flax import nnx

from jaxtrain.generate.engine import Engine, check_generation_layout
from jaxtrain.generate.loading import cache_dtype, canonical_model


class TrainingSampler:
    def __init__(self, trainer):
        from jaxtrain.data.tokenizer import load_tokenizer

        check_generation_layout(trainer.mesh)  # at start, not at the first sample
        self.tr = trainer
        self.tokenizer = load_tokenizer(trainer.exp.data.tokenizer)
        self.prompts = list(trainer.exp.observe.sample_prompts)
        self.ids = [self.tokenizer.encode(p) for p in self.prompts]
        empty = [p for p, i in zip(self.prompts, self.ids) if not i]
        if empty:
            raise ValueError(f"ObserveConfig.sample_prompts: {empty[0]!r} encodes to no tokens")
        self.engine = None

    def __call__(self, params) -> list[dict]:
        """params in the run's layout (pipeline stages included) -> [{"prompt", "text"}]."""
        canonical = self.tr.state_layout.to_disk({"params": params})["params"]
        model_cfg = self.tr.exp.model
        if self.engine is None:
            model = canonical_model(model_cfg, canonical)
            self.engine = Engine(model, mesh=self.tr.mesh, rules=self.tr.rules, cache_dtype=cache_dtype(model))
        else:
            self.engine.state = nnx.state(canonical_model(model_cfg, canonical))
        new = self.engine.generate(self.ids, max_new_tokens=self.tr.exp.observe.sample_tokens,
                                   eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id)
        return [{"prompt": p, "text": self.tokenizer.decode(n)} for p, n in zip(self.prompts, new)]
