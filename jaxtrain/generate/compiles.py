"""Counting XLA compiles per jitted function with jax's public monitoring events.

jax records `/jax/core/compile/backend_compile_duration` (with the function's name) for every
backend compile, cache hits of the jit dispatch excluded. Counting those is public API on every
jax version we run (0.10 here, 0.11 on the GPU image), where a jitted function's `_cache_size()`
is a private method of jaxlib's C++ object.
"""
from __future__ import annotations

import collections
import contextlib
from typing import Iterator

import re

import jax

BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles() -> Iterator[collections.Counter]:
    """Within the block: {function name: backend compiles} (e.g. `counts["_decode_fn"]`; jax's
    "jit(name)" wrapper is taken off the name)."""
    counts: collections.Counter = collections.Counter()

    def listener(event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE_EVENT:
            name = str(kwargs.get("fun_name", "?"))
            wrapped = re.fullmatch(r"\w+\((.*)\)", name)
            counts[wrapped.group(1) if wrapped else name] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
