"""Issue #36, traces and agent metrics: ``agent_metrics`` values from hand-built multi-turn batches (and nothing for
single-turn ones), the trace writer (one line per trajectory, every trace_freq steps, the first trace_rows rows),
its cut on resume (as metrics.jsonl's), ``portrl trace`` output and every bad input (one line, exit 2), and one small
``run_training`` with trainer.trace_freq=1."""

import json

import pytest
import torch
from omegaconf import OmegaConf

from portrl.agent.trajectory import (META_NUM_TURNS, META_TOOL_CALLS, META_TOOL_ERRORS, META_TRACE, META_TURN_ENDS,
                                     META_TURN_REWARDS)
from portrl.cli import main
from portrl.models.tokenizer import build_char_tokenizer
from portrl.trainer.agent_metrics import agent_metrics
from portrl.trainer.traces import TRACES_FILE, TraceWriter, read_traces, trace_records
from portrl.workers.batch import build_rollout_batch

TOK = build_char_tokenizer()


def _ids(text):
    return TOK.encode(text)


def _single_turn(n=3, scores=(1.0, 0.0, 0.5)):
    """A scored single-turn rollout batch of ``n`` rows (prompts of different lengths: left padding)."""
    prompts = [_ids("1+1=" * (i + 1)) for i in range(n)]
    responses = [_ids(f"answer {i}") + [TOK.eos_token_id] for i in range(n)]
    b = build_rollout_batch(prompts, responses, meta={"uid": [f"u{i}" for i in range(n)],
                                                      "data_source": ["arith"] * n})
    T = b.tensors["responses"].shape[1]
    tls = torch.zeros(n, T)
    for i in range(n):
        tls[i, len(responses[i]) - 1] = scores[i]
    b["token_level_scores"] = tls
    b["acc"] = torch.tensor([s == 1.0 for s in scores[:n]])
    return b


CONVERSATION = [
    {"role": "user", "content": "What is 123456 * 654321?"},
    {"role": "assistant", "content": "Let me compute.",
     "tool_calls": [{"type": "function", "function": {"name": "calculator",
                                                      "arguments": "{\"expression\": \"123456*654321\"}"}}]},
    {"role": "tool", "name": "calculator", "content": "80779853376"},
    {"role": "assistant", "content": "The answer is 80779853376."},
]


def _multi_turn():
    """Four hand-built trajectories: turns 2, 1, 3, 1; tool calls 1, 0, 3, 0 of which 0, 0, 1 failed."""
    b = _single_turn(4, scores=(1.0, 0.0, 1.0, 0.0))
    b[META_NUM_TURNS] = [2, 1, 3, 1]
    b[META_TOOL_CALLS] = [1, 0, 3, 0]
    b[META_TOOL_ERRORS] = [0, 0, 1, 0]
    b[META_TURN_REWARDS] = [[0.5, 0.0], [0.0], [1.0, -0.5, 0.0], [0.25]]
    b[META_TURN_ENDS] = [[3, 9], [4], [2, 5, 9], [4]]
    b[META_TRACE] = [CONVERSATION, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}],
                     CONVERSATION, []]
    return b


# ------------------------------------------------------------------------------------------- metrics
def test_agent_metrics_exact():
    m = agent_metrics(_multi_turn())
    assert m == {"agent/num_turns/mean": 7 / 4, "agent/num_turns/max": 3.0, "agent/num_turns/min": 1.0,
                 "agent/tool_calls/mean": 1.0, "agent/tool_call_rate": 0.5, "agent/tool_error_rate": 0.25,
                 "agent/turn_reward/mean": 1.25 / 7}


def test_agent_metrics_over_chunks_with_a_prefix_and_none_for_single_turn():
    b = _multi_turn()
    whole = agent_metrics(b, prefix="val/")
    assert agent_metrics([b.slice(0, 1), b.slice(1, 4)], prefix="val/") == whole
    assert set(whole) == {"val/" + k for k in agent_metrics(b)}
    assert agent_metrics(_single_turn()) == {}
    assert agent_metrics([]) == {}


def test_no_tool_call_gives_a_zero_error_rate():
    b = _single_turn(2)
    b[META_NUM_TURNS] = [1, 1]
    m = agent_metrics(b)
    assert m["agent/tool_error_rate"] == 0.0 and m["agent/tool_call_rate"] == 0.0
    assert m["agent/turn_reward/mean"] == 0.0 and m["agent/num_turns/mean"] == 1.0


