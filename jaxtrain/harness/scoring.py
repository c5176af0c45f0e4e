"""Log-probabilities of given tokens under a model, batched on its mesh, for the evaluation harness.

A request is a token sequence and how many of its last tokens are scored: each scored token gets
its log-probability given everything before it, and whether it is the argmax there. Two ways to
compute that, chosen per request:

- `WholeSequences`: the model reads `tokens[:-1]`; requests sorted longest first, cut into batches
  of `batch_size` rows, right-padded to a length bucket, filler rows making up the last batch.
  Only the last positions of each row go through the LM head (a bucket of the most tokens any row
  scores), so the vocabulary projection costs what the scored tokens need.
- `SharedContexts`: requests that share everything but their scored tail (the choices of a
  multiple-choice question) read the shared context once: a batch of contexts is prefilled into the
  generation caches (KV, latent or state, whatever the family keeps), each request's cache is a copy
  of its context's, and its scored tokens are fed one per decode step. A question with four choices
  costs one context and four short continuations instead of four whole sequences.

Lengths are padded to buckets (powers of two and 1.5x powers of two, at least `MIN_BUCKET`), so a
task compiles a few programs whatever its lengths.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtrain.meshes.rules import use_rules
from jaxtrain.models.loss import token_losses

MIN_BUCKET = 32
MIN_TAIL = 8


def length_bucket(n: int, minimum: int = MIN_BUCKET) -> int:
    """The padded length for `n`: the smallest 2^k or 1.5 * 2^k at least `n` (and `minimum`)."""
    n = max(n, minimum)
    power = 1 << (n - 1).bit_length()
    return power * 3 // 4 if power * 3 // 4 >= n and power >= 4 else power


@dataclasses.dataclass(frozen=True)
class Scored:
    logprob: float   # sum of the scored tokens' log-probabilities
    greedy: bool     # every scored token is the argmax at its position


def _logprob_and_greedy(logits, targets):
    nll, _ = token_losses(logits, targets)
    return -nll, jnp.argmax(logits, axis=-1) == targets


class WholeSequences:
    """Each request as one row: the model reads the whole sequence, the LM head only its tail."""

    def __init__(self, scorer: "TokenScorer"):
        self.s = scorer
        self._score = jax.jit(self._score_fn, static_argnames=("tail",))

    def _score_fn(self, state, tokens, targets, last, *, tail: int):
        """tokens, targets [b, L]; last [b] the row's last input position -> (log-probability,
        is-argmax) [b, tail] of the targets at input positions last - tail + 1 .. last."""
        model = nnx.merge(self.s.graphdef, state)
        hidden, _ = model.hidden(tokens)
        at = jnp.clip(last[:, None] - tail + 1 + jnp.arange(tail)[None, :], 0, tokens.shape[1] - 1)
        h = jnp.take_along_axis(hidden, at[..., None], axis=1)
        return _logprob_and_greedy(model.logits(h), jnp.take_along_axis(targets, at, axis=1))

    def score(self, requests, indices: Sequence[int], results: list) -> None:
        b = self.s.batch_size
        order = sorted(indices, key=lambda i: -len(requests[i][0]))
        for start in range(0, len(order), b):
            rows = order[start:start + b]
            length = length_bucket(len(requests[rows[0]][0]) - 1)
            tail = min(length_bucket(max(requests[i][1] for i in rows), MIN_TAIL), length)
            tokens = np.zeros((b, length), np.int32)
            targets = np.zeros((b, length), np.int32)
            last = np.zeros((b,), np.int32)
            for row, i in enumerate(rows):
                seq = requests[i][0]
                tokens[row, :len(seq) - 1] = seq[:-1]
                targets[row, :len(seq) - 1] = seq[1:]
                last[row] = len(seq) - 2
            with self.s.rules():
                logprob, greedy = jax.device_get(self._score(self.s.state, tokens, targets, last, tail=tail))
            self.s.programs.add(("whole", length, tail))
            for row, i in enumerate(rows):
                n = requests[i][1]
                results[i] = Scored(float(np.sum(logprob[row, tail - n:], dtype=np.float64)),
                                    bool(np.all(greedy[row, tail - n:])))


class SharedContexts:
    """Requests sharing a context: the context prefilled once into the caches, each request's
    scored tokens decoded one step at a time from a copy of its context's cache."""

    def __init__(self, scorer: "TokenScorer", model):
        from jaxtrain.generate.loading import cache_dtype

        self.s = scorer
        self.dtype = cache_dtype(model)
        one, two = (jax.eval_shape(lambda n=n: model.init_cache(n, 8, self.dtype)) for n in (1, 2))
        # each cache leaf's batch axis: the one that differs between a 1-row and a 2-row cache
        self.batch_axes = jax.tree.map(lambda a, b: next(i for i, (x, y) in enumerate(zip(a.shape, b.shape))
                                                         if x != y), one, two)
        self._prefill = jax.jit(self._prefill_fn, static_argnames=("max_len",))
        self._expand = jax.jit(self._expand_fn)
        self._step = jax.jit(self._step_fn, donate_argnums=(1,))

    def _prefill_fn(self, state, tokens, positions, segment_ids, *, max_len: int):
        model = nnx.merge(self.s.graphdef, state)
        cache = model.init_cache(tokens.shape[0], max_len, self.dtype)
        logits, cache = model.prefill(tokens, positions, segment_ids, cache)
        return logits, cache

    def _expand_fn(self, logits, cache, context_of, first):
        """Each request row's copy of its context's cache, and its first scored token's score."""
        rows = jax.tree.map(lambda c, axis: jnp.take(c, context_of, axis=axis), cache, self.batch_axes)
        return rows, _logprob_and_greedy(jnp.take(logits, context_of, axis=0), first)

    def _step_fn(self, state, cache, tokens, index, valid_from, targets):
        model = nnx.merge(self.s.graphdef, state)
        logits, cache = model.decode(tokens[:, None], (index - valid_from)[:, None], cache, index, valid_from)
        return cache, _logprob_and_greedy(logits, targets)

    def score(self, requests, groups: Sequence[Sequence[int]], results: list) -> None:
        """`groups`: request indices sharing a context, each group's context prefilled once."""
        from jaxtrain.generate.engine import left_pad

        b = self.s.batch_size
        # contexts per prefill: about a batch of requests' worth, so that each prefill's contexts
        # are of like length (fewer pads) and their requests fill about one decode batch
        per_prefill = min(b, self.s.round_to_split(math.ceil(b * len(groups) / sum(map(len, groups)))))
        groups = sorted(groups, key=lambda g: -(len(requests[g[0]][0]) - requests[g[0]][1]))
        for start in range(0, len(groups), per_prefill):
            batch = groups[start:start + per_prefill]
            contexts = [requests[g[0]][0][:-requests[g[0]][1]] for g in batch]
            length = length_bucket(len(contexts[0]))
            tail = length_bucket(max(requests[i][1] for g in batch for i in g), MIN_TAIL)
            padded = left_pad(contexts + [[0]] * (per_prefill - len(contexts)), length)
            with self.s.rules():
                logits, cache = self._prefill(self.s.state, padded.tokens, padded.positions, padded.segment_ids,
                                              max_len=length + tail)
            self.s.programs.add(("prefill", per_prefill, length, tail))
            rows = [(c, i) for c, g in enumerate(batch) for i in g]
            for chunk in range(0, len(rows), b):
                self._decode_rows(requests, rows[chunk:chunk + b], logits, cache, padded.valid_from, length, results)

    def _decode_rows(self, requests, rows, logits, cache, valid_from, length, results) -> None:
        b = self.s.batch_size
        steps = max(requests[i][1] for _, i in rows)
        context_of = np.zeros((b,), np.int32)
        scored = np.zeros((b, steps), np.int32)  # each row's scored tokens, left-aligned
        for row, (c, i) in enumerate(rows):
            context_of[row] = c
            n = requests[i][1]
            scored[row, :n] = requests[i][0][-n:]
        with self.s.rules():
            cache_rows, first = self._expand(logits, cache, context_of, scored[:, 0])
        logprob, greedy = [np.asarray(first[0])], [np.asarray(first[1])]
        row_valid_from = jnp.asarray(np.asarray(valid_from)[context_of])
        for step in range(steps - 1):
            with self.s.decode_rules():
                cache_rows, out = self._step(self.s.state, cache_rows, scored[:, step], jnp.int32(length + step),
                                             row_valid_from, scored[:, step + 1])
            logprob.append(np.asarray(out[0]))
            greedy.append(np.asarray(out[1]))
        logprob, greedy = np.stack(logprob, 1), np.stack(greedy, 1)
        for row, (_, i) in enumerate(rows):
            n = requests[i][1]
            results[i] = Scored(float(np.sum(logprob[row, :n], dtype=np.float64)), bool(np.all(greedy[row, :n])))


