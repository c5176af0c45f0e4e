"""Records -> training-ready token documents (and loss masks), one `RawBatch` at a time.

  text               [bos] + tokens + [eos], exactly as jaxtrain/data/packing.py (same tokenizer
                     calls), so a store and the raw-file path pack identical windows; documents
                     empty after stripping whitespace are dropped, as there.
  chat               {"messages": [{"role", "content"}, ...]} rendered by the tokenizer's own chat
                     template and tokenized as `apply_chat_template` does; nothing is added around
                     it (the template decides bos: Llama 3's renders it, Qwen's has none). Loss mask
                     1 on each assistant turn as the template renders it through its end-of-turn
                     marker (e.g. "<|im_end|>"), not the whitespace the template puts between
                     turns: the model learns to end its turn, as trl's and Megatron's SFT do.
                     With `{% generation %}` marks the template's own assistant mask is used;
                     otherwise the spans come from rendering the conversation prefix by prefix.
  prompt_completion  {"prompt", "completion"}: [bos] + prompt + completion + [eos], each part
                     tokenized on its own; loss mask 1 on the completion and the eos.

A worker process builds one `Encoder` and calls `encode` for each batch; errors name the file
and line.
"""
from __future__ import annotations

import dataclasses
import json
import re

import numpy as np

from jaxtrain.data.store.documents import RawBatch
from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.tokenizer import ByteTokenizer, load_tokenizer

_GENERATION_MARK = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclasses.dataclass
class EncodedBatch:
    source: int
    tokens: np.ndarray  # the documents' tokens back to back, in the store's dtype
    lengths: np.ndarray  # int64 [documents]
    mask: np.ndarray | None  # uint8, like tokens (chat, prompt_completion)
    bytes_read: int


