"""What one layer of each kind keeps for its backward pass, read from the model itself.

For every layer kind of a model (models/stage_program.layer_stacks: a LayerStack, or one kind of
a PatternStack), one layer's forward is traced with `jax.vjp` on abstract inputs — nothing is
computed or allocated — and the residuals autodiff keeps for the backward pass are read off the
returned function, under each remat policy. Tracing at two sequence lengths separates each
residual into a part that grows with the tokens (activations) and a part that does not (the
layer's weights cast to the compute dtype). A residual is split over `tensor` when one of its
(fixed) dimensions has the size of a parameter dimension the rule tables put on `tensor`
(heads, mlp, ssm heads, ...). So the planner's activation figures come from the layers' own
code and shapes, not from a table kept beside them.

A residual that is a parameter itself (float32, a parameter's shape) is not counted: the
weights are arguments of the step, counted with the state.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.rules import RULE_SETS
from jaxtrain.models.layers.moe import MoEBlock
from jaxtrain.models.layers.params import logical_axes
from jaxtrain.models.layers.stack import REMAT_POLICIES
from jaxtrain.models.stage_program import layer_sequence, layer_stacks

# Lengths the layers are traced at: multiples of every block and chunk size the layers use
# (attention blocks, SSD chunks), and unlike any model dimension in practice.
PROBE_LENGTHS = (3 * 1024, 6 * 1024)


@dataclasses.dataclass(frozen=True)
class Residual:
    fixed_bytes: float  # bytes that do not grow with the tokens (e.g. a weight cast to bf16)
    token_bytes: float  # bytes per token of the batch
    square_bytes: float  # bytes per (query, key) pair of a row: scores kept whole (e.g. attention under `dots`)
    tensor_split: bool  # one of its dimensions is split over `tensor`
    itemsize: int  # bytes of one element as traced
    # Without remat, a token residual in a 2-byte compute dtype without a tensor-split dimension
    # is a matmul's input (the normed stream cast for the projections, MLA's latent and rotary
    # key): under sequence parallelism it is the all-gathered sequence, whole on every device
    # (the float32 residual stream around the norms stays split). Under the dots policies such
    # residuals are matmul outputs, reduce-scattered: split.
    gathered_input: bool = False

    def per_device(self, shape: "TokenShape") -> float:
        """Bytes on one device holding `shape.rows` rows of `shape.length` of the sequence's
        `shape.full_length` positions."""
        split = self.tensor_split or (shape.sequence_parallel and self.token_bytes and not self.fixed_bytes
                                      and not self.gathered_input)
        widen = 2 if shape.widen_half and self.itemsize == 2 else 1
        grows = self.token_bytes * shape.rows * shape.length + self.square_bytes * shape.rows * shape.length * shape.full_length
        return (self.fixed_bytes + grows * widen) / (shape.tensor if split else 1)


@dataclasses.dataclass(frozen=True)
class TokenShape:
    """The tokens one device holds in one layer: rows x length of the sequence's full_length."""
    rows: float
    length: float
    full_length: float
    tensor: int = 1
    sequence_parallel: bool = False  # the residual stream also split over tensor
    widen_half: bool = False  # 2-byte floats held as float32 (XLA:CPU computes bf16 in f32)


@dataclasses.dataclass(frozen=True)
class LayerKind:
    kind: tuple  # the kind's path in the parameter tree, e.g. ("stacks", "moe_blocks")
    count: int  # layers of this kind
    in_pattern: bool  # one kind of a PatternStack (a switch over kinds: see saved_bytes)
    params: int  # parameters of one layer
    param_bytes: int  # their bytes (float32)
    tensor_params: int  # parameters of one layer split over tensor (heads, mlp, ... dims)
    top_k: int  # experts each token is routed to (0: no routed experts)
    capacity_factor: float | None  # the router's capacity factor (None: dropless)
    residuals: dict  # remat policy -> tuple[Residual, ...] kept across the layer's backward

    def bytes(self, policy: str, shape: TokenShape) -> float:
        """Residual bytes of one layer on one device (Residual.per_device)."""
        return sum(r.per_device(shape) for r in self.residuals[policy])


@dataclasses.dataclass(frozen=True)
class ModelProfile:
    kinds: tuple[LayerKind, ...]
    sequence: tuple[tuple, ...]  # the kind of every layer, in model order
    embed: int
    vocab: int
    compute_itemsize: int  # bytes of one element of the residual stream
    non_layer_params: int  # embedding, head, final norm

    def kind(self, path: tuple) -> LayerKind:
        return next(k for k in self.kinds if k.kind == path)


def _tensor_names() -> set[str]:
    """Logical names some rule table puts on the tensor axis (parameters or activations)."""
    names = set()
    for rules in RULE_SETS.values():
        for table in (rules.params, rules.activations):
            names |= {n for n, axes in table.items() if "tensor" in axes}
    return names


