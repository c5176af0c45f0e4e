"""`python -m jaxtrain.data prepare --input FILES_OR_GLOBS... --tokenizer DIR|bytes --out STORE`
`python -m jaxtrain.data info PATH` (a store or a Megatron prefix: what it holds, checked)

prepare tokenizes text, chat or prompt/completion records in worker processes into a token store
(jaxtrain/data/store/), or with --megatron into a Megatron-LM `.bin`/`.idx` pair. Bad input:
one line naming the file (and line), exit 2, nothing written.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxtrain.data.store.errors import DataInputError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.data", description=__doc__.split("\n\n")[0])
    verbs = parser.add_subparsers(dest="verb", required=True)
    prep = verbs.add_parser("prepare", help="tokenize files into a token store")
    prep.add_argument("--input", nargs="+", required=True, action="extend",
                      help=".txt, .jsonl, .jsonl.gz, .jsonl.zst, .parquet files, save_to_disk folders, or globs")
    prep.add_argument("--tokenizer", required=True, help="'bytes' or a local Hugging Face tokenizer directory")
    prep.add_argument("--out", required=True, help="the store directory (a prefix with --megatron)")
    prep.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                      help="tokenizing processes (default: all cores)")
    prep.add_argument("--format", default="text", choices=("text", "chat", "prompt_completion"))
    prep.add_argument("--text_field", default="text", help="the text field of JSON lines / column of tables")
    prep.add_argument("--overwrite", action="store_true", help="replace an existing complete store")
    prep.add_argument("--megatron", action="store_true", help="write OUT.bin + OUT.idx (Megatron-LM MMIDIDX)")
    prep.add_argument("--batch_documents", type=int, default=256, help="documents per worker task")
    prep.add_argument("--no_progress", action="store_true", help="no progress bar")
    info = verbs.add_parser("info", help="check a store or Megatron prefix and print what it holds")
    info.add_argument("path")
    return parser


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.verb == "prepare":
            from jaxtrain.data.store.prepare import prepare

            summary = prepare(args.input, args.tokenizer, args.out, workers=args.workers, data_format=args.format,
                              text_field=args.text_field, overwrite=args.overwrite, megatron_output=args.megatron,
                              batch_documents=args.batch_documents, progress=not args.no_progress)
            print(f"wrote {summary.out}: {summary.documents} documents, {summary.tokens} tokens from "
                  f"{summary.input_bytes / 1e6:.1f} MB in {summary.seconds:.1f} s "
                  f"({summary.tokens_per_second / 1e6:.2f}M tokens/s)")
        else:
            from jaxtrain.data.store.readers import open_source

            source = open_source(args.path)
            lengths = source.document_lengths
            print(json.dumps({"source": repr(source), "documents": len(source), "tokens": int(lengths.sum()),
                              "vocab_size": source.vocab_size, "tokenizer_id": source.tokenizer_id,
                              "has_loss_mask": source.has_loss_mask, "max_token_id": source.max_token_id}, indent=1))
    except DataInputError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0
