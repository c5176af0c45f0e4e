"""Registers the mesh and context-parallel settings with gin without importing jax: the CLI
reads the mesh size first, to simulate that many CPU devices, and only then starts jax."""
import gin

from jaxtrain.meshes.context_settings import AllGatherKV, ContextParallel, Contiguous, LatentKV, LoadBalanced, RingKV
from jaxtrain.meshes.mesh_config import MeshConfig

GinMeshConfig = gin.external_configurable(MeshConfig, name="MeshConfig", module="meshes")
for _cls in (ContextParallel, Contiguous, LoadBalanced, RingKV, AllGatherKV, LatentKV):  # TrainConfig.context_parallel
    gin.external_configurable(_cls, module="meshes")
