"""The code reward (portrl.rewards.code): verl's prime_code rules, run in the real sandbox.

Each scored case is a sandbox subprocess; hostile programs are in tests/test_rewards_sandbox.py, here they
only need to get a score through the reward.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq
import pytest

from portrl.cli import main
from portrl.data import DataError
from portrl.data.code import BUILTIN_PROBLEMS
from portrl.data.preprocess import preprocess
from portrl.rewards.code import compute_score, extract_program, stdout_matches
from portrl.rewards.registry import CODE_SOURCES, reward_kind
from portrl.rewards.registry import compute_score as routed_score

FAST = {"timeout_s": 2.0, "memory_mb": 256}
ADD = json.dumps({"inputs": ["1 2\n", "3 4\n", "5 5\n", "7 1\n"], "outputs": ["3\n", "7\n", "10\n", "8\n"]})
ADD_PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def fenced(program: str, before: str = "Here is my solution.\n") -> str:
    return f"{before}```python\n{program}```\nDone."


def test_extract_program_follows_verl():
    assert extract_program(fenced("print(1)\n")) == "\nprint(1)\n"
    two = "```python\nprint('first')\n```\nbetter:\n```python\nprint('second')\n```"
    assert extract_program(two) == "\nprint('second')\n"  # the last python block
    thought = "<think>```python\nprint('draft')\n```</think>" + fenced("print('final')\n")
    assert "final" in extract_program(thought) and "draft" not in extract_program(thought)
    assert extract_program("print(2)") == "print(2)"  # no fence: the whole response
    # as verl's prime_code, <think> is not removed: a block inside it is the program when it is the last one
    assert extract_program("<think>```python\nprint(3)\n```</think>The answer is above.") == "\nprint(3)\n"


def test_a_program_inside_think_scores_as_in_verl():
    """verl's prime_code scores the last python block wherever it is: 1.0 for a right program in <think>."""
    response = "<think>Let me write it.\n```python\n" + ADD_PROGRAM + "```\n</think>\nDone."
    assert compute_score(response, ADD, **FAST)["score"] == 1.0
    assert routed_score("apps", response, ADD, code=FAST)["score"] == 1.0


def test_stdout_comparison_rules():
    assert stdout_matches("3\n", "3")
    assert stdout_matches("  1 2 \n3  \n\n", "1 2\n3")  # surrounding / per-line whitespace
    assert stdout_matches("a\n\nb\n", "a\nb\n")  # empty lines
    assert stdout_matches("0.3333333\n", "0.33333333")  # numbers within verl's tolerance
    assert not stdout_matches("0.34\n", "0.33")
    assert not stdout_matches("10\n", "1")  # integers compare exactly
    assert not stdout_matches("1 2\n", "1\n2")
    assert stdout_matches("x\ny\n", ["x", "y"])  # expected as a list of lines
    assert stdout_matches("3\n", 3)  # a number in the JSON compares as its text


def test_correct_stdin_program_scores_one():
    result = compute_score(fenced(ADD_PROGRAM), ADD, **FAST)
    assert result == {"score": 1.0, "acc": 1.0, "passed": 4, "total": 4, "status": "ok"}


def test_partly_correct_program_scores_the_share():
    wrong_for_big = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n"
    result = compute_score(fenced(wrong_for_big), ADD, **FAST)
    assert (result["score"], result["acc"], result["passed"], result["status"]) == (0.5, 0.0, 2, "wrong")
    assert compute_score(fenced(wrong_for_big), ADD, continuous=False, **FAST)["score"] == 0.0


def test_only_the_first_ten_cases_count_when_continuous():
    inputs = [f"{i} 0\n" for i in range(12)]
    outputs = [f"{i}\n" for i in range(10)] + ["wrong\n", "wrong\n"]
    tests = json.dumps({"inputs": inputs, "outputs": outputs})
    result = compute_score(fenced(ADD_PROGRAM), tests, **FAST)
    assert (result["score"], result["total"]) == (1.0, 10)  # verl: the share of the first 10
    assert compute_score(fenced(ADD_PROGRAM), tests, continuous=False, **FAST)["score"] == 0.0


