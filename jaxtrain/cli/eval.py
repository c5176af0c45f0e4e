"""`python -m jaxtrain.eval`: a model scored on text, two ways.

Perplexity of a raw text file (e.g. a WikiText-2/103 raw file), read as one token stream and
scored with a sliding window; prints loss, perplexity and tokens scored as JSON:

    python -m jaxtrain.eval --workdir=DIR --data=FILE [--seq_len --stride --batch_size]

lm-evaluation-harness tasks (multiple choice, perplexity, generation; the harness's own or your
YAMLs), with jaxtrain as the harness's model backend (jaxtrain/harness/); prints the harness's
table, and --output writes its results JSON (with the per-request samples under --log_samples):

    python -m jaxtrain.eval (--workdir=DIR | --hf_dir=DIR) --tasks=hellaswag,arc_easy
        [--include_path=DIR --limit=N --num_fewshot=K --batch_size=B --layout=SPEC
         --output=results.json --log_samples --apply_chat_template]

A workdir's model and tokenizer come from DIR/config.gin (written by the train CLI), restored from
its newest intact checkpoint onto the run's layout (or --layout); --gin_file/--gin_param add to it.
Bad input: exit 2, one line.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from jaxtrain.cli.launch import add_common_flags, fail, start_from_model_source


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


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training workdir (config.gin + checkpoints/)")
    source.add_argument("--hf_dir", help="a Hugging Face model directory (--tasks only)")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--data", help="raw text file, evaluated as one stream (perplexity)")
    mode.add_argument("--tasks", help="comma-separated lm-eval task or group names")
    parser.add_argument("--seq_len", type=int, default=None, help="window length (default: TrainConfig.seq_len)")
    parser.add_argument("--stride", type=int, default=None, help="window stride (default: seq_len // 2)")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="windows per batch (default: global_batch); requests per batch under --tasks (default 8)")
    parser.add_argument("--layout", default=None, help='mesh and rules, e.g. "data=2,tensor=2" (default: one device '
                                                       "for --hf_dir, the run's layout for --workdir)")
    parser.add_argument("--include_path", default=None, help="a folder of your own task YAMLs")
    parser.add_argument("--limit", type=float, default=None, help="documents per task (a fraction if below 1)")
    parser.add_argument("--num_fewshot", type=int, default=None)
    parser.add_argument("--max_length", type=int, default=None,
                        help="longest request in tokens (default: the model's positions, or the run's seq_len)")
    parser.add_argument("--output", default=None, help="write the harness's results JSON here")
    parser.add_argument("--log_samples", action="store_true", help="keep each request and response in --output")
    parser.add_argument("--apply_chat_template", action="store_true", help="render prompts with the tokenizer's "
                                                                           "chat template")
    parser.add_argument("--seed", type=int, default=0, help="few-shot sampling and sampled generation")
    args = parser.parse_args(argv)
    if args.hf_dir is not None and args.data is not None:
        parser.error("--data (perplexity) needs --workdir; --hf_dir evaluates --tasks")
    return args


def perplexity(args) -> int:
    if not os.path.exists(args.data):
        fail(f"data file not found: {args.data}")
    start_from_model_source(args)

    import dataclasses

    from jaxtrain.data.packing import tokenize_text_stream
    from jaxtrain.data.tokenizer import load_tokenizer
    from jaxtrain.training.config import load_experiment
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


def harness_tasks(args) -> int:
    try:
        from jaxtrain.harness.tasks import TaskRequest
        import lm_eval  # noqa: F401
    except ImportError as e:
        fail(f"--tasks needs lm-evaluation-harness ({e}): pip install 'jaxtrain[eval]'")

    try:  # the cheap checks first: nothing loads for a bad flag
        request = TaskRequest(tuple(t.strip() for t in args.tasks.split(",")), include_path=args.include_path,
                              limit=args.limit, num_fewshot=args.num_fewshot, log_samples=args.log_samples,
                              apply_chat_template=args.apply_chat_template, seed=args.seed)
        if args.batch_size is not None and args.batch_size < 1:
            raise ValueError(f"--batch_size must be >= 1, got {args.batch_size}")
        if args.max_length is not None and args.max_length < 2:
            raise ValueError(f"--max_length must be >= 2, got {args.max_length}")
    except ValueError as e:
        fail(str(e))
    start_from_model_source(args)

    from jaxtrain.harness import lm as harness_lm
    from jaxtrain.harness.tasks import evaluate, output_types, table, task_manager, write_results
    from jaxtrain.training.restore_latest import RestoreFailed

    try:
        manager = task_manager(request)
        kinds = output_types(manager, request.tasks)
        model = harness_lm.JaxtrainLM(workdir=args.workdir, hf_dir=args.hf_dir,
                                      layout=args.layout if args.hf_dir else None, batch_size=args.batch_size or 8,
                                      max_length=args.max_length, seed=args.seed, gin_ready=True)
        model.check_request_kinds(kinds)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except RestoreFailed as e:
        fail(str(e), code=e.exit_code)
    results = evaluate(model, request, manager)
    print(table(results), flush=True)
    if args.output:
        write_results(results, args.output)
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    return perplexity(args) if args.data is not None else harness_tasks(args)


if __name__ == "__main__":
    sys.exit(main())
