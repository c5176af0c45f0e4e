"""The jitted train and eval steps.

The loss is the token-mean cross-entropy over the whole global batch. With gradient
accumulation each microbatch contributes (sum of its token losses) / (tokens in the whole
batch), so the accumulated gradient equals the one-batch gradient exactly.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshes.rules import RuleSet, constrain, named_sharding, use_rules
from models.loss import chunked_cross_entropy

BATCH_KEYS = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
ROW = ("batch", "length")


def batch_shardings(mesh, rules: RuleSet, global_batch: int, seq_len: int) -> dict:
    s = named_sharding(mesh, ROW, (global_batch, seq_len), rules.activations)
    return {k: s for k in BATCH_KEYS}


def _forward_sums(graphdef, params, batch, *, loss_chunk, z_loss):
    model = nnx.merge(graphdef, params)
    hidden, aux = model.hidden(batch["inputs"], batch["positions"], batch["segment_ids"])
    nll, z, correct = chunked_cross_entropy(model.logits, hidden, batch["targets"], batch["loss_mask"],
                                            chunk=loss_chunk, z_loss=z_loss)
    return nll, z, correct


def _split_microbatches(batch, microbatches: int):
    """[B, L] -> [m, B/m, L], microbatch i taking rows i, i+m, ... so that every data shard
    contributes to every microbatch and no rows move between devices."""
    def split(x):
        b = x.shape[0]
        x = x.reshape((b // microbatches, microbatches) + x.shape[1:])
        return constrain(jnp.swapaxes(x, 0, 1), (None,) + ROW)
    return jax.tree.map(split, batch)


def make_train_step(graphdef, tx, schedule, *, mesh, rules: RuleSet, state_shardings, batch_sharding,
                    microbatches: int, loss_chunk: int, z_loss: float):
    def loss_fn(params, mb, total_tokens):
        nll, z, correct = _forward_sums(graphdef, params, mb, loss_chunk=loss_chunk, z_loss=z_loss)
        return (nll + z) / total_tokens, (nll, z, correct)

    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def step(state, batch):
        with use_rules(mesh, rules):
            params = state["params"]
            total_tokens = jnp.maximum(batch["loss_mask"].sum(), 1.0)
            if microbatches == 1:
                (_, sums), grads = grad_fn(params, batch, total_tokens)
            else:
                def accumulate(carry, mb):
                    grads_acc, sums_acc = carry
                    (_, sums), grads = grad_fn(params, mb, total_tokens)
                    return (jax.tree.map(jnp.add, grads_acc, grads), jax.tree.map(jnp.add, sums_acc, sums)), None

                zeros = (jax.tree.map(jnp.zeros_like, params), (jnp.zeros(()),) * 3)
                (grads, sums), _ = jax.lax.scan(accumulate, zeros, _split_microbatches(batch, microbatches))
            updates, opt_state = tx.update(grads, state["opt_state"], params)
            new_params = optax.apply_updates(params, updates)
        nll, z, correct = sums
        metrics = {
            "loss": nll / total_tokens,
            "z_loss": z / total_tokens,
            "accuracy": correct / total_tokens,
            "grad_norm": optax.global_norm(grads),
            "param_norm": optax.global_norm(new_params),
            "learning_rate": schedule(state["step"]),
            "loss_tokens": total_tokens,
        }
        return {"step": state["step"] + 1, "params": new_params, "opt_state": opt_state}, metrics

    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                   out_shardings=(state_shardings, replicated), donate_argnums=(0,))


def make_eval_step(graphdef, *, mesh, rules: RuleSet, params_shardings, batch_sharding, loss_chunk: int):
    """Sums (nll, tokens, correct) over a batch; callers divide after summing batches."""
    def step(params, batch):
        with use_rules(mesh, rules):
            nll, _, correct = _forward_sums(graphdef, params, batch, loss_chunk=loss_chunk, z_loss=0.0)
        return {"nll": nll, "tokens": batch["loss_mask"].sum(), "correct": correct}

    return jax.jit(step, in_shardings=(params_shardings, batch_sharding),
                   out_shardings=NamedSharding(mesh, PartitionSpec()))
