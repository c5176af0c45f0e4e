"""Checks that jaxtrain computes the same model as transformers for an HF directory.

    python -m jaxtrain.hf.verify HF_DIR [--tolerance=1e-4] [--batch=2] [--length=64] [--seed=0]

Runs the same random tokens through transformers (CPU, float32) and through jaxtrain, prints
the max relative logit error (max |ours - theirs| / max |theirs|), the mean KL divergence of
our next-token distribution from theirs, and top-1 / top-5 agreement; exits 1 when the error
exceeds the tolerance, 2 when the directory cannot be read.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def compare_logits(ours: np.ndarray, theirs: np.ndarray) -> dict:
    ours, theirs = np.asarray(ours, np.float64), np.asarray(theirs, np.float64)
    log_p = theirs - _logsumexp(theirs)
    log_q = ours - _logsumexp(ours)
    kl = (np.exp(log_p) * (log_p - log_q)).sum(-1)
    top5_ours = np.argsort(-ours, axis=-1)[..., :5]
    top5_theirs = np.argsort(-theirs, axis=-1)[..., :5]
    overlap = (top5_ours[..., :, None] == top5_theirs[..., None, :]).any(-1).mean(-1)
    return {
        "max_relative_error": float(np.abs(ours - theirs).max() / max(np.abs(theirs).max(), 1e-30)),
        "kl_divergence": float(kl.mean()),
        "top1_agreement": float((ours.argmax(-1) == theirs.argmax(-1)).mean()),
        "top5_agreement": float(overlap.mean()),
    }


def _logsumexp(x: np.ndarray) -> np.ndarray:
    top = x.max(-1, keepdims=True)
    return top + np.log(np.exp(x - top).sum(-1, keepdims=True))


def transformers_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    from jaxtrain.extras import require

    torch = require("torch", "comparing logits with transformers")
    AutoModelForCausalLM = require("transformers", "comparing logits with transformers").AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, local_files_only=True)
    model.eval()
    with torch.no_grad():
        return model(torch.as_tensor(tokens, dtype=torch.long)).logits.float().numpy()


def jaxtrain_logits(hf_dir: str, tokens: np.ndarray) -> np.ndarray:
    import jax
    from flax import nnx

    from jaxtrain.hf.loading import load

    graphdef, state = nnx.split(load(hf_dir))
    forward = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))
    return np.asarray(forward(state, np.asarray(tokens, np.int32)), np.float32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.hf.verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir")
    parser.add_argument("--tolerance", type=float, default=1e-4, help="largest max_relative_error that passes")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from jaxtrain.hf.errors import HFCheckpointError, HFConfigError
    from jaxtrain.hf.loading import read_config
    try:
        _, config = read_config(args.hf_dir)
        tokens = np.random.default_rng(args.seed).integers(0, config.vocab_size, (args.batch, args.length))
        ours = jaxtrain_logits(args.hf_dir, tokens)
    except (HFConfigError, HFCheckpointError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    metrics = compare_logits(ours, transformers_logits(args.hf_dir, tokens))
    for name, value in metrics.items():
        print(f"{name:>20}: {value:.3e}" if "error" in name or "kl" in name else f"{name:>20}: {value:.4f}")
    passed = metrics["max_relative_error"] <= args.tolerance
    print(f"{'PASS' if passed else 'FAIL'}: max relative logit error {metrics['max_relative_error']:.3e} "
          f"{'<=' if passed else '>'} tolerance {args.tolerance:.1e}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
