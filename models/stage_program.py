"""A model's layers seen by the pipeline: one sequence of layer kinds, and one stage's program.

A *kind* is the path of a `LayerStack` in the parameter tree: `("stacks", "moe_blocks")` for a
plain stack, `("stacks", "blocks", "moe")` for one kind of a `PatternStack`. Every layer of the
model is (kind, index within its kind), in the order the model applies them.

A stage runs its slots (meshes/pipeline_split.py) as one program, the same on every stage: a
masked scan per run of one kind, or, when its kinds alternate under remat `full`, the kinds
loop: one scan with a switch and the switch's own VJP, over every stage at once
(models/layers/kind_residuals.py: each kind's residuals at its own slots only), which compiles
one layer of each kind (`stage_loop` says why; `PipelineConfig.stage_loop` chooses otherwise:
run by run, or a plain switch).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtrain.meshes.rules import constrain_param
from jaxtrain.meshes.tree_paths import path_keys
from jaxtrain.models.layers.kind_residuals import scan_kinds
from jaxtrain.models.layers.layer_scan import scan_layers
from jaxtrain.models.layers.moe import MoEBlock
from jaxtrain.models.layers.params import LOGICAL_AXES
from jaxtrain.models.layers.pattern_stack import pattern_slots, read_indices
from jaxtrain.models.layers.stack import LayerStack


def layer_stacks(model) -> dict[tuple, LayerStack]:
    """Every LayerStack of a CausalLM by kind path, in order of first use."""
    out = {}
    for name in model.stack_order:
        stack = model.stacks[name]
        if isinstance(stack, LayerStack):
            out[("stacks", name)] = stack
        else:  # a PatternStack: one LayerStack per kind
            for kind in stack.kinds:
                out[("stacks", name, kind)] = stack.stack(kind)
    return out


def layer_sequence(model) -> list[tuple[tuple, int]]:
    """(kind path, index within the kind) of every layer, in the order the model applies them."""
    sequence = []
    for name in model.stack_order:
        stack = model.stacks[name]
        if isinstance(stack, LayerStack):
            sequence += [(("stacks", name), i) for i in range(stack.num_layers)]
        else:
            sequence += [(("stacks", name, kind), i) for kind, i in stack.slots]
    return sequence


def layer_cost(stack: LayerStack) -> float:
    """Parameters one token passes through in one layer of the stack — routed experts count
    top_k / num_experts of theirs: a proxy for the layer's compute, for balancing stages."""
    size = lambda module: sum(x.size for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(module))))
    total = float(size(stack.layers))
    for _, node in nnx.iter_graph(stack.layers):
        if isinstance(node, MoEBlock):
            total -= size(node.experts) * (1 - node.cfg.top_k / node.cfg.num_experts)
    return total / stack.num_layers


# How a stage rematerializes activations (PipelineConfig.remat), on top of the model's own
# per-layer policy (`remat` of its config):
#   none   only the model's policy
#   layer  every layer recomputed in the backward pass (the model's policy, or `full`)
#   stage  only each tick's stage input is kept; the whole stage is recomputed
STAGE_REMAT = ("none", "layer", "stage")
# How a stage loops over its slots: a scan per run of one kind; one scan with a plain switch on the
# kind (sound under remat `full` only: a switch keeps every kind's residuals at every slot); one
# scan with a switch whose own VJP keeps each kind's residuals at its own slots only.
LOOPS = ("runs", "switched", "kinds")


