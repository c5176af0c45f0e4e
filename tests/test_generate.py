"""Generation with the key/value cache (models/layers/decode_cache.py, jaxtrain/generate/engine.py)
on a tiny random Llama imported from transformers: greedy tokens equal transformers' generate,
each step's logits equal the full training forward's at that position, each row stops at its own
EOS, and sampled tokens equal an independent sampler's (numpy filters, the documented keys)."""
from __future__ import annotations

import types

import numpy as np
import pytest

from hf_tiny_models import forward, save_tiny_llama
from jaxtrain import hf
from jaxtrain.generate import Engine, Sampling, count_compiles, left_pad

pytestmark = [pytest.mark.slow]

PROMPT_LENGTHS = (5, 11, 3)
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    directory = save_tiny_llama(tmp_path_factory.mktemp("llama"), seed=3, vocab_size=97, attention_bias=True)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 97, n).tolist() for n in PROMPT_LENGTHS]
    model = hf.load(directory)
    return types.SimpleNamespace(dir=directory, model=model, prompts=prompts, engine=Engine(model, bucket=16))


def transformers_greedy(directory, prompts, new_tokens):
    """transformers' generate(do_sample=False) on the left-padded batch: the new tokens per row."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True).eval()
    model.generation_config.eos_token_id = None  # a random model may emit any id: no early stop
    length = max(map(len, prompts))
    ids = torch.zeros((len(prompts), length), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, length - len(prompt):] = torch.tensor(prompt)
        mask[row, length - len(prompt):] = 1
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: torch's thread pool on a loaded 2-core machine costs more
    try:
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=0)
    finally:
        torch.set_num_threads(threads)
    return out[:, length:].numpy().tolist()


def test_greedy_equals_transformers_generate_for_left_padded_batch(tiny):
    ours = tiny.engine.generate(tiny.prompts, max_new_tokens=NEW_TOKENS)
    theirs = transformers_greedy(tiny.dir, tiny.prompts, NEW_TOKENS)
    assert ours == theirs


def test_prefill_and_decode_logits_equal_the_full_forward(tiny):
    steps = {}
    rows = tiny.engine.generate(tiny.prompts, max_new_tokens=NEW_TOKENS,
                                on_logits=lambda step, logits: steps.__setitem__(step, logits))
    cached = np.stack([steps[s] for s in range(NEW_TOKENS)], axis=1)  # [b, new, vocab]
    # the full forward over each prompt + its generated tokens, right-padded (causal: pads after
    # a position change nothing there); step s's logits are those at the prompt's last token + s
    sequences = [p + r[:-1] for p, r in zip(tiny.prompts, rows)]
    tokens = np.zeros((len(sequences), max(map(len, sequences))), np.int32)
    for row, seq in enumerate(sequences):
        tokens[row, :len(seq)] = seq
    full = forward(tiny.model, tokens)
    expected = np.stack([full[row, len(p) - 1:len(p) - 1 + NEW_TOKENS] for row, p in enumerate(tiny.prompts)])
    assert np.isfinite(cached).all() and np.isfinite(expected).all()
    np.testing.assert_allclose(cached, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_decode_compiles_once_and_rows_stop_at_their_eos(tiny):
    engine = Engine(tiny.model, bucket=16)  # its own jitted functions: their compiles counted here
    with count_compiles() as compiled:
        free = engine.generate(tiny.prompts, max_new_tokens=NEW_TOKENS)
        assert compiled["_decode_fn"] == 1, "the decode step recompiled during one generation"
        eos = free[0][4]  # row 0 stops at its 5th token; other rows stop at their first one of it
        stopped = engine.generate(tiny.prompts, max_new_tokens=NEW_TOKENS, eos_id=eos)
    assert compiled["_decode_fn"] == 1 and compiled["_prefill_fn"] == 1
    for row, tokens in zip(stopped, free):
        end = tokens.index(eos) + 1 if eos in tokens else NEW_TOKENS
        assert row == tokens[:end]
    assert len(stopped[0]) <= 5
    short = engine.generate(tiny.prompts, max_new_tokens=7)
    assert short == [tokens[:7] for tokens in free]


LAYOUTS = {"data=2": dict(data=2), "tensor=2": dict(tensor=2), "data=2,tensor=2": dict(data=2, tensor=2)}


@pytest.fixture(scope="module")
def one_device_outputs(tiny):
    greedy = tiny.engine.generate(tiny.prompts, max_new_tokens=12)
    sampled = tiny.engine.generate(tiny.prompts, max_new_tokens=12, sampling=Sampling(0.8, top_k=20, top_p=0.9),
                                   seed=5)
    return greedy, sampled


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layouts_generate_the_one_device_tokens(tiny, one_device_outputs, layout):
    import jax

    from jaxtrain.meshes.mesh import MeshConfig, build_mesh
    from jaxtrain.meshes.rules import get_rule_set

    sizes = LAYOUTS[layout]
    mesh = build_mesh(MeshConfig(**sizes), jax.devices()[:int(np.prod(list(sizes.values())))])
    engine = Engine(hf.load(tiny.dir, mesh=mesh), mesh=mesh, rules=get_rule_set("dp"), bucket=16)
    greedy, sampled = one_device_outputs
    assert engine.generate(tiny.prompts, max_new_tokens=12) == greedy
    if layout == "data=2,tensor=2":  # one layout is enough for the seeded draws (a compile each)
        assert engine.generate(tiny.prompts, max_new_tokens=12, sampling=Sampling(0.8, top_k=20, top_p=0.9),
                               seed=5) == sampled
    # the cache is sharded like the weights: kv_heads over tensor, batch over data
    with engine._rules():
        padded = left_pad(tiny.prompts + [[0]], 16)
        _, _, cache = engine._prefill(engine.state, padded.tokens, padded.positions, padded.segment_ids,
                                      jax.random.key(0), max_len=32, sampling=Sampling())
    spec = tuple(cache["blocks"]["k"].sharding.spec) + (None,) * 5  # [layers, b, max_len, kv_heads, head_dim]
    assert spec[:5] == (None, "data" if "data" in sizes else None, None, "tensor" if "tensor" in sizes else None, None)


# -- references from the full forward (no cache): each row's own tokens, positions from 0 ----------

REFERENCE_LENGTH = 48  # every reference below fits: one compile of the full forward


@pytest.fixture(scope="module")
def last_logits(tiny):
    """sequences (lists of ids) -> [b, vocab] float32: the full forward's logits at each one's last
    token. Right-padded to one length: causal, so the pads after a token change nothing there."""
    import jax
    from flax import nnx

    graphdef, state = nnx.split(tiny.model)
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))

    def run(sequences):
        tokens = np.zeros((len(sequences), REFERENCE_LENGTH), np.int32)
        for row, seq in enumerate(sequences):
            tokens[row, :len(seq)] = seq
        logits = np.asarray(forward(state, tokens))
        return np.stack([logits[row, len(seq) - 1] for row, seq in enumerate(sequences)]).astype(np.float32)

    return run


def reference_generate(last_logits, prompts, new_tokens, choose):
    """Each row's `new_tokens` tokens, chosen by `choose(step, logits [b, vocab])` from the full
    forward over its prompt and its own tokens so far (no EOS: rows never stop)."""
    sequences = [list(p) for p in prompts]
    for step in range(new_tokens):
        for seq, token in zip(sequences, choose(step, last_logits(sequences))):
            seq.append(int(token))
    return [seq[len(p):] for seq, p in zip(sequences, prompts)]


def greedy(step, logits):
    return logits.argmax(-1)


def test_each_row_stops_right_after_its_own_eos(tiny, last_logits):
    """Rows reach the EOS at different steps and one never does: a row's tokens end with its first
    EOS (then -1 in the stream), the others run on, and the stream lasts max_new_tokens steps."""
    base, other, shift = tiny.prompts[1], tiny.prompts[2], 5
    # (the third row only keeps the reference's batch at 3 rows: one compile of its forward)
    first = reference_generate(last_logits, [base, other, tiny.prompts[0]], NEW_TOKENS + shift, greedy)
    # base's prompt followed by its own first `shift` tokens continues the same text `shift` steps on,
    # so it reaches a token of base's continuation `shift` steps earlier than base does
    eos = next(t for i, t in enumerate(first[0][:NEW_TOKENS]) if i > shift and t not in first[0][:i]
               and t not in first[1][:NEW_TOKENS])
    prompts = [base, other, base + first[0][:shift]]  # the last row stops too
    free = reference_generate(last_logits, prompts, NEW_TOKENS, greedy)
    ends = [row.index(eos) + 1 if eos in row else None for row in free]
    assert ends[1] is None and None not in (ends[0], ends[2]) and ends[0] != ends[2], (eos, ends)

    steps = list(tiny.engine.stream(prompts, max_new_tokens=NEW_TOKENS, eos_id=eos))
    assert len(steps) == NEW_TOKENS  # the row without an EOS keeps the batch going
    expected = [row[:end] + [-1] * (NEW_TOKENS - end) if end else row for row, end in zip(free, ends)]
    assert np.stack(steps, axis=1).tolist() == expected
    assert tiny.engine.generate(prompts, max_new_tokens=NEW_TOKENS, eos_id=eos) == \
        [row[:end] if end else row for row, end in zip(free, ends)]


# The cached logits differ from the full forward's by about 2e-6 here: a filter decision closer than this
# to its edge could differ between the two without either being wrong.
NEAR_TIE = 1e-5


def numpy_filter(logits: np.ndarray, s: Sampling) -> np.ndarray:
    """[b, vocab] float32 logits / temperature, -inf outside the top-k (ties with the k-th kept),
    then outside the smallest most-likely set whose probability reaches top_p (a token stays if the
    tokens more likely than it hold less than top_p). Asserts no row sits on a filter's edge."""
    z = logits.astype(np.float32) / np.float32(s.temperature)
    if s.top_k:
        ranked = -np.sort(-z, axis=-1)
        assert (ranked[:, s.top_k - 1] - ranked[:, s.top_k] > NEAR_TIE).all(), "a near tie at the top-k edge"
        z = np.where(z >= ranked[:, s.top_k - 1:s.top_k], z, -np.inf)
    if s.top_p < 1:
        for row in z:
            p = np.exp(row.astype(np.float64) - row.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            mass_before = np.cumsum(p[order]) - p[order]
            assert np.abs(mass_before - s.top_p).min() > NEAR_TIE, "a near tie at the top-p edge"
            row[order[mass_before >= s.top_p]] = -np.inf
    return z


SETTINGS = [(Sampling(1.0), 1), (Sampling(1.3, top_p=0.8), 3), (Sampling(0.8, top_k=20, top_p=0.9), 5)]
SAMPLED_TOKENS = 16


@pytest.mark.parametrize("sampling, seed", SETTINGS, ids=[str(s) for s, _ in SETTINGS])
def test_sampled_tokens_equal_an_independent_sampler(tiny, last_logits, sampling, seed):
    """Step s draws jax.random.categorical(fold_in(key(seed), s), filtered logits [b, vocab]) (the
    schedule sampling.py documents), the filters here in numpy on the full forward's logits."""
    import jax

    root = jax.random.key(seed)

    def draw(step, logits):  # one batch-shaped draw per step, as the engine's: its bits depend on [b, vocab]
        return np.asarray(jax.random.categorical(jax.random.fold_in(root, step), numpy_filter(logits, sampling)))

    expected = reference_generate(last_logits, tiny.prompts, SAMPLED_TOKENS, draw)
    assert tiny.engine.generate(tiny.prompts, max_new_tokens=SAMPLED_TOKENS, sampling=sampling, seed=seed) == expected
    assert min(len(set(row)) for row in expected) >= 4  # drawn from a spread: the keys decide


def test_two_seeds_draw_different_tokens(tiny):
    import jax

    first = []
    runs = [tiny.engine.generate(tiny.prompts, max_new_tokens=SAMPLED_TOKENS, sampling=Sampling(1.0), seed=seed,
                                 on_logits=lambda step, logits: first.append(logits) if step == 0 else None)
            for seed in (11, 12)]
    assert np.asarray(jax.nn.softmax(first[0], axis=-1)).max() < 0.5  # flat: two seeds must part
    assert all(a != b for a, b in zip(*runs))
