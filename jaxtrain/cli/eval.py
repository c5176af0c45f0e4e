"""`python -m jaxtrain.eval --workdir=DIR --data=FILE`

Evaluates the latest checkpoint in DIR on a raw text file (e.g. a WikiText-2/103 raw file),
read as one token stream and scored with a sliding window: prints loss, perplexity and the
number of tokens scored, as JSON. The model and tokenizer come from DIR/config.gin (written
by the train CLI); --gin_file/--gin_param add to or override it.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from jaxtrain.cli.launch import add_common_flags, fail, start


def evaluate_stream(setup, params, stream, *, seq_len: int, stride: int, batch_size: int, pad_id: int) -> dict:
    """Loss and perplexity of a token stream, scored in sliding windows by `setup`'s eval step
    (a TrainSetup built for batches of `batch_size` windows of `seq_len`)."""
    import jax

    from jaxtrain.data.sliding_window import batch_windows, sliding_windows

    nll = tokens = 0.0
    for batch in batch_windows(sliding_windows(stream, seq_len, stride, pad_id), batch_size):
        out = jax.device_get(setup.eval_step(params, setup.device_batch(batch)))
        nll, tokens = nll + float(out["nll"]), tokens + float(out["tokens"])
    loss = nll / max(tokens, 1.0)
    return {"loss": loss, "perplexity": math.exp(min(loss, 80.0)), "tokens": int(tokens)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.eval", description=__doc__)
    add_common_flags(parser)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--data", required=True, help="raw text file, evaluated as one stream")
    parser.add_argument("--seq_len", type=int, default=None, help="window length (default: TrainConfig.seq_len)")
    parser.add_argument("--stride", type=int, default=None, help="window stride (default: seq_len // 2)")
    parser.add_argument("--batch_size", type=int, default=None, help="windows per batch (default: global_batch)")
    args = parser.parse_args(argv)
    saved = os.path.join(args.workdir, "config.gin")
    if not args.gin_file:
        if not os.path.exists(saved):
            fail(f"{saved} not found: pass --gin_file describing the model")
        args.gin_file = [saved]
    if not os.path.exists(args.data):
        fail(f"data file not found: {args.data}")
    start(args)

    import dataclasses

    from jaxtrain.training.config import load_experiment
    from jaxtrain.data.packing import tokenize_text_stream
    from jaxtrain.data.tokenizer import load_tokenizer
    from jaxtrain.training.device_groups import one_mesh_program
    from jaxtrain.training.restore_latest import RestoreFailed, restore_latest_params
    from jaxtrain.training.train_setup import build_train_setup

    try:
        exp = load_experiment()
        seq_len = args.seq_len or exp.train.seq_len
        batch_size = args.batch_size or exp.train.global_batch
        plan, devices = one_mesh_program(exp.plan)  # device groups: one group's program
        # The run's own layout, sized for the eval windows (checked here, before any restore).
        setup = build_train_setup(exp.model, plan,
                                  dataclasses.replace(exp.train, seq_len=seq_len, global_batch=batch_size),
                                  exp.optimizer, devices, loss=exp.loss)
        tokenizer = load_tokenizer(exp.data.tokenizer)
        stream = tokenize_text_stream(args.data, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    try:
        step, params = restore_latest_params(setup, args.workdir, exp.checkpoint.allow_unverified_restore,
                                             as_saved=False)
    except RestoreFailed as e:
        fail(str(e), code=e.exit_code)
    result = evaluate_stream(setup, params, stream, seq_len=seq_len, stride=args.stride or max(seq_len // 2, 1),
                             batch_size=batch_size, pad_id=tokenizer.pad_id)
    print(json.dumps({"checkpoint_step": step, "data": args.data, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