class StageProgram:
    """One stage's forward for one tick: its slots, in the order of the stage's slot pattern, as
    one scan over the slots with a switch on each slot's kind (models/layers/layer_scan.py), so
    the program compiles one layer of each kind however the kinds alternate, or as a scan per
    run of one kind (`stage_loop` chooses). A padding slot's output is discarded (x passes
    through) and its aux is zero.

    Switched, each step slices its slot's layer of every kind out of the stage's weights (with several
    passes of the interleaved schedule, of the current pass), each weight kept in its parameter
    sharding, inside the step's `jax.checkpoint`, whose policy never saves the slices
    (layer_scan.step_policy): the backward slices them again instead of keeping a copy of the
    stage's weights for every slot and tick (the stage's stacks are loop-invariant, so autodiff
    keeps them once). A stage of one kind in one pass scans its weights as the scan's input.
    """

    def __init__(self, model, pattern, passes: int, remat: str = "none", loop: str = "auto"):
        """pattern: the stage's slot pattern, one kind per slot (StagePlan.pattern); `remat`:
        one of STAGE_REMAT (checked with the config by PipelineConfig.validate); `loop`: auto
        (`stage_loop` chooses: what training runs), or one of LOOPS to compare them."""
        if loop not in ("auto",) + LOOPS:
            raise ValueError(f"StageProgram loop must be 'auto' or one of {LOOPS}, got {loop!r}")
        stacks = layer_stacks(model)
        self.kinds = tuple(dict.fromkeys(pattern))
        unknown = [k for k in self.kinds if k not in stacks]
        if unknown:
            raise ValueError(f"stage slot pattern names kinds {unknown} the model does not have: {list(stacks)}")
        self.graphdefs = [nnx.graphdef(stacks[k].layers) for k in self.kinds]
        self.names = [_layer_names(stacks[k]) for k in self.kinds]
        self.slots = pattern_slots(pattern)
        self.runs = pattern_runs(pattern)
        self.passes, self.remat = passes, remat
        self.layer_remat = self._layer_remat({stacks[k].remat for k in self.kinds})
        if passes > 1 and self.layer_remat == "none":  # as the planner assumes (planner/layer_profile.pipelined_policy)
            self.layer_remat = "dots"
        self.loop = stage_loop(pattern, self.layer_remat) if loop == "auto" else loop
        self.by_runs = self.loop == "runs" or len(self.runs) == len(self.kinds)
        # The kinds loop runs over every stage at once (the stage vmap inside each layer): its
        # own VJP cannot be batched by the pipeline's stage vmap (models/layers/kind_residuals.py).
        self.all_stages = self.loop == "kinds" and not self.by_runs

    def _layer_remat(self, policies: set) -> str:
        if len(policies) > 1:
            raise ValueError(f"a pipeline stage runs its layers under one remat policy, but the model's "
                             f"stacks have {sorted(policies)}")
        policy = policies.pop()
        return "full" if self.remat == "layer" and policy == "none" else policy

    def __call__(self, params: dict, valid: dict, repeat, x, positions, segment_ids):
        """params[kind]: the stage's layer state, leaves [passes, slots, ...]; valid[kind]: bool
        [passes, slots]. Returns (x, aux per kind with leaves [slots, ...])."""
        fn = jax.checkpoint(self._apply, prevent_cse=False) if self.remat == "stage" else self._apply
        return fn(params, valid, repeat, x, positions, segment_ids)

    def every_stage(self, params: dict, valid: dict, repeat, x, positions, segment_ids):
        """All stages at once (the kinds loop): every argument with a leading `stages` dimension
        (params[kind] [stages, passes, slots, ...], valid[kind] [stages, passes, slots], repeat
        [stages]). Returns (x [stages, ...], aux per kind with leaves [stages, slots, ...])."""
        fn = jax.checkpoint(self._apply_kinds, prevent_cse=False) if self.remat == "stage" else self._apply_kinds
        return fn(params, valid, repeat, x, positions, segment_ids)

    def _apply_kinds(self, params, valid, repeat, x, positions, segment_ids):
        per_stage = functools.partial(jax.vmap, spmd_axis_name="pipeline")
        if self.passes == 1:
            params, valid = jax.tree.map(lambda a: a[:, 0], params), jax.tree.map(lambda a: a[:, 0], valid)
        else:
            valid = jax.tree.map(lambda v: per_stage(lambda v_, r: v_[r])(v, repeat), valid)
        stacks = [params[k] for k in self.kinds]
        keep = jnp.stack([valid[kind][:, index] for kind, index in self.slots], axis=1)  # [stages, slots]
        ctx = {"keep": keep, "repeat": repeat if self.passes > 1 else None,
               "positions": positions, "segment_ids": segment_ids}

        def take(k, stack, read, ctx):
            one = lambda s, r: _layer_of(s, r, read, self.names[k])
            if ctx["repeat"] is None:
                return per_stage(lambda s: one(s, None))(stack)
            return per_stage(one)(stack, ctx["repeat"])

        def put(k, dstack, read, ctx, dw):
            one = lambda s, r, g: _add_to_layer(s, r, read, g, self.names[k])
            if ctx["repeat"] is None:
                return per_stage(lambda s, g: one(s, None, g))(dstack, dw)
            return per_stage(one)(dstack, ctx["repeat"], dw)

        def apply(k, x, weights, ctx, step):
            def one(x, w, pos, seg, ok):
                y, aux = nnx.merge(self.graphdefs[k], w)(x, pos, seg)
                return jnp.where(ok, y, x), jax.tree.map(lambda a: jnp.where(ok, a, jnp.zeros_like(a)), aux)
            keep = jax.lax.dynamic_index_in_dim(ctx["keep"], step, axis=1, keepdims=False)
            return per_stage(one)(x, weights, ctx["positions"], ctx["segment_ids"], keep)

        reads = jnp.asarray([i for _, i in self.slots], jnp.int32)
        kind_ids = [self.kinds.index(kind) for kind, _ in self.slots]
        x, per_kind = scan_kinds(take, put, apply, x, stacks, ctx, reads, kind_ids, remat=self.layer_remat)
        # occurrences first in the loop, stages first in the pipeline
        per_kind = [jax.tree.map(lambda a: jnp.moveaxis(a, 0, 1), aux) for aux in per_kind]
        return x, dict(zip(self.kinds, per_kind))

    def _apply(self, params, valid, repeat, x, positions, segment_ids):
        if self.passes == 1:  # a static index: no copy of the weights at all
            params, valid, repeat = jax.tree.map(lambda a: a[0], params), jax.tree.map(lambda a: a[0], valid), None
        else:
            valid = jax.tree.map(lambda a: a[repeat], valid)
        stacks = [params[k] for k in self.kinds]
        layers = [lambda carry, weights, g=g: nnx.merge(g, weights)(carry, positions, segment_ids)
                  for g in self.graphdefs]
        if self.by_runs:
            return self._apply_by_runs(stacks, layers, valid, repeat, x)
        # each slot's own validity, in slot order (static gathers of the per-kind masks)
        keep = jnp.stack([valid[kind][index] for kind, index in self.slots])
        kind_ids = [self.kinds.index(kind) for kind, _ in self.slots]
        weights_at = lambda read: tuple(_layer_of(s, repeat, read[k], names)
                                        for k, (s, names) in enumerate(zip(stacks, self.names)))
        x, per_kind = scan_layers(layers, x, read_indices(self.slots, self.kinds), weights_at,
                                  kind_ids=kind_ids, keep=keep, remat=self.layer_remat)
        return x, dict(zip(self.kinds, per_kind))

    def _apply_by_runs(self, stacks, layers, valid, repeat, x):
        """Each kind's one run of slots as a scan of its own, the weights the scan's input
        (one pass) or sliced in the step (several passes)."""
        pieces = {kind: [] for kind in self.kinds}
        for kind, start, length in self.runs:
            k = self.kinds.index(kind)
            keep = valid[kind][start:start + length]
            if repeat is None:
                xs = jax.tree.map(lambda a: jax.lax.slice_in_dim(a, start, start + length), stacks[k])
                x, (aux,) = scan_layers([layers[k]], x, xs, keep=keep, remat=self.layer_remat)
            else:
                weights_at = lambda slot, k=k: (_layer_of(stacks[k], repeat, slot, self.names[k]),)
                x, (aux,) = scan_layers([layers[k]], x, start + jnp.arange(length), weights_at, keep=keep,
                                        remat=self.layer_remat)
            pieces[kind].append(aux)
        return x, {k: jax.tree.map(lambda *a: jnp.concatenate(a), *p) for k, p in pieces.items()}


