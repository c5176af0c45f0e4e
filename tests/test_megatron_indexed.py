"""Megatron-LM indexed datasets: files written by an independent struct-level writer (the layout of
megatron/core/datasets/indexed_dataset.py) read back identically; jaxtrain's writer produces the
same bytes; a store exported with --megatron reads back as the store; corrupt files are refused."""
from __future__ import annotations

import os
import pathlib
import struct
import subprocess
import sys

import numpy as np
import pytest

from jaxtrain.data.store import megatron
from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.megatron import MegatronIndexedDataset, MegatronWriter
from jaxtrain.data.store.prepare import prepare
from jaxtrain.data.store.readers import check_fits_vocabulary, open_source
from store_helpers import source_documents, write_megatron_reference
from test_data import random_documents, rng, write_jsonl  # noqa: F401

pytestmark = [pytest.mark.fast]


def random_megatron_documents(rng, count, high):
    """Documents of 1..3 sequences (as Megatron writes sentence-split data), some sequences empty."""
    return [[rng.integers(0, high, size=int(rng.integers(0, 12))).tolist() for _ in range(rng.integers(1, 4))]
            for _ in range(count)]


@pytest.mark.parametrize("dtype, high", [(np.uint16, 65536), (np.int32, 2**31 - 1), (np.uint8, 256)])
def test_reference_files_read_back(tmp_path, rng, dtype, high, monkeypatch):
    # The index is checked, and the max id scanned, a few entries at a time: every chunk seam is crossed.
    monkeypatch.setattr(megatron, "_INDEX_CHUNK", 3)
    monkeypatch.setattr(megatron, "_CHUNK", 5)
    docs = random_megatron_documents(rng, 17, high)
    prefix = write_megatron_reference(tmp_path / "corpus_text_document", docs, dtype)
    source = open_source(prefix)
    assert isinstance(source, MegatronIndexedDataset) and source.dtype == dtype
    expected = [sum(seqs, []) for seqs in docs]
    assert source_documents(source) == expected
    assert source.document_lengths.tolist() == [len(d) for d in expected]
    assert source.vocab_size is None and source.loss_mask(0) is None and not source.has_loss_mask
    long = max(range(len(expected)), key=lambda d: len(expected[d]))
    assert source.tokens(long, 1, 4).tolist() == expected[long][1:4]
    assert source.max_token_id == max(max(d) for d in expected if d)
    assert open_source(f"{prefix}.idx").name == prefix  # naming either file works


def test_writer_is_byte_identical_to_the_reference(tmp_path, rng, monkeypatch):
    monkeypatch.setattr(megatron, "_CHUNK", 3)  # the index is assembled across many chunks
    docs = random_megatron_documents(rng, 23, 50_000)
    writer = MegatronWriter(tmp_path / "ours", np.uint16)
    for sequences in docs[:10]:
        writer.add_sequences(sequences)
    single = [s[0] for s in docs[10:] if len(s) == 1]  # one-sequence documents: one batch
    if single:
        writer.add_batch(np.concatenate([np.asarray(s, np.int64) for s in single]), np.array([len(s) for s in single]))
    for sequences in docs[10:]:
        if len(sequences) > 1:
            writer.add_sequences(sequences)
    writer.commit()
    reordered = docs[:10] + [s for s in docs[10:] if len(s) == 1] + [s for s in docs[10:] if len(s) > 1]
    reference = write_megatron_reference(tmp_path / "ref", reordered, np.uint16)
    for suffix in (".bin", ".idx"):
        assert pathlib.Path(f"{reference}{suffix}").read_bytes() == (tmp_path / f"ours{suffix}").read_bytes()
    assert not list(tmp_path.glob("*.tmp-*"))


def test_store_exported_with_megatron_reads_back(tmp_path, rng):
    files = [write_jsonl(tmp_path / "a.jsonl", random_documents(rng, 25))]
    store = open_source(prepare(files, "bytes", tmp_path / "store", workers=1).out)
    prefix = prepare(files, "bytes", tmp_path / "mega" / "corpus", workers=1, megatron_output=True).out
    exported = open_source(prefix)
    assert isinstance(exported, MegatronIndexedDataset) and exported.dtype == np.uint16
    assert source_documents(exported) == source_documents(store)
    with pytest.raises(DataInputError, match="already exist; pass --overwrite"):
        prepare(files, "bytes", prefix, workers=1, megatron_output=True)