def _layer_fn(stack):
    graphdef, state = nnx.split(stack.layers)
    one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:], a.dtype), state)

    def apply(weights, x, positions, segment_ids):
        y, _ = nnx.merge(graphdef, weights)(x, positions, segment_ids)
        return y

    return apply, one, state


def _residual_avals(apply, weights, embed: int, length: int, dtype, policy):
    fn = apply if policy is None else jax.checkpoint(apply, policy=policy, prevent_cse=False)
    x = jax.ShapeDtypeStruct((1, length, embed), dtype)
    ids = jax.ShapeDtypeStruct((1, length), jnp.int32)
    vjp = jax.eval_shape(lambda w, h, p, s: jax.vjp(lambda w_, h_: fn(w_, h_, p, s), w, h)[1], weights, x, ids, ids)
    return jax.tree.leaves(vjp)


def _profile_kind(path, stack, count: int, in_pattern: bool, embed: int, dtype, tensor_names: set) -> LayerKind:
    apply, one, stacked = _layer_fn(stack)
    flat = nnx.to_flat_state(stacked)
    param_shapes = {(tuple(v.shape[1:]), jnp.dtype(v.dtype)) for _, v in flat}
    tensor_sizes = set()
    tensor_params = 0
    for _, v in flat:
        names = logical_axes(v)[1:]
        split = [size for name, size in zip(names, v.shape[1:]) if name in tensor_names and size > 1]
        tensor_sizes.update(split)
        tensor_params += math.prod(v.shape[1:]) if split else 0
    params = sum(math.prod(v.shape[1:]) for _, v in flat)
    param_bytes = sum(math.prod(v.shape[1:]) * jnp.dtype(v.dtype).itemsize for _, v in flat)
    short, long = PROBE_LENGTHS
    residuals = {}
    for name, policy in REMAT_POLICIES.items():
        a = _residual_avals(apply, one, embed, short, dtype, policy)
        b = _residual_avals(apply, one, embed, long, dtype, policy)
        if len(a) != len(b):  # a layer whose residual structure changes with length: no linear fit
            raise ValueError(f"layer kind {'/'.join(path)}: residuals differ between lengths {short} and {long}")
        out = []
        for ra, rb in zip(a, b):
            if (tuple(ra.shape), jnp.dtype(ra.dtype)) in param_shapes:
                continue  # the layer's own weights: arguments of the step
            size_a = math.prod(ra.shape) * jnp.dtype(ra.dtype).itemsize
            size_b = math.prod(rb.shape) * jnp.dtype(rb.dtype).itemsize
            fixed_dims = [d for d, e in zip(ra.shape, rb.shape) if d == e]
            growing = len(ra.shape) - len(fixed_dims)
            if growing >= 2:  # [.., queries, keys]: quadratic in the length
                fixed, per_token, square = 0.0, 0.0, size_a / short ** 2
            else:
                per_token = (size_b - size_a) / (long - short)
                fixed, square = max(size_a - per_token * short, 0.0), 0.0
            itemsize = jnp.dtype(ra.dtype).itemsize
            out.append(Residual(fixed, per_token, square, any(d in tensor_sizes for d in fixed_dims), itemsize,
                                gathered_input=name == "none" and itemsize == 2 and not fixed))
        residuals[name] = tuple(out)
    routers = [node.cfg for _, node in nnx.iter_graph(stack.layers) if isinstance(node, MoEBlock)]
    top_k = max((r.top_k for r in routers), default=0)
    capacity = routers[0].capacity_factor if routers else None
    return LayerKind(path, count, in_pattern, params, param_bytes, tensor_params, top_k, capacity, residuals)


def pipelined_policy(policy: str, passes: int) -> str:
    """The remat policy a layer effectively runs under inside a pipeline stage. The stage
    program is vmapped over the stages, which gives every matmul a batch dimension: the policies
    that save only matmuls without one (`dots_no_batch`, `offload_dots`) then save nothing, as
    `full`. With several passes (interleaved) a layer without remat runs under `dots`
    (models/stage_program.py)."""
    if policy in ("dots_no_batch", "offload_dots"):
        return "full"
    return "dots" if passes > 1 and policy == "none" else policy


@functools.lru_cache(maxsize=16)
def profile_model(model_cfg) -> ModelProfile:
    """The ModelProfile of a model config (frozen dataclass: cached per config)."""
    model = nnx.eval_shape(lambda: model_cfg.build(nnx.Rngs(0)))
    stacks = layer_stacks(model)
    sequence = tuple(kind for kind, _ in layer_sequence(model))
    dtype = jnp.dtype(getattr(model_cfg, "dtype", "float32") or "float32")
    embed = int(model.embed.table.shape[1])
    vocab = int(model.embed.table.shape[0])
    tensor_names = _tensor_names()
    kinds = tuple(_profile_kind(path, stack, sequence.count(path), len(path) > 2, embed, dtype, tensor_names)
                  for path, stack in stacks.items())
    total = sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(model))))
    in_layers = sum(k.params * k.count for k in kinds)
    return ModelProfile(kinds, sequence, embed, vocab, dtype.itemsize, total - in_layers)
