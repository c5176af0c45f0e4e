"""Token stores written by `prepare` against the in-memory tokenization of jaxtrain/data/packing.py:
same documents, same tokens, for every input format and any worker count; corrupt stores refused."""
from __future__ import annotations

import gzip
import json
import subprocess

import numpy as np
import pytest

from jaxtrain.data import packing
from jaxtrain.data.store import documents, store_format
from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.readers import check_fits_vocabulary, open_source
from jaxtrain.data.store.memory_source import text_files_source
from jaxtrain.data.store.prepare import prepare
from jaxtrain.data.store.store_format import TokenStore
from jaxtrain.data.store.store_writer import StoreWriter
from jaxtrain.data.tokenizer import load_tokenizer
from store_helpers import source_documents
from test_data import make_hf_tokenizer_dir, random_documents, rng, write_jsonl, write_txt  # noqa: F401

pytestmark = [pytest.mark.fast]


def packed_documents(docs, tokenizer):
    """The reference: each document `[bos] + encode(doc) + [eos]`, token by token."""
    return [[tokenizer.bos_id] + list(tokenizer.encode(d)) + [tokenizer.eos_id] for d in docs]


def store_meta(store):
    return json.loads((store / "metadata.json").read_text())


def test_store_equals_packing_stream(tmp_path, rng):
    docs = random_documents(rng, 40)
    hf_dir, _ = make_hf_tokenizer_dir(tmp_path, docs)
    files = [write_txt(tmp_path / "a.txt", docs[:25]), write_jsonl(tmp_path / "b.jsonl", docs[25:])]
    read_back = [d for f in files for d in packing.read_documents(packing.resolve_path(f))]
    for spec in ("bytes", hf_dir):
        tok = load_tokenizer(spec)
        assert tok.encode_batch(docs) == [tok.encode(d) for d in docs]
        store = TokenStore(prepare(files, spec, tmp_path / f"store_{tok.vocab_size}", workers=1).out)
        expected = packed_documents(read_back, tok)
        assert source_documents(store) == expected
        assert source_documents(text_files_source(files, spec)) == expected  # the raw-file path training reads
        assert store.document_lengths.tolist() == [len(d) for d in expected]
        meta = store.metadata
        assert (meta.documents, meta.tokens, meta.vocab_size) == (len(docs), sum(map(len, expected)), tok.vocab_size)
        assert (meta.bos_id, meta.eos_id, meta.pad_id) == (tok.bos_id, tok.eos_id, tok.pad_id)
        assert meta.max_token_id == max(max(d) for d in expected) and meta.dtype == "uint16"
        assert store.loss_mask(0) is None and not store.has_loss_mask
        assert [s["path"] for s in meta.sources] == [str(packing.resolve_path(f)) for f in files]
        assert store.tokens(3, 2, 5).tolist() == expected[3][2:5]
    assert store.tokenizer_id.startswith("hf_tok_True_True@sha256:") and len(store.tokenizer_id) == 40


def test_worker_count_does_not_change_a_byte(tmp_path, rng):
    docs = random_documents(rng, 30)
    files = [write_jsonl(tmp_path / "a.jsonl", docs), write_txt(tmp_path / "b.txt", docs[::-1])]
    stores = [tmp_path / f"w{w}" for w in (1, 2)]
    for workers, out in zip((1, 2), stores):
        prepare(files, "bytes", out, workers=workers, batch_documents=4)  # 16 batches over 2 processes
    for name in ("tokens.bin", "offsets.npy", "metadata.json"):
        assert (stores[0] / name).read_bytes() == (stores[1] / name).read_bytes(), name


def test_every_input_format_gives_the_same_store(tmp_path, rng, monkeypatch):
    pa = pytest.importorskip("pyarrow")
    monkeypatch.setattr(documents, "TABLE_BATCH_ROWS", 3)  # tables read in several pieces
    import datasets
    import pyarrow.parquet as pq

    docs = random_documents(rng, 20)
    lines = "".join(json.dumps({"text": d, "n": i}) + "\n" for i, d in enumerate(docs)).encode()
    (tmp_path / "c.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "c.jsonl").write_bytes(lines)
    subprocess.run(["zstd", "-q", str(tmp_path / "c.jsonl"), "-o", str(tmp_path / "d.jsonl.zst")], check=True)
    pq.write_table(pa.table({"text": docs, "n": list(range(20))}), tmp_path / "e.parquet", row_group_size=7)
    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "f_dataset"))
    inputs = [write_txt(tmp_path / "a.txt", docs), str(tmp_path / "c.jsonl.gz"), str(tmp_path / "d.jsonl.zst"),
              str(tmp_path / "e.parquet"), str(tmp_path / "f_dataset")]
    expected = packed_documents([d.strip() for d in docs], load_tokenizer("bytes"))
    for number, path in enumerate(inputs):
        store = TokenStore(prepare([path], "bytes", tmp_path / f"store{number}", workers=1, batch_documents=6).out)
        assert source_documents(store) == expected, path
    glob_store = TokenStore(prepare([str(tmp_path / "*.jsonl*")], "bytes", tmp_path / "globbed", workers=1).out)
    assert source_documents(glob_store) == expected * 3  # c.jsonl, c.jsonl.gz, d.jsonl.zst in sorted order