def _idx_bytes(prefix):
    return bytearray(pathlib.Path(f"{prefix}.idx").read_bytes())


def _corrupt(prefix, case):
    idx = _idx_bytes(prefix)
    header = 9 + 8 + 1 + 8 + 8
    sequences = struct.unpack_from("<Q", idx, 18)[0]
    if case == "magic":
        idx[0:7] = b"NOTIDX!"
    elif case == "version":
        struct.pack_into("<Q", idx, 9, 2)
    elif case == "dtype":
        idx[17] = 9
    elif case == "float_dtype":
        idx[17] = 7
    elif case == "truncated_idx":
        idx = idx[:-5]
    elif case == "pointer":
        struct.pack_into("<q", idx, header + 4 * sequences + 8 * 2, 3)
    elif case == "doc_index":
        struct.pack_into("<q", idx, header + 12 * sequences + 8 * 2, 0)
    elif case == "truncated_bin":
        data = pathlib.Path(f"{prefix}.bin").read_bytes()
        pathlib.Path(f"{prefix}.bin").write_bytes(data[:-2])
    elif case == "header_only":
        idx = idx[:20]
    pathlib.Path(f"{prefix}.idx").write_bytes(bytes(idx))


@pytest.mark.parametrize("case, message", [
    ("magic", r"\.idx: not a Megatron MMIDIDX index"),
    ("version", r"\.idx: index version 2"),
    ("dtype", r"\.idx: unknown dtype code 9"),
    ("float_dtype", r"\.idx: dtype float32 cannot hold token ids"),
    ("truncated_idx", r"\.idx: \d+ bytes, but its header announces"),
    ("header_only", r"\.idx: 20 bytes, shorter than the 34-byte header"),
    ("pointer", r"\.idx: sequence 2 points at byte 3"),
    ("doc_index", r"\.idx: document indices must rise"),
    ("truncated_bin", r"\.bin: \d+ bytes, the index describes \d+"),
])
def test_corrupt_files_are_refused(tmp_path, rng, case, message):
    docs = [[list(range(5)), [7, 8]], [[1, 2, 3]], [[4] * 6]]
    prefix = write_megatron_reference(tmp_path / "data", docs, np.uint16)
    open_source(prefix)
    _corrupt(prefix, case)
    with pytest.raises(DataInputError, match=message):
        open_source(prefix)


def test_missing_half_and_unknown_path(tmp_path):
    prefix = write_megatron_reference(tmp_path / "data", [[[1, 2]]], np.uint16)
    pathlib.Path(f"{prefix}.idx").unlink()
    with pytest.raises(DataInputError, match=r"data\.idx: missing"):
        open_source(prefix)
    with pytest.raises(DataInputError, match="neither a token store directory nor a Megatron prefix"):
        open_source(tmp_path / "nothing")


def test_vocabulary_check_caches_the_max_id(tmp_path, rng):
    docs = random_megatron_documents(rng, 9, 1000) + [[[1000 + int(rng.integers(0, 10))]]]
    top = max(max(sum(d, [])) for d in docs if sum(d, []))
    prefix = write_megatron_reference(tmp_path / "data", docs, np.uint16)
    with pytest.raises(DataInputError, match=f"data: token id {top} does not fit the model's vocabulary of 1000"):
        check_fits_vocabulary(open_source(prefix), 1000)
    check_fits_vocabulary(open_source(prefix), top + 1)
    sidecar = pathlib.Path(f"{prefix}.max_id.json")
    assert sidecar.is_file()
    original = megatron._CHUNK
    try:
        megatron._CHUNK = None  # a second open must not scan again: the sidecar answers
        assert open_source(prefix).max_token_id == top
    finally:
        megatron._CHUNK = original


def test_a_dead_writers_temporaries_are_removed(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [tmp_path / f"corpus.{part}.tmp-{int(dead.stdout)}" for part in ("bin", "lengths", "docs")]
    for path in stale:
        path.write_bytes(b"partial")
    mine = tmp_path / f"corpus.bin.tmp-{os.getpid()}x"  # not a pid: left alone
    mine.write_bytes(b"")
    writer = MegatronWriter(tmp_path / "corpus")
    writer.add_document([1, 2, 3])
    writer.commit()
    assert not any(p.exists() for p in stale) and mine.exists()
    assert source_documents(open_source(tmp_path / "corpus")) == [[1, 2, 3]]
