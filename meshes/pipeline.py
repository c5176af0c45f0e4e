"""Pipeline parallelism inside one SPMD program, over the `pipeline` mesh axis.

Stage parameters carry a leading `stages` dimension split over `pipeline`, so each pipeline
group of devices holds only its own stage's layers. Every tick, all stages apply their chunk of
layers to their current microbatch at once — the stage function is `vmap`ped over that
dimension with `spmd_axis_name="pipeline"`, so inside it every sharding constraint and every
nested `shard_map` (expert parallelism) gains the pipeline axis on the stage dimension — and
then the activations move one stage on: `jnp.roll` over the pipeline-sharded dimension, which
XLA lowers to a collective permute. Autodiff of the tick loop is the backward pipeline.

Per stage a buffer of M microbatch activations serves two purposes: on the first stage it
holds the outputs that loop back from the last stage for the next pass (interleaved
schedule), on the last stage it collects the final outputs. Ticks in the bubble compute on
stale data whose results are never used (all stages run one program).
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp

from jaxtrain.meshes.rules import constrain


def run_pipeline(stage_fn: Callable, stage_params, inputs, side: Sequence, schedule, *, stages: int,
                 names: tuple = ("batch", "residual_length", "embed"), all_stages: bool = False):
    """Runs every microbatch through all stages (and all passes of the schedule).

    stage_fn(params, repeat, x, *side_mb) -> (y, aux): one stage's chunk for pass `repeat`;
    `params` are that stage's (the leading stages dim removed). inputs: [M, *x] activations
    entering the first stage; side: per-microbatch arrays [M, ...] (positions, segment ids)
    handed to each stage with its microbatch; names: logical names of x's dims.
    Returns (outputs [M, *x] from the last stage's last pass, aux summed over microbatches
    per stage and pass: leaves [stages, repeats, ...]).

    all_stages: stage_fn takes every stage's arguments at once (a leading `stages` dimension on
    each) and vmaps what it must itself: a stage whose loop has its own VJP (a `jax.vjp` traced
    inside it) cannot be batched by the stage vmap (models/layers/kind_residuals.py).
    """
    m_count, repeats = inputs.shape[0], schedule.virtual_stages
    x_shape = inputs.shape[1:]
    act = ("stages",) + tuple(names)
    buf_names = ("stages", None) + tuple(names)
    per_stage = functools.partial(jax.vmap, spmd_axis_name="pipeline")
    x_struct = jax.ShapeDtypeStruct(x_shape, inputs.dtype)
    side_structs = [jax.ShapeDtypeStruct(a.shape[1:], a.dtype) for a in side]
    if all_stages:
        every = lambda s: jax.ShapeDtypeStruct((stages,) + s.shape, s.dtype)
        aux_shape = jax.eval_shape(lambda p, x, s: stage_fn(p, jnp.zeros((stages,), jnp.int32), x, *s)[1],
                                   stage_params, every(x_struct), [every(s) for s in side_structs])
        aux_shape = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape[1:], s.dtype), aux_shape)
    else:
        one_stage = jax.tree.map(lambda a: a[0], stage_params)
        aux_shape = jax.eval_shape(lambda p, x, s: stage_fn(p, 0, x, *s)[1], one_stage, x_struct, side_structs)
    aux_zero = jax.tree.map(lambda s: jnp.zeros((stages, repeats) + s.shape, s.dtype), aux_shape)

    def before(stage, recv, buf, tick):
        """One stage's input this tick: (x, microbatch, pass, valid, buf, side rows)."""
        if repeats > 1:  # the first stage files the output that just came round from the last one
            k_in = tick - stages
            slot = jnp.mod(k_in, m_count)
            again = (stage == 0) & (k_in >= 0) & (k_in < m_count * (repeats - 1))
            buf = buf.at[slot].set(jnp.where(again, recv, buf[slot]))
        mb, repeat, valid = schedule.work(stage, tick, m_count)
        first = inputs[mb] if repeats == 1 else jnp.where(repeat == 0, inputs[mb], buf[mb])
        x = jnp.where(stage == 0, first, recv)
        return x, mb, repeat, valid, buf, [a[mb] for a in side]

    def after(stage, y, aux, mb, repeat, valid, buf, acc):
        done = (stage == stages - 1) & valid & (repeat == repeats - 1)
        buf = buf.at[mb].set(jnp.where(done, y, buf[mb]))
        acc = jax.tree.map(lambda total, a: total.at[repeat].add(jnp.where(valid, a, jnp.zeros_like(a))), acc, aux)
        return buf, acc

    def stage_tick(params, stage, recv, buf, acc, tick):
        x, mb, repeat, valid, buf, side_mb = before(stage, recv, buf, tick)
        y, aux = stage_fn(params, repeat, x, *side_mb)
        buf, acc = after(stage, y, aux, mb, repeat, valid, buf, acc)
        return y, buf, acc

    def every_stage_tick(params, stage, recv, buf, acc, tick):
        x, mb, repeat, valid, buf, side_mb = per_stage(before, in_axes=(0, 0, 0, None))(stage, recv, buf, tick)
        y, aux = stage_fn(params, repeat, x, *side_mb)
        buf, acc = per_stage(after)(stage, y, aux, mb, repeat, valid, buf, acc)
        return y, buf, acc

    all_stages_tick = every_stage_tick if all_stages else per_stage(stage_tick, in_axes=(0, 0, 0, 0, 0, None))
    stage_ids = jnp.arange(stages)

    def tick(carry, t):
        recv, buf, acc = carry
        y, buf, acc = all_stages_tick(stage_params, stage_ids, recv, buf, acc, t)
        recv = constrain(jnp.roll(y, 1, axis=0), act)  # stage s's output becomes stage s+1's input
        return (recv, constrain(buf, buf_names), acc), None

    recv = constrain(jnp.zeros((stages,) + x_shape, inputs.dtype), act)
    buf = constrain(jnp.zeros((stages, m_count) + x_shape, inputs.dtype), buf_names)
    (_, buf, acc), _ = jax.lax.scan(tick, (recv, buf, aux_zero), jnp.arange(schedule.ticks(stages, m_count)))
    return buf[stages - 1], acc
