"""Types of Hugging Face model parts that portrl walks by attribute name.

A Llama-family decoder (``model.model.layers[i].self_attn.q_proj`` ...) is an ``nn.Module`` whose submodules are
named by its architecture, not declared: torch types every such attribute as ``Tensor | Module``. Code that walks
that layout annotates the walked object as :data:`HFModule`, which says so and lets the checker (mypy, see
pyproject.toml) accept the attribute reads instead of each one being cast.
"""

from __future__ import annotations

from typing import Any, TypeAlias


#: an HF model, its inner decoder or config, one of its layers, or a peft layer: read by attribute names of the
#: architecture
HFModule: TypeAlias = Any
