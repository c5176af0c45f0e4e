"""Blend weights -> integers with the same ratios, so the per-sample assignment (blend.py) is
exact and repeats with period `sum(a)`.

A weight is taken as the decimal a config writes (`0.7` is 7/10, not the nearest binary float):
(0.7, 0.2, 0.1) -> (7, 2, 1), period 10. When the exact integers would make the period longer
than `MAX_PERIOD` samples (weights of many digits, 1/3 written out as 0.333...), each weight is
rounded to a multiple of 1/MAX_PERIOD of the total instead (at least 1): each source's share then
differs from the given one by less than (number of sources) / MAX_PERIOD.
"""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

MAX_PERIOD = 1 << 20  # a resume computes at most one period: bounded so resuming stays quick


def integer_weights(weights) -> np.ndarray:
    """int64 [sources]: the smallest integers in the weights' ratios (rounded past MAX_PERIOD)."""
    values = np.asarray(weights, np.float64)
    if values.ndim != 1 or not len(values):
        raise ValueError("a blend needs at least one weighted source")
    if not np.all(np.isfinite(values)) or np.any(values <= 0):
        raise ValueError(f"blend weights must be positive numbers, got {values.tolist()}")
    exact = [Fraction(repr(float(w))) for w in values]
    scale = math.lcm(*(f.denominator for f in exact))
    integers = [int(f * scale) for f in exact]
    if sum(integers) // math.gcd(*integers) > MAX_PERIOD:
        total = sum(exact)
        integers = [max(1, round(f / total * MAX_PERIOD)) for f in exact]
    divisor = math.gcd(*integers)
    return np.array([n // divisor for n in integers], np.int64)
