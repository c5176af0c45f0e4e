"""A LoRA run's adapters (models/lora.py) -> Hugging Face: a peft adapter directory, or merged
into the base's weights as a full model directory; and back: a peft adapter directory as our
adapters, to continue training them.

Names come from the family's tensor table (jaxtrain/hf/families/): the adapter of a Dense goes to
the HF module its kernel is written as, so `stacks/blocks/layers/attn/q/adapter/{a,b}` row i is
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_{A,B}.weight`. peft stores lora_A as
[rank, in] and lora_B as [out, rank], `in` and `out` flattened as the HF weight [out, in] is:
that is our A [in..., rank] and B [rank, out...] flattened and transposed, when the kernel's map
only transposes and merges axes. Each kernel's map is checked to be such (written once on an
index array); another (a fused or permuted tensor) is refused by name rather than guessed.
"""
from __future__ import annotations

import json
import math
import os

import numpy as np

from jaxtrain.hf.exporter import ExportPlan
from jaxtrain.hf.trees import flatten, unflatten

ADAPTER = "adapter"
PEFT_PREFIX = "base_model.model."


def adapter_pairs(params: dict) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{kernel path: (A, B)} of every adapter in a params tree."""
    flat = flatten(params)
    suffix = f"/{ADAPTER}/a"
    return {path[:-len(suffix)] + "/kernel": (np.asarray(flat[path]), np.asarray(flat[path[:-1] + "b"]))
            for path in flat if path.endswith(suffix)}


def _split(kernel_shape, a, b) -> tuple[int, int, int]:
    """(leading stack axes, input axes, output axes) of an adapted kernel."""
    lead = a.ndim + b.ndim - len(kernel_shape) - 2
    return lead, a.ndim - lead - 1, b.ndim - lead - 1


def merged(params: dict, scale: float) -> dict:
    """`params` with each adapted kernel replaced by kernel + scale * A @ B (computed in float32,
    stored in the kernel's dtype) and the adapters dropped: the base's structure."""
    flat = flatten(params)
    for kernel_path, (a, b) in adapter_pairs(params).items():
        kernel = np.asarray(flat[kernel_path])
        lead, n_in, n_out = _split(kernel.shape, a, b)
        stack = kernel.shape[:lead]
        a3 = a.astype(np.float32).reshape(math.prod(stack), -1, a.shape[-1])
        b3 = b.astype(np.float32).reshape(math.prod(stack), b.shape[lead], -1)
        delta = np.einsum("lir,lro->lio", a3, b3).reshape(kernel.shape)
        flat[kernel_path] = (kernel.astype(np.float32) + scale * delta).astype(kernel.dtype)
    return unflatten({p: v for p, v in flat.items() if f"/{ADAPTER}/" not in p})


class _IndexSource:
    """Regions of an index array (its low or high 20 bits: exact in any float the export writes):
    where an export writes each element."""

    def __init__(self, shape, high: bool):
        self.shape, self.high = shape, high

    def region(self, path, index, slices):
        ids = np.arange(math.prod(self.shape), dtype=np.int64).reshape(self.shape)[tuple(slices)]
        return (ids >> 20) if self.high else (ids & (2 ** 20 - 1))


def _written_index(plan: ExportPlan, name: str, shape) -> np.ndarray:
    low, high = (plan.build(name, _IndexSource(shape, h)).astype(np.int64) for h in (False, True))
    return (high << 20) | low


def _modules(plan: ExportPlan, kernel_path: str, a_shape, b_shape) -> tuple[int, int, list[tuple[tuple, str]]]:
    """(fan in, fan out, [(stack index, HF module)]) of the adapter on `kernel_path`: the module
    each row of the stacked factors belongs to. A kernel written as anything but one module's
    weight, transposed and with axes merged, is refused naming it."""
    leaf = plan.leaves.get(kernel_path)
    if leaf is None or len(leaf.maps) != 1:
        raise ValueError(f"adapter on {kernel_path}: the HF mapping writes it as {len(leaf.maps) if leaf else 0} "
                         f"tensors; adapter export needs one")
    lead, n_in, _ = _split(leaf.shape, np.empty(a_shape, np.int8), np.empty(b_shape, np.int8))
    layer = leaf.layer_shape
    fan_in, fan_out = math.prod(layer[:n_in]), math.prod(layer[n_in:])
    bound = leaf.maps[0]
    first = bound.map.hf_name(next(iter(leaf.stack_indices())))
    if len(plan.parts[first]) != 1 or bound.map.hf_slice or bound.map.ours_slice:
        raise ValueError(f"adapter on {kernel_path}: its HF tensor {first} is fused with others; adapter "
                         f"export for fused tensors is not supported")
    written = _written_index(plan, first, layer)
    expected = np.arange(fan_in * fan_out).reshape(fan_in, fan_out).T
    if written.shape != expected.shape or not np.array_equal(written, expected):
        raise ValueError(f"adapter on {kernel_path}: its HF tensor {first} is a rearrangement other than a "
                         f"transpose; adapter export for it is not supported")
    rows = []
    for index in leaf.stack_indices():
        name = bound.map.hf_name(index)
        if not name.endswith(".weight"):
            raise ValueError(f"adapter on {kernel_path}: HF tensor {name} is not a module's weight")
        rows.append((tuple(index), name[:-len(".weight")]))
    return fan_in, fan_out, rows


def peft_tensors(plan: ExportPlan, params: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    """({peft tensor name: array}, target module names) for the adapters in `params`."""
    tensors, modules = {}, set()
    for kernel_path, (a, b) in adapter_pairs(params).items():
        fan_in, fan_out, rows = _modules(plan, kernel_path, a.shape, b.shape)
        for row, module in rows:
            modules.add(module.rsplit(".", 1)[-1])
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a[row].reshape(fan_in, -1).T)
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b[row].reshape(-1, fan_out).T)
    return tensors, sorted(modules)


def peft_modules(plan: ExportPlan, shapes: dict[str, tuple[tuple, tuple]]) -> dict[str, set[str]]:
    """{kernel path: the HF modules its adapter rows are} for adapters of the given shapes
    ({kernel path: (A's shape, B's shape)})."""
    return {path: {module for _, module in _modules(plan, path, a, b)[2]} for path, (a, b) in shapes.items()}


def adapters_from_peft(plan: ExportPlan, shapes: dict[str, tuple[tuple, tuple]], tensors: dict) -> dict[str, tuple]:
    """{kernel path: (A, B)} in our layout from peft's tensors (peft_tensors inverted); a tensor
    of the wrong shape is refused naming it."""
    out = {}
    for kernel_path, (a_shape, b_shape) in shapes.items():
        fan_in, fan_out, rows = _modules(plan, kernel_path, a_shape, b_shape)
        a, b = np.zeros(a_shape, np.float32), np.zeros(b_shape, np.float32)
        rank = a_shape[-1]
        for row, module in rows:  # peft: A [rank, in], B [out, rank]
            for factor, target, shape in (("A", a, (rank, fan_in)), ("B", b, (fan_out, rank))):
                name = f"{PEFT_PREFIX}{module}.lora_{factor}.weight"
                value = np.asarray(tensors[name], np.float32)
                if value.shape != shape:
                    raise ValueError(f"{name} has shape {value.shape}; this model and rank need {shape}")
                target[row] = value.T.reshape(target[row].shape)
        out[kernel_path] = (a, b)
    return out


def write_peft_dir(directory: str, tensors: dict, modules: list[str], lora, base_name: str) -> None:
    """adapter_config.json + adapter_model.safetensors, as peft's save_pretrained writes them."""
    from safetensors.numpy import save_file

    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank, "lora_alpha": lora.alpha,
              "lora_dropout": lora.dropout, "target_modules": modules, "use_rslora": lora.use_rslora,
              "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "init_lora_weights": True,
              "base_model_name_or_path": base_name}
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "adapter_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