def pattern_runs(pattern) -> tuple[tuple[str, int, int], ...]:
    """The slot pattern as runs of one kind: (kind, first index within that kind, length)."""
    out, seen = [], {}
    for kind in pattern:
        if out and out[-1][0] == kind:
            out[-1][2] += 1
        else:
            out.append([kind, seen.get(kind, 0), 1])
        seen[kind] = seen.get(kind, 0) + 1
    return tuple(map(tuple, out))


def alternates(kinds_in_order) -> bool:
    """Whether a sequence of layer kinds revisits a kind (several runs of one kind)."""
    return len(pattern_runs(kinds_in_order)) > len(set(kinds_in_order))


def stage_loop(pattern, layer_remat: str) -> str:
    """How a stage runs its slots by default (`PipelineConfig.stage_loop="auto"`): where the kinds
    alternate under remat `full`, the kinds loop (one scan with a switch on the kind and the
    switch's own VJP, each kind's residuals at its own slots only: models/layers/kind_residuals.py);
    otherwise run by run (a scan per run of one kind, the weights the scan's input).

    Why: run by run unrolls a stage's short runs, and XLA hoists their FSDP gathers out of the
    pipeline's tick loop, so the stage's gathered weights are held for the whole step and every
    unrolled layer is compiled. The kinds loop compiles one layer per kind and gathers inside the
    loop, so under remat `full` a full-size hybrid stage holds a fraction of the temp of run by
    run or of a plain switch, and compiles several times faster. Without remat the kinds loop
    writes its residual buffers per tick and holds more than run by run, whose collectives also
    merge across the unrolled layers (fewer rendezvous, which is what a step of simulated CPU
    devices waits on). `python benchmarks/stage_loop_memory.py
    --gin_file=configs/nemotron3_nano_pipeline.gin --layout pipeline=2,data=8,microbatches=2,rules=fsdp
    --loops kinds,runs,switched` compiles the three side by side. `PipelineConfig.stage_loop`
    chooses otherwise."""
    return "kinds" if alternates(pattern) and layer_remat == "full" else "runs"


