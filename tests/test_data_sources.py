"""Windows read from a TokenSource slice by slice equal the packing of the whole corpus held in
memory; sources are checked (empty, another tokenizer, ids past the vocabulary) before a run."""
from __future__ import annotations

import pickle
import random

import numpy as np
import pytest

from jaxtrain.data import packing as data
from jaxtrain.data.store import loader, training_sources
from jaxtrain.data.store.memory_source import MemorySource
from jaxtrain.data.store.windows import WindowIndex

from data_reference import FIELDS, reference_windows

pytestmark = [pytest.mark.fast]


@pytest.fixture
def rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"random seed: {seed}")  # shown by pytest when a test fails
    return np.random.default_rng(seed)


def random_source(rng, documents, with_masks, vocab=1000):
    lengths = rng.integers(0, 40, size=documents)  # empty documents too
    lengths[0] = max(lengths[0], 1)
    docs = [rng.integers(0, vocab, size=int(n)) for n in lengths]
    masks = [rng.integers(0, 2, size=int(n)) for n in lengths] if with_masks else None
    return MemorySource(docs, masks, name="random", vocab_size=vocab, pad_id=vocab), docs, masks


def reference_examples(docs, masks, order, seq_len, pad):
    """The whole corpus concatenated in `order`, packed by the shared reference packer."""
    return reference_windows([docs[d] for d in order], seq_len, pad,
                             [masks[d] for d in order] if masks else None)


@pytest.mark.parametrize("with_masks", [False, True], ids=["plain", "masked"])
def test_windows_equal_the_concatenated_corpus(rng, with_masks):
    source, docs, masks = random_source(rng, 60, with_masks)
    seq_len = int(rng.integers(3, 50))
    order = rng.permutation(len(docs))
    index = pickle.loads(pickle.dumps(WindowIndex(source, seq_len, order)))  # workers get a copy
    expected = reference_examples(docs, masks, order, seq_len, source.pad_id)
    assert index.count == len(expected)
    rows = rng.permutation(index.count + 2) - 2  # every window, in a random order, and padding rows
    got = index.examples(rows)
    for i, window in enumerate(rows):
        if window < 0:  # all padding, nothing trained
            assert (got["inputs"][i] == source.pad_id).all() and not got["loss_mask"][i].any()
            assert not got["segment_ids"][i].any() and not got["positions"][i].any()
            continue
        for name in FIELDS:
            np.testing.assert_array_equal(got[name][i], np.asarray(expected[window][name]), err_msg=name)
    assert got["inputs"].dtype == np.int32 and got["loss_mask"].dtype == np.float32


@pytest.mark.parametrize("lengths", [[1], [0, 1, 0], [2], [0, 3]], ids=["1", "0-1-0", "2", "0-3"])
def test_the_shortest_streams(lengths):
    """The edge the reference packer decides: a stream of at most one token is one padded window
    with nothing trained (WindowIndex.count is never 0); two tokens are one trained target."""
    docs = [np.arange(5, 5 + n) for n in lengths]
    source = MemorySource(docs, name="short", vocab_size=100, pad_id=99)
    index = WindowIndex(source, 4)
    expected = reference_windows(docs, 4, 99)
    assert index.count == len(expected) == 1
    got = index.examples(np.arange(index.count))
    for name in FIELDS:
        np.testing.assert_array_equal(got[name][0], np.asarray(expected[0][name]), err_msg=name)
    assert got["loss_mask"].sum() == max(sum(lengths) - 1, 0)


