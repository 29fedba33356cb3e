"""Load a Hugging Face causal LM and its tokenizer from a local directory (never from the hub).

:func:`check_model_dir` is what can be known about a model directory without loading it (it exists, holds a
readable ``config.json`` and, when asked, tokenizer files); it raises :class:`ModelDirError`, a user error
naming the config key the path came from. The loaders run the same checks first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import json
import logging
import pickle
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoTokenizer

from portrl.errors import UserError
from portrl.models.attention import register_attention
from portrl.models.multimodal import is_vision_language
from portrl.models.processor import load_vl_processor
from portrl.models.tiny_vl import DEFAULT_DIR as TINY_VL_DIR
from portrl.ops.registry import _resolve_backend, select

if TYPE_CHECKING:
    from portrl.device.backend import Backend

log = logging.getLogger(__name__)

DTYPES = ("float32", "bfloat16", "float16", "float64")
HF_ATTENTION = ("hf_sdpa", "hf_eager")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
DOWNLOAD_HINT = "portrl loads local directories only; download the model first, e.g. " \
                "`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir /models/Qwen2.5-0.5B-Instruct`"


class ModelDirError(UserError, FileNotFoundError):
    """A model or tokenizer path is not a usable local Hugging Face directory."""


def check_model_dir(path, key: str = "model path", *, config: bool = True, tokenizer: bool = False) -> Path:
    """``path`` as a Path, checked to be a directory with a readable ``config.json`` (``config``) and tokenizer
    files (``tokenizer``); ModelDirError naming ``key`` (e.g. ``model.path``) and what is missing otherwise."""
    p = Path(path).expanduser()
    if not p.exists():
        hint = ("model=tiny-vl reads it there: build it first with `python -m portrl.models.write_tiny_vl`"
                if p == Path(TINY_VL_DIR).expanduser() else DOWNLOAD_HINT)
        raise ModelDirError(f"{key} {str(p)!r} does not exist ({hint})")
    if not p.is_dir():
        raise ModelDirError(f"{key} {str(p)!r} is not a directory; give a Hugging Face model directory "
                            "(config.json, weights, tokenizer files)")
    if config:
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ModelDirError(f"{key} {str(p)!r} has no config.json; it is not a Hugging Face model directory "
                                f"({DOWNLOAD_HINT})")
        try:
            ok = isinstance(json.loads(cfg.read_text()), dict)
        except (OSError, ValueError):
            ok = False
        if not ok:
            raise ModelDirError(f"{key} {str(p)!r}: config.json is not a JSON object; the model directory is "
                                "damaged, download it again")
    if tokenizer and not any((p / f).exists() for f in TOKENIZER_FILES):
        raise ModelDirError(f"{key} {str(p)!r} has no tokenizer files ({' / '.join(TOKENIZER_FILES[:2])}); "
                            "set model.tokenizer_path to a directory that has them, or download the full model")
    return p


def check_pickled_weights(path, key: str = "model path") -> None:
    """A model directory whose weights are pickles (``pytorch_model*.bin``, no ``*.safetensors``, which
    transformers would prefer) is loaded here with torch's ``weights_only`` unpickler, memory-mapped (nothing is
    read but the pickle's opcodes): a pickle that holds anything but tensors and plain containers is refused by
    torch, and that refusal becomes one ModelDirError naming the file and the object it wanted to build, before
    any worker starts. Nothing in the file runs either way."""
    p = Path(path).expanduser()
    if not p.is_dir() or any(p.glob("*.safetensors")):
        return
    for f in sorted(p.glob("pytorch_model*.bin")):
        try:
            try:
                torch.load(f, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:  # the legacy (non-zip) format cannot be memory-mapped
                if "mmap" not in str(exc):
                    raise
                torch.load(f, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            found = re.search(r"GLOBAL (\S+)", str(exc))
            what = f" ({found.group(1)})" if found else ""
            raise ModelDirError(f"{key} {str(p)!r}: {f.name} is a pickle that builds more than tensors{what}, which "
                                "torch's safe loader refuses and portrl never runs; use the model's safetensors "
                                "weights, or convert this file in an environment you trust") from None
        except (RuntimeError, OSError, EOFError) as exc:
            raise ModelDirError(f"{key} {str(p)!r}: {f.name} cannot be read as PyTorch weights "
                                f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); the file is damaged, "
                                "download it again") from None


def load_tokenizer(path):
    """``AutoTokenizer.from_pretrained(path, local_files_only=True)``; a missing path or tokenizer is a clear error."""
    p = check_model_dir(path, "tokenizer path", config=False, tokenizer=True)
    tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    if tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return tok


def load_processor(path):
    """The model's processor (``AutoProcessor``: tokenizer + image processor + chat template) when the directory
    has an image processor (``preprocessor_config.json``), else None (a text model). Local files only; see
    portrl/models/processor.py for how it loads without torchvision."""
    p = check_model_dir(path, "model path", config=False)
    if not (p / "preprocessor_config.json").is_file():
        return None
    processor = load_vl_processor(p)
    tok = getattr(processor, "tokenizer", None)
    if tok is not None and tok.pad_token_id is None and tok.eos_token_id is not None:
        tok.pad_token = tok.eos_token
    return processor


def torch_dtype(dtype):
    """A torch dtype from its name ("float32", "bfloat16", ...) or a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; valid: {', '.join(DTYPES)}")
    return getattr(torch, dtype)