def _layer_names(stack: LayerStack) -> dict:
    """{path of a weight within one layer: its logical names} (the stack's, less `layers`)."""
    names = {}
    for path, variable in nnx.to_flat_state(nnx.state(stack.layers)):
        axes = variable.get_metadata().get(LOGICAL_AXES)
        names[tuple(path)] = tuple(axes)[1:] if axes is not None else None
    return names


def _layer_of(stack, repeat, index, names: dict):
    """Layer `index` (traced) of a stage's stacked weights (in pass `repeat` when not None), each
    weight kept in its parameter sharding, as PatternStack's `layer_of` does: unconstrained, XLA
    may gather FSDP-sharded weights outside the switch instead of in the branch that uses them."""
    def one(path, a):
        w = a[repeat, index] if repeat is not None else jax.lax.dynamic_index_in_dim(a, index, keepdims=False)
        axes = names.get(path_keys(path))
        return constrain_param(w, axes) if axes is not None else w

    return jax.tree_util.tree_map_with_path(one, stack)


def _add_to_layer(stack, repeat, index, grads, names: dict):
    """`stack` with one layer's `grads` added to the layer _layer_of(stack, repeat, index) reads:
    its transpose, as one layer's work (autodiff's transpose is a zero stack with one row set).
    An index past the end adds nothing (kind_residuals.PAST_END)."""
    def one(path, a, g):
        axes = names.get(path_keys(path))
        g = constrain_param(g, axes) if axes is not None else g
        return (a.at[index] if repeat is None else a.at[repeat, index]).add(g, mode="drop")

    return jax.tree_util.tree_map_with_path(one, stack, grads)