def test_validation_logs_val_agent_metrics_over_its_chunks():
    """validate() gathers agent metrics over every chunk of the validation prompts, prefixed val/."""
    from portrl.config.options_schema import default_config
    from portrl.trainer.validation import validate
    from portrl.workers.batch import Batch

    rollout = _multi_turn()

    class Gen:  # each chunk of 2 prompts is answered by the next 2 hand-built trajectories
        def __init__(self):
            self.at = 0

        def concat(self, method, chunk, params, **extra):
            assert method == "generate_from" and len(chunk) == 2
            self.at += 2
            return rollout.slice(self.at - 2, self.at)

    class Reward:
        def compute_reward(self, b):
            return Batch({"acc": b.tensors["acc"], "seq_scores": b.tensors["token_level_scores"].sum(-1)})

    cfg = default_config()
    OmegaConf.update(cfg, "data.val_batch_size", 2)
    out = validate(cfg, Gen(), Reward(), Batch(meta={"uid": list("abcd")}), step=3)
    assert {k: v for k, v in out.items() if "/agent/" in k} == agent_metrics(rollout, prefix="val/")
    assert out["val/acc/mean"] == 0.5
    single = validate(cfg, type("G", (), {"concat": lambda self, *a, **k: _single_turn(2, (1.0, 0.0))})(), Reward(),
                      Batch(meta={"uid": list("ab")}), step=3)
    assert not [k for k in single if "agent" in k]


# -------------------------------------------------------------------------------------------- writer
def test_single_turn_records_decode_prompt_and_response():
    b = _single_turn()
    recs = trace_records(5, b, rows=2, tokenizer=TOK)
    assert [r["row"] for r in recs] == [0, 1]
    r = recs[1]
    assert (r["step"], r["uid"], r["data_source"], r["num_turns"]) == (5, "u1", "arith", 1)
    assert r["score"] == 0.0 and r["acc"] == 0.0 and recs[0]["score"] == 1.0
    assert r["prompt"] == "1+1=1+1=" and r["messages"] == [{"role": "assistant", "content": "answer 1"}]


def test_multi_turn_records_carry_the_trace():
    recs = trace_records(1, _multi_turn(), rows=10, tokenizer=TOK)
    assert len(recs) == 4 and recs[0]["messages"] == CONVERSATION and recs[2]["num_turns"] == 3
    assert recs[3]["messages"] == []


def test_writer_every_freq_steps_first_rows_one_line_each(tmp_path):
    w = TraceWriter(tmp_path, freq=2, rows=2, tokenizer=TOK)
    for step in range(1, 6):
        w.observe(step, _single_turn())
    w.observe(6, None)  # a step that trained on nothing
    lines = (tmp_path / TRACES_FILE).read_text().splitlines()
    assert [(json.loads(x)["step"], json.loads(x)["row"]) for x in lines] == [(2, 0), (2, 1), (4, 0), (4, 1)]
    assert TraceWriter(tmp_path / "off", freq=0, rows=2, tokenizer=TOK).observe(1, _single_turn()) is None
    assert not (tmp_path / "off").exists()


def _steps(path):
    return [r["step"] for r in read_traces(path / TRACES_FILE)]


def test_resume_drops_the_lines_after_the_checkpoint(tmp_path):
    w = TraceWriter(tmp_path, freq=1, rows=1, tokenizer=TOK)
    for step in range(1, 5):
        w.observe(step, _single_turn())
    with open(tmp_path / TRACES_FILE, "a") as fh:
        fh.write('{"step": 5, "row"')  # a torn line of a killed run
    resumed = TraceWriter(tmp_path, freq=1, rows=1, tokenizer=TOK, resume_step=2)
    assert _steps(tmp_path) == [1, 2, 3, 4]  # nothing changes before the first step
    resumed.observe(3, _single_turn())
    resumed.observe(4, _single_turn())
    assert _steps(tmp_path) == [1, 2, 3, 4]
    assert len((tmp_path / TRACES_FILE).read_text().splitlines()) == 4  # the torn line went with the cut


def test_resume_without_tracing_still_cuts_and_a_fresh_start_removes(tmp_path):
    w = TraceWriter(tmp_path, freq=1, rows=1, tokenizer=TOK)
    for step in range(1, 4):
        w.observe(step, _single_turn())
    TraceWriter(tmp_path, freq=0, rows=1, tokenizer=TOK, resume_step=1).observe(2, _single_turn())
    assert _steps(tmp_path) == [1]
    TraceWriter(tmp_path, freq=0, rows=1, tokenizer=TOK, resume_step=0).observe(1, _single_turn())
    assert not (tmp_path / TRACES_FILE).exists()


