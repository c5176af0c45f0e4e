"""How the wheel is laid out (the project's metadata is in pyproject.toml): one import name.

The repository keeps the model layers in top-level folders (models/, meshes/, pallas_kernels/);
the wheel installs them as jaxtrain.models, jaxtrain.meshes and jaxtrain.pallas_kernels, and
copies the configs and the small corpus into jaxtrain/bundled/, where jaxtrain/bundled.py finds
them. An editable install (`pip install -e .`, the Makefile's) reads them where they are.
"""
import pathlib
import shutil

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

LAYERS = ("models", "meshes", "pallas_kernels")
BUNDLED = ("configs", "data/tiny_corpus")

packages = find_packages(include=["jaxtrain", "jaxtrain.*"])
package_dir = {"jaxtrain": "jaxtrain"}
for layer in LAYERS:
    package_dir[f"jaxtrain.{layer}"] = layer
    packages += [f"jaxtrain.{layer}"] + [f"jaxtrain.{layer}.{sub}" for sub in find_packages(layer)]


class BuildWithBundledFiles(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = pathlib.Path(self.build_lib) / "jaxtrain" / "bundled"
        shutil.rmtree(target, ignore_errors=True)  # a reused build folder keeps no file we dropped
        for folder in BUNDLED:
            shutil.copytree(folder, target / folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__", "*.py"))


setup(packages=packages, package_dir=package_dir, cmdclass={"build_py": BuildWithBundledFiles})
