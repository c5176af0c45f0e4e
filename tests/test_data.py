"""Tokenizers and the packed grain pipeline, checked against a plain-Python reference packer."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from jaxtrain.data import packing as data
from jaxtrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from jaxtrain.meshes.mesh import MeshConfig, build_mesh

from data_reference import FIELDS, reference_windows

pytestmark = [pytest.mark.fast]

WORDS = ["the", "a", "ball", "Emma", "said", "quiet", "café", "naïve", "中文", "🙂", "x", "—", "?"]


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"random seed: {seed}")  # shown by pytest when a test fails
    return np.random.default_rng(seed)


def random_documents(rng, count, max_words=40):
    """Documents with multi-byte characters and single newlines but no blank lines."""
    docs = []
    for _ in range(count):
        words = rng.choice(WORDS, size=rng.integers(1, max_words + 1))
        seps = rng.choice([" ", " ", " ", "\n"], size=len(words) - 1)
        docs.append("".join(w + s for w, s in zip(words, list(seps) + [""])))
    return docs


def write_txt(path, docs):
    # Extra blank lines and surrounding spaces must not create or change documents.
    path.write_text("\n\n \n".join(f"  {d}  " for d in docs) + "\n\n\n", encoding="utf-8")
    return str(path)


def write_jsonl(path, docs, field="text"):
    lines = [json.dumps({field: d, "id": i}) for i, d in enumerate(docs)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def reference_rows(docs, encode, bos, eos, pad, seq_len):
    """Text documents framed as the raw path frames them ([bos] + tokens + [eos]), then packed by
    the shared reference packer."""
    return reference_windows([[bos] + list(encode(doc)) + [eos] for doc in docs], seq_len, pad)


def byte_rows(docs, seq_len):
    tok = ByteTokenizer()
    return reference_rows(docs, tok.encode, tok.bos_id, tok.eos_id, tok.pad_id, seq_len)


def assert_row_equal(batch, i, expected):
    for name in FIELDS:
        np.testing.assert_array_equal(batch[name][i], np.asarray(expected[name]), err_msg=name)
    assert batch["inputs"].dtype == np.int32 and batch["loss_mask"].dtype == np.float32


def row_key(batch, i):
    return b"".join(batch[name][i].tobytes() for name in FIELDS)


def as_batch(row):
    """A reference row as a one-row batch, to compare with `row_key`."""
    return {
        name: np.asarray([row[name]], np.float32 if name == "loss_mask" else np.int32)
        for name in FIELDS
    }


def docs_with_window_count(rng, count, seq_len):
    """Byte-tokenized documents of random letters (so windows differ) packing into exactly
    `count` full windows."""
    target = count * seq_len + 1

    def letters(n):
        return "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), size=n))

    docs, used = [], 0
    while True:
        doc = letters(int(rng.integers(1, 3 * seq_len)))
        if used + len(doc) + 2 + 3 > target:  # keep room for a filler of 1+ letters
            break
        docs.append(doc)
        used += len(doc) + 2
    docs.append(letters(target - used - 2))  # fills the last window exactly
    assert sum(len(d) + 2 for d in docs) == target
    return docs


def docs_in_stream_order(path, seed):
    """The documents between each bos and eos of the packed stream, decoded."""
    tok = ByteTokenizer()
    ids = data.load_stream([path], "bytes", "text", doc_seed=seed).tokens.tolist()
    starts = [i for i, t in enumerate(ids) if t == tok.bos_id]
    ends = [i for i, t in enumerate(ids) if t == tok.eos_id]
    return [tok.decode(ids[s + 1:e]) for s, e in zip(starts, ends)]


def train_config(files, **kw):
    return data.DataConfig(train_files=tuple(files), eval_files=tuple(files), **kw)


# ----------------------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip(rng):
    tok = load_tokenizer("bytes")
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (256, 257, 258, 259)
    text = " ".join(random_documents(rng, 5))
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode([tok.bos_id] + ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.decode([0xE4, 0xB8]) == "\ufffd"  # a cut multi-byte character is replaced


def make_hf_tokenizer_dir(tmp_path, docs, with_bos=True, with_eos=True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>"] + ["<s>"] * with_bos + ["</s>"] * with_eos
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(docs, trainer)
    names = {"unk_token": "<unk>"}
    names.update({"bos_token": "<s>"} if with_bos else {})
    names.update({"eos_token": "</s>"} if with_eos else {})
    path = tmp_path / f"hf_tok_{with_bos}_{with_eos}"
    PreTrainedTokenizerFast(tokenizer_object=core, **names).save_pretrained(str(path))
    return str(path), core


def test_hf_tokenizer_dir_and_packing(tmp_path, rng):
    docs = random_documents(rng, 30)
    path, core = make_hf_tokenizer_dir(tmp_path, docs)
    tok = load_tokenizer(path)
    assert isinstance(tok, HFTokenizer)
    assert tok.bos_id == core.token_to_id("<s>") and tok.eos_id == core.token_to_id("</s>")
    assert tok.pad_id == tok.eos_id  # no pad token: falls back to eos
    assert tok.vocab_size == core.get_vocab_size()
    for doc in docs[:5]:
        assert tok.encode(doc) == core.encode(doc, add_special_tokens=False).ids
        assert tok.decode([tok.bos_id] + tok.encode(doc) + [tok.eos_id]) == doc

    files = [write_txt(tmp_path / "c.txt", docs)]
    cfg = train_config(files, tokenizer=path, shuffle=False)
    batches = data.make_eval_batches(cfg, seq_len=16, batch_size=1, max_batches=None)
    encode = lambda d: core.encode(d, add_special_tokens=False).ids  # noqa: E731
    expected = reference_rows(docs, encode, tok.bos_id, tok.eos_id, tok.pad_id, 16)
    assert len(batches) == len(expected)
    for batch, row in zip(batches, expected):
        assert_row_equal(batch, 0, row)


def test_hf_tokenizer_without_bos_or_eos(tmp_path, rng):
    docs = random_documents(rng, 10)
    no_bos, _ = make_hf_tokenizer_dir(tmp_path, docs, with_bos=False)
    tok = load_tokenizer(no_bos)
    assert tok.bos_id == tok.eos_id == tok.pad_id
    no_eos, _ = make_hf_tokenizer_dir(tmp_path, docs, with_eos=False)
    with pytest.raises(ValueError, match="no eos token"):
        load_tokenizer(no_eos)


def test_unknown_tokenizer_spec(tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer 'gpt9'"):
        load_tokenizer("gpt9")
    missing = str(tmp_path / "nope")
    with pytest.raises(ValueError, match="unknown tokenizer .*nope"):
        data.make_eval_batches(
            train_config([write_txt(tmp_path / "a.txt", ["hi"])], tokenizer=missing),
            seq_len=4, batch_size=1, max_batches=1,
        )


# ----------------------------------------------------------------------------- packing


def test_packing_matches_reference(tmp_path, rng):
    docs = random_documents(rng, 40)
    files = [write_txt(tmp_path / "a.txt", docs[:25]), write_txt(tmp_path / "b.txt", docs[25:])]
    seq_len = int(rng.integers(5, 40))
    cfg = train_config(files, shuffle=False)
    expected = byte_rows(docs, seq_len)
    batches = data.make_eval_batches(cfg, seq_len=seq_len, batch_size=3, max_batches=None)
    assert len(batches) == -(-len(expected) // 3)
    for i, row in enumerate(expected):
        assert_row_equal(batches[i // 3], i % 3, row)
    # Rows past the end pad the last batch and are masked out entirely.
    for i in range(len(expected), 3 * len(batches)):
        last = batches[-1]
        assert last["loss_mask"][i % 3].sum() == 0 and not last["segment_ids"][i % 3].any()

    # Unshuffled training sees the same windows in the same order.
    it = data.make_train_iterator(cfg, seq_len=seq_len, global_batch=2, seed=0)
    for step in range(len(expected) // 2):
        batch = next(it)
        for r in range(2):
            assert_row_equal(batch, r, expected[2 * step + r])


def test_documents_reassemble_from_stream(tmp_path, rng):
    docs = random_documents(rng, 30)
    path = write_txt(tmp_path / "a.txt", docs)
    assert docs_in_stream_order(path, seed=None) == docs
    shuffled = docs_in_stream_order(path, seed=5)
    assert sorted(shuffled) == sorted(docs)
    stream = data.load_stream([path], "bytes", "text", doc_seed=5)
    assert stream.tokens[-1] == ByteTokenizer.eos_id
    assert (np.diff(stream.doc_ids) >= 0).all() and stream.doc_ids[-1] == len(docs) - 1

    # Shuffled training rows come from the reference packing of the shuffled document order.
    expected = {row_key(as_batch(r), 0) for r in byte_rows(shuffled, 12)}
    it = data.make_train_iterator(train_config([path]), seq_len=12, global_batch=4, seed=5)
    for _ in range(5):
        batch = next(it)
        assert all(row_key(batch, r) in expected for r in range(4))


def test_tokenize_text_stream(tmp_path, rng):
    text = "\n\n".join(random_documents(rng, 5)) + "\n"
    path = tmp_path / "raw.txt"
    path.write_text(text, encoding="utf-8")
    stream = data.tokenize_text_stream(str(path), "bytes")
    assert stream.dtype == np.int32 and stream.tolist() == list(text.encode("utf-8"))
    hf_path, core = make_hf_tokenizer_dir(tmp_path, [text])
    hf_stream = data.tokenize_text_stream(path, load_tokenizer(hf_path))
    assert hf_stream.tolist() == core.encode(text, add_special_tokens=False).ids


# ----------------------------------------------------------------------------- sources


def test_jsonl_and_txt_give_the_same_batches(tmp_path, rng):
    docs = random_documents(rng, 20)
    txt = write_txt(tmp_path / "a.txt", docs)
    jsonl = write_jsonl(tmp_path / "a.jsonl", docs, field="body")
    from_txt = data.make_eval_batches(
        train_config([txt], shuffle=False), seq_len=9, batch_size=2, max_batches=None
    )
    from_jsonl = data.make_eval_batches(
        train_config([jsonl], text_field="body", shuffle=False), seq_len=9, batch_size=2, max_batches=None
    )
    assert len(from_txt) == len(from_jsonl)
    for a, b in zip(from_txt, from_jsonl):
        for name in FIELDS:
            np.testing.assert_array_equal(a[name], b[name])


def test_datasets_folder(tmp_path, rng):
    datasets = pytest.importorskip("datasets")
    docs = random_documents(rng, 15)
    folder = tmp_path / "hf_ds"
    datasets.Dataset.from_dict({"content": docs, "n": list(range(15))}).save_to_disk(str(folder))
    cfg = train_config([str(folder)], text_field="content", shuffle=False)
    batches = data.make_eval_batches(cfg, seq_len=11, batch_size=1, max_batches=None)
    expected = byte_rows(docs, 11)
    assert len(batches) == len(expected)
    for batch, row in zip(batches, expected):
        assert_row_equal(batch, 0, row)
    with pytest.raises(ValueError, match="no column 'text'"):
        data.make_eval_batches(
            train_config([str(folder)]), seq_len=11, batch_size=1, max_batches=None
        )


def test_default_corpus_from_another_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    batches = data.make_eval_batches(data.DataConfig(), seq_len=64, batch_size=4, max_batches=3)
    assert len(batches) == 3 and batches[0]["inputs"].shape == (4, 64)
    assert batches[0]["loss_mask"].sum() > 200
    text = ByteTokenizer().decode(batches[0]["inputs"][0])
    assert text.isascii() and " " in text


# ----------------------------------------------------------------------------- iterators


def test_state_restore_across_epochs(tmp_path, rng):
    seq_len, global_batch = 8, 4
    path = write_txt(tmp_path / "a.txt", docs_with_window_count(rng, 14, seq_len))
    cfg = train_config([path])
    steps_per_epoch = 14 // global_batch  # 3; two windows are left over each epoch

    def fresh():
        return data.make_train_iterator(cfg, seq_len=seq_len, global_batch=global_batch, seed=7)

    reference = fresh()
    sequence = [next(reference) for _ in range(3 * steps_per_epoch)]
    for k in (0, 1, steps_per_epoch - 1, steps_per_epoch, 2 * steps_per_epoch - 1):
        it = fresh()
        for _ in range(k):
            next(it)
        state = it.get_state()
        batch_a = next(it)
        restored = fresh()
        restored.set_state(state)
        for expected in [batch_a] + sequence[k + 1:]:
            got = next(restored)
            for name in FIELDS:
                np.testing.assert_array_equal(got[name], expected[name])

    # Each epoch uses distinct windows, in a fresh order.
    epochs = [
        [row_key(b, r) for b in sequence[e * 3:(e + 1) * 3] for r in range(global_batch)]
        for e in range(3)
    ]
    assert all(len(set(e)) == len(e) == 12 for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    other_seed = data.make_train_iterator(cfg, seq_len=seq_len, global_batch=global_batch, seed=8)
    assert [row_key(next(other_seed), r) for r in range(4)] != epochs[0][:4]


def test_orbax_checkpoint_round_trip(tmp_path, rng):
    import grain
    import orbax.checkpoint as ocp

    path = write_txt(tmp_path / "a.txt", random_documents(rng, 30))
    cfg = train_config([path])

    def fresh():
        return data.make_train_iterator(cfg, seq_len=10, global_batch=2, seed=3)

    it = fresh()
    for _ in range(5):
        next(it)
    it_state = it.get_state()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.save(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointSave(it)))
        manager.wait_until_finished()
        assert manager.all_steps() == [5]
    expected = [next(it) for _ in range(3)]

    restored = fresh()
    with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
        manager.restore(5, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(restored)))
    assert restored.get_state() == it_state
    for batch in expected:
        got = next(restored)
        for name in FIELDS:
            np.testing.assert_array_equal(got[name], batch[name])


@pytest.mark.parametrize("process_count", [2, 4])
def test_process_shards_partition_each_global_batch(tmp_path, rng, process_count):
    seq_len, global_batch, windows = 6, 8, 24  # 3 steps per epoch, nothing left over
    path = write_txt(tmp_path / "a.txt", docs_with_window_count(rng, windows, seq_len))
    cfg = train_config([path])
    all_rows = {row_key(as_batch(r), 0) for r in byte_rows(docs_in_stream_order(path, 11), seq_len)}
    assert len(all_rows) == windows

    whole = data.make_train_iterator(cfg, seq_len=seq_len, global_batch=global_batch, seed=11)
    shards = [
        data.make_train_iterator(
            cfg, seq_len=seq_len, global_batch=global_batch, seed=11,
            process_index=p, process_count=process_count,
        )
        for p in range(process_count)
    ]
    for _epoch in range(2):
        seen = [set() for _ in range(process_count)]
        for _step in range(windows // global_batch):
            full = next(whole)
            step_rows = set()
            for p, shard in enumerate(shards):
                batch = next(shard)
                assert batch["inputs"].shape == (global_batch // process_count, seq_len)
                keys = {row_key(batch, r) for r in range(global_batch // process_count)}
                step_rows |= keys
                seen[p] |= keys
            assert step_rows == {row_key(full, r) for r in range(global_batch)}
        for p in range(process_count):
            for q in range(p):
                assert not seen[p] & seen[q]
        assert set().union(*seen) == all_rows


def test_eval_batches_sharded_over_processes(tmp_path, rng):
    path = write_txt(tmp_path / "a.txt", random_documents(rng, 25))
    cfg = train_config([path], shuffle=False)
    whole = data.make_eval_batches(cfg, seq_len=7, batch_size=4, max_batches=None)
    parts = [
        data.make_eval_batches(
            cfg, seq_len=7, batch_size=4, max_batches=None, process_index=p, process_count=2
        )
        for p in range(2)
    ]
    assert len(parts[0]) == len(parts[1]) == len(whole)
    for t, batch in enumerate(whole):
        for name in FIELDS:
            np.testing.assert_array_equal(parts[0][t][name], batch[name][0::2])
            np.testing.assert_array_equal(parts[1][t][name], batch[name][1::2])
    assert len(data.make_eval_batches(cfg, seq_len=7, batch_size=4, max_batches=2)) == 2


# ----------------------------------------------------------------------------- bad input


def test_missing_file(tmp_path):
    missing = str(tmp_path / "absent.txt")
    with pytest.raises(FileNotFoundError, match="absent.txt"):
        data.make_train_iterator(train_config([missing]), seq_len=4, global_batch=1, seed=0)
    with pytest.raises(FileNotFoundError, match="no/such/corpus.txt"):
        data.make_eval_batches(
            train_config(["no/such/corpus.txt"]), seq_len=4, batch_size=1, max_batches=1
        )


def test_empty_corpus(tmp_path):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n", encoding="utf-8")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n", encoding="utf-8")
    with pytest.raises(ValueError, match="empty corpus: .*blank.txt.*empty.jsonl"):
        data.make_eval_batches(
            train_config([str(blank), str(empty)]), seq_len=4, batch_size=1, max_batches=1
        )


def test_empty_file_lists_name_their_field():
    """An empty eval_files turns evaluation off in a run (tests/test_no_eval.py), so only an
    explicit request for eval batches refuses it; training needs files."""
    with pytest.raises(ValueError, match=r"^DataConfig\.eval_files is empty: there is nothing to evaluate"):
        data.make_eval_batches(data.DataConfig(eval_files=[]), seq_len=8, batch_size=2, max_batches=1)
    with pytest.raises(ValueError, match=r"^DataConfig\.train_files is empty: name a corpus file"):
        data.make_train_iterator(data.DataConfig(train_files=[]), seq_len=8, global_batch=2, seed=0)
    data.check_sources_fit(data.DataConfig(eval_files=[]), 259)  # nothing to check for eval


def test_malformed_jsonl(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": "ok"}\n\n{"text": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        data.make_eval_batches(train_config([str(bad_json)]), seq_len=4, batch_size=1, max_batches=1)
    no_field = tmp_path / "nofield.jsonl"
    no_field.write_text('{"text": "ok"}\n{"body": "x"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"nofield\.jsonl:2: no 'text' field"):
        data.make_eval_batches(train_config([str(no_field)]), seq_len=4, batch_size=1, max_batches=1)


def test_bad_batch_and_file_type(tmp_path):
    path = write_txt(tmp_path / "a.txt", ["some text"] * 20)
    with pytest.raises(ValueError, match="global batch 6 is not divisible by process count 4"):
        data.make_train_iterator(
            train_config([path]), seq_len=4, global_batch=6, seed=0, process_index=0, process_count=4
        )
    with pytest.raises(ValueError, match="global batch 6 is not divisible by process count 4"):
        data.make_eval_batches(
            train_config([path]), seq_len=4, batch_size=6, max_batches=1, process_count=4
        )
    with pytest.raises(ValueError, match="fewer than the global batch 1000"):
        data.make_train_iterator(train_config([path]), seq_len=4, global_batch=1000, seed=0)
    csv = tmp_path / "a.csv"
    csv.write_text("a,b\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.csv: unsupported corpus file type"):
        data.make_eval_batches(train_config([str(csv)]), seq_len=4, batch_size=1, max_batches=1)


@pytest.mark.parametrize("mesh_cfg, processes, expected", [
    (MeshConfig(data=16), 2, [(0, 2), (1, 2)]),  # data split over the processes
    (MeshConfig(pipeline=2, data=8), 2, [(0, 1), (0, 1)]),  # a pipeline stage per process: same rows
    (MeshConfig(pipeline=2, data=8), 4, [(0, 2), (1, 2), (0, 2), (1, 2)]),  # 2 stages x 2 data halves
], ids=["data", "pipeline", "pipeline_and_data"])
def test_each_process_feeds_the_rows_its_devices_hold(mesh_cfg, processes, expected):
    """Devices are numbered process-major (device d belongs to process d // (16 / processes)), as
    jax.distributed numbers them; processes spread over the outermost mesh axes first."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxtrain.training.batch_shards import process_batch_shard

    mesh = build_mesh(mesh_cfg)
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    per_process = 16 // processes
    got = [process_batch_shard(sharding, (16, 8), p, process_of=lambda d: d.id // per_process)
           for p in range(processes)]
    assert got == expected
    with pytest.raises(ValueError, match="overlapping but different rows"):
        odd = NamedSharding(build_mesh(MeshConfig(data=4, tensor=4)), PartitionSpec("data", None))
        process_batch_shard(odd, (16, 8), 0, process_of=lambda d: 0 if d.id < 9 else 1)  # shard 2 split
