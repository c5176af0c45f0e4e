"""Orbax checkpoints of the train state and the data iterator, layout-independent on disk, and
verified when they are read back.

A step directory (named by the number of completed steps) holds the items `params`,
`opt_state` (each a mesh-free tree: plain nested dicts, layers stacked) and `data` (the grain
iterator, one file per process; a run with another number of processes restores from any of
them, since the state is the number of global batches taken). Orbax commits a step atomically:
it is written under a temporary name and renamed once every file is there, so a crash never
leaves a half-written step that looks complete.

Each step also carries a manifest in Orbax's step metadata (written in the same atomic commit):
the items saved, a layout-independent fingerprint of every array (jaxtrain/checkpoints/fingerprint.py),
the data iterator's state and whatever the trainer adds (the batches it skipped). `restore`
checks the step against it: an array whose fingerprint differs (a flipped bit, a truncated
file) or unreadable metadata is a `CorruptCheckpoint` naming the step and what is wrong; an
item the run needs that the step lacks is a `CheckpointError` naming it. `restore_latest` then falls back to the
newest intact step, moving the corrupt ones aside (never deleting them). A checkpoint written
by `python -m jaxtrain.convert` holds parameters only (with their fingerprints): training then
starts fresh optimizer and data state; any other step missing an item the run needs is an
error unless the run asks to reset that item.

Only what fails on its own terms is moved aside. Before any array is read, each item's saved
structure is compared with the run's (jaxtrain/checkpoints/compatibility.py): a config change
that alters it is an `IncompatibleCheckpoint` naming the leaves (or, when only positions in the
optimizer chain moved, the state is carried over with one line saying so); a step without a
manifest or fingerprints is an `UnverifiedCheckpoint` unless the run allows unverified restores.
Neither moves anything. Manifests also record each parameter's optimizer role (decay, no_decay,
frozen) so a resume can say which changed.
"""
from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import shutil
import time
import sys

import grain
import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxtrain.checkpoints.adapter_base import (BASE_KEY, AdapterCheckpoints, BaseRecord, FullCheckpoints, merge_trees,
                                               params_fingerprint, split_tree)
from jaxtrain.checkpoints.compatibility import carried_over_line, fit_item, saved_item
from jaxtrain.checkpoints.errors import (CheckpointError, CheckpointSaveError, CorruptCheckpoint,  # noqa: F401
                                         IncompatibleCheckpoint, UnverifiedCheckpoint)
from jaxtrain.checkpoints.fingerprint import tree_fingerprints

STATE_ITEMS = ("params", "opt_state")
ALL_ITEMS = STATE_ITEMS + ("data",)
MANIFEST_KEY = "jaxtrain"
CONVERTED = "converted"  # manifest `kind` of a parameters-only checkpoint (jaxtrain.cli.convert, a params-only save)