class TokenScorer:
    """Scores requests with one model on one mesh (or one device). `rules`: the rule table the
    model's weights are sharded by; `batch_size`: rows per compiled batch, rounded up to what the
    mesh splits the batch into. Requests that share a context go through `SharedContexts` where
    the model keeps generation caches and the layout can decode (no `context` axis), the others
    (and all with `share_contexts=False`) through `WholeSequences`."""

    def __init__(self, model, *, mesh=None, rules=None, batch_size: int = 8, share_contexts: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.graphdef, self.state = nnx.split(model)
        self.mesh, self.rules_table = mesh, rules
        self.split = 1 if mesh is None else math.prod(mesh.shape[a] for a in rules.activations.get("batch", ())
                                                       if a in mesh.shape)
        self.batch_size = self.round_to_split(batch_size)
        self.vocab = int(model.config.vocab_size)
        self.programs: set[tuple] = set()  # (kind, [rows,] length bucket, tail bucket) of each program run
        self.whole = WholeSequences(self)
        can_decode = hasattr(model, "init_cache") and (mesh is None or mesh.shape.get("context", 1) == 1)
        self.shared = SharedContexts(self, model) if share_contexts and can_decode else None

    def round_to_split(self, rows: int) -> int:
        """`rows` rounded up to a multiple of the ways the mesh splits the batch."""
        return -(-rows // self.split) * self.split

    def rules(self):
        return contextlib.nullcontext() if self.mesh is None else use_rules(self.mesh, self.rules_table)

    def decode_rules(self):
        from jaxtrain.generate.engine import decode_rules

        return contextlib.nullcontext() if self.mesh is None else use_rules(self.mesh, decode_rules(self.rules_table))

    def score(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[Scored]:
        """For each (tokens, n_scored): the log-probability of its last `n_scored` tokens given
        everything before them, and whether greedy decoding would produce them."""
        for i, (tokens, n_scored) in enumerate(requests):
            if not 1 <= n_scored < len(tokens):
                raise ValueError(f"request {i}: {n_scored} scored tokens of {len(tokens)}; needs at least one "
                                 "token of context and one scored")
            if any(not 0 <= t < self.vocab for t in tokens):
                raise ValueError(f"request {i}: token ids must be in [0, vocab_size={self.vocab})")
        by_context: dict[tuple, list[int]] = {}
        for i, (tokens, n_scored) in enumerate(requests):
            by_context.setdefault(tuple(tokens[:-n_scored]), []).append(i)
        shared = [g for g in by_context.values() if len(g) > 1] if self.shared is not None else []
        alone = [i for g in by_context.values() if len(g) == 1 or self.shared is None for i in g]
        results: list[Scored | None] = [None] * len(requests)
        if shared:
            self.shared.score(requests, shared, results)
        if alone:
            self.whole.score(requests, alone, results)
        return results

    def set_state(self, state) -> None:
        """New parameters for the same model: the compiled programs are reused."""
        self.state = state
