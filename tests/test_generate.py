"""Generation with the key/value cache (models/layers/decode_cache.py, jaxtrain/generate/engine.py)
on a tiny random Llama imported from transformers: greedy tokens equal transformers' generate,
and each step's logits equal the full training forward's at that position."""
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

    from meshes.mesh import MeshConfig, build_mesh
    from meshes.rules import get_rule_set

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
