"""What can be wrong with a checkpoint; each message names the step and the cause."""


class CheckpointError(Exception):
    """A checkpoint that cannot be used as it is; the message names the step and the cause."""


class CorruptCheckpoint(CheckpointError):
    """The step's files do not hold what its manifest says was saved (or cannot be read): the
    only kind of step moved aside to `<directory>_corrupt/`."""


class CheckpointSaveError(CheckpointError):
    """An (async) save failed; the step was not committed."""


class IncompatibleCheckpoint(CheckpointError):
    """An intact step written for another state structure (a config change): a config error,
    never a reason to move the step aside."""


class UnverifiedCheckpoint(CheckpointError):
    """A step without a manifest (or without fingerprints in it): its arrays cannot be verified,
    so it is restored only when the run allows that (CheckpointConfig.allow_unverified_restore)."""
