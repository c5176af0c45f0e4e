"""Rotary position embeddings, with one strategy object per frequency-scaling variant.

`apply_rope` uses the "rotate half" layout (first half of head_dim paired with the second
half), the layout HF Llama checkpoints are stored in; `apply_rope_interleaved` pairs adjacent
dims, the layout of DeepSeek's checkpoints.
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


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's temperature correction for a context stretched `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN: frequencies that turn fewer than `beta_slow` times over the original context are
    interpolated (divided by `factor`), those turning more than `beta_fast` times are kept, and
    a linear ramp over the dimensions between blends the two.

    The temperature correction comes in two parts, as in transformers (and DeepSeek):
    `attention_factor()` multiplies cos/sin, so it reaches only the rotated dimensions of q and
    k (it is 1 when mscale == mscale_all_dim, as in DeepSeek-V2's configs), and
    `softmax_scale_factor()` multiplies the softmax scale of a model that applies the
    correction to all dimensions (mscale_all_dim; 1 when it is 0).
    """
    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0  # 0 = not set (transformers treats 0 and absent alike)
    mscale_all_dim: float = 0.0  # 0 = not set
    attention_factor_override: float | None = None  # HF `attention_factor`: replaces the derived one
    truncate: bool = True  # round the ramp's ends out to whole dimensions

    def inv_freq(self, rotary_dim: int, theta: float) -> np.ndarray:
        freq = base_inv_freq(rotary_dim, theta)
        low, high = (self._dim_turning(rotations, rotary_dim, theta) for rotations in (self.beta_fast, self.beta_slow))
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, rotary_dim - 1)
        if low == high:
            high += 0.001  # a one-point ramp would divide by zero
        # 1 where the frequency is kept (fast), 0 where it is interpolated (slow).
        keep = 1.0 - np.clip((np.arange(rotary_dim // 2) - low) / (high - low), 0.0, 1.0)
        return freq / self.factor * (1.0 - keep) + freq * keep

    def _dim_turning(self, rotations: float, rotary_dim: int, theta: float) -> float:
        """The (fractional) dimension index whose frequency turns `rotations` times over the
        original context."""
        return rotary_dim * math.log(self.original_max_position / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    def attention_factor(self) -> float:
        if self.attention_factor_override is not None:
            return float(self.attention_factor_override)
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor)  # transformers' rule: one of the two alone is not used

    def softmax_scale_factor(self) -> float:
        return _yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


def rope_attention_factor(scaling) -> float:
    """The multiplier on cos/sin a scaling strategy asks for (only YaRN has one)."""
    return scaling.attention_factor() if isinstance(scaling, YarnScaling) else 1.0


def apply_rope_interleaved(x, positions, inv_freq: np.ndarray, scale: float = 1.0):
    """Rotate x[b, l, heads, d] by positions[b, l], pairing adjacent dims (2i, 2i+1) — the layout
    DeepSeek's checkpoints use for their rotary dims (a complex multiply in their code).
    `scale` multiplies cos and sin (YaRN's attention factor). The math runs in float32."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(np.asarray(inv_freq), jnp.float32)
    cos = (jnp.cos(angles) * scale)[:, :, None, :]
    sin = (jnp.sin(angles) * scale)[:, :, None, :]
    pairs = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = jnp.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
    return rotated.reshape(x.shape).astype(x.dtype)


# The frequency-scaling strategies, for the families whose gin files choose one (models/family.py).
SCALINGS = (NoScaling, LinearScaling, Llama3Scaling, YarnScaling)
