"""jaxtrain from Python: build a run and step it on batches you provide.

    from jaxtrain.api import Run
    from jaxtrain.models.llama import LlamaConfig

    run = Run.create(LlamaConfig(vocab_size=320), "data=4,tensor=2,rules=fsdp",
                     train=TrainConfig(global_batch=8, seq_len=64, steps=100))
    metrics = run.step({"inputs": x, "targets": y})      # numpy [global_batch, seq_len]
    run.evaluate({"inputs": x, "targets": y})            # {"loss", "accuracy", "tokens"}
    run.save("/tmp/ckpt"); run.restore("/tmp/ckpt")      # canonical checkpoints, any layout
    run.generate([[5, 17, 3]], max_new_tokens=16)        # new token ids per prompt (greedy)

A batch is a dict of [global_batch, seq_len] arrays: `inputs` and `targets` (token ids), and
optionally `positions` (default 0..L-1 per row), `segment_ids` (packed documents; default one
document per row) and `loss_mask` (default all ones). Every process passes the same whole
global batch; each device takes its own shard of it. The run is the same machinery the
Trainer uses (jaxtrain/training/train_setup.py): any ParallelPlan, pipelines included, the same
numbers. The Trainer adds the data pipeline, logging, evaluation and resilience around it.

Device groups of different speed (one node of fast GPUs, one of slower ones) train with uneven
shares of each batch: `Run.create(model, "data=8", ..., groups=DeviceGroups(rows=(24, 8)))`
gives the first 8 devices 24 rows of each batch and the next 8 devices 8 rows, each group laid
out by the plan, with the numbers of one program on the whole batch
(jaxtrain/training/device_groups.py).
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from jaxtrain.checkpoints.checkpointer import Checkpointer
from jaxtrain.training.config import TrainConfig
from jaxtrain.training.device_groups import DeviceGroups
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.training.run_configs import LossConfig
from jaxtrain.training.state import TrainState
from jaxtrain.training.step import BATCH_KEYS
from jaxtrain.training.train_setup import TrainSetup, build_train_setup


class Run:
    def __init__(self, setup: TrainSetup, state: TrainState, train: TrainConfig):
        self.setup, self.state, self.train = setup, state, train
        self._engine = None  # generation's compiled functions (built on the first `generate`)

    @classmethod
    def create(cls, model, plan: ParallelPlan | str = "", *, train: TrainConfig = TrainConfig(),
               optimizer: OptimizerConfig = OptimizerConfig(), devices=None, seed: int = 0,
               params: dict | None = None, groups: DeviceGroups | None = None,
               loss: LossConfig | None = None, lora=None) -> "Run":
        """A run of `model` (a model config) laid out by `plan` (a ParallelPlan or spec string;
        "" puts every device on `data`; a mesh of fixed sizes takes the first devices it needs). `params`: canonical parameters to start from (host
        or device arrays, e.g. from `hf.load`); otherwise initialized from `seed`. `train`
        gives the batch shape and the learning-rate schedule's length, `loss` the loss settings
        (z-loss, chunk; default LossConfig()).
        `groups`: data parallelism over device groups with uneven batch shares, each group laid
        out by `plan` (whose `microbatches` then counts the microbatches of all groups);
        `devices` may then list each group's devices.
        `lora`: a LoraConfig (models/lora.py): low-rank adapters on a frozen `model`; `params` may
        then be the base's alone (e.g. `hf.load`'s), the adapters starting fresh (B = 0)."""
        from jaxtrain.models.lora import with_lora

        model = with_lora(model, lora)
        if isinstance(plan, str):
            plan = ParallelPlan().with_spec(plan)
        groups = groups if groups is not None else plan.device_groups()  # the plan's `groups=`
        sizes = plan.mesh.sizes().values()
        if devices is None and -1 not in sizes and groups is None:  # a fixed mesh takes the first devices it needs
            devices = jax.devices()[:plan.mesh.fixed_device_count()]
        setup = build_train_setup(model, plan, train, optimizer, devices, groups=groups, loss=loss)
        if params is not None and lora is not None:
            params = _with_fresh_adapters(setup, params, seed)
        state = setup.state.init(seed) if params is None else setup.state_from_params(params)
        return cls(setup, state, train)

    # -- stepping ------------------------------------------------------------------------------
    def step(self, batch: dict) -> dict:
        """One optimizer step on `batch`; its metrics as Python numbers (this waits for the step)."""
        self.state, metrics = self.setup.train_step(self.state, self._device_batch(batch))
        return {k: float(v) for k, v in jax.device_get(metrics).items()}

    def evaluate(self, batch: dict) -> dict:
        """Mean loss and accuracy over the batch's loss-masked tokens (no update)."""
        out = jax.device_get(self.setup.eval_step(self.state.params, self._device_batch(batch)))
        tokens = max(float(out["tokens"]), 1.0)
        return {"loss": float(out["nll"]) / tokens, "accuracy": float(out["correct"]) / tokens,
                "tokens": float(out["tokens"])}

    @property
    def step_count(self) -> int:
        return int(jax.device_get(self.state.step))

    @property
    def params(self) -> dict:
        """The parameters in the canonical layout (layer stacks; what checkpoints hold)."""
        return self.setup.state.to_disk({"params": self.state.params})["params"]

    # -- generation ----------------------------------------------------------------------------
    def generate(self, prompts, *, max_new_tokens: int = 32, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int = 0, eos_id: int | None = None, tokenizer=None):
        """New tokens for each prompt (lists of token ids; or strings, encoded and the results
        decoded by `tokenizer`), from the current parameters on this run's mesh: greedy by default,
        a row stops at `eos_id` (default: the tokenizer's) or after `max_new_tokens`
        (jaxtrain/generate/engine.py)."""
        from jaxtrain.generate.engine import check_prompts
        from jaxtrain.generate.loading import Loaded, canonical_model
        from jaxtrain.generate.sampling import Sampling

        sampling = Sampling(temperature, top_k, top_p)
        texts = any(isinstance(p, str) for p in prompts)
        if texts and tokenizer is None:
            raise ValueError("text prompts need a tokenizer (Run.generate(..., tokenizer=...)); or pass token ids")
        ids = [tokenizer.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
        check_prompts(ids, max_new_tokens, None)
        vocab = self.setup.state.model_cfg.vocab_size
        if any(not 0 <= t < vocab for p in ids for t in p):
            raise ValueError(f"prompt token ids must be in [0, vocab_size={vocab})")
        if eos_id is None and tokenizer is not None:
            eos_id = tokenizer.eos_id
        if self._engine is None:  # built once: its compiled prefill/decode are reused by later calls
            model = canonical_model(self.setup.state.model_cfg, self.params)
            self._engine = Loaded(model, self.setup.mesh, self.setup.rules, tokenizer, None).engine()
        else:  # the same compiled functions, today's parameters
            self._engine.state = nnx.state(canonical_model(self.setup.state.model_cfg, self.params))
        out = self._engine.generate(ids, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, eos_id=eos_id,
                                    pad_id=getattr(tokenizer, "pad_id", 0))
        return [tokenizer.decode(new) for new in out] if texts else out

    # -- checkpoints ---------------------------------------------------------------------------
    def save(self, directory: str) -> int:
        """Writes the state (params, optimizer, step) as checkpoint `step_count` in `directory`
        and waits for it; returns the step. Restorable onto any plan."""
        step = self.step_count
        checkpointer = Checkpointer(directory, async_save=False)
        try:
            checkpointer.save(step, self.setup.state.to_disk(self.state.checkpoint_items()))
            checkpointer.wait()
        finally:
            checkpointer.close()
        return step

    def restore(self, directory: str, step: int | None = None, allow_unverified: bool = False) -> int:
        """Loads checkpoint `step` (default: the newest intact one) into this run's layout.
        `allow_unverified`: also a step without a manifest (restored with a warning)."""
        checkpointer = Checkpointer(directory)
        try:  # a params-only checkpoint gets a fresh optimizer state
            restored = self.setup.restore(checkpointer, step, quarantine=False, allow_unverified=allow_unverified)
        finally:
            checkpointer.close()
        if restored is None:
            raise FileNotFoundError(f"no checkpoint in {directory}")
        self.state = restored.state
        return restored.step

    # -- batches -------------------------------------------------------------------------------
    def _device_batch(self, batch: dict) -> dict:
        t = self.train
        shape = (t.global_batch, t.seq_len)
        missing = {"inputs", "targets"} - set(batch)
        if missing:
            raise ValueError(f"a batch needs {sorted(missing)} (and may have positions, segment_ids, loss_mask)")
        unknown = set(batch) - set(BATCH_KEYS)
        if unknown:
            raise ValueError(f"unknown batch keys {sorted(unknown)}; known: {sorted(BATCH_KEYS)}")
        full = {"positions": np.broadcast_to(np.arange(t.seq_len, dtype=np.int32), shape),
                "segment_ids": np.ones(shape, np.int32), "loss_mask": np.ones(shape, np.float32), **batch}
        for key, value in full.items():
            if tuple(np.shape(value)) != shape:
                raise ValueError(f"batch[{key!r}] has shape {tuple(np.shape(value))}; this run takes "
                                 f"[global_batch, seq_len] = {list(shape)} (TrainConfig)")
        vocab = self.setup.state.model_cfg.vocab_size
        for key in ("inputs", "targets"):
            ids = np.asarray(full[key])
            if ids.min() < 0 or ids.max() >= vocab:
                raise ValueError(f"batch[{key!r}] holds token ids outside [0, vocab_size={vocab})")
        return self.setup.device_batch(full)


def _with_fresh_adapters(setup: TrainSetup, params: dict, seed: int) -> dict:
    """`params` with fresh adapters where it has none (a base model's parameters)."""
    from jaxtrain.training.lora_run import trained_part, with_fresh_adapters

    part = trained_part(setup)
    if part is None or jax.tree.leaves(part.select(params)):
        return params  # the adapters were given too
    return with_fresh_adapters(setup, part, params, seed)