def test_uint32_tokens_above_65535(tmp_path, rng):
    assert store_format.token_dtype(65536) == np.uint16 and store_format.token_dtype(65537) == np.uint32
    ids = [rng.integers(0, 100_000, size=int(n)) for n in rng.integers(0, 9, size=12)]
    writer = StoreWriter(tmp_path / "big", vocab_size=100_000, has_loss_mask=False)
    writer.add(np.concatenate(ids), np.array([len(i) for i in ids]))
    writer.commit(tokenizer_id="test", vocab_size=100_000, bos_id=1, eos_id=2, pad_id=0, data_format="text",
                  sources=())
    store = open_source(tmp_path / "big")
    assert store.metadata.dtype == "uint32" and source_documents(store) == [i.tolist() for i in ids]
    check_fits_vocabulary(store, 100_000)
    with pytest.raises(DataInputError, match=f"big: token id {max(map(max, filter(len, ids)))} does not fit"):
        check_fits_vocabulary(store, 70_000)


@pytest.fixture
def small_store(tmp_path, rng):
    return prepare([write_txt(tmp_path / "a.txt", random_documents(rng, 10))], "bytes", tmp_path / "s", workers=1).out


def _corrupt(name):
    def truncate_tokens(store):
        data = (store / "tokens.bin").read_bytes()
        (store / "tokens.bin").write_bytes(data[:-2])

    def decreasing_offsets(store):
        offsets = np.load(store / "offsets.npy")
        offsets[3] = offsets[5]
        np.save(store / "offsets.npy", offsets)

    def no_metadata(store):
        (store / "metadata.json").unlink()

    def future_version(store):
        meta = store_meta(store)
        meta["version"] = 99
        (store / "metadata.json").write_text(json.dumps(meta))

    def offsets_short(store):
        np.save(store / "offsets.npy", np.load(store / "offsets.npy")[:-1])

    return locals()[name]


@pytest.mark.parametrize("case, message", [
    ("truncate_tokens", r"tokens.bin: \d+ bytes, the metadata says \d+"),
    ("decreasing_offsets", "offsets.npy: document offsets decrease at document"),
    ("no_metadata", "not a complete token store"),
    ("future_version", "metadata.json: store format version 99"),
    ("offsets_short", r"offsets.npy: int64 \(\d+,\), expected int64"),
])
def test_corrupt_store_is_refused(small_store, case, message):
    TokenStore(small_store)  # sound before
    _corrupt(case)(__import__("pathlib").Path(small_store))
    with pytest.raises(DataInputError, match=message):
        open_source(small_store)


def test_tokenizer_identity_follows_the_tokenizer_files(tmp_path, rng):
    import shutil

    from jaxtrain.data.store.tokenizer_identity import tokenizer_identity

    first, _ = make_hf_tokenizer_dir(tmp_path / "one", random_documents(rng, 20))
    other, _ = make_hf_tokenizer_dir(tmp_path / "two", random_documents(rng, 20) + ["zzzz qqqq"] * 5)
    copy = tmp_path / "copy" / "hf_tok_True_True"
    shutil.copytree(first, copy)
    (copy / "config.json").write_text("{}")  # not a tokenizer file
    assert tokenizer_identity(str(copy)) == tokenizer_identity(first) != tokenizer_identity(other)
    assert tokenizer_identity("bytes") == "bytes"


