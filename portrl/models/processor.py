"""A vision-language model's processor (tokenizer + image processor + chat template), saved and loaded locally.

transformers' Qwen2-VL / Qwen2.5-VL processors also hold a video processor, and transformers only defines video
processors when torchvision is installed: without it ``AutoProcessor.from_pretrained`` and the processors'
constructors fail on the missing video class although images never need it. :func:`load_vl_processor` then
builds the same processor class from its image processor, tokenizer and chat template with no video processor
(videos are not supported then); with torchvision it is plain ``AutoProcessor``. :func:`save_vl_processor`
writes the files a released model directory has (``preprocessor_config.json`` naming the processor class,
``chat_template.json``, the tokenizer files), which both ways load.
"""

from __future__ import annotations

import json
import logging
from typing import Any
from pathlib import Path

import transformers
from transformers import AutoConfig

log = logging.getLogger(__name__)


def _processor_class(path: Path):
    """The processor class a model directory names (``processor_class`` in its preprocessor / processor /
    tokenizer config), else the one transformers maps the config's model_type to; None when neither."""
    for name in ("processor_config.json", "preprocessor_config.json", "tokenizer_config.json"):
        f = path / name
        if f.is_file():
            cls_name = json.loads(f.read_text()).get("processor_class")
            if cls_name and hasattr(transformers, cls_name):
                return getattr(transformers, cls_name)
    # lazy: the processor mapping loads transformers' processing stack (image libraries), see load_vl_processor
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES  # noqa: PLC0415  (transformers: only where a model is built)

    model_type = AutoConfig.from_pretrained(str(path), local_files_only=True).model_type
    cls_name = PROCESSOR_MAPPING_NAMES.get(model_type)
    return getattr(transformers, cls_name) if cls_name and hasattr(transformers, cls_name) else None


def _without_video(cls: type) -> type:
    """``cls`` accepting ``video_processor=None`` (its constructor checks every sub-processor's class, and the
    video base class does not exist without torchvision)."""
    base: Any = cls  # a processor class chosen at run time

    class ImagesOnly(base):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None and argument_name == "video_processor":
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__, ImagesOnly.__qualname__ = cls.__name__, cls.__qualname__
    return ImagesOnly


def _chat_template(path: Path, tokenizer):
    for name in ("chat_template.jinja", "chat_template.json"):
        f = path / name
        if f.is_file():
            text = f.read_text()
            return json.loads(text)["chat_template"] if name.endswith(".json") else text
    return getattr(tokenizer, "chat_template", None)


def load_vl_processor(path):
    """``AutoProcessor.from_pretrained(path)`` (local files), or without torchvision the same processor class built
    from its image processor, tokenizer and chat template with no video processor."""
    # lazy: transformers' processing stack loads image libraries that text runs never need
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer  # noqa: PLC0415  (transformers: only where a model is built)
    from transformers.utils import is_torchvision_available  # noqa: PLC0415  (transformers: only where a model is built)

    p = Path(path)
    cls = None if is_torchvision_available() else _processor_class(p)
    if cls is None or "video_processor" not in cls.get_attributes():
        return AutoProcessor.from_pretrained(str(p), local_files_only=True)
    log.info("torchvision is not installed: %s without a video processor (images only)", cls.__name__)
    tokenizer = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    images = AutoImageProcessor.from_pretrained(str(p), local_files_only=True)
    return _without_video(cls)(image_processor=images, tokenizer=tokenizer, video_processor=None,
                               chat_template=_chat_template(p, tokenizer))


def save_vl_processor(processor, out_dir) -> None:
    """Write ``processor``'s files into ``out_dir`` as released model directories have them: the image
    processor's ``preprocessor_config.json`` (with ``processor_class``), ``chat_template.json`` and the tokenizer
    (whose config carries the chat template too). A video processor, when there is one, is saved as well."""
    out = Path(out_dir)
    processor.image_processor.save_pretrained(str(out))
    cfg_file = out / "preprocessor_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["processor_class"] = type(processor).__name__
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if getattr(processor, "video_processor", None) is not None:
        processor.video_processor.save_pretrained(str(out))
    tok = processor.tokenizer
    if processor.chat_template:
        tok.chat_template = processor.chat_template
        (out / "chat_template.json").write_text(json.dumps({"chat_template": processor.chat_template}, indent=2) + "\n")
    tok.save_pretrained(str(out))
