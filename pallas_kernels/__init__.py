"""Single-device Pallas (Triton) kernels with XLA references.

Each public function takes impl="auto" | "pallas" | "xla": "auto" runs the
Pallas kernel when compiling for a GPU and the XLA reference elsewhere;
"pallas" off GPU runs the kernel in the Pallas interpreter. No mesh, model or
config code lives here.
"""

from jaxtrain.pallas_kernels.causal_conv1d import causal_conv1d
from jaxtrain.pallas_kernels.grouped_matmul import grouped_matmul
from jaxtrain.pallas_kernels.moe_routing import RoutingPlan, route
from jaxtrain.pallas_kernels.ssd_scan import ssd_scan

__all__ = ["causal_conv1d", "grouped_matmul", "route", "RoutingPlan", "ssd_scan"]
