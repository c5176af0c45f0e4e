"""A config change never throws a good checkpoint away, and nothing unverified is trained on:
the saved optimizer structure is compared with the new one before any restore (carried over
where only chain positions moved, refused by name otherwise, never moved aside); a step without
a manifest is refused unless allowed; fingerprints see swapped rows and layers; the roles each
parameter had are recorded. On tiny trees, in process."""
from __future__ import annotations

import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from jaxtrain.checkpoints.checkpointer import (Checkpointer, CorruptCheckpoint, IncompatibleCheckpoint,
                                               UnverifiedCheckpoint)
from jaxtrain.checkpoints.compatibility import describe_differences, moved_leaves, roles_changed_line
from jaxtrain.checkpoints.fingerprint import BlockFingerprint, tree_fingerprints
from jaxtrain.training.optim import OptimizerConfig, make_optimizer

pytestmark = [pytest.mark.slow]

MESH = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def sharding_of(x):
    """Rows over `data` where they divide (a layout to restore into), replicated otherwise."""
    spec = PartitionSpec("data") if x.ndim and x.shape[0] % 4 == 0 else PartitionSpec()
    return NamedSharding(MESH, spec)


def random_params(seed: int) -> dict:
    k = jax.random.split(jax.random.key(seed), 3)
    return {"w": jax.random.normal(k[0], (16, 8)), "bias": jax.random.normal(k[1], (8,)),
            "stack": jax.random.normal(k[2], (2, 8, 8))}  # two stacked layers


def trained_state(tx, seed: int = 0) -> dict:
    """Params and an optimizer state after two updates (Adam moments not zero)."""
    params = random_params(seed)
    opt_state = tx.init(params)
    for i in range(2):
        grads = jax.tree.map(lambda p: jnp.sin(p * (i + 2.0)), params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
    return {"params": params, "opt_state": opt_state}


def abstract_of(tx) -> dict:
    params = jax.eval_shape(lambda: random_params(0))
    tree = {"params": params, "opt_state": jax.eval_shape(tx.init, params)}
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_of(a)), tree)


def adamw(clip_norm):
    return make_optimizer(OptimizerConfig(warmup_steps=0, clip_norm=clip_norm), 10)[0]


def save(directory, step: int, state: dict, **kw) -> None:
    checkpointer = Checkpointer(str(directory), async_save=False, **kw)
    checkpointer.save(step, state)
    checkpointer.close()


def restore_latest(directory, abstract, **kw):
    checkpointer = Checkpointer(str(directory), async_save=False)
    try:
        return checkpointer.restore_latest(abstract, **kw)
    finally:
        checkpointer.close()


def assert_trees_equal(got, want):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        g, w = np.asarray(jax.device_get(g)), np.asarray(jax.device_get(w))
        assert np.isfinite(g).all()
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("saved_clip, now_clip", [(1.0, None), (None, 1.0)])
def test_clipping_switched_carries_the_adam_moments_over_with_one_line(tmp_path, capsys, saved_clip, now_clip):
    saved = trained_state(adamw(saved_clip))
    save(tmp_path / "ck", 2, saved)
    now_tx = adamw(now_clip)
    step, restored, _ = restore_latest(tmp_path / "ck", abstract_of(now_tx))
    assert step == 2
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(abstract_of(now_tx)["opt_state"])
    # Clipping's state is empty: the saved leaves (counts, mu, nu) are the new state's, in the same order.
    assert_trees_equal(restored["opt_state"], saved["opt_state"])
    lines = [line for line in capsys.readouterr().err.splitlines() if "carried over" in line]
    assert len(lines) == 1 and lines[0].startswith("note: step 2: opt_state carried over"), lines
    assert not (tmp_path / "ck_corrupt").exists() and (tmp_path / "ck" / "2").is_dir()
    now_tx.update(restored["params"], restored["opt_state"], restored["params"])  # trains on


def test_a_stateless_transform_appended_restores_the_same_leaves_without_a_line(tmp_path, capsys):
    """The same leaves in another tree (an empty node more at the end), which Orbax itself refuses."""
    saved_tx = optax.chain(optax.adam(0.1))
    now_tx = optax.chain(optax.adam(0.1), optax.masked(optax.set_to_zero(), lambda p: jax.tree.map(lambda _: False, p)))
    saved = trained_state(saved_tx)
    save(tmp_path / "ck", 2, saved)
    step, restored, _ = restore_latest(tmp_path / "ck", abstract_of(now_tx), strict=True)
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(abstract_of(now_tx)["opt_state"])
    assert_trees_equal(restored["opt_state"], saved["opt_state"])
    assert "carried over" not in capsys.readouterr().err  # no leaf moved


def test_an_optimizer_state_of_another_kind_is_refused_by_name_and_nothing_moves(tmp_path):
    save(tmp_path / "ck", 2, trained_state(adamw(1.0)))
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(IncompatibleCheckpoint) as e:
        restore_latest(tmp_path / "ck", abstract_of(optax.sgd(0.1, momentum=0.9)))
    message = str(e.value)
    assert "step 2" in message and "saved opt_state does not fit" in message, message
    assert "(leaves only now: 3 (0/trace/bias, 0/trace/stack, 0/trace/w); only saved: 7 (1/0/count, " in message, \
        message
    assert "reset_on_resume=('opt_state',)" in message
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # nothing moved


