"""`prepare` beyond plain text: chat masks against the chat template's own rendering, prompt/
completion masks, every bad input as one line naming the file (and line) with exit 2 and nothing
written, and a prepare killed mid-write that leaves no complete-looking store."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys

import pytest

from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.prepare import PAUSE_ENV, prepare
from jaxtrain.data.store.readers import open_source
from store_helpers import CHATML, CHATML_MARKED, make_chat_tokenizer, source_documents, source_masks
from test_data import WORDS, random_documents, rng, write_jsonl, write_txt  # noqa: F401

pytestmark = [pytest.mark.fast]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def random_conversations(rng, count):
    def text():
        return " ".join(rng.choice(WORDS, size=int(rng.integers(1, 8))))

    conversations = []
    for _ in range(count):
        messages = [{"role": "system", "content": text()}] if rng.random() < 0.5 else []
        for _ in range(int(rng.integers(1, 4))):
            messages += [{"role": "user", "content": text()}, {"role": "assistant", "content": text()}]
        conversations.append(messages)
    return conversations


def write_records(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("chat_tok")
    texts = [" ".join(WORDS)] * 4
    plain = make_chat_tokenizer(folder / "plain", texts, CHATML)
    return plain, make_chat_tokenizer(folder / "marked", texts, CHATML_MARKED)


def test_chat_mask_is_exactly_the_assistant_turns(tmp_path, rng, chat_tokenizers):
    from transformers import AutoTokenizer

    plain, marked = chat_tokenizers
    conversations = random_conversations(rng, 12)
    path = write_records(tmp_path / "chat.jsonl", [{"messages": m, "id": i} for i, m in enumerate(conversations)])
    # The reference: transformers' own assistant mask from the template with {% generation %} marks.
    hf = AutoTokenizer.from_pretrained(marked)
    reference = [hf.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                 for m in conversations]
    for spec in (plain, marked):  # plain: rendered prefix by prefix; marked: the template's own mask
        store = open_source(prepare([path], spec, tmp_path / os.path.basename(spec), workers=1, data_format="chat").out)
        assert store.has_loss_mask and store.metadata.data_format == "chat"
        assert source_documents(store) == [list(r["input_ids"]) for r in reference]
        masks = source_masks(store)
        assert masks == [list(r["assistant_masks"]) for r in reference]
        for messages, tokens, mask in zip(conversations, source_documents(store), masks):
            trained = hf.decode([t for t, m in zip(tokens, mask) if m])
            assert trained == "".join(m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant")


def test_prompt_completion_masks_the_prompt(tmp_path, rng):
    docs = random_documents(rng, 20, max_words=6)
    records = [{"prompt": docs[i], "completion": docs[i + 1]} for i in range(0, 20, 2)]
    store = open_source(prepare([write_records(tmp_path / "pc.jsonl", records)], "bytes", tmp_path / "pc", workers=1,
                                data_format="prompt_completion").out)
    for record, tokens, mask in zip(records, source_documents(store), source_masks(store)):
        prompt, completion = list(record["prompt"].encode()), list(record["completion"].encode())
        assert tokens == [256] + prompt + completion + [257]
        assert mask == [0] * (1 + len(prompt)) + [1] * (len(completion) + 1)


def _bad_inputs(tmp_path):
    """(inputs, prepare kwargs, message) for each bad input."""
    good = write_jsonl(tmp_path / "good.jsonl", ["a doc"])
    (tmp_path / "empty.jsonl").write_text("")
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "fine"}\n\n{"text": "bad" oops}\n')
    field = tmp_path / "field.jsonl"
    field.write_text('{"text": "fine"}\n{"body": "no text"}\n')
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
                    + "\n" + json.dumps({"messages": [{"role": "user", "content": "a"}]}) + "\n")
    (tmp_path / "table.csv").write_text("text\nhello\n")
    return [
        ([str(tmp_path / "nothing*.jsonl")], {}, r"nothing\*\.jsonl: the glob matches no file"),
        ([str(tmp_path / "missing.jsonl")], {}, r"missing\.jsonl: no such file"),
        ([good, str(tmp_path / "empty.jsonl")], {}, r"empty\.jsonl: empty file"),
        ([good, str(blank)], {}, r"blank\.jsonl: no documents \(empty source\)"),
        ([str(lines)], {}, r"lines\.jsonl:3: not valid JSON"),
        ([str(field)], {}, r"field\.jsonl:2: field 'text' is missing"),
        ([str(tmp_path / "table.csv")], {}, r"table\.csv: unsupported input type"),
        ([write_txt(tmp_path / "t.txt", ["x"])], {"data_format": "chat"}, r"t\.txt: \.txt files hold plain text"),
        ([good], {"data_format": "chat"}, "bytes: --format chat needs a Hugging Face tokenizer with a chat template"),
        ([good], {"workers": 0}, "--workers must be at least 1"),
    ], chat


@pytest.mark.parametrize("case", range(10))
def test_bad_input_names_the_file_and_writes_nothing(tmp_path, case):
    inputs, kwargs, message = _bad_inputs(tmp_path)[0][case]
    out = tmp_path / "out"
    with pytest.raises(DataInputError, match=message):
        prepare(inputs, "bytes", out, **{"workers": 1, **kwargs})
    assert not out.exists() and not list(tmp_path.glob("out.*"))


def test_chat_line_without_assistant_turn(tmp_path, chat_tokenizers):
    _, chat = _bad_inputs(tmp_path)
    with pytest.raises(DataInputError, match=r"chat\.jsonl:2: no assistant turn"):
        prepare([str(chat)], chat_tokenizers[0], tmp_path / "out", workers=1, data_format="chat")
    assert not list(tmp_path.glob("out*"))


def _cli(*args, env=None, **kw):
    return subprocess.Popen([sys.executable, "-m", "jaxtrain.data", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


@pytest.mark.end_to_end
def test_cli_exit_codes_and_a_killed_prepare(tmp_path, rng):
    docs = random_documents(rng, 40)
    corpus = write_jsonl(tmp_path / "corpus.jsonl", docs)
    out = tmp_path / "store"
    # Killed after its second batch is written: no store, only a temporary directory.
    env = dict(os.environ, **{PAUSE_ENV: "2:120"})
    killed = _cli("prepare", "--input", corpus, "--tokenizer", "bytes", "--out", str(out), "--workers", "1",
                  "--batch_documents", "4", "--no_progress", env=env)
    ready, _, _ = select.select([killed.stderr], [], [], 60)
    line = killed.stderr.readline() if ready else "(nothing within 60 s)"
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert line.startswith("prepare: paused after 2 batches"), line
    partial = tmp_path / f"store.tmp-{killed.pid}" / "tokens.bin"
    assert partial.is_file() and not out.exists()
    with pytest.raises(DataInputError, match="neither a token store"):
        open_source(out)
    # The rerun cleans the dead writer's directory and completes.
    done = _cli("prepare", "--input", corpus, "--tokenizer", "bytes", "--out", str(out), "--no_progress")
    assert done.wait(120) == 0, done.stderr.read()
    assert not partial.parent.exists()
    assert source_documents(open_source(out)) == [[256] + list(d.strip().encode()) + [257] for d in docs]
    again = _cli("prepare", "--input", corpus, "--tokenizer", "bytes", "--out", str(out))
    assert again.wait(60) == 2
    expected = f"error: {out}: already exists (a complete store); pass --overwrite to replace it"
    assert again.stderr.read().strip() == expected
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": 1}\n')
    failed = _cli("prepare", "--input", str(bad), "--tokenizer", "bytes", "--out", str(tmp_path / "other"))
    assert failed.wait(60) == 2
    assert failed.stderr.read().strip().splitlines()[-1] == f"error: {bad}:2: field 'text' is not a string"
    assert not (tmp_path / "other").exists() and not list(tmp_path.glob("other.*"))
