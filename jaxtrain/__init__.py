"""jaxtrain: one import name for the whole system.

The model layers live in the repository's top-level folders `models/`, `meshes/` and
`pallas_kernels/` and are imported as `jaxtrain.models`, `jaxtrain.meshes` and
`jaxtrain.pallas_kernels`. An installed wheel holds them inside this package (setup.py); in a
checkout this package's path also covers the repository root, so the same names find the
folders where they are.
"""
import os as _os

_ROOT = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_ROOT, "pyproject.toml")) and _os.path.isdir(_os.path.join(_ROOT, "models")):
    __path__.append(_ROOT)  # noqa: F821 (a package's __path__)
