"""Write a tiny Qwen2 causal LM and its tokenizer to disk, for tests and demos (no download)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch

from portrl.models.tokenizer import build_tokenizer
from portrl.user_files import new_dir


def write_tiny_model(out_dir, *, vocab="arith", hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
                     num_kv_heads: int = 2, intermediate_size: int | None = None, max_position_embeddings: int = 2048,
                     tie_word_embeddings: bool = True, initializer_range: float = 0.02, seed: int = 0, overwrite: bool = False) -> Path:
    """Save a randomly initialised Qwen2ForCausalLM (float32, safetensors) and a real HF tokenizer in ``out_dir``.

    ``vocab`` is a tiny vocabulary name ("arith": one token per ASCII character, ChatML specials; see
    portrl.models.tokenizer) or a tokenizer object to save alongside. The model's ``vocab_size`` is
    the tokenizer's length rounded up to a multiple of 16; eos is ``<|im_end|>``, pad ``<|endoftext|>``.
    ``intermediate_size`` defaults to ``4 * hidden_size``; ``initializer_range`` is the init std (larger
    values give peakier, more input-sensitive outputs for tests). Weights depend only on ``seed`` and the sizes.
    The directory is written under a temporary name and renamed; an existing non-empty ``out_dir`` is
    an error unless ``overwrite``.
    """
    # here, not at the top: the model class loads transformers' modeling stack (~2 s); portrl.trainer.preflight
    # imports this package to check a run's inputs before any model is built
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM  # noqa: PLC0415  (transformers: only where a model is built)

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True or choose another directory")
    if hidden_size % num_heads or num_heads % num_kv_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads}) and num_heads "
                         f"by num_kv_heads ({num_kv_heads})")
    if (hidden_size // num_heads) % 2:
        raise ValueError(f"head_dim = hidden_size / num_heads = {hidden_size // num_heads} must be even (rotary)")
    tokenizer = build_tokenizer(vocab) if isinstance(vocab, str) else vocab
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer needs an eos token")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    config = Qwen2Config(
        vocab_size=-(-len(tokenizer) // 16) * 16,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=pad_id,
        use_cache=True,
        initializer_range=initializer_range,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # transformers types .to as unbound
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=pad_id,
                                               bos_token_id=None)
    with new_dir(out) as tmp:
        with _no_progress_bars():  # a run's console shows its own progress only (the trainer writes this model)
            model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out


@contextmanager
def _no_progress_bars() -> Iterator[None]:
    """transformers' progress bars ("Writing model shards") off for the block, as they were after it."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415  (transformers: only where a model is built)

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
