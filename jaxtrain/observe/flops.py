"""Peak dense bf16 FLOP/s per device kind, for model FLOPs utilization (MFU)."""
from __future__ import annotations

# Dense (no sparsity) bf16 tensor-core peaks from the vendors' data sheets, FLOP/s per device.
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe part is lower (756e12) and matched first below
    "H100 PCIe": 756e12,
    "H800": 989e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "B200": 2250e12,
    "GB200": 2500e12,
    "TPU v5p": 459e12,
    "TPU v5 lite": 197e12,
    "TPU v4": 275e12,
}


def peak_flops(device_kind: str, override: float | None = None) -> float | None:
    """Peak FLOP/s of one device, or None when unknown (e.g. CPU) and not configured."""
    if override:
        return float(override)
    matches = [k for k in PEAK_BF16_FLOPS if k.lower() in device_kind.lower()]
    return PEAK_BF16_FLOPS[max(matches, key=len)] if matches else None


def model_flops_utilization(flops_per_token: float, tokens_per_sec: float, peak: float | None,
                            devices: int) -> float | None:
    """Achieved model FLOP/s over the devices' peak; None when the peak is unknown."""
    return flops_per_token * tokens_per_sec / (peak * devices) if peak else None
