"""Registers MeshConfig with gin without importing jax: the CLI reads the mesh size first,
to simulate that many CPU devices, and only then starts jax."""
import gin

from meshes.mesh_config import MeshConfig

GinMeshConfig = gin.external_configurable(MeshConfig, name="MeshConfig", module="meshes")
