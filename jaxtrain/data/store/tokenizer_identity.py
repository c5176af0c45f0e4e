"""A tokenizer's identity as a store records it: "bytes", or the tokenizer directory's name plus
a sha256 of its tokenizer files, so training can refuse a store made with another tokenizer."""
from __future__ import annotations

import hashlib
import pathlib

# What defines the ids a tokenizer produces (weights or model configs in the folder do not).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "vocab.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "chat_template.json")


def tokenizer_identity(spec: str) -> str:
    """"bytes", or "<dir name>@sha256:<first 16 hex of the hash of its tokenizer files>"."""
    if spec == "bytes":
        return "bytes"
    folder = pathlib.Path(spec)
    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        path = folder / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes() + b"\0")
    return f"{folder.resolve().name}@sha256:{digest.hexdigest()[:16]}"