def test_a_text_source_is_its_documents_framed(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("hi there\n\nsecond  doc\n", encoding="utf-8")
    source = training_sources.corpus_source([str(path)], "bytes", "text")
    assert len(source) == 2 and source.tokenizer_id is None and source.pad_id == 258
    assert source.tokens(1).tolist() == [256, *b"second  doc", 257]
    assert source.tokens(0, 1, 3).tolist() == list(b"hi")


def test_empty_source_and_other_tokenizer(tmp_path):
    empty = MemorySource([np.zeros(0, np.int32)], name="stores/empty")
    with pytest.raises(ValueError, match="stores/empty: empty source"):
        training_sources.check_source(empty, "bytes")
    other = MemorySource([np.arange(5)], name="stores/web", tokenizer_id="hf:gpt2")
    with pytest.raises(ValueError, match="stores/web: tokenized with 'hf:gpt2', but DataConfig.tokenizer is 'bytes'"):
        training_sources.check_source(other, "bytes")


def test_token_ids_past_the_vocabulary(tmp_path):
    source = MemorySource([np.array([1, 2, 300])], name="stores/big_ids", vocab_size=400)
    training_sources.check_fits_vocabulary([source], 301)
    with pytest.raises(ValueError, match=r"stores/big_ids: token id 300 does not fit the model's vocabulary of 300"):
        training_sources.check_fits_vocabulary([source], 300)


def test_train_iterator_over_a_store_like_source(tmp_path, rng, monkeypatch):
    """A store entry in train_files trains from its source (a memory stand-in for the reader):
    the same batches as the window index over that source in the seeded document order."""
    source, docs, _ = random_source(rng, 40, with_masks=True, vocab=200)
    store = tmp_path / "store"
    store.mkdir()
    monkeypatch.setattr(training_sources, "_open_store", lambda path, tokenizer: source)
    cfg = data.DataConfig(train_files=(str(store),), eval_files=(str(store),))
    it = data.make_train_iterator(cfg, seq_len=7, global_batch=2, seed=4)
    index = WindowIndex(source, 7, loader.document_order(source, 4))
    order = np.random.default_rng([loader.WINDOW_ORDER_STREAM, 4, 0]).permutation(index.count)
    for step in range(3):
        batch, want = next(it), index.examples(order[2 * step:2 * step + 2])
        for name in FIELDS:
            np.testing.assert_array_equal(batch[name], want[name], err_msg=name)
    with pytest.raises(ValueError, match="random: token id 1.. does not fit the model's vocabulary of 150"):
        data.check_sources_fit(cfg, 150)


# ----------------------------------------------------------------------------- real stores


def _texts(rng, count):
    words = ["the", "a", "ball", "said", "café", "中文", "🙂", "x"]
    return [" ".join(rng.choice(words, size=int(rng.integers(1, 30)))) for _ in range(count)]


def _assert_same_batches(a, b, steps):
    for step in range(steps):
        x, y = next(a), next(b)
        for name in FIELDS:
            np.testing.assert_array_equal(x[name], y[name], err_msg=f"step {step} {name}")


def test_store_and_megatron_files_train_like_the_raw_file(tmp_path, rng):
    """A store written by prepare, and Megatron .bin/.idx written byte by byte from the same
    framed documents, give exactly the raw file's batches (training and eval), read from
    their memory maps."""
    from store_helpers import write_megatron_reference

    from jaxtrain.data.store.prepare import prepare
    from jaxtrain.data.tokenizer import ByteTokenizer

    texts = _texts(rng, 40)
    raw = tmp_path / "corpus.txt"
    raw.write_text("\n\n".join(texts) + "\n", encoding="utf-8")
    prepare([str(raw)], "bytes", tmp_path / "store", workers=1)
    tok = ByteTokenizer()
    framed = [[[tok.bos_id, *t.encode("utf-8"), tok.eos_id]] for t in texts]
    prefix = write_megatron_reference(tmp_path / "mega_text_document", framed, np.uint16)

    def run(entry):
        cfg = data.DataConfig(train_files=(entry,), eval_files=(entry,))
        return data.make_train_iterator(cfg, seq_len=13, global_batch=4, seed=6), \
            data.make_eval_batches(cfg, seq_len=13, batch_size=4, max_batches=None)

    raw_eval = run(str(raw))[1]
    for entry in (str(tmp_path / "store"), prefix, prefix + ".idx"):
        train, evals = run(entry)
        _assert_same_batches(train, run(str(raw))[0], 6)
        assert len(evals) == len(raw_eval)
        for got, want in zip(evals, raw_eval):
            for name in FIELDS:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{entry} eval {name}")


def test_blend_of_a_store_and_a_megatron_prefix(tmp_path, rng):
    from store_helpers import write_megatron_reference

    from jaxtrain.data.store.prepare import prepare

    raw = tmp_path / "web.txt"
    raw.write_text("\n\n".join(_texts(rng, 30)), encoding="utf-8")
    prepare([str(raw)], "bytes", tmp_path / "web", workers=1)
    # the Megatron documents hold only ids below 32 (control bytes), which the text never has
    prefix = write_megatron_reference(tmp_path / "code", [[list(rng.integers(0, 32, 20))] for _ in range(5)],
                                      np.uint16)
    cfg = data.DataConfig(blend=("3", str(tmp_path / "web"), "1", prefix), eval_files=(str(raw),))
    batch = next(data.make_train_iterator(cfg, seq_len=8, global_batch=8, seed=2))
    assert batch["source_ids"].tolist() == [0, 0, 1, 0, 0, 0, 1, 0]  # 3:1 by the rule (lag at i + 1), worked out by hand
    real = batch["segment_ids"] > 0
    from_megatron = (batch["source_ids"] == 1)[:, None] & real
    assert (batch["inputs"][from_megatron] < 32).all() and (batch["inputs"][~from_megatron & real] >= 32).all()


def test_store_windows_pickle_without_the_corpus(tmp_path, rng):
    """A store's window index sent to a worker process carries its path, not the memory-mapped
    tokens (a pickled numpy memmap copies its data), and reads the same windows there."""
    from jaxtrain.data.store.prepare import prepare

    raw = tmp_path / "corpus.txt"
    raw.write_text("\n\n".join(_texts(rng, 400)), encoding="utf-8")
    prepare([str(raw)], "bytes", tmp_path / "store", workers=1)
    source = training_sources.corpus_source([str(tmp_path / "store")], "bytes", "text")
    index = WindowIndex(source, 16, loader.document_order(source, 3))
    copy = pickle.dumps(index)
    assert len(copy) < 16 * len(source) + 20_000 < (tmp_path / "store" / "tokens.bin").stat().st_size
    rows = rng.permutation(index.count)[:20]
    got, want = pickle.loads(copy).examples(rows), index.examples(rows)
    for name in FIELDS:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_stores_and_raw_files_in_one_list_are_one_corpus_in_order(tmp_path, rng):
    """train_files = [store of a, b.txt, store of c] trains exactly like [a.txt, b.txt, c.txt]."""
    from jaxtrain.data.store.prepare import prepare

    raws = []
    for name in "abc":
        raw = tmp_path / f"{name}.txt"
        raw.write_text("\n\n".join(_texts(rng, int(rng.integers(5, 15)))), encoding="utf-8")
        raws.append(str(raw))
    for name in "ac":
        prepare([str(tmp_path / f"{name}.txt")], "bytes", tmp_path / f"store_{name}", workers=1)
    mixed = (str(tmp_path / "store_a"), raws[1], str(tmp_path / "store_c"))

    def iterator(files):
        cfg = data.DataConfig(train_files=files, eval_files=files)
        return data.make_train_iterator(cfg, seq_len=11, global_batch=3, seed=8)

    _assert_same_batches(iterator(mixed), iterator(tuple(raws)), 8)
