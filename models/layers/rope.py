"""Rotary position embeddings, with one strategy object per frequency-scaling variant.

Rotation uses the "rotate half" layout (first half of head_dim paired with the second half),
the layout HF Llama checkpoints are stored in.
"""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np


def base_inv_freq(rotary_dim: int, theta: float) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))


@dataclasses.dataclass(frozen=True)
class NoScaling:
    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        return base_inv_freq(rotary_dim, theta)


@dataclasses.dataclass(frozen=True)
class LinearScaling:
    """Positions divided by `factor` (position interpolation)."""
    factor: float = 1.0

    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        return base_inv_freq(rotary_dim, theta) / self.factor


@dataclasses.dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        freq = base_inv_freq(rotary_dim, theta)
        wavelength = 2 * math.pi / freq
        long_wave = self.original_max_position / self.low_freq_factor
        short_wave = self.original_max_position / self.high_freq_factor
        # 0 at the long-wavelength edge, 1 at the short one.
        blend = (self.original_max_position / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor)
        blended = (1 - blend) * freq / self.factor + blend * freq
        return np.where(wavelength > long_wave, freq / self.factor,
                        np.where(wavelength < short_wave, freq, blended))


def apply_rope(x, positions, inv_freq: np.ndarray):
    """Rotate x[b, l, heads, d] by positions[b, l]; the math runs in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(np.asarray(inv_freq), jnp.float32)
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
