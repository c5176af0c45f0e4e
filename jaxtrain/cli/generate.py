"""`python -m jaxtrain.generate (--workdir W | --hf_dir D) (--prompt TEXT | --prompts FILE.jsonl)`

Generates from the newest checkpoint of a training workdir (model and tokenizer from its
config.gin, restored as the eval CLI restores it) or from a Hugging Face directory. One prompt:
its new text is streamed to stdout as it is generated. A prompts file (one JSON object per line,
{"prompt": TEXT}, or a JSON string): one JSON line per prompt, {"prompt", "text", "tokens"}.
Greedy by default; --temperature/--top_k/--top_p/--seed sample. Bad input: exit 2, one line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from jaxtrain.cli.launch import add_common_flags, fail, start_from_model_source


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m jaxtrain.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_flags(parser)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--workdir", help="a training workdir (config.gin + checkpoints/)")
    source.add_argument("--hf_dir", help="a Hugging Face model directory (config.json + safetensors)")
    prompts = parser.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--prompt", help="one prompt; its text is streamed as it is generated")
    prompts.add_argument("--prompts", help='a JSONL file: {"prompt": TEXT} (or a JSON string) per line')
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--max_len", type=int, default=None, help="largest prompt + new tokens (cache length)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: no top-k filter")
    parser.add_argument("--top_p", type=float, default=1.0, help="1: no nucleus filter")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--layout", default=None, help='mesh and rules, e.g. "data=2,tensor=2" (default: one '
                                                       "device for --hf_dir, the run's layout for --workdir)")
    parser.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    return parser.parse_args(argv)


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    if not os.path.exists(args.prompts):
        fail(f"prompts file not found: {args.prompts}")
    texts = []
    with open(args.prompts) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                fail(f"{args.prompts}:{number}: not JSON ({e.msg})")
            text = item.get("prompt") if isinstance(item, dict) else item
            if not isinstance(text, str):
                fail(f'{args.prompts}:{number}: expected {{"prompt": TEXT}} or a JSON string')
            texts.append(text)
    return texts


def encode(tokenizer, texts: list[str], chat: bool, source: str) -> list[list[int]]:
    if tokenizer is None:
        fail(f"{source} has no tokenizer: text prompts cannot be encoded")
    if chat:
        hf_tok = getattr(tokenizer, "hf_tokenizer", None)
        if hf_tok is None or not getattr(hf_tok, "chat_template", None):
            fail(f"--chat: the tokenizer of {source} has no chat template")
        texts = [hf_tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                            add_generation_prompt=True) for t in texts]
    return [tokenizer.encode(t) for t in texts]


def check_lengths(ids: list[list[int]], texts: list[str], args, max_positions) -> None:
    for i, prompt in enumerate(ids):
        if not prompt:
            fail(f"prompt {i + 1} is empty" + (f" ({texts[i]!r} encodes to no tokens)" if texts[i] else ""))
        total = len(prompt) + args.max_new_tokens
        for limit, what in ((max_positions, "the model's positions"), (args.max_len, "--max_len")):
            if limit is not None and total > limit:
                fail(f"prompt {i + 1} has {len(prompt)} tokens; with --max_new_tokens={args.max_new_tokens} "
                     f"that is {total}, more than {what} ({limit})")


def stream_one(engine, prompt_ids, tokenizer, **kwargs) -> list[int]:
    """Prints the new text as it comes (whole characters only), returns the new tokens."""
    new, shown = [], ""
    for step_tokens in engine.stream([prompt_ids], **kwargs):
        if step_tokens[0] < 0:
            break
        new.append(int(step_tokens[0]))
        text = tokenizer.decode(new)
        if len(text) > len(shown) and not text.endswith("\ufffd"):
            print(text[len(shown):], end="", flush=True)
            shown = text
    text = tokenizer.decode(new)
    print(text[len(shown):], flush=True)
    return new


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.max_new_tokens < 1:
        fail(f"--max_new_tokens must be >= 1, got {args.max_new_tokens}")
    from jaxtrain.generate.sampling import Sampling  # no jax at import time

    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        fail(str(e))
    texts = read_prompts(args)
    if not texts:
        fail(f"no prompts in {args.prompts}")
    for i, text in enumerate(texts):
        if not text:
            fail(f"prompt {i + 1} is empty")

    start_from_model_source(args)

    from jaxtrain.generate import loading
    from jaxtrain.training.restore_latest import RestoreFailed

    source = args.workdir or args.hf_dir
    try:
        if args.workdir is not None:
            loaded = loading.load_workdir(args.workdir)
        else:
            loaded = loading.load_hf_dir(args.hf_dir, args.layout)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
    except RestoreFailed as e:
        fail(str(e), code=e.exit_code)
    ids = encode(loaded.tokenizer, texts, args.chat, source)
    check_lengths(ids, texts, args, loaded.max_positions)
    engine = loaded.engine()
    kwargs = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, seed=args.seed,
                  eos_id=loaded.tokenizer.eos_id, pad_id=loaded.tokenizer.pad_id)
    if args.prompt is not None:
        stream_one(engine, ids[0], loaded.tokenizer, **kwargs)
        return 0
    for text, new in zip(texts, engine.generate(ids, **kwargs)):
        print(json.dumps({"prompt": text, "text": loaded.tokenizer.decode(new), "tokens": new}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
