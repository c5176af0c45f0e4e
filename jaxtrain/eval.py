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

from jaxtrain.launch import add_common_flags, fail, start


def evaluate_stream(exp, mesh, params, stream, *, seq_len: int, stride: int, batch_size: int, pad_id: int) -> dict:
    import jax

    from jaxtrain.sliding_window import batch_windows, sliding_windows
    from jaxtrain.state import abstract_model, param_shardings
    from jaxtrain.step import batch_shardings, make_eval_step
    from meshes.rules import get_rule_set

    rules = get_rule_set(exp.train.rules)
    graphdef, abstract_state = abstract_model(exp.model)
    bsh = batch_shardings(mesh, rules, batch_size, seq_len)
    step = make_eval_step(graphdef, mesh=mesh, rules=rules, batch_sharding=bsh, loss_chunk=exp.train.loss_chunk,
                          params_shardings=param_shardings(abstract_state, mesh, rules.params),
                          context_parallel=exp.train.context_parallel)
    nll = tokens = 0.0
    for batch in batch_windows(sliding_windows(stream, seq_len, stride, pad_id), batch_size):
        out = jax.device_get(step(params, {k: jax.device_put(v, bsh[k]) for k, v in batch.items()}))
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

    from jaxtrain.checkpoint import CheckpointError, Checkpointer
    from jaxtrain.resilience import exit_codes
    from jaxtrain.config import load_experiment
    from jaxtrain.data import tokenize_text_stream
    from jaxtrain.optim import make_optimizer
    from jaxtrain.state import state_shardings
    from jaxtrain.tokenizer import load_tokenizer
    from meshes.mesh import build_mesh
    from meshes.rules import get_rule_set

    try:
        exp = load_experiment()
        mesh = build_mesh(exp.mesh)
        exp.model.validate(dict(mesh.shape))
        checkpointer = Checkpointer(os.path.join(args.workdir, "checkpoints"))
        step = checkpointer.latest_step()
        if step is None:
            fail(f"no checkpoint in {args.workdir}/checkpoints")
        tokenizer = load_tokenizer(exp.data.tokenizer)
        stream = tokenize_text_stream(args.data, tokenizer)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    tx, _ = make_optimizer(exp.optimizer, exp.train.steps)
    _, abstract, _ = state_shardings(exp.model, tx, mesh, get_rule_set(exp.train.rules))
    try:  # the newest intact step (a corrupt newer one is reported and skipped, not moved)
        step, restored, _ = checkpointer.restore_latest({"params": abstract["params"]}, quarantine=False)
    except CheckpointError as e:
        fail(str(e), code=exit_codes.CHECKPOINT)
    params = restored["params"]
    checkpointer.close()
    seq_len = args.seq_len or exp.train.seq_len
    try:
        exp.train.context_parallel.validate(seq_len, mesh.shape["context"])
    except ValueError as e:
        fail(f"--seq_len={seq_len}: {e}")
    result = evaluate_stream(exp, mesh, params, stream, seq_len=seq_len, stride=args.stride or max(seq_len // 2, 1),
                             batch_size=args.batch_size or exp.train.global_batch, pad_id=tokenizer.pad_id)
    print(json.dumps({"checkpoint_step": step, "data": args.data, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