def test_all_or_nothing_stops_at_the_first_failure():
    import time

    slow_unless_first = "import time\nx = input()\nif x == '1':\n    print('bad')\nelse:\n    time.sleep(3)\n    print(x)\n"
    tests = json.dumps({"inputs": ["1", "2", "3", "4"], "outputs": ["1", "2", "3", "4"]})
    start = time.monotonic()
    result = compute_score(fenced(slow_unless_first), tests, continuous=False, timeout_s=5.0, memory_mb=256,
                           max_workers=1)
    assert (result["score"], result["passed"], result["status"]) == (0.0, 0, "wrong")
    assert time.monotonic() - start < 2.5  # the three slow cases never ran


def test_call_based_correct_and_incorrect():
    tests = json.dumps({"fn_name": "add", "inputs": [[1, 2], [3, 4]], "outputs": [3, 7]})
    assert compute_score(fenced("def add(a, b):\n    return a + b\n"), tests, **FAST)["score"] == 1.0
    wrong = compute_score(fenced("def add(a, b):\n    return a - b\n"), tests, **FAST)
    assert (wrong["score"], wrong["status"]) == (0.0, "wrong")
    noisy = "def add(a, b):\n    print('debug', a, b)\n    return a + b\n"  # printing does not disturb the result
    assert compute_score(fenced(noisy), tests, **FAST)["score"] == 1.0
    # PRIME's form: one JSON argument per line, outputs as JSON text; a Solution class; tuples compare as lists
    prime = json.dumps({"fn_name": "pair", "inputs": ["1\n2", "3\n4"], "outputs": ["[1, 2]", "[3, 4]"]})
    program = "class Solution:\n    def pair(self, a, b):\n        return (a, b)\n"
    assert compute_score(fenced(program), prime, **FAST)["score"] == 1.0


def test_call_based_outputs_are_unwrapped_once_per_problem():
    """APPS wraps every return value in a list: such a problem compares with the element, every case; a problem
    with any other output compares whole values, never also the first element (verl's per-comparison "or")."""
    apps = json.dumps({"fn_name": "sort_list", "inputs": [[[3, 1, 2]], [[2, 1]]], "outputs": [[[1, 2, 3]], [[1, 2]]]})
    assert compute_score(fenced("def sort_list(xs):\n    return sorted(xs)\n"), apps, **FAST)["score"] == 1.0
    # not wrapped: the sort task's outputs are lists of several values; min(xs) equals the first element only
    plain = json.dumps({"fn_name": "sort_list", "inputs": [[[3, 1, 2]], [[2, 1]]], "outputs": [[1, 2, 3], [1, 2]]})
    assert compute_score(fenced("def sort_list(xs):\n    return sorted(xs)\n"), plain, **FAST)["score"] == 1.0
    assert compute_score(fenced("def sort_list(xs):\n    return min(xs)\n"), plain, **FAST)["score"] == 0.0
    two_sum = json.dumps({"fn_name": "two_sum", "inputs": [[[2, 7, 11], 9], [[3, 3], 6]], "outputs": [[0, 1], [0, 1]]})
    assert compute_score(fenced("def two_sum(xs, t):\n    return 0\n"), two_sum, **FAST)["score"] == 0.0
    # a problem whose every output really is a one-element list says so
    single = json.dumps({"fn_name": "one", "inputs": [[1], [2]], "outputs": [[1], [2]], "outputs_wrapped": False})
    assert compute_score(fenced("def one(x):\n    return [x]\n"), single, **FAST)["score"] == 1.0
    assert compute_score(fenced("def one(x):\n    return x\n"), single, **FAST)["score"] == 0.0


def test_leetcode_assert_forms():
    tests = json.dumps({"asserts": ["assert candidate([1, 2]) == [1, 3]", "assert candidate([]) == []",
                                    "assert candidate([5]) == [5]"],
                        "entry_point": "Solution().runningSum", "setup": "from typing import List"})
    program = ("class Solution:\n    def runningSum(self, nums: List[int]) -> List[int]:\n"
               "        out = []\n        for x in nums:\n            out.append(x + (out[-1] if out else 0))\n"
               "        return out\n")
    assert compute_score(fenced(program), tests, **FAST)["score"] == 1.0
    partly = compute_score(fenced(program.replace("return out", "return out[:1]")), tests, **FAST)
    assert (partly["passed"], partly["status"]) == (2, "wrong")  # [1, 2] -> [1] fails its assert
    check = json.dumps({"test": "def check(candidate):\n    assert candidate(3) == 9\n", "entry_point": "sq"})
    assert compute_score(fenced("def sq(x):\n    return x * x\n"), check, **FAST)["score"] == 1.0
    assert compute_score(fenced("def sq(x):\n    return x + x\n"), check, **FAST)["score"] == 0.0