class Encoder:
    def __init__(self, tokenizer_spec: str, data_format: str, text_field: str, dtype: str):
        self.tokenizer = load_tokenizer(tokenizer_spec)
        self.data_format, self.text_field = data_format, text_field
        self.dtype = np.dtype(dtype)
        self.hf = getattr(self.tokenizer, "hf_tokenizer", None)
        if data_format == "chat":
            check_chat_template(self.tokenizer, tokenizer_spec)
            self._generation_marks = bool(_GENERATION_MARK.search(self.hf.chat_template))

    # ------------------------------------------------------------------ records

    def _records(self, batch: RawBatch) -> list:
        if batch.kind != "json":
            return batch.items
        records = []
        for line, where in zip(batch.items, batch.locations):
            try:
                records.append(json.loads(line))
            except (json.JSONDecodeError, UnicodeDecodeError) as err:
                raise DataInputError(f"{batch.path}:{_number(where)}: not valid JSON ({err})") from None
            if not isinstance(records[-1], dict):
                raise DataInputError(f"{batch.path}:{_number(where)}: a JSON line must hold an object")
        return records

    def _field(self, record, name: str, batch: RawBatch, where: str) -> str:
        value = record.get(name) if isinstance(record, dict) else None
        if not isinstance(value, str):
            problem = "is not a string" if isinstance(record, dict) and name in record else "is missing"
            raise DataInputError(f"{batch.path}:{_number(where)}: field {name!r} {problem}")
        return value

    # ------------------------------------------------------------------ formats

    def encode(self, batch: RawBatch) -> EncodedBatch:
        records = self._records(batch)
        if self.data_format == "text":
            return self._text(batch, records)
        if self.data_format == "prompt_completion":
            return self._prompt_completion(batch, records)
        return self._chat(batch, records)

    def _finish(self, batch, pieces, masks) -> EncodedBatch:
        lengths = np.array([len(p) for p in pieces], np.int64)
        tokens = np.concatenate(pieces).astype(self.dtype) if pieces else np.zeros(0, self.dtype)
        mask = None
        if masks is not None:
            mask = np.concatenate(masks).astype(np.uint8) if masks else np.zeros(0, np.uint8)
        return EncodedBatch(batch.source, tokens, lengths, mask, batch.bytes_read)

    def _encode_many(self, texts: list[str]) -> list[np.ndarray]:
        if isinstance(self.tokenizer, ByteTokenizer):  # the UTF-8 bytes are the ids
            return [np.frombuffer(t.encode("utf-8"), np.uint8) for t in texts]
        return [np.asarray(ids, np.int64) for ids in self.tokenizer.encode_batch(texts)]

    def _text(self, batch, records) -> EncodedBatch:
        if batch.kind == "text":
            texts = [t.strip() for t in records]
        else:
            texts = [self._field(r, self.text_field, batch, w).strip() for r, w in zip(records, batch.locations)]
        texts = [t for t in texts if t]
        bos, eos = [self.tokenizer.bos_id], [self.tokenizer.eos_id]
        pieces = [np.concatenate([bos, ids, eos]) for ids in self._encode_many(texts)]
        return self._finish(batch, pieces, None)

    def _prompt_completion(self, batch, records) -> EncodedBatch:
        prompts, completions = [], []
        for record, where in zip(records, batch.locations):
            prompts.append(self._field(record, "prompt", batch, where))
            completions.append(self._field(record, "completion", batch, where))
        prompt_ids, completion_ids = self._encode_many(prompts), self._encode_many(completions)
        bos, eos = [self.tokenizer.bos_id], [self.tokenizer.eos_id]
        pieces, masks = [], []
        for p, c in zip(prompt_ids, completion_ids):
            pieces.append(np.concatenate([bos, p, c, eos]))
            masks.append(np.concatenate([np.zeros(1 + len(p), np.uint8), np.ones(len(c) + 1, np.uint8)]))
        return self._finish(batch, pieces, masks)

    def _chat(self, batch, records) -> EncodedBatch:
        pieces, masks = [], []
        for record, where in zip(records, batch.locations):
            messages = check_messages(record, f"{batch.path}:{_number(where)}")
            tokens, mask = (self._chat_generation_marks(messages) if self._generation_marks
                            else self._chat_prefix_diff(messages, f"{batch.path}:{_number(where)}"))
            pieces.append(np.asarray(tokens, np.int64))
            masks.append(np.asarray(mask, np.uint8))
        return self._finish(batch, pieces, masks)

    def _chat_generation_marks(self, messages):
        out = self.hf.apply_chat_template(messages, tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
        return out["input_ids"], out["assistant_masks"]

    def _render(self, messages, generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def _chat_prefix_diff(self, messages, where: str):
        full = self._render(messages, False)
        spans = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._render(messages[:turn], True) if turn else ""
            through = self._render(messages[:turn + 1], False)
            if not (full.startswith(before) and full.startswith(through) and len(through) > len(before)):
                raise DataInputError(
                    f"{where}: the chat template does not render this conversation prefix by prefix "
                    "(it rewrites earlier turns), so the assistant tokens cannot be found; add "
                    "{% generation %} marks to the template")
            spans.append((len(before), len(through.rstrip())))
        encoding = self.hf(full, add_special_tokens=False, return_offsets_mapping=True)
        mask = np.zeros(len(encoding["input_ids"]), np.uint8)
        for t, (start, end) in enumerate(encoding["offset_mapping"]):
            mask[t] = any(start < b and end > a for a, b in spans)
        return encoding["input_ids"], mask


def check_chat_template(tokenizer, spec: str) -> None:
    hf = getattr(tokenizer, "hf_tokenizer", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise DataInputError(f"{spec}: --format chat needs a Hugging Face tokenizer with a chat template")


def check_messages(record, where: str) -> list[dict]:
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataInputError(f"{where}: 'messages' must be a non-empty list of {{role, content}}")
    for message in messages:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataInputError(f"{where}: each message needs a string 'role' and 'content', got {message!r:.80}")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataInputError(f"{where}: no assistant turn (nothing to train on)")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def _number(where: str) -> str:
    """"line 7" -> "7" (file:line), anything else kept as it is."""
    return where[5:] if where.startswith("line ") else where
