"""What the peers' watch (peers.py) and the shared-directory check (shared_directory.py) share:
the key prefix of their entries in the coordinator's key-value store, and the one-line form of an
error's text. Its own module so that neither of the two imports the other."""
from __future__ import annotations

PREFIX = "jaxtrain/peers/"


def one_line(text, limit: int = 500) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."
