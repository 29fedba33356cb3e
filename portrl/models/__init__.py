"""Hugging Face models: local loading with portrl's attention plugged in, packed log-probs, tiny test models."""

from portrl.models.attention import make_attention_forward, register_attention
from portrl.models.loader import load_causal_lm, load_processor, load_tokenizer, torch_dtype
from portrl.models.logprobs import compute_logprobs, pack_rows
from portrl.models.tiny import write_tiny_model
from portrl.models.tiny_vl import write_tiny_vl_model
from portrl.models.tokenizer import build_char_tokenizer

__all__ = [
    "build_char_tokenizer", "compute_logprobs", "load_causal_lm", "load_tokenizer", "make_attention_forward",
    "load_processor", "pack_rows", "register_attention", "torch_dtype", "write_tiny_model", "write_tiny_vl_model",
]