@pytest.mark.parametrize("exit_call", ["exit(0)", "import sys\nsys.exit(0)", "import os\nos._exit(0)"])
def test_a_program_that_exits_before_the_tests_fails(exit_call):
    asserts = json.dumps({"asserts": ["assert f(1) == 2"], "entry_point": "f"})
    check = json.dumps({"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"})
    calls = json.dumps({"fn_name": "f", "inputs": [[1]], "outputs": [2]})
    program = f"def f(x):\n    return 0\nprint('PASS')\n{exit_call}\n"
    for tests in (asserts, check, calls):
        result = compute_score(fenced(program), tests, **FAST)
        assert (result["score"], result["status"]) == (0.0, "wrong"), tests


@pytest.mark.parametrize("after, status", [("time.sleep(0.5)\nos._exit(0)\n", "wrong"),
                                           ("while True:\n    pass\n", "timeout")])
def test_a_program_that_closes_its_pipes_is_judged_by_how_it_exits(after, status):
    """The program's answers stop (its reply pipe closes) a while before it exits: its status is its own exit's,
    not the kill that ends the case (CI saw "runtime_error" for an exit(0) on a loaded machine)."""
    check = json.dumps({"test": "def check(candidate):\n    assert candidate(1) == 2\n", "entry_point": "f"})
    program = f"import os, time\ndef f(x):\n    return 0\nos.closerange(3, 1024)\n{after}"
    result = compute_score(fenced(program), check, **FAST)
    assert (result["score"], result["status"]) == (0.0, status)


@pytest.mark.parametrize("program, status", [
    ("while True:\n    pass\n", "timeout"),
    ("def f(:\n", "syntax_error"),
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", "timeout"),
    ("x = bytearray(10 ** 10)\n", "memory"),
    ("print(input())\nprint(input())\n", "runtime_error"),
])
def test_bad_programs_get_a_score(program, status):
    tests = json.dumps({"inputs": ["1\n"], "outputs": ["1\n1\n"]})
    result = compute_score(fenced(program), tests, timeout_s=1.0, memory_mb=256)
    assert (result["score"], result["status"]) == (0.0, status)


def test_malformed_ground_truth_is_a_data_error_naming_the_row():
    extra = {"index": 7, "split": "train"}
    for truth in ("not json", json.dumps([1, 2]), json.dumps({"inputs": ["1"]}),
                  json.dumps({"inputs": ["1"], "outputs": []}), json.dumps({"asserts": []})):
        with pytest.raises(DataError, match="row 7 \\(train\\)"):
            routed_score("apps", fenced(ADD_PROGRAM), truth, extra)


def test_registered_data_sources_route_to_the_code_reward():
    from portrl.rewards import code

    assert CODE_SOURCES is code.CODE_SOURCES  # one list: the registry routes the code reward's own sources
    for source in CODE_SOURCES:
        assert reward_kind(source) == "code"
    for source in ("codecontests", "apps", "codeforces", "taco", "leetcode"):
        result = routed_score(source, fenced(ADD_PROGRAM), ADD, {"index": 0}, code=FAST)
        assert result["score"] == 1.0 and result["total"] == 4
    # the code settings reach the code reward only: other rewards still score with them present
    assert routed_score("openai/gsm8k", "#### 72", "72", None, code=FAST)["score"] == 1.0


def test_reward_manager_scores_code_rows_with_the_configured_settings():
    from portrl.rewards import RewardManager

    manager = RewardManager(reward_kwargs={"code": {"continuous": False, **FAST}})
    result = manager.score([fenced(ADD_PROGRAM), fenced("print(3)\n"), "#### 5"],
                           ["apps", "taco", "openai/gsm8k"], [ADD, ADD, "5"])
    assert result.scores.tolist() == [1.0, 0.0, 1.0]  # all-or-nothing: "print(3)" passes 1 of 4


