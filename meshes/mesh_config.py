"""MeshConfig without importing jax, so the CLI can read it before jax starts (to simulate devices)."""
from __future__ import annotations

import dataclasses
import math

AXES = ("pipeline", "data", "context", "expert", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the five mesh axes; one may be -1 to take the remaining devices."""
    pipeline: int = 1
    data: int = -1
    context: int = 1
    expert: int = 1
    tensor: int = 1
    # Per-axis factor spanning processes (DCN); None spreads processes over outer axes first.
    dcn: tuple[int, ...] | None = None

    def sizes(self) -> dict[str, int]:
        return {a: getattr(self, a) for a in AXES}

    def fixed_device_count(self) -> int:
        """Devices the explicit sizes need (a -1 axis counts as 1)."""
        return math.prod(max(s, 1) for s in self.sizes().values())

