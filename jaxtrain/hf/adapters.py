"""A LoRA run's adapters (models/lora.py) -> Hugging Face: a peft adapter directory, or merged
into the base's weights as a full model directory.

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


def peft_tensors(plan: ExportPlan, params: dict) -> tuple[dict[str, np.ndarray], list[str]]:
    """({peft tensor name: array}, target module names) for the adapters in `params`."""
    tensors, modules = {}, set()
    for kernel_path, (a, b) in adapter_pairs(params).items():
        leaf = plan.leaves.get(kernel_path)
        if leaf is None or len(leaf.maps) != 1:
            raise ValueError(f"adapter on {kernel_path}: the HF mapping writes it as {len(leaf.maps) if leaf else 0} "
                             f"tensors; adapter export needs one")
        lead, n_in, _ = _split(leaf.shape, a, b)
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
        for index in leaf.stack_indices():
            name = bound.map.hf_name(index)
            if not name.endswith(".weight"):
                raise ValueError(f"adapter on {kernel_path}: HF tensor {name} is not a module's weight")
            module = name[:-len(".weight")]
            modules.add(module.rsplit(".", 1)[-1])
            row = tuple(index)
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(a[row].reshape(fan_in, -1).T)
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(b[row].reshape(-1, fan_out).T)
    return tensors, sorted(modules)


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
