"""Batched generation: one jitted prefill, then a jitted one-token decode step with the caches
donated (updated in place), compiled once per (batch, max_len, prompt length) bucket.

Prompts of different lengths are left-padded (models/layers/decode_cache.py), so every row writes
its next token at the same cache index. A row stops at `eos_id` or after `max_new_tokens`; the
loop ends when every row has stopped.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.generate.sampling import Sampling, sample
from jaxtrain.meshes.rules import use_rules

BUCKET = 64  # prompt lengths and cache lengths round up to a multiple of this: few compiles


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class PaddedPrompts:
    tokens: np.ndarray        # [b, P] int32, each prompt right-aligned
    positions: np.ndarray     # [b, P] counting from 0 at the row's first real token (pads: 0)
    segment_ids: np.ndarray   # [b, P] 1 on real tokens, 0 on pads
    valid_from: np.ndarray    # [b] the row's pad count: its first real cache entry


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int = 0) -> PaddedPrompts:
    b = len(prompts)
    tokens = np.full((b, length), pad_id, np.int32)
    segment_ids = np.zeros((b, length), np.int32)
    valid_from = np.array([length - len(p) for p in prompts], np.int32)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            tokens[row, length - len(prompt):] = prompt
            segment_ids[row, length - len(prompt):] = 1
    positions = np.maximum(np.arange(length)[None, :] - valid_from[:, None], 0).astype(np.int32)
    return PaddedPrompts(tokens, positions, segment_ids, valid_from)


def check_prompts(prompts: Sequence[Sequence[int]], max_new_tokens: int, max_positions: int | None) -> None:
    """Errors (ValueError) for input that cannot be generated from, before anything compiles."""
    if not prompts:
        raise ValueError("no prompts given")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    for i, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {i} is empty")
        if max_positions is not None and len(prompt) + max_new_tokens > max_positions:
            raise ValueError(f"prompt {i} has {len(prompt)} tokens; with max_new_tokens={max_new_tokens} that "
                             f"passes the model's {max_positions} positions")


def decode_rules(rules):
    """The rule table a decode step runs under: `rules` with the token axis whole. A step holds one
    token per row, which no sequence-parallel (`dp_sp`, `fsdp_sp`: residual over tensor) or
    context-parallel split can divide; weights and caches shard as under `rules`."""
    activations = {**rules.activations, "length": (), "residual_length": ()}
    return dataclasses.replace(rules, name=f"{rules.name} decode", activations=activations)


def check_generation_layout(mesh) -> None:
    """ValueError, before anything compiles, for a mesh generation cannot run on: under context
    parallelism a prompt's tokens (and so its cache entries) sit in the layout's device order,
    not in the order decode appends to."""
    if mesh is not None and mesh.shape.get("context", 1) > 1:
        raise ValueError(f"generation does not run under context parallelism (context={mesh.shape['context']} in "
                         f"this layout): generate on a layout without `context`, e.g. data and tensor only")


class Engine:
    """Generation with one model on one mesh (or one device). `rules`: the rule table the model's
    weights are sharded by (meshes/rules.py), so the caches shard like them."""

    def __init__(self, model, *, mesh=None, rules=None, cache_dtype=jnp.float32, bucket: int = BUCKET):
        check_generation_layout(mesh)
        self.graphdef, self.state = nnx.split(model)
        self.mesh, self.rules, self.cache_dtype, self.bucket = mesh, rules, cache_dtype, bucket
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("max_len", "sampling"))
        self._decode = jax.jit(self._decode_fn, static_argnames=("sampling",), donate_argnums=(1,))

    def _rules(self, decode: bool = False):
        if self.mesh is None:
            return contextlib.nullcontext()
        return use_rules(self.mesh, decode_rules(self.rules) if decode else self.rules)

    def batch_multiple(self) -> int:
        """How many ways the rule table splits `batch` on this mesh (1 without a mesh)."""
        if self.mesh is None:
            return 1
        return math.prod(self.mesh.shape[a] for a in self.rules.activations.get("batch", ()) if a in self.mesh.shape)

    def _prefill_fn(self, state, tokens, positions, segment_ids, key, *, max_len: int, sampling: Sampling):
        model = nnx.merge(self.graphdef, state)
        cache = model.init_cache(tokens.shape[0], max_len, self.cache_dtype)
        logits, cache = model.prefill(tokens, positions, segment_ids, cache)
        return sample(logits, key, sampling), logits, cache

    def _decode_fn(self, state, cache, tokens, index, valid_from, key, *, sampling: Sampling):
        model = nnx.merge(self.graphdef, state)
        positions = (index - valid_from)[:, None]
        logits, cache = model.decode(tokens[:, None], positions, cache, index, valid_from)
        return sample(logits, key, sampling), logits, cache

    def stream(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int, sampling: Sampling = Sampling(),
               seed: int = 0, eos_id: int | None = None, pad_id: int = 0,
               on_logits: Callable | None = None) -> Iterator[np.ndarray]:
        """Yields each step's tokens [b] (int, -1 for rows already stopped). `on_logits(step,
        logits)`: the logits each step's tokens were drawn from (tests)."""
        check_prompts(prompts, max_new_tokens, None)
        length = round_up(max(len(p) for p in prompts), self.bucket)
        max_len = round_up(length + max_new_tokens - 1, self.bucket)
        rows = len(prompts)
        # filler rows (one pad token each) so that the batch divides the mesh's batch split
        prompts = list(prompts) + [[pad_id]] * (round_up(rows, self.batch_multiple()) - rows)
        padded = left_pad(prompts, length, pad_id)
        root = jax.random.key(seed)
        done = np.zeros(len(prompts), bool)
        done[rows:] = True
        with self._rules():
            tokens, logits, cache = self._prefill(self.state, padded.tokens, padded.positions, padded.segment_ids,
                                                  jax.random.fold_in(root, 0), max_len=max_len, sampling=sampling)
        valid_from = jnp.asarray(padded.valid_from)
        for step in range(max_new_tokens):
            if step:
                with self._rules(decode=True):  # entered per call: the rules never stay set across a yield
                    tokens, logits, cache = self._decode(self.state, cache, tokens, jnp.int32(length + step - 1),
                                                         valid_from, jax.random.fold_in(root, step),
                                                         sampling=sampling)
            if on_logits is not None:
                on_logits(step, np.asarray(logits))
            out = np.where(done, -1, np.asarray(tokens))
            yield out[:rows]
            if eos_id is not None:
                done |= out == eos_id
            if done.all():
                return

    def generate(self, prompts: Sequence[Sequence[int]], **kwargs) -> list[list[int]]:
        """The new tokens of each prompt (up to and including its EOS)."""
        rows = [[] for _ in prompts]
        for tokens in self.stream(prompts, **kwargs):
            for row, token in zip(rows, tokens):
                if token >= 0:
                    row.append(int(token))
        return rows
