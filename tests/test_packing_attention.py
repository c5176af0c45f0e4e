"""Packed rows: attention never crosses documents, so each document's logits inside a packed
row equal the logits of that document run alone."""
import pytest
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from helpers import TINY_LLAMA

pytestmark = [pytest.mark.fast]


def test_packed_row_equals_documents_run_separately():
    model = TINY_LLAMA.build(nnx.Rngs(params=jax.random.key(1)))
    rng = np.random.default_rng(2)
    lengths = [5, 9, 2]
    docs = [rng.integers(0, TINY_LLAMA.vocab_size, n).astype(np.int32) for n in lengths]
    tokens = np.concatenate(docs)[None]
    segment_ids = np.concatenate([np.full(n, i + 1) for i, n in enumerate(lengths)]).astype(np.int32)[None]
    positions = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)[None]
    packed = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)))
    start = 0
    for doc in docs:
        alone = np.asarray(model(jnp.asarray(doc[None])))
        np.testing.assert_allclose(packed[0, start:start + len(doc)], alone[0], rtol=1e-5, atol=1e-5)
        start += len(doc)
    # Without segment ids the later documents see the earlier ones: the check above can fail.
    unsegmented = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions)))
    assert not np.allclose(unsegmented[0, lengths[0]:], packed[0, lengths[0]:], atol=1e-4)