def test_only_positions_may_differ_for_a_carry_over():
    f32 = ((16, 8), "float32")
    saved = {"1/0/mu/w": f32, "1/0/nu/w": f32, "1/0/count": ((), "int32"), "1/2/count": ((), "int32")}
    moved = {"0/0/mu/w": f32, "0/0/nu/w": f32, "0/0/count": ((), "int32"), "0/2/count": ((), "int32")}
    assert moved_leaves(saved, moved) == {"0/0/mu/w": "1/0/mu/w", "0/0/nu/w": "1/0/nu/w",
                                          "0/0/count": "1/0/count", "0/2/count": "1/2/count"}
    assert moved_leaves(saved, {**moved, "0/0/nu/w": ((8, 8), "float32")}) is None  # another shape
    assert describe_differences(saved, {**moved, "0/0/nu/w": ((8, 8), "float32")}) == \
        "leaves nu/w: saved [16, 8] float32, now [8, 8] float32"
    assert moved_leaves(saved, {**moved, "0/0/nu/w": ((16, 8), "bfloat16")}) is None  # another dtype
    assert moved_leaves(saved, {k: v for k, v in moved.items() if k != "0/2/count"}) is None  # a leaf fewer
    assert moved_leaves(saved, {**moved, "0/0/trace/w": f32}) is None  # a leaf more


def test_a_step_without_manifest_is_refused_unless_allowed_then_restored_with_a_warning(tmp_path, capsys):
    tx = adamw(1.0)
    first, second = trained_state(tx, seed=1), trained_state(tx, seed=2)
    save(tmp_path / "ck", 1, first)
    save(tmp_path / "ck", 2, second)
    step_dir = tmp_path / "ck" / "2"
    os.remove(step_dir / "_CHECKPOINT_METADATA")  # ...and step 1's params in its place: only a manifest could tell
    shutil.rmtree(step_dir / "params")
    shutil.copytree(tmp_path / "ck" / "1" / "params", step_dir / "params")
    with pytest.raises(UnverifiedCheckpoint) as e:
        restore_latest(tmp_path / "ck", abstract_of(tx))
    assert "step 2" in str(e.value) and "CheckpointConfig.allow_unverified_restore=True" in str(e.value)
    assert step_dir.is_dir() and not (tmp_path / "ck_corrupt").exists()

    capsys.readouterr()
    step, restored, _ = restore_latest(tmp_path / "ck", abstract_of(tx), allow_unverified=True)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert step == 2 and len(warnings) == 1 and "WITHOUT verification" in warnings[0], warnings
    assert_trees_equal(restored["params"], first["params"])  # what is on disk, on purpose


def swap_rows(params):
    return {**params, "w": params["w"][np.r_[1, 0, 2:16]]}


def swap_layers(params):
    return {**params, "stack": params["stack"][::-1]}


@pytest.mark.parametrize("swap", [swap_rows, swap_layers])
def test_swapped_rows_or_layers_are_a_fingerprint_mismatch(tmp_path, swap):
    tx = adamw(1.0)
    state = trained_state(tx)
    swapped = {**state, "params": swap(state["params"])}
    assert sorted(np.asarray(swapped["params"]["w"]).ravel().tolist()) == sorted(
        np.asarray(state["params"]["w"]).ravel().tolist())  # the same values, other places
    save(tmp_path / "ck", 2, state)
    save(tmp_path / "other", 2, swapped)
    shutil.rmtree(tmp_path / "ck" / "2" / "params")
    shutil.copytree(tmp_path / "other" / "2" / "params", tmp_path / "ck" / "2" / "params")
    with pytest.raises(CorruptCheckpoint, match="fingerprint mismatch"):
        restore_latest(tmp_path / "ck", abstract_of(tx), strict=True)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32])
def test_streamed_blocks_in_any_order_give_the_arrays_fingerprint(dtype):
    """What jaxtrain.convert records (blocks as they are written) against the device-side hash."""
    x = np.asarray(jax.random.normal(jax.random.key(3), (6, 10, 4)) * 100).astype(dtype)
    fingerprint = BlockFingerprint(x.shape)
    regions = [(slice(a, a + 2), slice(b, b + 5), slice(0, 4)) for a in (4, 0, 2) for b in (5, 0)]
    for region in regions:
        fingerprint.add(region, x[region])
    assert fingerprint.value() == tree_fingerprints({"x": jnp.asarray(x)})["x"]


def test_roles_are_recorded_and_a_change_is_one_line_naming_the_parameters(tmp_path):
    saved_roles = {"w": "decay", "bias": "no_decay", "stack": "decay"}
    save(tmp_path / "ck", 2, trained_state(adamw(1.0)), roles=saved_roles)
    checkpointer = Checkpointer(str(tmp_path / "ck"))
    manifest = checkpointer.manifest(2)
    checkpointer.close()
    assert manifest["roles"] == saved_roles
    line = roles_changed_line(2, manifest["roles"], {**saved_roles, "stack": "no_decay", "bias": "frozen"})
    assert line == ("note: optimizer roles changed since step 2 was saved (2 parameters): "
                    "bias no_decay -> frozen, stack decay -> no_decay")
    assert roles_changed_line(2, manifest["roles"], saved_roles) is None
    assert roles_changed_line(2, None, saved_roles) is None  # an older run recorded none


def test_a_fresh_start_beside_steps_moved_aside_says_so(tmp_path, capsys):
    from jaxtrain.training.trainer import _warn_about_set_aside_steps
    (tmp_path / "checkpoints").mkdir()
    _warn_about_set_aside_steps(str(tmp_path / "checkpoints"))
    assert capsys.readouterr().err == ""
    (tmp_path / "checkpoints_corrupt" / "6-1700000000").mkdir(parents=True)
    _warn_about_set_aside_steps(str(tmp_path / "checkpoints"))
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: no checkpoint in ") and "['6-1700000000']" in err[0], err
