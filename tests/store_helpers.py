"""Shared by the token-store tests: a tiny chat tokenizer built in-test, an independent Megatron
MMIDIDX writer (following the documented layout with struct, not jaxtrain's writer), and reading a
whole source back as Python lists."""
from __future__ import annotations

import struct

import numpy as np

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same rendering with the assistant turns marked, so transformers computes its own mask (the
# newline is an expression: transformers' jinja trims a newline that follows a block tag).
CHATML_MARKED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}{% else %}"
                 "{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_chat_tokenizer(path, texts, template=CHATML, vocab_size=500):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    core = Tokenizer(models.BPE(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = template
    tok.save_pretrained(str(path))
    return str(path)


MEGATRON_CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.uint16: 8}


def write_megatron_reference(prefix, documents, dtype):
    """`documents`: lists of sequences (lists of ids). The layout of Megatron-LM's
    megatron/core/datasets/indexed_dataset.py, written field by field with struct."""
    dtype = np.dtype(dtype)
    lengths, pointers, doc_index, data, at = [], [], [0], b"", 0
    for sequences in documents:
        for seq in sequences:
            lengths.append(len(seq))
            pointers.append(at)
            chunk = np.asarray(seq, dtype).tobytes()
            data += chunk
            at += len(chunk)
        doc_index.append(len(lengths))
    idx = b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_CODES[dtype.type])
    idx += struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_index))
    idx += struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(pointers)}q", *pointers)
    idx += struct.pack(f"<{len(doc_index)}q", *doc_index)
    with open(f"{prefix}.bin", "wb") as f:
        f.write(data)
    with open(f"{prefix}.idx", "wb") as f:
        f.write(idx)
    return str(prefix)


def source_documents(source):
    return [source.tokens(d).tolist() for d in range(len(source))]


def source_masks(source):
    return [source.loss_mask(d).tolist() for d in range(len(source))]
