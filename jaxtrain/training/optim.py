"""AdamW with warmup + decay and global-norm clipping (optax).

Which parameters get weight decay, and which are frozen (set by the train step's own rule, not
by gradients), is declared where each parameter is made (models/layers/params.py OPTIMIZER);
`make_optimizer` takes those roles by parameter path (`optimizer_roles` in training/state.py).
The masks look leaves up by path, so they hold for the canonical and the pipeline-stage layout
alike (both keep the parameter paths)."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax

from jaxtrain.training.state import map_with_path
from jaxtrain.training.trained_params import only_trained, trained_params


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    learning_rate: float = 3e-4  # peak learning rate, reached after the warmup
    warmup_steps: int = 100  # linear warmup from zero
    decay: str = "cosine"  # cosine | linear | constant
    min_lr_ratio: float = 0.1  # final learning rate as a fraction of the peak
    b1: float = 0.9  # AdamW's first-moment decay
    b2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator term
    weight_decay: float = 0.1  # decoupled, on weight matrices only (norms and biases are exempt)
    clip_norm: float | None = 1.0  # global gradient-norm clip (None: no clipping)


def make_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    if cfg.warmup_steps < 0 or cfg.learning_rate <= 0:
        raise ValueError(f"need warmup_steps >= 0 and learning_rate > 0, got {cfg}")
    warmup = min(cfg.warmup_steps, total_steps)
    decay_steps = max(total_steps - warmup, 1)
    peak, end = cfg.learning_rate, cfg.learning_rate * cfg.min_lr_ratio
    decays = {
        "cosine": lambda: optax.cosine_decay_schedule(peak, decay_steps, alpha=cfg.min_lr_ratio),
        "linear": lambda: optax.linear_schedule(peak, end, decay_steps),
        "constant": lambda: optax.constant_schedule(peak),
    }
    if cfg.decay not in decays:
        raise ValueError(f"unknown learning-rate decay {cfg.decay!r}; choose one of {sorted(decays)}")
    ramp = optax.linear_schedule(peak / max(warmup, 1), peak, max(warmup - 1, 1))
    return optax.join_schedules([ramp, decays[cfg.decay]()], [warmup]) if warmup else decays[cfg.decay]()


def _role_mask(roles: dict, wanted: tuple[str, ...]):
    """A mask over a params tree: True where the leaf's role (by path; "decay" if unlisted) is wanted."""
    def mask(params):
        return map_with_path(lambda path, _: roles.get(path, "decay") in wanted, params)
    return mask


def make_optimizer(cfg: OptimizerConfig, total_steps: int, roles: dict | None = None
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """`roles`: {parameter path: "decay" | "no_decay" | "frozen" | "untrained"}; None treats every parameter
    as "decay" (the optimizer state's structure does not depend on it)."""
    roles = roles or {}
    schedule = make_schedule(cfg, total_steps)
    adamw = optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=_role_mask(roles, ("decay",)))
    frozen = optax.masked(optax.set_to_zero(), _role_mask(roles, ("frozen",)))
    clip = [clip_by_global_norm(cfg.clip_norm)] if cfg.clip_norm else []
    # parameters declared "untrained" get no optimizer state at all (jaxtrain/training/trained_params.py)
    return only_trained(optax.chain(*clip, adamw, frozen), trained_params(roles)), schedule


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """Global-norm clipping (Pascanu et al. 2012; optax.clip_by_global_norm's rule and state)
    that takes the norm the train step already reduced (`tx.update(..., global_norm=n)`): computed
    here it would be one more all-reduce per leaf group, twice a step (the non-finite guard runs
    the update twice). Without it, the norm of `updates`."""
    def update_fn(updates, state, params=None, *, global_norm=None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if global_norm is None else global_norm
        keep = jnp.squeeze(norm < max_norm)
        return jax.tree.map(lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm), updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
