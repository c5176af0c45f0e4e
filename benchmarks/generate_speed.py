"""Decode speed against transformers' generate on the same random weights, side by side in one
process (same threads): prefill and decode timed separately, greedy, no early stop.

    .venv/bin/python benchmarks/generate_speed.py --batch 1 8 --prompt_len 256 --new_tokens 128

Defaults: a 135M-parameter Llama shape (30 layers, d 576, 9 heads / 3 kv heads, vocab 49152).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    p.add_argument("--prompt_len", type=int, default=256)
    p.add_argument("--new_tokens", type=int, default=128)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()

    import jax
    import torch
    import transformers

    from jaxtrain import hf
    from jaxtrain.generate import Engine

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=args.layers, num_attention_heads=9, num_key_value_heads=3,
                                   max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    theirs = transformers.LlamaForCausalLM(cfg).eval()
    theirs.generation_config.eos_token_id = None
    with tempfile.TemporaryDirectory() as d:
        theirs.save_pretrained(d)
        engine = Engine(hf.load(d), bucket=64)
    for b in args.batch:
        prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, args.prompt_len)).tolist()
        engine.generate(prompts, max_new_tokens=args.new_tokens)  # compiles
        t0 = time.perf_counter()
        steps = iter(engine.stream(prompts, max_new_tokens=args.new_tokens))
        next(steps)
        t1 = time.perf_counter()
        for _ in steps:
            pass
        t2 = time.perf_counter()
        ids = torch.tensor(prompts)
        with torch.no_grad():
            theirs(ids)  # warm
            s0 = time.perf_counter()
            theirs.generate(ids, do_sample=False, max_new_tokens=1, min_new_tokens=1, pad_token_id=0)
            s1 = time.perf_counter()
            theirs.generate(ids, do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                            pad_token_id=0)
            s2 = time.perf_counter()
        decode_new = b * (args.new_tokens - 1)
        print(json.dumps({"batch": b, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                          "jaxtrain_prefill_s": round(t1 - t0, 3), "transformers_prefill_s": round(s1 - s0, 3),
                          "jaxtrain_decode_tok_s": round(decode_new / (t2 - t1), 1),
                          "transformers_decode_tok_s": round(decode_new / ((s2 - s1) - (s1 - s0)), 1),
                          "torch_threads": torch.get_num_threads(), "jax": jax.__version__}), flush=True)


if __name__ == "__main__":
    main()
