"""A real, local Hugging Face tokenizer for tiny test/demo models: one token per character.

Vocabulary ("arith"): the special tokens ``<|endoftext|>`` (pad), ``<|im_start|>``,
``<|im_end|>`` (eos), ``<unk>``, then newline, tab and the 95 printable ASCII characters, so
every digit, operator (``+ - * / =``), letter and space is exactly one token and
``decode(encode(s)) == s`` for ASCII text. It is a ``tokenizers`` WordLevel model behind a
per-character split, wrapped in ``PreTrainedTokenizerFast`` (Rust, fast on the hot path) with a
ChatML chat template (the one Qwen2 uses).
"""

from __future__ import annotations

import string

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
UNK = "<unk>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END, UNK)

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

VOCABS = ("arith",)


def _characters() -> list[str]:
    printable = [chr(c) for c in range(32, 127)]  # space .. ~
    return ["\n", "\t", *printable]


def build_char_tokenizer(model_max_length: int = 2048):
    """A PreTrainedTokenizerFast with the "arith" vocabulary above (not saved; call save_pretrained)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = [*SPECIAL_TOKENS, *_characters()]
    assert len(set(tokens)) == len(tokens) and set(string.digits) <= set(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token=UNK,
        pad_token=PAD,
        eos_token=IM_END,
        additional_special_tokens=[IM_START],
        model_max_length=model_max_length,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tokenizer(vocab: str):
    """The tokenizer for a named vocabulary (see VOCABS)."""
    if vocab == "arith":
        return build_char_tokenizer()
    raise ValueError(f"unknown tiny vocabulary {vocab!r}; valid: {', '.join(VOCABS)} (or pass a tokenizer object)")
