"""Log-probabilities of given tokens under a model, batched on its mesh, for the evaluation harness.

A request is a token sequence and how many of its last tokens are scored: the model reads
`tokens[:-1]` and each scored position gives the log-probability of the next token and whether it
is the argmax. Requests are sorted longest first and cut into batches of `batch_size` rows; a batch is
right-padded to its length bucket (a power of two, at least `MIN_BUCKET`) and filler rows make up
the last batch, so a whole task compiles one program per bucket whatever its lengths.

Per-token scores come back, not logits: the vocabulary dimension is reduced on the devices, a
chunk of positions at a time, so no device holds [batch, length, vocab] float32 logits at once.
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

from meshes.rules import use_rules
from models.loss import token_losses

MIN_BUCKET = 32
LOGIT_ELEMENTS = 1 << 25  # float32 logits one chunk of positions may hold on the mesh (128 MiB)


def length_bucket(n: int) -> int:
    """The padded length `n` input tokens are scored at: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class Scored:
    logprob: float   # sum of the scored tokens' log-probabilities
    greedy: bool     # every scored token is the argmax at its position


class TokenScorer:
    """Scores requests with one model on one mesh (or one device). `rules`: the rule table the
    model's weights are sharded by; `batch_size`: rows per compiled batch, rounded up to what the
    mesh splits the batch into."""

    def __init__(self, model, *, mesh=None, rules=None, batch_size: int = 8):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.graphdef, self.state = nnx.split(model)
        self.mesh, self.rules = mesh, rules
        split = 1 if mesh is None else math.prod(mesh.shape[a] for a in rules.activations.get("batch", ())
                                                  if a in mesh.shape)
        self.batch_size = -(-batch_size // split) * split
        self.vocab = int(model.config.vocab_size)
        self._score = jax.jit(self._score_fn)
        self.buckets_used: set[int] = set()

    def _rules(self):
        return contextlib.nullcontext() if self.mesh is None else use_rules(self.mesh, self.rules)

    def _score_fn(self, state, tokens, targets):
        """tokens, targets [b, L] -> (target log-probability [b, L], target is the argmax [b, L])."""
        model = nnx.merge(self.graphdef, state)
        hidden, _ = model.hidden(tokens)
        b, length = tokens.shape
        chunk = length
        while chunk > 1 and b * chunk * self.vocab > LOGIT_ELEMENTS:
            chunk //= 2

        def one_chunk(xs):
            h, t = xs
            logits = model.logits(h)
            nll, _ = token_losses(logits, t)
            return -nll, jnp.argmax(logits, axis=-1) == t

        def split(a):  # [b, L, ...] -> [L / chunk, b, chunk, ...]
            return jnp.moveaxis(a.reshape((b, length // chunk, chunk) + a.shape[2:]), 1, 0)

        logprob, greedy = jax.lax.map(one_chunk, (split(hidden), split(targets)))
        return (jnp.moveaxis(logprob, 0, 1).reshape(b, length), jnp.moveaxis(greedy, 0, 1).reshape(b, length))

    def score(self, requests: Sequence[tuple[Sequence[int], int]]) -> list[Scored]:
        """For each (tokens, n_scored): the log-probability of its last `n_scored` tokens given
        everything before them, and whether greedy decoding would produce them."""
        for i, (tokens, n_scored) in enumerate(requests):
            if not 1 <= n_scored < len(tokens):
                raise ValueError(f"request {i}: {n_scored} scored tokens of {len(tokens)}; needs at least one "
                                 "token of context and one scored")
            if any(not 0 <= t < self.vocab for t in tokens):
                raise ValueError(f"request {i}: token ids must be in [0, vocab_size={self.vocab})")
        order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]))
        results: list[Scored | None] = [None] * len(requests)
        for start in range(0, len(order), self.batch_size):
            rows = order[start:start + self.batch_size]
            length = length_bucket(len(requests[rows[0]][0]) - 1)
            tokens = np.zeros((self.batch_size, length), np.int32)
            targets = np.zeros((self.batch_size, length), np.int32)
            for row, i in enumerate(rows):
                seq = requests[i][0]
                tokens[row, :len(seq) - 1] = seq[:-1]
                targets[row, :len(seq) - 1] = seq[1:]
            with self._rules():
                logprob, greedy = jax.device_get(self._score(self.state, tokens, targets))
            self.buckets_used.add(length)
            for row, i in enumerate(rows):
                seq, n_scored = requests[i]
                scored = slice(len(seq) - 1 - n_scored, len(seq) - 1)
                results[i] = Scored(float(np.sum(logprob[row, scored], dtype=np.float64)),
                                    bool(np.all(greedy[row, scored])))
        return results
