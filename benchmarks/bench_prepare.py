"""`prepare` throughput against the raw fast tokenizer and `datasets.map`, side by side in one run.

  python benchmarks/bench_prepare.py [--mb 100] [--workers N] [--dir /tmp/bench_prepare] [--vocab 32000]

Generates a jsonl corpus of about --mb MB (Zipf-distributed pseudo-words, documents of 50-800
words) and trains a --vocab BPE tokenizer on part of it with `tokenizers`, saved as a Hugging
Face tokenizer directory (both under --dir, reused when present; never commit them). Then, on
the same machine one after another:

  raw        the Rust tokenizer's batch encode of every text (already in memory), all cores
  prepare    python -m jaxtrain.data's pipeline end to end: read, parse, tokenize in --workers
             processes, write the store
  datasets   load_dataset("json") + map(batched, num_proc=--workers) producing the same
             [bos] + ids + [eos] arrays (checked equal to the store's)

and prints tokens/s of each (wall clock, and per CPU-second of the process and its workers, which
a machine shared with other jobs distorts less) and prepare's ratios to the other two (issue
23's targets: >= 0.8x raw, faster than datasets).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import shutil
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def make_corpus(path: pathlib.Path, megabytes: float, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, size=int(n))) for n in rng.integers(1, 11, size=30_000)]
    weights = 1.0 / np.arange(1, len(words) + 1) ** 1.1
    weights /= weights.sum()
    target, written = int(megabytes * 1e6), 0
    with open(path, "w", encoding="utf-8") as f:
        while written < target:
            picks = rng.choice(len(words), size=(1000, 800), p=weights)
            for row, length in zip(picks, rng.integers(50, 800, size=1000)):
                text = " ".join(words[i] for i in row[:length])
                line = json.dumps({"text": text.capitalize() + ".", "source": "bench"}) + "\n"
                f.write(line)
                written += len(line)
                if written >= target:
                    break


def make_tokenizer(corpus: pathlib.Path, folder: pathlib.Path, vocab: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    def sample():
        with open(corpus, encoding="utf-8") as f:
            for number, line in enumerate(f):
                if number >= 5000:
                    return
                yield json.loads(line)["text"]

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(sample(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(str(folder))


def bench_raw(corpus: pathlib.Path, tokenizer_dir: pathlib.Path) -> tuple[int, float]:
    from transformers import AutoTokenizer

    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    with open(corpus, encoding="utf-8") as f:
        texts = [json.loads(line)["text"].strip() for line in f]
    backend = AutoTokenizer.from_pretrained(str(tokenizer_dir)).backend_tokenizer
    started = time.perf_counter()
    encodings = backend.encode_batch_fast(texts, add_special_tokens=False)
    seconds = time.perf_counter() - started
    return sum(len(e.ids) + 2 for e in encodings), seconds


def bench_prepare(corpus, tokenizer_dir, out, workers) -> tuple[int, float]:
    from jaxtrain.data.store.prepare import prepare

    shutil.rmtree(out, ignore_errors=True)
    summary = prepare([str(corpus)], str(tokenizer_dir), out, workers=workers, overwrite=True)
    return summary.tokens, summary.seconds


def bench_datasets(corpus, tokenizer_dir, cache, workers, store) -> tuple[int, float]:
    import datasets
    from transformers import AutoTokenizer

    shutil.rmtree(cache, ignore_errors=True)
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    bos, eos = tok.bos_token_id, tok.eos_token_id

    def encode(batch):
        ids = tok([t.strip() for t in batch["text"]], add_special_tokens=False)["input_ids"]
        return {"ids": [[bos] + i + [eos] for i in ids]}

    started = time.perf_counter()
    dataset = datasets.load_dataset("json", data_files=str(corpus), split="train", cache_dir=str(cache))
    mapped = dataset.map(encode, batched=True, num_proc=workers, remove_columns=dataset.column_names)
    seconds = time.perf_counter() - started
    column = mapped.with_format("numpy")["ids"]
    lengths = np.array([len(row) for row in column])
    flat = np.concatenate(list(column))
    from jaxtrain.data.store.readers import open_source

    source = open_source(store)
    same = (np.array_equal(lengths, source.document_lengths)
            and np.array_equal(flat, np.fromfile(pathlib.Path(store) / "tokens.bin", source.metadata.dtype)))
    if not same:
        raise SystemExit("datasets.map produced other tokens than the store: the comparison is void")
    return int(lengths.sum()), seconds


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children (the workers): the work
    done, which a machine shared with other jobs does not inflate the way it does wall time."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measured(run, *args):
    before = cpu_seconds()
    tokens, seconds = run(*args)
    return tokens, seconds, cpu_seconds() - before


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--dir", default="/tmp/bench_prepare")
    parser.add_argument("--vocab", type=int, default=32000)
    args = parser.parse_args(argv)
    folder = pathlib.Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer_dir = folder / f"corpus_{args.mb:g}mb.jsonl", folder / f"bpe_{args.vocab}"
    if not corpus.exists():
        make_corpus(corpus, args.mb)
    if not tokenizer_dir.exists():
        make_tokenizer(corpus, tokenizer_dir, args.vocab)
    rows = [("raw fast tokenizer, batch encode, all cores", *measured(bench_raw, corpus, tokenizer_dir))]
    rows.append((f"prepare --workers {args.workers} (read, tokenize, write)",
                 *measured(bench_prepare, corpus, tokenizer_dir, folder / "store", args.workers)))
    rows.append((f"datasets load_dataset + map(num_proc={args.workers})",
                 *measured(bench_datasets, corpus, tokenizer_dir, folder / "hf_cache", args.workers, folder / "store")))
    size = corpus.stat().st_size / 1e6
    print(f"corpus {size:.0f} MB jsonl, {rows[1][1] / 1e6:.1f}M tokens, BPE vocab {args.vocab}, "
          f"{os.cpu_count()} cores")
    print(f"| {'what':<52} | {'seconds':>8} | {'M tokens/s':>10} | {'CPU s':>7} | {'M tokens/CPU s':>14} |")
    for name, tokens, seconds, cpu in rows:
        print(f"| {name:<52} | {seconds:8.1f} | {tokens / seconds / 1e6:10.2f} | {cpu:7.1f} "
              f"| {tokens / cpu / 1e6:14.3f} |")
    for label, column in (("wall", 2), ("CPU", 3)):
        raw, prep, hf = (row[1] / row[column] for row in rows)
        print(f"{label}: prepare / raw = {prep / raw:.2f} (target >= 0.8); "
              f"prepare / datasets.map = {prep / hf:.2f} (target > 1)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