def _drop_closed_loop_callbacks(previous):
    """When an async write fails (a full disk), Orbax closes its event loop while TensorStore still
    has write callbacks queued on it; each then prints an 'Event loop is closed' traceback.
    The failure itself reaches the trainer as one CheckpointSaveError, so these are dropped."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, RuntimeError) and "Event loop is closed" in str(unraisable.exc_value):
            return
        previous(unraisable)
    hook.jaxtrain = True
    return hook


class _OrbaxTracebacksToOneLine(logging.Filter):
    """Orbax logs a failed background write with its whole traceback (~50 lines per thread);
    the same failure reaches the trainer as a CheckpointSaveError. Keep Orbax's line, drop
    the traceback."""

    def filter(self, record) -> bool:
        if record.exc_info and "orbax" in record.pathname:
            record.msg, record.args = " ".join(record.getMessage().split())[:300], None
            record.exc_info = record.exc_text = None
        return True


class Checkpointer:
    def __init__(self, directory: str, *, keep: int | None = 3, async_save: bool = True, roles: dict | None = None,
                 saves: FullCheckpoints | AdapterCheckpoints = FullCheckpoints()):
        """`roles`: {parameter path: optimizer role}, recorded in every manifest written, so a
        resume can name the parameters whose role changed since. `saves`: what a save writes
        (jaxtrain/checkpoints/adapter_base.py: everything, or a LoRA run's adapters on a base)."""
        if not getattr(sys.unraisablehook, "jaxtrain", False):
            sys.unraisablehook = _drop_closed_loop_callbacks(sys.unraisablehook)
            logging.getLogger("absl").addFilter(_OrbaxTracebacksToOneLine())
        self.directory = os.path.abspath(directory)
        self.saves = saves
        kept = saves.keep_steps(self.directory)
        if kept and keep is not None:  # Orbax takes either max_to_keep or a policy
            policies = ocp.checkpoint_managers
            options = ocp.CheckpointManagerOptions(
                create=True, enable_async_checkpointing=async_save,
                preservation_policy=policies.AnyPreservationPolicy([policies.LatestN(n=keep),
                                                                    policies.CustomSteps(kept)]))
        else:
            options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                                   enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._saving = None  # the step of the save in flight, if any
        self.roles = roles

    # -- what is on disk ----------------------------------------------------------------------
    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def items(self, step: int) -> set[str]:
        path = os.path.join(self.directory, str(step))
        return {p for p in os.listdir(path) if os.path.isdir(os.path.join(path, p))}

    def manifest(self, step: int) -> dict | None:
        """The jaxtrain manifest of `step`, or None for a step written without one."""
        try:
            # Orbax logs unparsable step metadata and returns an empty one: parse it first.
            step_metadata = os.path.join(self.directory, str(step), "_CHECKPOINT_METADATA")
            if os.path.exists(step_metadata):
                with open(step_metadata) as f:
                    json.load(f)
            with _quiet_absl():  # Orbax warns about every item it was not told how to read
                custom = self.manager.metadata(step).custom_metadata or {}
        except Exception as e:  # garbled JSON, missing file: say which step
            raise CorruptCheckpoint(f"step {step}: unreadable step metadata ({type(e).__name__}: "
                                    f"{_one_line(e)})") from None
        return custom.get(MANIFEST_KEY)

    def saved_shapes(self, step: int, item: str = "params") -> dict[str, tuple]:
        """{leaf path: shape} of an item as saved (read from its metadata, no arrays)."""
        _, leaves = saved_item(os.path.join(self.directory, str(step)), item)
        return {path: shape for path, (shape, _) in leaves.items()}

    # -- saving -------------------------------------------------------------------------------
    def save(self, step: int, state: dict, data_iterator=None, *, extra: dict | None = None) -> None:
        """Starts saving `state` (any of STATE_ITEMS; params alone is a valid checkpoint) as
        `step`, with `extra` (JSON) in its manifest. Raises CheckpointSaveError if the previous
        async save failed."""
        self.wait()  # Orbax would wait for the previous save anyway; this names its failure right
        # a state built for the save may bring some fingerprints along (jaxtrain/pipeline/streamed_save.py)
        brought = getattr(state, "fingerprints", {})
        state = self.saves.select(state)
        saved = {k: state[k] for k in STATE_ITEMS if k in state}
        items = {k: ocp.args.StandardSave(v) for k, v in saved.items()}
        known = {p: fp for p, fp in brought.items() if p.split("/")[0] in saved}
        manifest = {"items": sorted(saved), "fingerprints": tree_fingerprints(saved, known), "time": time.time(),
                    **self.saves.manifest(), **(extra or {})}
        if self.roles is not None:
            manifest["roles"] = self.roles
        if data_iterator is not None:
            items["data"] = grain.checkpoint.CheckpointSave(data_iterator)
            manifest["items"].append("data")
            manifest["data_state"] = data_iterator.get_state()
        elif set(saved) == {"params"} and BASE_KEY not in manifest:  # parameters only, on purpose (an import)
            manifest["kind"] = CONVERTED
        self._saving = step
        with self._naming_failures():
            self.manager.save(step, args=ocp.args.Composite(**items), force=True,
                              custom_metadata={MANIFEST_KEY: manifest})

    def check(self) -> None:
        """Raises CheckpointSaveError if a save in flight has failed (cheap: no waiting)."""
        with self._naming_failures():
            self.manager.check_for_errors()

    def wait(self) -> None:
        """Blocks until the save in flight is committed; raises CheckpointSaveError if it failed."""
        with self._naming_failures():
            self.manager.wait_until_finished()
            self.manager.check_for_errors()
        self._saving = None

    @contextlib.contextmanager
    def _naming_failures(self):
        """Any Orbax error inside becomes one CheckpointSaveError naming the step being saved."""
        try:
            yield
        except Exception as e:
            raise CheckpointSaveError(f"saving step {self._saving} to {self.directory} failed: "
                                      f"{_save_failure(e)}") from e

    def close(self) -> None:
        """Waits for the save in flight and closes; after a failed save it only raises (closing
        Orbax's manager then would leave its writer threads failing against a closed loop)."""
        self.wait()
        self.manager.close()

    # -- restoring ----------------------------------------------------------------------------
    def restore(self, step: int, abstract_state: dict, data_iterator=None, *, reset=(),
                allow_unverified: bool = False) -> dict:
        """The items on disk restored into the shardings carried by `abstract_state`
        (ShapeDtypeStructs) and verified against the step's manifest; the data iterator, if
        given, is restored in place. `reset`: items the caller will start fresh. Before any
        array is read, each item's saved structure is compared with `abstract_state`
        (IncompatibleCheckpoint, or optimizer state carried over: compatibility.py), and a step
        without fingerprints is refused (UnverifiedCheckpoint) unless `allow_unverified`.
        A step that records a base (a LoRA run's adapters) is restored on it: the parameters it
        lacks are read from the base, which must still have the recorded fingerprint."""
        manifest = self.manifest(step)
        if manifest is not None and manifest.get(BASE_KEY):
            return self._restore_on_base(step, manifest, abstract_state, data_iterator, reset, allow_unverified)
        return self._restore_saved(step, manifest, abstract_state, data_iterator, reset, allow_unverified)

    def _restore_on_base(self, step, manifest, abstract_state, data_iterator, reset, allow_unverified) -> dict:
        recorded = BaseRecord.from_json(manifest[BASE_KEY])
        self.saves.check_base(recorded)
        own, base = split_tree(abstract_state.get("params", {}), set(self.saved_shapes(step)))
        if not base:  # the step's own items asked for (the adapters alone, or no parameters)
            return self._restore_saved(step, manifest, abstract_state, data_iterator, reset, allow_unverified)
        found = base_record(recorded.directory, recorded.step, what=f"the base of {self.directory}/{step}")
        if found.fingerprint != recorded.fingerprint:
            raise IncompatibleCheckpoint(f"{self.directory}/{step} holds adapters trained on base {recorded.describe()}, "
                                         f"but {found.describe()} is there now: restore the base the adapters were "
                                         f"trained on, or train into a fresh workdir")
        if not own:
            raise IncompatibleCheckpoint(f"{self.directory}/{step} holds none of this model's parameters")
        state = self._restore_saved(step, manifest, {**abstract_state, "params": own}, data_iterator, reset,
                                    allow_unverified)
        base_checkpointer = Checkpointer(recorded.directory, keep=None, async_save=False)
        try:
            base_params = base_checkpointer.restore(recorded.step, {"params": base})["params"]
        finally:
            base_checkpointer.close()
        return {**state, "params": merge_trees(base_params, state["params"])}

    def _restore_saved(self, step, manifest, abstract_state, data_iterator, reset, allow_unverified) -> dict:
        present = self.items(step)
        expected = self._expected_items(step, manifest, present, abstract_state, data_iterator, reset)
        state_items = [k for k in STATE_ITEMS if k in expected]
        self._check_verifiable(step, manifest, allow_unverified)
        step_dir = os.path.join(self.directory, str(step))
        fits = {}
        for k in state_items:
            try:
                fits[k] = fit_item(step, step_dir, k, abstract_state[k])
            except CheckpointError:
                raise
            except Exception as e:  # garbled array metadata: the step cannot be read
                raise CorruptCheckpoint(f"step {step}: cannot be read ({type(e).__name__}: {_one_line(e)})") from None
        items = {k: ocp.args.StandardRestore(fits[k].target) for k in state_items}
        other_layout = None  # a data state written by another number of processes
        if "data" in expected:
            data_dir = os.path.join(self.directory, str(step), "data")
            if os.path.exists(os.path.join(data_dir, f"process_{jax.process_index()}-of-{jax.process_count()}.json")):
                items["data"] = grain.checkpoint.CheckpointRestore(data_iterator)
            else:
                other_layout = sorted(f for f in os.listdir(data_dir) if f.startswith("process_"))
                if not other_layout:
                    raise CorruptCheckpoint(f"step {step}: the data item holds no iterator state")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(**items))
            if other_layout:
                # Our iterators' state is the number of global batches taken (jaxtrain/data/packing.py), the
                # same in every process's file, so any process's file positions this process's shard.
                with open(os.path.join(data_dir, other_layout[0])) as f:
                    data_iterator.set_state(json.load(f))
        except Exception as e:  # truncated files, garbled array metadata, TensorStore errors
            raise CorruptCheckpoint(f"step {step}: cannot be read ({type(e).__name__}: {_one_line(e)})") from None
        state = {k: restored[k] for k in state_items}  # as saved: the manifest's paths
        if manifest is not None and manifest.get("fingerprints"):
            self._verify(step, manifest, state, data_iterator if "data" in expected else None)
        for k in state_items:
            if fits[k].carried_over:
                _print_once(carried_over_line(step, k, fits[k]))
        return {k: fits[k].to_now(state[k]) for k in state_items}

    def _check_verifiable(self, step: int, manifest: dict | None, allow_unverified: bool) -> None:
        if manifest is not None and manifest.get("fingerprints"):
            return
        what = ("no manifest (its _CHECKPOINT_METADATA is missing or was not written by jaxtrain)" if manifest is None
                else "a manifest without fingerprints")
        if not allow_unverified:
            raise UnverifiedCheckpoint(
                f"step {step} in {self.directory} has {what}: its arrays cannot be verified, so it is not "
                f"restored. Bind CheckpointConfig.allow_unverified_restore=True to restore it unverified, or move "
                f"{self.directory}/{step} aside to resume from an older step")
        _print_once(f"warning: step {step} in {self.directory} has {what}: restored WITHOUT verification "
                    f"(CheckpointConfig.allow_unverified_restore=True)")

    def _expected_items(self, step, manifest, present, abstract_state, data_iterator, reset) -> set[str]:
        wanted = {k for k in STATE_ITEMS if k in abstract_state} | ({"data"} if data_iterator is not None else set())
        saved = set(manifest["items"]) if manifest is not None else present & set(ALL_ITEMS)
        if "params" not in present:
            raise CorruptCheckpoint(f"step {step}: no params item in {self.directory}/{step}")
        converted = (manifest or {}).get("kind") == CONVERTED or (manifest is None and saved == {"params"})
        missing = sorted((wanted & saved - present) | (set() if converted else wanted - saved))
        missing = [k for k in missing if k not in reset]
        if missing:
            them = "them" if len(missing) > 1 else "it"
            raise CheckpointError(
                f"checkpoint {self.directory}/{step} has no {' and no '.join(missing)} item; resuming would "
                f"silently restart {them}. Bind CheckpointConfig.reset_on_resume={tuple(missing)!r} to start {them} "
                f"fresh on purpose")
        return (wanted & saved & present) - set(reset)

    def _verify(self, step: int, manifest: dict, state: dict, data_iterator) -> None:
        actual = tree_fingerprints(state)
        expected = {p: fp for p, fp in manifest.get("fingerprints", {}).items() if p.split("/")[0] in state}
        wrong = [p for p, fp in expected.items() if actual.get(p) != fp]
        wrong += sorted(set(actual) - set(expected))  # an array the manifest does not know was not saved with it
        if wrong:
            raise CorruptCheckpoint(f"step {step}: {len(wrong)} array(s) differ from what was saved (fingerprint "
                                    f"mismatch), first {wrong[0]}")
        if data_iterator is not None and "data_state" in manifest and data_iterator.get_state() != manifest["data_state"]:
            raise CorruptCheckpoint(f"step {step}: the data iterator state {data_iterator.get_state()} differs "
                                    f"from the saved {manifest['data_state']}")

    def restore_latest(self, abstract_state: dict, data_iterator=None, *, reset=(), strict: bool = False,
                       quarantine: bool = True, allow_unverified: bool = False):
        """(step, state, manifest) of the newest intact step, or None when there is none at all.
        Corrupt newer steps are skipped with a warning naming what is wrong and, with
        `quarantine` (a run that will write new steps), moved to `<directory>_corrupt/`; with
        `strict` the first one raises instead. Every process takes the same decision. Raises
        CheckpointError when steps exist but none is intact; a step that is intact but does not
        fit (IncompatibleCheckpoint) or cannot be verified (UnverifiedCheckpoint) raises at once
        and moves nothing."""
        problems = []
        for step in reversed(self.all_steps()):
            error = None
            try:
                state = self.restore(step, abstract_state, data_iterator, reset=reset,
                                     allow_unverified=allow_unverified)
            except CorruptCheckpoint as e:
                error = str(e)
            error = _first_error_on_any_process(error)
            if error is None:
                if problems:
                    self.manager.reload()
                return step, state, self.manifest(step) or {}
            if strict:
                raise CorruptCheckpoint(f"{error} (CheckpointConfig.strict_restore: no fallback)")
            problems.append(error)
            where = f"moved to {self._quarantine(step)}" if quarantine else "skipped"
            if jax.process_index() == 0:
                print(f"warning: checkpoint {error}; {where}, falling back to an older step", file=sys.stderr,
                      flush=True)
        if problems:
            raise CheckpointError(f"no intact checkpoint in {self.directory}: " + "; ".join(problems))
        return None

    def _quarantine(self, step: int) -> str:
        target = os.path.join(self.directory + "_corrupt", f"{step}-{int(time.time())}")
        if jax.process_index() == 0:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.move(os.path.join(self.directory, str(step)), target)
        _barrier(f"jaxtrain_quarantine_{step}")
        return target


