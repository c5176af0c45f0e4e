"""lm-eval loglikelihood requests per second: jaxtrain's harness backend against the harness's HF
backend on the same random weights, each backend in its own process (a process that ran one
framework slows the other), alternating A B B A, on the same CPUs with the same thread count.

    .venv/bin/python benchmarks/harness_speed.py --requests 96 --batch 32 --rounds 2 --choices 4

Requests are multiple-choice shaped: contexts of 16-200 tokens, each with `--choices`
continuations of 1-8 tokens (4: a question and its answers, as ARC or HellaSwag ask; 1: no two
requests share a context), random ids, scored through each backend's `_loglikelihood_tokens`
(tokenization is not timed). The HF backend's cache for one-token continuations applies where it
would on a real task. Each process scores the requests once to warm up (jaxtrain compiles its
programs there), then once timed. Defaults: a 135M-parameter Llama shape (30 layers, d 576, 9 heads / 3 kv
heads, vocab 49152), float32.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def save_model(directory: str, layers: int) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                   num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
                                   max_position_embeddings=2048, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(directory)
    # any tokenizer: requests are token ids, the backends only ask it for eos/bos
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.train_from_iterator(["a b c"], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    transformers.PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(directory)


def requests(n: int, choices: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < n:
        context = rng.integers(0, 49152, int(rng.integers(16, 201))).tolist()
        for _ in range(min(choices, n - len(out))):
            continuation = rng.integers(0, 49152, int(rng.integers(1, 9))).tolist()
            out.append(((f"c{len(out)}", f"x{len(out)}"), context, continuation))
    return out


def worker(backend: str, hf_dir: str, n: int, batch: int, choices: int) -> dict:
    if backend == "hf":
        import torch
        from lm_eval.models.huggingface import HFLM

        torch.set_num_threads(len(os.sched_getaffinity(0)))
        lm = HFLM(pretrained=hf_dir, dtype="float32", device="cpu", batch_size=batch, max_length=2048)
    else:
        from jaxtrain.harness.lm import JaxtrainLM

        lm = JaxtrainLM(hf_dir=hf_dir, batch_size=batch, max_length=2048)
    reqs = requests(n, choices)
    t0 = time.perf_counter()
    first = lm._loglikelihood_tokens(reqs, disable_tqdm=True)  # warm-up (jaxtrain: compiles)
    t1 = time.perf_counter()
    second = lm._loglikelihood_tokens(reqs, disable_tqdm=True)
    t2 = time.perf_counter()
    assert [a for a, _ in first] == [a for a, _ in second]
    programs = sorted(lm.scorer.programs) if backend == "jaxtrain" else None
    return {"backend": backend, "requests_per_s": n / (t2 - t1), "timed_s": t2 - t1, "warmup_s": t1 - t0,
            "programs": programs, "logprob_sum": float(sum(a for a, _ in second))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--choices", type=int, default=4, help="continuations per context")
    p.add_argument("--worker", choices=["jaxtrain", "hf"], default=None)
    p.add_argument("--hf_dir", default=None)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.hf_dir, args.requests, args.batch, args.choices)), flush=True)
        return
    env = {**os.environ, "PYTHONPATH": REPO, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    rows = []
    with tempfile.TemporaryDirectory() as hf_dir:
        save_model(hf_dir, args.layers)
        for r in range(args.rounds):
            order = ("jaxtrain", "hf") if r % 2 == 0 else ("hf", "jaxtrain")
            for backend in order:
                proc = subprocess.run([sys.executable, __file__, "--worker", backend, "--hf_dir", hf_dir,
                                       "--requests", str(args.requests), "--batch", str(args.batch),
                                       "--choices", str(args.choices)],
                                      env=env, capture_output=True, text=True, cwd=REPO)
                if proc.returncode:
                    sys.exit(proc.stderr[-3000:])
                row = json.loads(proc.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(json.dumps(row), flush=True)
    med = {b: statistics.median(r["requests_per_s"] for r in rows if r["backend"] == b) for b in ("jaxtrain", "hf")}
    sums = {b: [r["logprob_sum"] for r in rows if r["backend"] == b][0] for b in med}
    programs = next(r["programs"] for r in rows if r["backend"] == "jaxtrain")
    print(json.dumps({"requests": args.requests, "choices": args.choices, "batch": args.batch,
                      "cpus": len(os.sched_getaffinity(0)), "jaxtrain_requests_per_s": med["jaxtrain"],
                      "hf_requests_per_s": med["hf"], "ratio": med["jaxtrain"] / med["hf"],
                      "programs": programs, "logprob_sum_difference": abs(sums["jaxtrain"] - sums["hf"])}), flush=True)


if __name__ == "__main__":
    main()
