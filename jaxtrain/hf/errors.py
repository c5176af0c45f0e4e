"""Errors for HF checkpoints and configs we cannot read faithfully; messages name the field or tensor."""


class HFConfigError(ValueError):
    """A config.json field or value that we do not support or that is missing."""


class HFCheckpointError(ValueError):
    """A missing, misshapen, unexpected or unreadable tensor or file."""
