"""A real, local Hugging Face tokenizer for tiny test/demo models: Qwen2's byte-level BPE with no merges.

Vocabulary ("arith"): the 256 byte-level symbols (id = byte value, so every digit, operator
``+ - * / =``, letter, space and newline is exactly one token), then ``<|endoftext|>`` (256, pad),
``<|im_start|>`` (257) and ``<|im_end|>`` (258, eos): 259 tokens. It is a ``Qwen2Tokenizer`` (the
class transformers picks for a Qwen2 model directory, so it loads back identically with
``AutoTokenizer``), Rust-backed, with the ChatML chat template Qwen2 uses (and Qwen2.5's tool-calling branches,
without the tools' schemas in a system message: :data:`CHAT_TEMPLATE`).
``decode(encode(s)) == s`` for any text.
"""

from __future__ import annotations

from transformers import Qwen2Tokenizer

PAD = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

# ChatML, no default system prompt. Tool branches as Qwen2.5-Instruct's template (portrl/models/qwen25.py): an
# assistant's ``tool_calls`` as ``<tool_call>`` JSON, consecutive ``tool`` messages as ``<tool_response>`` blocks of one
# user turn; unlike Qwen2.5 the ``tools`` schemas are not listed in a system message (hundreds of byte tokens: the tiny
# demo model learns its tools by SFT). Any other message renders as before the tool branches, byte for byte.
CHAT_TEMPLATE = """{%- for message in messages %}
    {%- if message.role == "assistant" and message.tool_calls %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
        {{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""

VOCABS = ("arith",)


def byte_symbols() -> list[str]:
    """GPT-2 / Qwen2 byte-level alphabet: the printable symbol standing for each byte 0..255, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, extra = {}, 0
    for b in range(256):
        if b in printable:
            symbols[b] = chr(b)
        else:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]


def build_char_tokenizer(model_max_length: int = 2048, specials: tuple[str, ...] = ()):
    """A Qwen2Tokenizer over single bytes (the "arith" vocabulary above); call save_pretrained to store it.
    ``specials``: more special tokens, one id each after ``<|im_end|>`` (the tiny vision-language model's vision
    tokens, portrl/models/tiny_vl.py); the first 259 ids stay as above."""
    vocab = {sym: i for i, sym in enumerate(byte_symbols())}
    for special in (PAD, IM_START, IM_END, *specials):
        vocab[special] = len(vocab)
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=PAD,
        eos_token=IM_END,
        pad_token=PAD,
        extra_special_tokens=[IM_START, *specials],
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
