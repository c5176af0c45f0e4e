"""`open_source(path)`: a store directory or a Megatron prefix -> its `TokenSource`; and the
vocabulary check training runs before it builds anything."""
from __future__ import annotations

import os
import pathlib

from jaxtrain.data.store.errors import DataInputError
from jaxtrain.data.store.megatron import MegatronIndexedDataset, is_megatron_prefix
from jaxtrain.data.store.store_format import METADATA_FILE, TokenStore


def open_source(path: str | os.PathLike, *, vocab_size: int | None = None, pad_id: int = 0):
    """A TokenStore for a store directory, a MegatronIndexedDataset for a prefix with .bin and
    .idx (`vocab_size` and `pad_id` apply to Megatron data only: stores record their own)."""
    given = str(path)
    prefix = given[:-4] if given.endswith((".bin", ".idx")) else given
    if pathlib.Path(given).is_dir():
        return TokenStore(given)
    if is_megatron_prefix(prefix):
        return MegatronIndexedDataset(prefix, vocab_size=vocab_size, pad_id=pad_id)
    if os.path.exists(f"{prefix}.bin") or os.path.exists(f"{prefix}.idx"):
        have = ".bin" if os.path.exists(f"{prefix}.bin") else ".idx"
        missing = ".idx" if have == ".bin" else ".bin"
        raise DataInputError(f"{prefix}{missing}: missing (a Megatron dataset needs both {prefix}.bin and .idx)")
    if pathlib.Path(given).name == METADATA_FILE:
        return TokenStore(pathlib.Path(given).parent)
    raise DataInputError(
        f"{given}: neither a token store directory nor a Megatron prefix (prefix.bin + prefix.idx)")


def check_fits_vocabulary(source, vocab_size: int) -> None:
    """DataInputError naming the source when a token id is >= `vocab_size`. Stores answer from
    their metadata, Megatron data from one chunked scan (cached beside it); others are scanned."""
    top = _max_token_id(source)
    if top >= vocab_size:
        recorded = f" (the data's tokenizer has {source.vocab_size})" if source.vocab_size else ""
        raise DataInputError(
            f"{source.name}: token id {top} does not fit the model's vocabulary of {vocab_size}{recorded}")


def _max_token_id(source) -> int:
    own = getattr(source, "max_token_id", None)  # an attribute or property (stores, Megatron, memory)
    if own is not None:
        return int(own)
    top = -1
    for document in range(len(source)):
        tokens = source.tokens(document)
        if len(tokens):
            top = max(top, int(tokens.max()))
    return top
