"""The generation interfaces: `python -m jaxtrain.generate` (run in-process through its main) on a
tiny HF directory with a chat tokenizer, its one-line exit-2 errors, and `Run.generate`."""
from __future__ import annotations

import json
import shutil
import types

import jax
import numpy as np
import pytest

from hf_tiny_models import save_tiny_llama
from jaxtrain import hf
from jaxtrain.cli.generate import main
from jaxtrain.data.tokenizer import HFTokenizer
from jaxtrain.generate import Engine, Sampling
from store_helpers import make_chat_tokenizer

pytestmark = [pytest.mark.slow]

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "hello world, hello cats and dogs"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    bare = save_tiny_llama(tmp_path_factory.mktemp("bare"), seed=4, vocab_size=320, max_position_embeddings=64)
    full = tmp_path_factory.mktemp("with_tokenizer")
    shutil.copytree(bare, full, dirs_exist_ok=True)
    make_chat_tokenizer(full, TEXTS * 20, vocab_size=300)
    tokenizer = HFTokenizer(str(full))
    return types.SimpleNamespace(bare=bare, full=str(full), tokenizer=tokenizer,
                                 engine=Engine(hf.load(str(full)), bucket=16))


def run_cli(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr()


def test_one_prompt_streams_the_greedy_text(hf_dir, capsys):
    ids = hf_dir.tokenizer.encode("the cat")
    expected = hf_dir.engine.generate([ids], max_new_tokens=10, eos_id=hf_dir.tokenizer.eos_id)[0]
    code, out = run_cli(capsys, "--hf_dir", hf_dir.full, "--prompt", "the cat", "--max_new_tokens", "10")
    assert code == 0
    assert out.out == hf_dir.tokenizer.decode(expected) + "\n"


def test_prompts_file_with_chat_template_and_sampling(hf_dir, capsys, tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "a dog"}) + "\n" + json.dumps("hello world") + "\n")
    code, out = run_cli(capsys, "--hf_dir", hf_dir.full, "--prompts", str(path), "--chat", "--max_new_tokens", "6",
                        "--temperature", "0.9", "--top_k", "50", "--top_p", "0.95", "--seed", "3")
    assert code == 0
    rows = [json.loads(line) for line in out.out.splitlines()]
    tok = hf_dir.tokenizer.hf_tokenizer
    ids = [hf_dir.tokenizer.encode(tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                           add_generation_prompt=True)) for t in ("a dog", "hello world")]
    assert all(i[0] == tok.convert_tokens_to_ids("<|im_start|>") for i in ids)  # the template was applied
    expected = hf_dir.engine.generate(ids, max_new_tokens=6, sampling=Sampling(0.9, 50, 0.95), seed=3,
                                      eos_id=hf_dir.tokenizer.eos_id, pad_id=hf_dir.tokenizer.pad_id)
    assert [r["prompt"] for r in rows] == ["a dog", "hello world"]
    assert [r["tokens"] for r in rows] == expected
    assert [r["text"] for r in rows] == [hf_dir.tokenizer.decode(e) for e in expected]


BAD = {
    "negative temperature": (["--temperature", "-0.5"], "temperature"),
    "top_p zero": (["--top_p", "0"], "top_p"),
    "top_p above one": (["--top_p", "1.5"], "top_p"),
    "negative top_k": (["--top_k", "-2"], "top_k"),
    "empty prompt": (["--prompt", ""], "empty"),
    "past the model's positions": (["--prompt", "q" * 60, "--max_new_tokens", "8"], "model's positions"),
    "past max_len": (["--max_len", "8", "--max_new_tokens", "6"], "--max_len"),
    "no tokenizer": (["--bare"], "no tokenizer"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_exits_2_with_one_line(hf_dir, capsys, case):
    extra, words = BAD[case]
    source = hf_dir.bare if "--bare" in extra else hf_dir.full
    extra = [a for a in extra if a != "--bare"]
    argv = ["--hf_dir", source, *extra] + ([] if "--prompt" in extra else ["--prompt", "the cat sat"])
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("error:") and words in err, err


def test_run_generate_on_a_mesh_uses_the_current_parameters():
    from jaxtrain.api import Run
    from jaxtrain.generate.loading import canonical_model
    from jaxtrain.training.config import TrainConfig
    from jaxtrain.models.llama import LlamaConfig

    cfg = LlamaConfig(vocab_size=64, embed=32, layers=2, heads=4, kv_heads=2, mlp=48)
    run = Run.create(cfg, "data=2,tensor=2", train=TrainConfig(global_batch=4, seq_len=16, steps=2), seed=1)
    prompts = [[3, 9, 27, 4], [11, 2], [5, 6, 7, 8, 9, 10, 11]]
    outputs = []
    for seed in (1, 2):  # the second: other parameters, the same compiled functions
        if seed == 2:
            run.state = run.state.replace(params=jax.tree.map(lambda p: p * 1.5, run.state.params))
        reference = Engine(canonical_model(cfg, jax.device_get(run.params)))
        outputs.append(run.generate(prompts, max_new_tokens=9))
        assert outputs[-1] == reference.generate(prompts, max_new_tokens=9)
    assert outputs[0] != outputs[1]
    with pytest.raises(ValueError, match="vocab_size"):
        run.generate([[3, 64]])
    with pytest.raises(ValueError, match="tokenizer"):
        run.generate(["some text"])


def test_one_prompt_is_printed_as_it_is_generated(capsys):
    """Each character is on stdout before the next token is generated (multi-byte characters wait
    for their last byte)."""
    from jaxtrain.cli.generate import stream_one
    from jaxtrain.data.tokenizer import ByteTokenizer

    text = "héllo"
    seen = []

    class Steps:  # an engine whose steps record what had been printed before each of them
        def stream(self, prompts, **kwargs):
            for byte in text.encode():
                seen.append(capsys.readouterr().out)
                yield np.array([byte])

    new = stream_one(Steps(), [1], ByteTokenizer())
    seen.append(capsys.readouterr().out)
    assert bytes(new).decode() == text
    assert seen == ["", "h", "", "é", "l", "l", "o\n"]
