"""`prepare`: input files -> a token store (or a Megatron `.bin`/`.idx` pair), tokenized in worker
processes.

The main process reads the inputs as a stream of batches (jaxtrain/data/store/documents.py);
worker processes parse and tokenize them (jaxtrain/data/store/formats.py); results come back in
submission order and are appended to the output as they arrive. At most `2 x workers` batches
are in flight, so memory is bounded whatever the corpus size, and the output is byte-identical
for any worker count. Nothing is written before every input has been checked; the output
appears only when complete (jaxtrain/data/store/store_writer.py).
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import pathlib
import sys
import time
from typing import Sequence

import numpy as np

from jaxtrain.data.store import documents, formats, megatron, store_format, store_writer
from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.tokenizer_identity import tokenizer_identity
from jaxtrain.data.tokenizer import load_tokenizer

# Test hook: "N:SECONDS" sleeps SECONDS after writing N batches (a test kills prepare there).
PAUSE_ENV = "JAXTRAIN_PREPARE_PAUSE_AFTER_BATCHES"


@dataclasses.dataclass(frozen=True)
class PrepareSummary:
    out: str
    documents: int
    tokens: int
    input_bytes: int
    seconds: float

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


_worker_encoder: formats.Encoder | None = None


def _start_worker(args) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker: the workers are the parallelism
    _worker_encoder = formats.Encoder(*args)


def _encode_in_worker(batch: documents.RawBatch) -> formats.EncodedBatch:
    return _worker_encoder.encode(batch)


def _start_method() -> str:
    """fork where it is safe (Linux, one thread, no jax: the CLI), so workers start at once with
    the tokenizer library already imported; spawn elsewhere (a forked copy of a process holding
    jax or other threads can deadlock)."""
    import threading

    if sys.platform == "linux" and threading.active_count() == 1 and "jax" not in sys.modules:
        return "fork"
    return "spawn"


def _encoded_batches(batches, encoder_args, workers: int):
    """Encoded batches in input order; `workers` processes (1: this process) with bounded backlog."""
    if workers <= 1:
        encoder = formats.Encoder(*encoder_args)
        for batch in batches:
            yield encoder.encode(batch)
        return
    context = multiprocessing.get_context(_start_method())
    pool = context.Pool(workers, initializer=_start_worker, initargs=(encoder_args,))
    try:
        pending = collections.deque()
        for batch in batches:
            pending.append(pool.apply_async(_encode_in_worker, (batch,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
    finally:
        pool.terminate()
        pool.join()


def _progress(total_bytes: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: the workers may then be forked
    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="prepare", smoothing=0.1)


def prepare(
    inputs: Sequence[str],
    tokenizer: str,
    out: str | os.PathLike,
    *,
    workers: int | None = None,
    data_format: str = "text",
    text_field: str = "text",
    overwrite: bool = False,
    megatron_output: bool = False,
    batch_documents: int = 256,
    progress: bool = False,
) -> PrepareSummary:
    """Tokenize `inputs` (files or globs) into a token store at `out` (a Megatron prefix when
    `megatron_output`). Raises DataInputError, before writing anything, for bad input it can see
    up front; one found while reading (a bad line) aborts and leaves no output."""
    started = time.perf_counter()
    if data_format not in store_format.DATA_FORMATS:
        raise DataInputError(f"--format {data_format!r}: choose one of {', '.join(store_format.DATA_FORMATS)}")
    workers = (os.cpu_count() or 1) if workers is None else workers
    if workers < 1:
        raise DataInputError(f"--workers must be at least 1, got {workers}")
    if batch_documents < 1:
        raise DataInputError(f"--batch_documents must be at least 1, got {batch_documents}")
    paths = documents.expand_inputs(inputs)
    for path in paths:
        documents.check_input(path, data_format, text_field)
    try:
        tok = load_tokenizer(tokenizer)
    except ValueError as err:
        raise DataInputError(str(err)) from err
    if data_format == "chat":
        formats.check_chat_template(tok, tokenizer)
    out = pathlib.Path(out)
    if megatron_output:
        if data_format != "text":
            raise DataInputError(f"--megatron holds no loss mask: --format {data_format} needs a token store")
        if megatron.is_megatron_prefix(out) and not overwrite:
            raise DataInputError(f"{out}.bin/.idx already exist; pass --overwrite to replace them")
    else:
        store_writer.check_output_free(out, overwrite, store_format.is_complete_store)

    dtype = store_format.token_dtype(tok.vocab_size)
    has_mask = data_format != "text"
    writer = (megatron.MegatronWriter(out, dtype) if megatron_output
              else store_writer.StoreWriter(out, tok.vocab_size, has_mask))
    sizes = [documents.input_size(p) for p in paths]
    bar = _progress(sum(sizes), progress)
    pause_after, pause_seconds = _pause_hook()
    per_source = np.zeros(len(paths), np.int64)
    done_bytes = np.zeros(len(paths), np.int64)
    tokens = 0
    try:
        batches = documents.read_batches(paths, data_format, text_field, batch_documents)
        encoder_args = (tokenizer, data_format, text_field, dtype.name)
        for count, encoded in enumerate(_encoded_batches(batches, encoder_args, workers), start=1):
            if megatron_output:
                writer.add_batch(encoded.tokens, encoded.lengths)
            else:
                writer.add(encoded.tokens, encoded.lengths, encoded.mask)
            per_source[encoded.source] += len(encoded.lengths)
            tokens += len(encoded.tokens)
            if bar is not None:
                done_bytes[encoded.source] = encoded.bytes_read
                bar.update(int(done_bytes.sum()) - bar.n)
                bar.set_postfix_str(f"{tokens / max(time.perf_counter() - started, 1e-9) / 1e6:.2f}M tok/s")
            if count == pause_after:
                print(f"prepare: paused after {count} batches ({PAUSE_ENV})", file=sys.stderr, flush=True)
                time.sleep(pause_seconds)
        if bar is not None:
            bar.update(bar.total - bar.n)  # .txt progress counts characters: close the gap
        empty = [str(p) for p, n in zip(paths, per_source) if n == 0]
        if empty:
            raise DataInputError(f"{empty[0]}: no documents (empty source)")
        if megatron_output:
            writer.commit()
        else:
            writer.commit(
                tokenizer_id=tokenizer_identity(tokenizer), vocab_size=int(tok.vocab_size),
                bos_id=int(tok.bos_id), eos_id=int(tok.eos_id), pad_id=int(tok.pad_id),
                data_format=data_format, text_field=text_field,
                sources=tuple({"path": str(p.resolve()), "bytes": s, "mtime_ns": p.stat().st_mtime_ns}
                              for p, s in zip(paths, sizes)))
    except BaseException:
        writer.abort()
        raise
    finally:
        if bar is not None:
            bar.close()
    return PrepareSummary(str(out), int(per_source.sum()), tokens, sum(sizes), time.perf_counter() - started)


def _pause_hook() -> tuple[int, float]:
    value = os.environ.get(PAUSE_ENV, "")
    if not value:
        return -1, 0.0
    batches, _, seconds = value.partition(":")
    return int(batches), float(seconds or 3600)
