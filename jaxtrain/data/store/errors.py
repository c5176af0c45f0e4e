"""The one error every data reader and writer raises for bad input: the CLIs print its message
(which names the file, and the line where there is one) and exit 2."""
from __future__ import annotations


class DataInputError(ValueError):
    """Bad input data: a corrupt or truncated store or `.idx`, a malformed line, a missing field."""
