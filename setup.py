"""Package discovery only (metadata lives in pyproject.toml).

The top-level ``backends/`` folder is installed as ``portrl.backends`` and ``configs/`` (YAML presets)
as ``portrl.configs`` (docs/ARCHITECTURE.md), which ``[tool.setuptools.packages.find]`` cannot express, so the
package list is computed here.
"""
from setuptools import find_packages, setup

packages = ["portrl", *(f"portrl.{p}" for p in find_packages("portrl"))]
packages += ["portrl.backends", *(f"portrl.backends.{p}" for p in find_packages("backends"))]
packages += ["portrl.configs"]

setup(
    packages=packages,
    package_dir={"portrl": "portrl", "portrl.backends": "backends", "portrl.configs": "configs"},
)
