"""The XLA flags that make the suite's many small programs compile fast on XLA:CPU, for the
suite's own process (tests/conftest.py) and for the CLI processes tests start
(tests/processes.child_env).

- LLVM -O0 halves the compile (tests/test_deepseek.py: 221 -> 91 s CPU).
- XLA:CPU's older loop emitters instead of its MLIR fusion emitters halve the backend compile
  again (tests/test_pattern_scan.py, one device: 24.5 -> 11.0 s; `make test` 15:03 -> 7:49).
  Fusion decisions and buffer assignment are HLO passes before the emitters, so compile-only
  memory figures barely move (tiny DeepSeek: identical; DeepSeek-V2-Lite FSDP-16 temp 16.191 ->
  16.186 GiB, arguments identical); results can differ in the last float32 bits, as any two
  programs' do. Full-size compiles gain nothing from it (V2-Lite: 14.7 s either way): the
  time goes to many small programs' emitting, which is what the suite compiles.

Neither changes what a test compares: every side of a comparison is compiled alike."""
from __future__ import annotations

import os
import sys

DEVICE_COUNT = "--xla_force_host_platform_device_count=16"


def _jaxlib_knows(flag: str) -> bool:
    """Whether this jaxlib registers `flag` (an XLA flag it does not know aborts the process, and
    XLA removes flags between releases). jaxlib is looked at, not imported: XLA reads XLA_FLAGS
    once, when jax starts."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from jaxtrain.xla_gpu_flags import known_flags  # imports no jax

    return flag in known_flags([flag])


COMPILE_FLAGS = " ".join(["--xla_backend_optimization_level=0"]
                         + (["--xla_cpu_use_fusion_emitters=false"]
                            if _jaxlib_knows("xla_cpu_use_fusion_emitters") else []))
