"""Token stores, Megatron indexed datasets and `prepare`. `open_source(path)` opens a
store directory or a Megatron prefix as a `TokenSource` (jaxtrain/data/store/source.py)."""
from jaxtrain.data.store.readers import open_source  # noqa: F401