def base_record(directory: str, step: int | None = None, *, what: str = "the base") -> BaseRecord:
    """The record of parameter checkpoint `step` (default: the newest) in `directory` as a base
    for adapters: a verifiable step that is not itself adapters on a base."""
    directory = os.path.abspath(directory)
    if not os.path.isdir(directory):
        raise IncompatibleCheckpoint(f"{what}: no checkpoint directory {directory}")
    steps = sorted(int(d) for d in os.listdir(directory) if d.isdigit())
    if not steps:
        raise IncompatibleCheckpoint(f"{what}: no checkpoint in {directory}")
    if step is not None and step not in steps:
        raise IncompatibleCheckpoint(f"{what}: no step {step} in {directory} (steps: {steps})")
    step = steps[-1] if step is None else step
    checkpointer = Checkpointer(directory, keep=None, async_save=False)
    try:
        manifest = checkpointer.manifest(step)
    finally:
        checkpointer.close()
    if manifest is None or not manifest.get("fingerprints"):
        raise IncompatibleCheckpoint(f"{what}: {directory}/{step} has no manifest with fingerprints to identify it by")
    if manifest.get(BASE_KEY):
        raise IncompatibleCheckpoint(f"{what}: {directory}/{step} holds adapters, not a base model's parameters")
    return BaseRecord(directory, step, params_fingerprint(manifest))


def _print_once(line: str) -> None:
    if jax.process_index() == 0:
        print(line, file=sys.stderr, flush=True)


def _first_error_on_any_process(error: str | None) -> str | None:
    """Every process must fall back together: a file one process alone failed to read counts
    for all (the first failing process's message)."""
    if jax.process_count() == 1:
        return error
    from jax.experimental import multihost_utils
    failed = multihost_utils.process_allgather(np.int32(error is not None))
    if not failed.any():
        return None
    return error or f"failed to restore on process {int(np.argmax(failed))}"


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def _quiet_absl():
    from absl import logging as absl_logging
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
        yield
    finally:
        absl_logging.set_verbosity(level)


def _save_failure(e: BaseException) -> str:
    """One line for a failed save, leading with the cause an operator acts on."""
    text = _one_line(e)
    if getattr(e, "errno", None) == errno.ENOSPC or "No space left" in text or "RESOURCE_EXHAUSTED" in text:
        return f"No space left on device ({text})"
    return text


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text[:400] + ("..." if len(text) > 400 else "")
