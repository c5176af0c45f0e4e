"""jaxtrain checkpoints written and read a block at a time, so converting never holds a whole
model in host memory.

Orbax saves a tree of arrays that already exist. For conversion the leaves are instead
`StreamedArray`s: a private type handler opens the same TensorStore array Orbax would and
writes it block by block as the blocks are produced, one block per storage chunk. The result
is an ordinary params-only checkpoint (Orbax still writes the metadata and commits the step
atomically): jaxtrain.checkpoints.checkpointer.Checkpointer restores it onto any mesh. Reading for export
is the reverse: a handler returns the opened TensorStore arrays instead of their contents,
and regions are read when asked for.

The handlers use Orbax's public type-handler surface (`NumpyHandler`, `get_json_tspec_write`,
`get_json_tspec_read`, `ParamInfo`); that is the place to look if an Orbax upgrade breaks
conversion.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Iterable

import jax
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts

from jaxtrain.checkpoints.checkpointer import CONVERTED, MANIFEST_KEY
from jaxtrain.checkpoints.fingerprint import BlockFingerprint, leaf_path
from jaxtrain.hf.errors import HFCheckpointError

Blocks = Callable[[], Iterable[tuple[tuple[slice, ...], np.ndarray]]]


class StreamedArray:
    """A checkpoint leaf of `shape` whose data `blocks()` produces as (region, array) pairs
    that tile it; storage chunks are `chunk_shape`, the size of one block."""

    def __init__(self, shape, dtype, chunk_shape, blocks: Blocks):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)
        self.chunk_shape = tuple(chunk_shape)
        self.blocks = blocks


class _StreamingWriter(ocp.type_handlers.NumpyHandler):
    async def serialize(self, values, infos, args=None):
        args = args or [ocp.SaveArgs()] * len(values)
        for value, info, arg in zip(values, infos, args):  # one leaf at a time bounds memory
            await info.await_path_creation()
            if jax.process_index() != 0:
                continue
            spec = ocp.type_handlers.get_json_tspec_write(
                info, use_ocdbt=info.is_ocdbt_checkpoint, global_shape=value.shape,
                local_shape=value.chunk_shape, dtype=value.dtype,
                process_index=jax.process_index() if info.is_ocdbt_checkpoint else None, arg=arg)
            store = await ts.open(ts.Spec(spec), create=True, open=True, context=info.ts_context)
            for region, block in value.blocks():
                await store[region].write(np.asarray(block, value.dtype))
        return []  # everything is on disk already; nothing left to commit in the background


class _LazyArray:
    """Restore type asking the reader below for unread TensorStore arrays."""


class _LazyReader(ocp.type_handlers.NumpyHandler):
    async def deserialize(self, infos, args=None):
        stores = []
        for info in infos:
            spec = ocp.type_handlers.get_json_tspec_read(info, use_ocdbt=info.is_ocdbt_checkpoint)
            stores.append(await ts.open(ts.Spec(spec), open=True, context=info.ts_context))
        return stores


def save_streamed_params(checkpoint_dir: str, step: int, params) -> None:
    """Writes a params-only checkpoint `checkpoint_dir/<step>` from a tree of StreamedArrays, with
    each array's fingerprint in its manifest (computed from the blocks as they are written), so
    the trainer verifies it on restore like any step."""
    registry = ocp.type_handlers.create_type_handler_registry(
        (StreamedArray, _StreamingWriter()),
        (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
    )
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    manager = ocp.CheckpointManager(os.path.abspath(checkpoint_dir), options=options,
                                    item_handlers={"params": ocp.PyTreeCheckpointHandler(type_handler_registry=registry)})
    fingerprints = {}  # filled while the arrays are written, before Orbax commits the step with its metadata
    params = jax.tree_util.tree_map_with_path(lambda path, leaf: _fingerprinted(leaf, f"params/{leaf_path(path)}",
                                                                              fingerprints), params)
    manifest = {"kind": CONVERTED, "items": ["params"], "fingerprints": fingerprints}
    try:
        manager.save(step, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params)), force=True,
                     custom_metadata={MANIFEST_KEY: manifest})
        manager.wait_until_finished()
    finally:
        manager.close()
    _check_manifest_written(os.path.join(os.path.abspath(checkpoint_dir), str(step)), manifest)


def _fingerprinted(leaf: StreamedArray, name: str, fingerprints: dict) -> StreamedArray:
    """`leaf`, its blocks feeding fingerprints[name] as the writer takes them."""
    def blocks():
        fingerprint = BlockFingerprint(leaf.shape)
        for region, block in leaf.blocks():
            block = np.asarray(block, leaf.dtype)  # what is written: the fingerprint of the stored values
            fingerprint.add(region, block)
            yield region, block
        fingerprints[name] = fingerprint.value()

    return StreamedArray(leaf.shape, leaf.dtype, leaf.chunk_shape, blocks)


def _check_manifest_written(step_dir: str, manifest: dict) -> None:
    """Orbax writes the step metadata after the arrays, from the dict it was given: the fingerprints
    filled in meanwhile are in it. Should a release copy that dict up front, put them in now (an
    atomic replace of the metadata file) rather than leave a step that cannot be verified."""
    path = os.path.join(step_dir, "_CHECKPOINT_METADATA")
    with open(path) as f:
        metadata = json.load(f)
    written = metadata.get("custom_metadata", {}).get(MANIFEST_KEY, {})
    if written.get("fingerprints") != manifest["fingerprints"]:
        metadata.setdefault("custom_metadata", {})[MANIFEST_KEY] = manifest
        with open(path + ".tmp", "w") as f:
            json.dump(metadata, f)
        os.replace(path + ".tmp", path)


class CheckpointSource:
    """The params of `checkpoint_dir/<step>`, read from disk only as `region` asks for them."""

    def __init__(self, checkpoint_dir: str, step: int, abstract_params: dict):
        item = os.path.join(os.path.abspath(checkpoint_dir), str(step), "params")
        if not os.path.isdir(item):
            raise HFCheckpointError(f"checkpoint {checkpoint_dir}/{step} has no params item")
        registry = ocp.type_handlers.create_type_handler_registry(
            (_LazyArray, _LazyReader()),
            (jax.Array, ocp.type_handlers.get_type_handler(jax.Array)),
        )
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=_LazyArray), abstract_params)
        checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(type_handler_registry=registry))
        try:
            stores = checkpointer.restore(item, args=ocp.args.PyTreeRestore(restore_args=restore_args))
        except (KeyError, ValueError, FileNotFoundError) as e:
            raise HFCheckpointError(f"{item}: cannot open the params the config describes: {e}") from e
        finally:
            checkpointer.close()
        self.stores = {}
        for path, store in jax.tree_util.tree_leaves_with_path(stores):
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            self.stores[name] = store
        for path, expected in jax.tree_util.tree_leaves_with_path(abstract_params):
            name = "/".join(str(getattr(k, "key", k)) for k in path)
            got = tuple(self.stores[name].shape) if name in self.stores else None
            if got != tuple(expected.shape):
                raise HFCheckpointError(f"{item}: parameter {name} has shape {got}, but the config implies "
                                        f"{tuple(expected.shape)}")

    def region(self, path: str, index: tuple[int, ...], slices: tuple[slice, ...]) -> np.ndarray:
        return self.stores[path][tuple(index) + tuple(slices)].read().result()