def test_overwrite_replaces_a_store_and_nothing_else(tmp_path, rng):
    first, second = random_documents(rng, 5), random_documents(rng, 7)
    out = tmp_path / "store"
    prepare([write_txt(tmp_path / "a.txt", first)], "bytes", out, workers=1)
    with pytest.raises(DataInputError, match="already exists .*--overwrite"):
        prepare([write_txt(tmp_path / "b.txt", second)], "bytes", out, workers=1)
    prepare([str(tmp_path / "b.txt")], "bytes", out, workers=1, overwrite=True)
    assert source_documents(open_source(out)) == packed_documents([d.strip() for d in second], load_tokenizer("bytes"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.txt", "b.txt", "store"]  # no .tmp-/.old- left
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    with pytest.raises(DataInputError, match="precious: exists and is not a token store"):
        prepare([str(tmp_path / "b.txt")], "bytes", precious, workers=1, overwrite=True)
    assert (precious / "notes.txt").read_text() == "mine"


def test_reading_stays_a_few_batches_ahead_of_writing(tmp_path, rng, monkeypatch):
    """Memory is bounded: the inputs are read lazily, at most 2 x workers batches ahead of the
    writer, whatever the corpus size."""
    from jaxtrain.data.store import prepare as prepare_module

    pulled, lead = [0], []
    original_read, original_add = documents.read_batches, StoreWriter.add

    def counting_read(*args, **kwargs):
        for batch in original_read(*args, **kwargs):
            pulled[0] += 1
            yield batch

    def recording_add(self, *args):
        lead.append(pulled[0] - len(lead) - 1)  # batches read but not yet written
        return original_add(self, *args)

    monkeypatch.setattr(prepare_module.documents, "read_batches", counting_read)
    monkeypatch.setattr(StoreWriter, "add", recording_add)
    docs = random_documents(rng, 60, max_words=3)
    prepare([write_jsonl(tmp_path / "a.jsonl", docs)], "bytes", tmp_path / "s", workers=2, batch_documents=2)
    assert len(lead) == 30 and max(lead) <= 2 * 2 and pulled[0] == 30


def test_reading_windows_maps_nothing_of_the_data(tmp_path, rng):
    """Windows are read by positioned reads, not memory maps: every page of a mapped corpus the
    loader touched would stay in the process's RSS (RssFile grew ~5.5 MB per 16 x 4096 batch from a
    2 GB store), so after every window of a masked store and a Megatron prefix has been read, and
    they equal the documents written, /proc/self/maps names none of their files."""
    from jaxtrain.data.store.windows import WindowIndex
    from store_helpers import write_megatron_reference

    lengths = rng.integers(1, 50, size=30)
    tokens = rng.integers(0, 1000, size=int(lengths.sum()))
    mask = rng.integers(0, 2, size=len(tokens))
    writer = StoreWriter(tmp_path / "store", vocab_size=1000, has_loss_mask=True)
    writer.add(tokens, lengths, mask)
    writer.commit(tokenizer_id="bytes", vocab_size=1000, bos_id=1, eos_id=2, pad_id=0, data_format="chat", sources=())
    splits = np.cumsum(lengths)[:-1]
    docs = [d.tolist() for d in np.split(tokens, splits)]
    prefix = write_megatron_reference(tmp_path / "mega", [[d] for d in docs], np.uint16)
    for source in (open_source(tmp_path / "store"), open_source(prefix)):
        assert source_documents(source) == docs
        index = WindowIndex(source, 7, rng.permutation(len(docs)))
        index.examples(np.arange(index.count))
    store = open_source(tmp_path / "store")
    assert [store.loss_mask(d).tolist() for d in range(len(docs))] == [m.tolist() for m in np.split(mask, splits)]
    mapped = open("/proc/self/maps").read()
    assert str(tmp_path) not in mapped, [line for line in mapped.splitlines() if str(tmp_path) in line]


@pytest.mark.parametrize("preadv", [True, False], ids=["preadv", "seek_read"])
def test_file_array_reads_what_numpy_wrote(tmp_path, rng, monkeypatch, preadv):
    """FileArray against numpy's own view of the file: slices (clipped like numpy's), items from
    either end, chunks, a pickled copy; with os.preadv and with the seek + read fallback."""
    import pickle

    from jaxtrain.data.store.file_array import FileArray

    if not preadv:
        monkeypatch.delattr("os.preadv", raising=False)
    values = rng.integers(0, 2**31, size=int(rng.integers(50, 200))).astype(np.uint32)
    path = tmp_path / "array.bin"
    path.write_bytes(b"header!" + values.tobytes())
    array = FileArray(path, np.uint32, len(values), offset=7)
    for _ in range(20):
        start, stop = sorted(rng.integers(-5, len(values) + 5, size=2).tolist())
        np.testing.assert_array_equal(array[start:stop], values[start:stop])
    assert array[0] == values[0] and array[-1] == values[-1] and array[len(values) // 2] == values[len(values) // 2]
    with pytest.raises(IndexError):
        array[len(values)]
    np.testing.assert_array_equal(np.concatenate([c for _, c in array.chunks(7)]), values)
    assert [s for s, _ in array.chunks(7)] == list(range(0, len(values), 7))
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(array))[3:40], values[3:40])
    short = FileArray(path, np.uint32, len(values) + 1, offset=7)  # a file shorter than it claims
    with pytest.raises(OSError, match="truncated"):
        short[len(values) - 2:]
