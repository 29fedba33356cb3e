"""The token ids the chat template adds between model turns, and the strict check of the running ids.

Token in, token out: a trajectory's running ids are the prompt's ids, then each model turn's ids exactly as the
engine sampled them (ending with the stop token, the tokenizer's eos ``<|im_end|>``), then for each tool (or
environment) turn the ids the template adds for those messages up to the next generation prompt (the *delta*),
and so on. The model's tokens are never decoded and re-encoded.

The delta is computed as verl does: render a fixed base conversation (ending with an assistant turn) with and
without the new messages and take the difference; it begins right after the assistant turn's eos (so the ``\\n``
the template writes after ``<|im_end|>`` belongs to the delta) and ends with the next generation prompt
(``<|im_start|>assistant\\n``). Because it starts after a special token, tokenizing it alone gives the ids it
has inside the whole conversation.

The strict check (``rollout.multi_turn.tokenization_sanity_check_mode=strict``) compares the running ids with the
template's tokenization of the whole conversation. They can differ although every piece is right: a BPE tokenizer
may encode the decoded text of a model turn differently from the tokens the model sampled (``" 12"`` sampled as
``" 1"`` + ``"2"``), or the template may render a turn differently from what the model wrote (the tool-call JSON
with other spacing). Training goes on the sampled tokens either way; the check is for verifying a new model's
template and parser, and stops the run with :class:`TokenizationMismatch` naming the first differing position.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from portrl.errors import UserError

Messages = List[Dict[str, Any]]

# the fixed conversation the deltas are taken after (any content works: the delta starts after the assistant's eos)
_BASE: Messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
                   {"role": "assistant", "content": "A"}]
_CONTEXT = 12  # decoded tokens shown on each side of a mismatch


class TokenizationMismatch(UserError):
    """The running ids of a trajectory differ from the chat template's tokenization of its conversation."""


def _render(tokenizer: Any, messages: Messages, tools: Optional[Sequence[dict]], generation_prompt: bool) -> str:
    text = tokenizer.apply_chat_template(messages, tools=list(tools) if tools else None, tokenize=False,
                                         add_generation_prompt=generation_prompt)
    return str(text)


def _encode(tokenizer: Any, text: str) -> List[int]:
    """Ids of rendered template text, as ``apply_chat_template(tokenize=True)`` gives them (no special tokens
    added: the template wrote them)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_prompt_ids(tokenizer: Any, messages: Messages, tools: Optional[Sequence[dict]] = None) -> List[int]:
    """The prompt ids of ``messages`` with the generation prompt, the tools' schemas (OpenAI function schemas)
    given to the template (``tools=None`` when there are none)."""
    return _encode(tokenizer, _render(tokenizer, messages, tools, True))


class ChatDelta:
    """The delta ids of tool and user turns for one tokenizer and tool list (module docstring).

    The base conversation's rendering is computed once; each call renders the base plus the new messages and
    tokenizes only the text after the base's assistant eos.
    """

    def __init__(self, tokenizer: Any, tools: Optional[Sequence[dict]] = None):
        self.tokenizer = tokenizer
        self.tools = list(tools) if tools else None
        eos = tokenizer.eos_token
        if not eos or eos not in set(getattr(tokenizer, "all_special_tokens", ())):
            raise UserError(f"the tokenizer's eos {eos!r} is not a special token; multi-turn rollouts need the "
                            "assistant's end-of-turn token as the tokenizer's eos (<|im_end|> for ChatML models)")
        base = _render(tokenizer, _BASE, self.tools, False)
        end = base.rfind(eos)
        if end < 0 or not base[:end].endswith(_BASE[-1]["content"]):
            raise UserError(f"the chat template does not end an assistant turn with the tokenizer's eos {eos!r}; "
                            "multi-turn rollouts need a template whose assistant turns end with the model's stop token")
        self._base_text = base[:end + len(eos)]  # through the assistant's eos, the last token the model generated

    def _delta(self, messages: Messages) -> List[int]:
        full = _render(self.tokenizer, _BASE + messages, self.tools, True)
        if not full.startswith(self._base_text):
            raise UserError("the chat template renders the conversation before a tool turn differently when the "
                            "tool turn is added; multi-turn rollouts need a template that only appends")
        return _encode(self.tokenizer, full[len(self._base_text):])

    def tool_turn_ids(self, tool_texts: Sequence[str]) -> List[int]:
        """Ids after a model turn that ended with eos: its tool messages (one per text, in order) through the next
        generation prompt."""
        if not tool_texts:
            raise ValueError("tool_turn_ids needs at least one tool message")
        return self._delta([{"role": "tool", "content": str(t)} for t in tool_texts])

    def user_turn_ids(self, text: str) -> List[int]:
        """Ids after a model turn that ended with eos: a user (environment) message through the next generation
        prompt."""
        return self._delta([{"role": "user", "content": str(text)}])


def _context(tokenizer: Any, ids: Sequence[int], pos: int) -> str:
    lo, hi = max(0, pos - _CONTEXT), pos + _CONTEXT
    before = tokenizer.decode(list(ids[lo:pos]), skip_special_tokens=False)
    after = tokenizer.decode(list(ids[pos:hi]), skip_special_tokens=False)
    return repr(before) + " | " + repr(after)


def check_running_ids(tokenizer: Any, messages: Messages, tools: Optional[Sequence[dict]],
                      running_ids: Sequence[int]) -> None:
    """The strict check: ``render_prompt_ids(tokenizer, messages, tools)`` (the whole conversation with the
    generation prompt) must equal ``running_ids``; else :class:`TokenizationMismatch`, one line naming the first
    differing position with a short decoded context of both sides ("before | from there on")."""
    expected = render_prompt_ids(tokenizer, messages, tools)
    running = list(running_ids)
    if expected == running:
        return
    pos = next((i for i, (a, b) in enumerate(zip(expected, running)) if a != b), min(len(expected), len(running)))
    ids = ", ".join(f"{side} id {seq[pos]}" if pos < len(seq) else f"{side} ends" for side, seq in
                    (("template", expected), ("running", running)))
    raise TokenizationMismatch(
        f"multi-turn tokenization mismatch at token {pos} ({ids}; {len(expected)} vs {len(running)} ids): the chat "
        f"template gives {_context(tokenizer, expected, pos)} but the trajectory holds "
        f"{_context(tokenizer, running, pos)} (a model turn re-encodes differently from the tokens sampled, or the "
        "template renders it differently from what the model wrote); set "
        "rollout.multi_turn.tokenization_sanity_check_mode=disable to skip the check")