def model_class(config):
    """transformers' auto class for ``config``: ``AutoModelForImageTextToText`` for a vision-language model
    (Qwen2-VL, Qwen2.5-VL), else ``AutoModelForCausalLM``."""
    # here, not at the top: the model classes load transformers' modeling stack (~2 s), which the checks of
    # portrl.trainer.preflight (check_model_dir, load_tokenizer) must not wait for
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText  # noqa: PLC0415  (transformers: only where a model is built)

    return AutoModelForImageTextToText if is_vision_language(config) else AutoModelForCausalLM


def load_causal_lm(path, dtype="float32", backend: Backend | None = None, attn_impl=None, gradient_checkpointing: bool = False,
                   device=None):
    """Load ``AutoModelForCausalLM`` (``AutoModelForImageTextToText`` for a vision-language model) from a local
    directory with the backend's varlen attention plugged in.

    ``backend``: a Backend, a backend name or None (resolved: --device / PORTRL_DEVICE / detection).
    ``attn_impl``: an implementation name of the ``attention_varlen`` op (None: the backend's first
    choice that runs here); "hf_sdpa" / "hf_eager" bypass portrl and use transformers' own attention
    (padded batches with 4-D masks; the baseline the benchmarks compare against).
    The chosen log-prob kernel is kept on the model for :func:`portrl.models.compute_logprobs`.
    With ``gradient_checkpointing`` the decoder layers recompute activations in backward (non-reentrant)
    and the KV cache is disabled. ``device``: move the model there after loading.
    """
    p = check_model_dir(path)
    be = _resolve_backend(backend)
    if attn_impl in HF_ATTENTION:
        attn_name, impl = attn_impl[3:], attn_impl
    else:
        impl, fn = select("attention_varlen", impl=attn_impl, backend=be)
        attn_name = register_attention(be.name, impl, fn)
    config = AutoConfig.from_pretrained(str(p), local_files_only=True)
    # a vision-language model (Qwen2-VL, Qwen2.5-VL) loads as transformers' image-text-to-text class; the attention
    # implementation applies to its text decoder and its vision tower alike (the vision blocks call it
    # non-causally per image / window; portrl/models/attention.py)
    try:
        # use_kernels=False: transformers 5.x otherwise "kernelizes" the model by default, swapping its norms, MLPs and
        # linears for kernels it fetches from the Hugging Face Hub on accelerators (and re-kernelizes at every
        # train() / eval(): 0.5 ms a switch on the CPU). portrl picks its kernels itself (portrl.ops), the same on
        # every device the parity harness checks, and runs offline.
        model = model_class(config).from_pretrained(str(p), config=config, dtype=torch_dtype(dtype),
                                                    attn_implementation=attn_name, local_files_only=True,
                                                    use_kernels=False)
    except pickle.UnpicklingError:  # torch refused a pickled weights file: name it as the preflight does
        check_pickled_weights(p)
        raise
    lp_impl, lp_fn = select("logprobs_entropy", backend=be)
    model.portrl_kernels = {"attention_varlen": impl, "logprobs_entropy": lp_impl}
    model.portrl_logprobs_entropy = lp_fn
    if gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False
    if device is not None:
        model.to(device)
    own_host_tensors(model)
    log.info("loaded %s (%s, %s) attention=%s logprobs=%s", p, type(model).__name__, dtype, impl, lp_impl)
    return model


def own_host_tensors(model: torch.nn.Module) -> None:
    """Copy each host-memory parameter and buffer out of the weights file it was mapped from, into memory the
    process allocates: a mapped file's pages are not counted as the device's allocated memory (the CPU backend
    counts what its allocator hands out, backends/cpu/heap.py), so a run's measured peaks would leave the policy's
    weights out, and the optimizer's first write of each page would fault a private copy of it anyway. A tensor on
    an accelerator is the device's own already and is left alone."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            if t.device.type == "cpu" and t.numel():
                t.data = t.data.clone()