# ----------------------------------------------------------------------------------------------- CLI
def _run_with_traces(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text("{}")
    w = TraceWriter(run, freq=2, rows=4, tokenizer=TOK)
    for step in (1, 2, 3, 4):
        w.observe(step, _multi_turn() if step == 4 else _single_turn())
    return run


def test_cli_shows_the_last_traced_step(tmp_path, capsys):
    run = _run_with_traces(tmp_path)
    assert main(["trace", str(run)]) == 0
    out = capsys.readouterr().out
    assert out.count("=== step 4 | row ") == 4 and "step 2" not in out
    assert "=== step 4 | row 0 | arith | score 1 | acc 1 | 2 turns ===" in out
    assert "\n    tool (calculator)\n        80779853376\n" in out
    assert '-> calculator(expression="123456*654321")' in out
    assert "    prompt\n" in out  # row 3's trace is empty: its prompt is shown
    assert out.index("    user\n") < out.index("    assistant\n") < out.index("    tool (calculator)")
    assert main(["trace", str(run), "--last", "--rows", "1"]) == 0
    assert capsys.readouterr().out.count("=== step 4") == 1


def test_cli_single_turn_step_and_wrapping(tmp_path, capsys, monkeypatch):
    run = _run_with_traces(tmp_path)
    assert main(["trace", str(run), "--step", "2", "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "=== step 2 | row 1 | arith | score 0 | acc 0 | 1 turn ===" in out
    assert "    prompt\n        1+1=1+1=\n    assistant\n        answer 1\n" in out
    from portrl.cli.trace import render

    long = {"step": 1, "row": 0, "num_turns": 1, "messages": [{"role": "assistant", "content": "word " * 60}]}
    lines = render(long, width=40)
    assert all(len(x) <= 40 for x in lines[1:]) and len(lines) > 6
    assert all(x.startswith("        word") for x in lines[2:])


@pytest.mark.parametrize("argv, phrase", [
    (["{tmp}/missing"], "is not a portrl run folder"),
    (["{tmp}/plain"], "is not a portrl run folder"),
    (["{tmp}/untraced"], "holds no traces (traces.jsonl is missing or empty); run with trainer.trace_freq=N"),
    (["{tmp}/run", "--step", "3"], "no traces of step 3; traced steps: 2, 4"),
    (["{tmp}/run", "--rows", "0"], "--rows=0 must be >= 1"),
    (["{tmp}/run", "--step", "two"], "invalid int value"),
    (["{tmp}/run", "--step", "2", "--last"], "not allowed with argument"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path, capsys, argv, phrase):
    _run_with_traces(tmp_path)
    (tmp_path / "plain").mkdir()
    (tmp_path / "untraced").mkdir()
    (tmp_path / "untraced" / "metrics.jsonl").write_text('{"step": 1}\n')
    try:
        rc = main(["trace", *[a.format(tmp=tmp_path) for a in argv]])
    except SystemExit as exc:  # argparse's usage errors: its usage line, then one error line
        rc = int(exc.code)
    err = capsys.readouterr().err
    assert rc == 2 and phrase in err and "Traceback" not in err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("portrl") and ": error: " in lines[-1]
    assert len(lines) == 1 or "usage:" in err


# ------------------------------------------------------------------------------------- config, a run
@pytest.mark.parametrize("key, value, phrase", [("trainer.trace_freq", -1, "trainer.trace_freq=-1 must be >= 1"),
                                                ("trainer.trace_rows", 0, "trainer.trace_rows=0 must be >= 1")])
def test_config_ranges(key, value, phrase):
    from portrl.config.checks import check_ranges
    from portrl.config.options_schema import default_config

    cfg = default_config()
    assert not [p for p in check_ranges(cfg) if "trace" in p]
    OmegaConf.update(cfg, key, value)
    assert any(p.startswith(phrase) for p in check_ranges(cfg))


def _train_cfg(model, out, **extra):
    from portrl.config.options_schema import default_config

    cfg = default_config()
    over = {"device.name": "cpu", "device.num_threads": 1, "model.path": model, "trainer.output_dir": str(out),
            "data.arith.num_train": 32, "data.arith.num_test": 4, "data.train_batch_size": 2,
            "data.max_response_length": 4, "rollout.n": 2, "actor.ppo_mini_batch_size": 4, "trainer.total_steps": 2,
            "trainer.test_freq": 0, "trainer.val_before_train": False, "trainer.progress_bar": False,
            "trainer.loggers": ["jsonl"], "trainer.plot": False, "trainer.export_hf": False,
            "trainer.save_final": False, "trainer.trace_freq": 1, "trainer.trace_rows": 3, **extra}
    for k, v in over.items():
        OmegaConf.update(cfg, k, v)
    return cfg


def test_training_writes_traces_every_step(tiny_model, tmp_path, capsys):
    from portrl.trainer import run_training

    run_training(_train_cfg(tiny_model, tmp_path / "run"))
    recs = read_traces(tmp_path / "run" / TRACES_FILE)
    assert [(r["step"], r["row"]) for r in recs] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]
    assert all(r["data_source"] and r["messages"][0]["role"] == "assistant" and r["prompt"] for r in recs)
    assert main(["trace", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.count("=== step 2 | row") == 3


def test_a_resumed_run_keeps_one_trace_per_step(tiny_model, tmp_path):
    """Killed after step 3 was logged but before its checkpoint: the continuation from step 2 traces step 3 again,
    and the file holds the new run's step 3 only, as metrics.jsonl does."""
    import shutil

    from portrl.trainer import run_training

    out = tmp_path / "run"
    run_training(_train_cfg(tiny_model, out, **{"trainer.total_steps": 3, "trainer.save_freq": 1}))
    shutil.rmtree(out / "checkpoints" / "global_step_3")
    first = read_traces(out / TRACES_FILE)
    run_training(_train_cfg(tiny_model, out, **{"trainer.total_steps": 3, "trainer.save_freq": 1,
                                                "trainer.trace_rows": 1}))
    recs = read_traces(out / TRACES_FILE)
    assert [(r["step"], r["row"]) for r in recs] == [(1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2), (3, 0)]
    assert recs[:6] == first[:6]
    metrics_steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert metrics_steps == [1, 2, 3]
