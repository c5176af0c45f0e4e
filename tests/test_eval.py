"""Sliding-window evaluation against a direct per-token reference."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from helpers import TINY_LLAMA
from jaxtrain.training.config import TrainConfig
from jaxtrain.cli.eval import evaluate_stream
from jaxtrain.training.optim import OptimizerConfig
from jaxtrain.training.parallel_plan import ParallelPlan
from jaxtrain.data.sliding_window import sliding_windows
from jaxtrain.training.train_setup import build_train_setup

pytestmark = [pytest.mark.slow]


@pytest.mark.parametrize("n, seq_len, stride", [(50, 16, 8), (17, 16, 16), (5, 16, 4), (40, 8, 3)])
def test_each_target_scored_once_with_enough_context(n, seq_len, stride):
    stream = np.arange(n, dtype=np.int32) + 1
    scored = []
    for w, win in enumerate(sliding_windows(stream, seq_len, stride, pad_id=0)):
        begin = w * stride
        for i in np.nonzero(win["loss_mask"])[0]:
            assert win["targets"][i] == stream[begin + i + 1] and win["inputs"][i] == stream[begin + i]
            scored.append(begin + i + 1)
            if w > 0:
                assert i + 1 >= seq_len - stride  # context tokens before the target
    assert sorted(scored) == list(range(1, n))


def test_sliding_window_loss_equals_per_token_reference():
    n, seq_len, stride = 45, 16, 6
    stream = np.random.default_rng(5).integers(0, TINY_LLAMA.vocab_size, n).astype(np.int32)
    model = TINY_LLAMA.build(nnx.Rngs(params=jax.random.key(3)))
    params = nnx.to_pure_dict(nnx.state(model))
    setup = build_train_setup(TINY_LLAMA, ParallelPlan.parse("data=4,tensor=4,rules=dp"),
                              TrainConfig(global_batch=4, seq_len=seq_len), OptimizerConfig())
    out = evaluate_stream(setup, params, stream, seq_len=seq_len, stride=stride, batch_size=4, pad_id=0)

    # Reference: for each window start b (stride apart), one plain causal forward pass over
    # stream[b: b + seq_len]; the targets this window is first to reach are scored from it.
    nll, begin, reach = [], 0, 0
    while reach < n - 1:
        last = min(begin + seq_len, n - 1)
        logits = np.asarray(model(jnp.asarray(stream[None, begin:last])))[0]
        for j in range(max(reach + 1, begin + 1), last + 1):
            row = logits[j - 1 - begin].astype(np.float64)
            nll.append(np.log(np.exp(row - row.max()).sum()) + row.max() - row[stream[j]])
        reach, begin = last, begin + stride
    assert out["tokens"] == n - 1 == len(nll)
    np.testing.assert_allclose(out["loss"], np.mean(nll), rtol=1e-5)
