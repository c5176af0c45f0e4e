"""The suite runs on 16 simulated CPU devices; XLA reads the flags when jax starts.

The suite's time is mostly XLA:CPU compiling small programs: LLVM's -O0 halves it
(measured on tests/test_deepseek.py: 221 -> 91 s CPU) and changes no result the tests compare
(every side of a comparison is compiled alike; compile-only memory figures are unchanged)."""
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=16"
                           " --xla_backend_optimization_level=0"
                           # a loaded 2-core machine can leave simulated devices' threads >40 s apart
                           # at a collective (XLA:CPU's default abort), seen once in the reference layout
                           " --xla_cpu_collective_call_terminate_timeout_seconds=600").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
