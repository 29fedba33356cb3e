"""A model's shape read from its ``config.json`` alone: no weights, no transformers model built, so a plan works
for a model the machine could never load (a 72B config on a laptop).

:class:`ModelShape` holds the dimensions every count of the plan needs; :func:`shape_of_folder` reads them from a
folder (a vision-language model's language model from ``text_config``; its vision tower's parameters counted from
``vision_config``), :func:`shape_of_config` from a settled run config's ``model.path``.

Parameter counts of a decoder layer (``h`` hidden, ``a`` attention heads, ``k`` key/value heads, ``d`` head
dimension, ``i`` MLP width; Qwen2's q, k and v projections carry a bias, Llama's and Mistral's none)::

    attention = h a d + 2 h k d + a d h  (+ a d + 2 k d with the bias)
    mlp       = 3 h i                     (gate, up, down)
    norms     = 2 h
    model     = L (attention + mlp + norms) + h (final norm) + V h (embedding) + V h (head, unless tied)

Tested against the parameter count of the real transformers class built on the meta device
(tests/test_plan_shape.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from portrl.errors import UserError

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

#: model_type -> whether its q, k and v projections carry a bias (the families portrl plans for)
FAMILIES = {"qwen2": True, "llama": False, "mistral": False, "qwen2_5_vl": True, "qwen2_vl": True}


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only language model (and a vision tower's parameter count, if any)."""

    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool
    vision_params: int = 0

    @property
    def attention_params(self) -> int:
        """One layer's q, k, v, o projections (weights and biases)."""
        h, a, k, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        bias = a * d + 2 * k * d if self.qkv_bias else 0
        return h * a * d + 2 * h * k * d + a * d * h + bias

    @property
    def layer_params(self) -> int:
        return self.attention_params + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def layer_matmul_params(self) -> int:
        """One layer's matrix weights (no biases, no norms): the parameters each token multiplies."""
        h, a, k, d = self.hidden, self.heads, self.kv_heads, self.head_dim
        return 2 * h * a * d + 2 * h * k * d + 3 * h * self.intermediate

    @property
    def body_params(self) -> int:
        """The decoder layers and the final norm."""
        return self.layers * self.layer_params + self.hidden

    @property
    def embed_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def head_params(self) -> int:
        """The LM head's own parameters (0 when tied to the embedding)."""
        return 0 if self.tied else self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every parameter of the model, a tied table once, the vision tower included."""
        return self.embed_params + self.body_params + self.head_params + self.vision_params

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of the key/value cache one token holds over all layers (times the cache's bytes per element)."""
        return 2 * self.layers * self.kv_heads * self.head_dim


def _int(raw: Mapping[str, Any], key: str, where: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"{where}: {key} is {value!r}; a plan needs it as a positive integer")
    return value


def vision_tower_params(vision: Mapping[str, Any], out_hidden: int) -> int:
    """Parameters of a Qwen2-VL / Qwen2.5-VL vision tower from its ``vision_config``: the 3-D patch embedding (no
    bias), ``depth`` blocks (two norms, a fused qkv and an output projection with biases, a gated MLP with biases;
    Qwen2-VL's blocks: LayerNorms with biases and a two-matrix MLP of ``mlp_ratio`` width) and the patch merger
    (a norm, then ``merge^2 e -> merge^2 e -> out_hidden`` with biases)."""
    e = int(vision.get("hidden_size") or vision.get("embed_dim") or 0)
    depth = int(vision["depth"])
    patch, temporal, chans = int(vision["patch_size"]), int(vision.get("temporal_patch_size", 2)), int(
        vision.get("in_channels", vision.get("in_chans", 3)))
    merge = int(vision.get("spatial_merge_size", 2))
    patch_embed = chans * temporal * patch * patch * e
    attn = e * 3 * e + 3 * e + e * e + e
    if "intermediate_size" in vision:  # Qwen2.5-VL: RMS norms, gated MLP
        i = int(vision["intermediate_size"])
        block = 2 * e + attn + 2 * (e * i + i) + (i * e + e)
        merger_norm = e
    else:  # Qwen2-VL: LayerNorms (weight and bias), fc1/fc2 MLP
        i = int(e * float(vision.get("mlp_ratio", 4)))
        block = 4 * e + attn + (e * i + i) + (i * e + e)
        merger_norm = 2 * e
    m = e * merge * merge
    merger = merger_norm + (m * m + m) + (m * out_hidden + out_hidden)
    return patch_embed + depth * block + merger


def shape_of_raw(raw: Mapping[str, Any], where: str) -> ModelShape:
    """The shape of a parsed ``config.json``; UserError (one line) for a family portrl has no plan for or a
    missing dimension."""
    family = raw.get("model_type")
    if family not in FAMILIES:
        raise UserError(f"{where}: model_type {family!r} has no memory plan; planned families: "
                        f"{', '.join(FAMILIES)}")
    text = raw.get("text_config") or raw
    text = {**raw, **text} if text is not raw else raw  # older VL configs keep the language dims at the top
    hidden, heads = _int(text, "hidden_size", where), _int(text, "num_attention_heads", where)
    kv = text.get("num_key_value_heads") or heads
    head_dim = text.get("head_dim") or hidden // heads
    tied = bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    vision = raw.get("vision_config")
    return ModelShape(model_type=str(family), hidden=hidden, layers=_int(text, "num_hidden_layers", where),
                      heads=heads, kv_heads=int(kv), head_dim=int(head_dim),
                      intermediate=_int(text, "intermediate_size", where), vocab=_int(text, "vocab_size", where),
                      tied=tied, qkv_bias=FAMILIES[str(family)],
                      vision_params=vision_tower_params(vision, hidden) if isinstance(vision, Mapping) else 0)


def shape_of_folder(path: str | Path) -> ModelShape:
    """The shape of the model in ``path`` from its ``config.json``; UserError (one line) when there is none."""
    folder = Path(path).expanduser()
    config = folder / "config.json"
    if not config.is_file():
        raise UserError(f"{folder} has no config.json; a plan reads the model's shape from it (a Hugging Face "
                        "model folder)")
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{config} is not readable JSON ({e.__class__.__name__}); a plan reads the model's shape "
                        "from it") from None
    return shape_of_raw(raw, str(config))


def tiny_shape(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int, vocab: int) -> ModelShape:
    """The built-in tiny model's shape (portrl.models.tiny.write_tiny_model: Qwen2, tied embeddings), without
    writing it."""
    return ModelShape(model_type="qwen2", hidden=hidden, layers=layers, heads=heads, kv_heads=kv_heads,
                      head_dim=hidden // heads, intermediate=intermediate, vocab=vocab, tied=True, qkv_bias=True)


def shape_of_config(cfg: PortRLConfig) -> ModelShape:
    """The policy's shape from ``model.path`` (a settled config's, where the built-in tiny model is a folder too:
    portrl.trainer.resources.resolve_model_path)."""
    if not cfg.model.path:
        raise ValueError("shape_of_config needs model.path: resolve the built-in tiny model's folder first "
                         "(portrl.trainer.resources.resolve_model_path)")
    return shape_of_folder(cfg.model.path)
