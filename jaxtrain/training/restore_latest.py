"""The newest intact checkpoint of a training workdir, restored through the one restore path
(TrainSetup.restore): the library call eval and generate share. A failure is a `RestoreFailed`
carrying the exit code its CLI reports, so the library itself never exits."""
from __future__ import annotations

import os


class RestoreFailed(Exception):
    """No checkpoint, another model's checkpoint (exit code 2, a config error like a bad flag), or
    one that cannot be read (the checkpoint exit code)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


def restore_latest_params(setup, workdir: str, allow_unverified: bool, *, as_saved: bool = True):
    """(step, params) of the newest intact checkpoint in workdir/checkpoints: params on `setup`'s
    mesh, in the canonical (on-disk) layout, or `as_saved=False` in the setup's own (pipeline
    stages). A corrupt newer step is reported and skipped, not moved."""
    from jaxtrain.checkpoints.checkpointer import CheckpointError, Checkpointer, IncompatibleCheckpoint
    from jaxtrain.resilience import exit_codes

    checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"))
    try:
        if checkpointer.latest_step() is None:
            raise RestoreFailed(f"no checkpoint in {workdir}/checkpoints")
        try:
            restored = setup.restore(checkpointer, params_only=True, as_saved=as_saved, quarantine=False,
                                     allow_unverified=allow_unverified)
        except IncompatibleCheckpoint as e:
            raise RestoreFailed(str(e)) from e
        except CheckpointError as e:
            raise RestoreFailed(str(e), exit_codes.CHECKPOINT) from e
    finally:
        checkpointer.close()
    return restored.step, restored.params