def test_shipped_problem_set_converts_and_its_references_pass(tmp_path):
    paths = preprocess("code", tmp_path / "out", test_fraction=0.0)
    rows = pq.read_table(paths["train"]).to_pylist()
    problems = {p["id"]: p for p in map(json.loads, BUILTIN_PROBLEMS.read_text().splitlines())}
    assert len(rows) == len(problems) >= 10
    forms = set()
    for row in rows:
        assert row["ability"] == "code" and row["data_source"] in CODE_SOURCES
        assert "```python" in row["prompt"][0]["content"]
        truth = row["reward_model"]["ground_truth"]
        forms.add("fn_name" if "fn_name" in truth else "asserts" if "asserts" in truth
                  else "test" if '"test"' in truth else "stdio")
        reference = problems[row["extra_info"]["problem_id"]]["reference"]
        result = routed_score(row["data_source"], fenced(reference), truth, row["extra_info"], code=FAST)
        assert result["score"] == 1.0, (row["extra_info"]["problem_id"], result)
    assert forms == {"stdio", "fn_name", "asserts", "test"}


def test_preprocess_code_cli(tmp_path, capsys):
    problems = tmp_path / "problems.jsonl"
    problems.write_text(json.dumps({"question": "Add two numbers.", "tests": json.loads(ADD)}) + "\n"
                        + json.dumps({"prompt": "Square it.", "tests": {"asserts": ["assert sq(2) == 4"]}}) + "\n")
    args = ["preprocess", "code", "--input", str(problems), "--test-fraction", "0"]
    launcher = "import sys; from portrl.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", launcher, *args, "--output-dir", str(tmp_path / "out"),
                           "--data-source", "taco"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["data_source"] for r in rows] == ["taco", "taco"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "tests": {"inputs": ["1"]}}) + "\n")
    assert main(args[:3] + [str(bad), "--output-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "row 0" in err and "outputs" in err and "Traceback" not in err
    assert main(args + ["--output-dir", str(tmp_path / "bad"), "--data-source", "gsm8k"]) == 2
    assert "not a code data source; valid: codecontests" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


# ------------------------------------------------------------------------------ SandboxFusion (remote)
class _FakeSandboxFusion:
    """A local HTTP server speaking SandboxFusion's documented /run_code shapes; it runs the code in portrl's
    local sandbox. ``fail_next`` answers 504 that many times first."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        fake = self
        self.requests, self.fail_next = [], 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.path, body))
                if fake.fail_next:
                    fake.fail_next -= 1
                    self.send_response(504)
                    self.end_headers()
                    return
                from portrl.rewards.sandbox import SandboxLimits, run_program

                local = run_program(body["code"], body["stdin"] or "",
                                    SandboxLimits(timeout_s=body["run_timeout"], memory_mb=256))
                run = {"status": "TimeLimitExceeded" if local.status == "timeout" else "Finished",
                       "execution_time": local.time_s, "return_code": local.returncode,
                       "stdout": local.stdout, "stderr": local.stderr}
                answer = json.dumps({"status": "Success" if local.status == "ok" else "Failed", "message": "",
                                     "compile_result": None, "run_result": run, "executor_pod_name": None,
                                     "files": {}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        import threading

        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fusion(monkeypatch):
    import portrl.rewards.sandbox_fusion as sf

    monkeypatch.setattr(sf, "RETRY_DELAY_S", 0.01)
    server = _FakeSandboxFusion()
    yield server
    server.close()


def test_sandbox_fusion_service_scores_like_the_local_sandbox(fusion):
    remote = {**FAST, "sandbox_fusion_url": fusion.url + "/run_code"}
    assert compute_score(fenced(ADD_PROGRAM), ADD, **remote)["score"] == 1.0
    path, body = fusion.requests[0]
    assert path == "/run_code" and body["language"] == "python"
    assert body["stdin"] in ("1 2\n", "3 4\n", "5 5\n", "7 1\n")
    assert set(body) == {"code", "language", "stdin", "compile_timeout", "run_timeout", "files", "fetch_files"}
    partly = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n"
    assert compute_score(fenced(partly), ADD, **remote)["score"] == 0.5
    looping = compute_score(fenced("while True:\n    pass\n"), ADD, **{**remote, "timeout_s": 1.0})
    assert (looping["score"], looping["status"]) == (0.0, "timeout")
    calls = json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})
    root_url = {**remote, "sandbox_fusion_url": fusion.url}  # the service root: /run_code is appended
    assert compute_score(fenced("def add(a, b):\n    return a + b\n"), calls, **root_url)["score"] == 1.0


def test_sandbox_fusion_retries_a_gateway_timeout_and_names_a_dead_service(fusion):
    from portrl.rewards.sandbox import SandboxError

    fusion.fail_next = 2
    assert compute_score(fenced(ADD_PROGRAM), json.dumps({"inputs": ["1 1"], "outputs": ["2"]}),
                         sandbox_fusion_url=fusion.url, **FAST)["score"] == 1.0
    assert len(fusion.requests) == 3
    dead = fusion.url
    fusion.close()
    with pytest.raises(SandboxError, match="SandboxFusion at .* failed 3 times"):
        compute_score(fenced(ADD_PROGRAM), ADD, sandbox_fusion_url=dead, **FAST)


def test_reward_code_config_reaches_the_code_reward():
    from portrl.config.composition import compose
    from portrl.trainer.reward_scoring import RewardScorer

    cfg = compose(overrides=["reward.code.continuous=false", "reward.code.timeout_s=2", "reward.code.memory_mb=256"])
    worker = RewardScorer(cfg, tokenizer=None)
    assert worker.manager.reward_kwargs == {"code": {"continuous": False, "timeout_s": 2.0, "memory_mb": 256,
                                                     "max_workers": 4, "allow_unisolated": False,
                                                     "packages": ("numpy",)}}  # and the sandbox's (sandbox.*)
    partly = "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n"
    assert worker.manager.score([fenced(partly)], ["apps"], [ADD]).scores.tolist() == [0.0]  # all-or-nothing
    default = RewardScorer(compose(overrides=["reward.code.memory_mb=256"]), tokenizer=None)
    assert default.manager.score([fenced(partly)], ["apps"], [ADD]).scores.tolist() == [0.5]  # verl's share


def test_train_on_code_rows_end_to_end(tmp_path, monkeypatch):
    """`portrl train` on the shipped problem set with the tiny model: its responses are scored in the sandbox
    (score 0: the tiny model writes no programs), and no sandbox folder is left behind."""
    import tempfile

    sandboxes = tmp_path / "tmp"
    sandboxes.mkdir()
    monkeypatch.setenv("TMPDIR", str(sandboxes))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    data = preprocess("code", tmp_path / "data", test_fraction=0.25)
    small = ["device.num_threads=1", "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64",
             "model.tiny.num_heads=2", "model.tiny.num_kv_heads=1", "data.train_batch_size=4", "rollout.n=2",
             "actor.ppo_mini_batch_size=4", "data.max_response_length=8", "model.sft_warm_start=false",
             "trainer.progress_bar=false", "data.max_prompt_length=512", "reward.code.timeout_s=2"]
    out = tmp_path / "run"
    assert main(["--log-level", "WARNING", "train", *small, "trainer.total_steps=2", "trainer.test_freq=2",
                 f"data.train_files=[{data['train']}]", f"data.val_files=[{data['test']}]",
                 f"trainer.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if r["step"] == 1)
    assert step["critic/score/mean"] == 0.0 and step["timing_s/reward"] > 0
    assert any(k.startswith("val/score/") and k != "val/score/mean" for k in rows[-1])
    assert not list(sandboxes.glob("portrl-sandbox-*"))


def test_apps_taco_rows_convert_with_their_starter_code(tmp_path):
    io = {"fn_name": "double", "inputs": [[2], [5]], "outputs": [[4], [10]]}  # APPS wraps outputs in a list
    raw = tmp_path / "taco.jsonl"
    raw.write_text(json.dumps({"question": "Double a number.", "input_output": json.dumps(io),
                               "starter_code": "def double(x):\n    "}) + "\n")
    rows = pq.read_table(preprocess("code", tmp_path / "out", raw, test_fraction=0.0,
                                    data_source="taco")["train"]).to_pylist()
    content = rows[0]["prompt"][0]["content"]
    assert "Start from this code:\n```python\ndef double(x):\n```" in content and rows[0]["data_source"] == "taco"
    result = routed_score("taco", fenced("def double(x):\n    return 2 * x\n"), rows[0]["reward_model"]["ground_truth"],
                          rows[0]["extra_info"], code=FAST)
    assert result["score"] == 1.0
