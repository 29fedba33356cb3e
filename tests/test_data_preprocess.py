"""``portrl preprocess`` end to end in a tmp dir, for each raw format, and the arith generator."""

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from portrl.cli import main
from portrl.data import GSM8K_INSTRUCTION, MATH_INSTRUCTION, DataError, make_arith_rows, preprocess, write_split
from portrl.data.arith import arith_problems, evaluate
from portrl.rewards import compute_score

GSM8K = Path(__file__).parent / "data" / "gsm8k_sample.jsonl"


def read(path):
    return pq.read_table(path).to_pylist()


def test_gsm8k_cli_end_to_end(tmp_path, capsys):
    assert main(["preprocess", "gsm8k", "--input", str(GSM8K), "--output-dir", str(tmp_path / "out"),
                 "--test-fraction", "0.2", "--seed", "3"]) == 0
    assert "train: 40 rows" in capsys.readouterr().out
    train, test = read(tmp_path / "out" / "train.parquet"), read(tmp_path / "out" / "test.parquet")
    assert len(train) == 40 and len(test) == 10
    raw = {json.loads(line)["question"]: json.loads(line) for line in GSM8K.read_text().splitlines()}
    for split, rows in (("train", train), ("test", test)):
        for i, row in enumerate(rows):
            assert row["data_source"] == "openai/gsm8k" and row["ability"] == "math"
            assert row["reward_model"]["style"] == "rule"
            assert row["extra_info"]["split"] == split and row["extra_info"]["index"] == i
            content = row["prompt"][0]["content"]
            assert row["prompt"][0]["role"] == "user" and content.endswith(" " + GSM8K_INSTRUCTION)
            original = raw[row["extra_info"]["question"]]
            assert content == original["question"] + " " + GSM8K_INSTRUCTION
            # the reference solution earns the reward on its own ground truth
            assert compute_score(row["data_source"], original["answer"], row["reward_model"]["ground_truth"])["score"] == 1.0
    assert {r["extra_info"]["question"] for r in train}.isdisjoint(r["extra_info"]["question"] for r in test)
    assert not list((tmp_path / "out").glob(".*tmp"))  # no temporary file left behind


def test_gsm8k_folder_with_split_files(tmp_path):
    raw = tmp_path / "raw"
    raw.mkdir()
    lines = GSM8K.read_text().splitlines()
    (raw / "train.jsonl").write_text("\n".join(lines[:30]) + "\n")
    records = [json.loads(line) for line in lines[30:]]
    pq.write_table(pa.Table.from_pylist(records), raw / "test-00000-of-00001.parquet")
    paths = preprocess("gsm8k", tmp_path / "out", raw)
    assert len(read(paths["train"])) == 30 and len(read(paths["test"])) == 20
    assert read(paths["test"])[0]["extra_info"]["question"] == records[0]["question"]  # test keeps file order
    one = preprocess("gsm8k", tmp_path / "n", raw, n=5)
    assert len(read(one["train"])) == 5 and len(read(one["test"])) == 5


def test_math_json_input(tmp_path):
    records = [
        {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "level": "Level 1", "type": "Algebra"},
        {"problem": "Half?", "solution": "We get \\boxed{\\frac{1}{2}}.", "level": "Level 3", "type": "Prealgebra"},
        {"problem": "Set?", "solution": "First \\boxed{1}, finally \\boxed{\\{1, 2\\}}", "level": "Level 5", "type": "X"},
        {"problem": "No box", "solution": "The answer is 4.", "level": "Level 2", "type": "Algebra"},
    ]
    src = tmp_path / "math.json"
    src.write_text(json.dumps(records))
    paths = preprocess("math", tmp_path / "out", src, test_fraction=0.0)
    rows = read(paths["train"])
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "\\frac{1}{2}", "\\{1, 2\\}"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["prompt"][0]["content"] == "What is $1+1$? " + MATH_INSTRUCTION
    assert rows[1]["extra_info"] == {"split": "train", "index": 1, "level": "Level 3", "type": "Prealgebra"}
    assert "test" not in paths and not (tmp_path / "out" / "test.parquet").exists()
    easy = preprocess("math", tmp_path / "easy", src, test_fraction=0.0, difficulty=3)
    assert [r["reward_model"]["ground_truth"] for r in read(easy["train"])] == ["2", "\\frac{1}{2}"]


def test_dapo_math_parquet_deduplicated(tmp_path):
    prompt = ("Solve the following math problem step by step. The last line of your response should be of the form "
              "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\nWhat is {}?\n\n"
              'Remember to put your answer on its own line after "Answer:".')
    records = [{"data_source": "math_dapo", "prompt": [{"content": prompt.format(k), "role": "user"}],
                "ability": "MATH", "reward_model": {"ground_truth": str(k), "style": "rule-lighteval/MATH_v2"},
                "extra_info": {"index": f"id-{k}"}} for k in range(10) for _ in range(3)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "dapo.parquet")
    paths = preprocess("dapo_math", tmp_path / "out", tmp_path / "dapo.parquet", test_fraction=0.2)
    train, test = read(paths["train"]), read(paths["test"])
    assert len(train) == 8 and len(test) == 2
    row = train[0]
    assert row["data_source"] == "math_dapo" and row["reward_model"]["style"] == "rule"
    assert row["prompt"][0]["content"] == prompt.format(row["reward_model"]["ground_truth"])
    assert row["extra_info"]["source_index"] == "id-" + row["reward_model"]["ground_truth"]
    assert compute_score("math_dapo", "...\nAnswer: " + row["reward_model"]["ground_truth"],
                         row["reward_model"]["ground_truth"])["score"] == 1.0


def test_bad_raw_rows_name_file_row_and_field(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"question": "q", "answer": "#### 1"}\n{"question": "q2"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl: row 1: field 'answer' is missing"):
        preprocess("gsm8k", tmp_path / "o", src)
    src.write_text('{"question": "q", "answer": "no marker"}\n')
    with pytest.raises(DataError, match=r"row 0: field 'answer' has no '#### <number>'"):
        preprocess("gsm8k", tmp_path / "o", src)
    src.write_text('{"question": 5, "answer": "#### 1"}\n')
    with pytest.raises(DataError, match=r"row 0: field 'question' must be str, got int"):
        preprocess("gsm8k", tmp_path / "o", src)
    src.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    with pytest.raises(DataError, match=r"bad.jsonl: line 2: invalid JSON"):
        preprocess("gsm8k", tmp_path / "o", src)
    (tmp_path / "m.jsonl").write_text('{"problem": "p", "solution": "\\\\boxed{1}", "level": 3}\n')
    with pytest.raises(DataError, match=r"m.jsonl: row 0: field 'level' must be str"):
        preprocess("math", tmp_path / "o", tmp_path / "m.jsonl")


def test_cli_errors(tmp_path, capsys):
    out = str(tmp_path / "o")
    assert main(["preprocess", "gsm8k", "--input", str(tmp_path / "missing.jsonl"), "--output-dir", out]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main(["preprocess", "gsm8k", "--output-dir", out]) == 2
    assert "gsm8k needs --input" in capsys.readouterr().err
    assert main(["preprocess", "arith", "--input", str(GSM8K), "--output-dir", out]) == 2
    assert main(["preprocess", "gsm8k", "--input", str(GSM8K), "--output-dir", out, "--difficulty", "2"]) == 2
    assert main(["preprocess", "arith", "--output-dir", out, "--difficulty", "11"]) == 2
    assert "difficulty must be in 1..10" in capsys.readouterr().err
    (tmp_path / "x.csv").write_text("a,b\n")
    assert main(["preprocess", "gsm8k", "--input", str(tmp_path / "x.csv"), "--output-dir", out]) == 2
    assert "unsupported input type '.csv'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["preprocess", "squad", "--output-dir", out])


def test_arith_cli_and_determinism(tmp_path, capsys):
    for name in ("a", "b"):
        assert main(["preprocess", "arith", "--output-dir", str(tmp_path / name), "--n", "500", "--seed", "7",
                     "--sft"]) == 0
    for f in ("train.parquet", "test.parquet", "sft_train.parquet", "sft_test.parquet"):
        assert read(tmp_path / "a" / f) == read(tmp_path / "b" / f)
    train, test = read(tmp_path / "a" / "train.parquet"), read(tmp_path / "a" / "test.parquet")
    assert len(train) == 450 and len(test) == 50
    assert {r["prompt"][0]["content"] for r in train}.isdisjoint(r["prompt"][0]["content"] for r in test)
    sft = read(tmp_path / "a" / "sft_train.parquet")
    assert all(r["response"] == r["reward_model"]["ground_truth"] for r in sft)
    for r in train + test:
        assert compute_score(r["data_source"], r["reward_model"]["ground_truth"], r["reward_model"]["ground_truth"])["score"] == 1.0


def test_arith_problems_by_difficulty():
    rows = make_arith_rows(300, seed=0, difficulty=1)
    assert rows == make_arith_rows(300, seed=0, difficulty=1)
    assert rows != make_arith_rows(300, seed=1, difficulty=1)
    assert rows[0]["prompt"] == [{"role": "user", "content": rows[0]["prompt"][0]["content"]}]
    for r in rows:
        text = r["prompt"][0]["content"]
        assert text.endswith("=")
        op = "+" if "+" in text else "-"
        a, b = (int(x) for x in text[:-1].split(op))
        assert a < 100 and b < 100 and min(a, b) < 10 and int(r["reward_model"]["ground_truth"]) == evaluate(a, op, b) >= 0
    level2 = [t for t, _ in arith_problems(300, seed=0, difficulty=2)]
    assert any(min(int(x) for x in t[:-1].replace("-", "+").split("+")) >= 10 for t in level2)
    hard = arith_problems(500, seed=0, difficulty=5)
    ops = {t.strip("0123456789=")[0] for t, _ in hard}
    assert ops == {"+", "-", "*"} and any(ans < 0 for _, ans in hard)
    for text, ans in hard:
        if "*" in text:
            a, b = text[:-1].split("*")
            assert len(a) <= 2 and len(b) <= 2 and int(a) * int(b) == ans
    assert len({t for t, _ in hard}) == 500
    with pytest.raises(ValueError, match="cannot draw 1000 distinct test problems"):
        arith_problems(1000, seed=0, difficulty=1, split="test", test_fraction=0.01)


def test_write_split_is_atomic(tmp_path, monkeypatch):
    target = write_split(make_arith_rows(3, seed=0), tmp_path / "t.parquet")
    before = target.read_bytes()

    def boom(*args, **kwargs):
        raise OSError("disk full")
    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(OSError, match="disk full"):
        write_split(make_arith_rows(5, seed=1), target)
    assert target.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["t.parquet"]


# ------------------------------------------------------------------------------------------------ qa
def _arrow_stream(table: pa.Table, path: Path) -> None:
    """An Arrow IPC stream file, as datasets' save_to_disk writes its data-*.arrow files."""
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def _save_to_disk(records: list, folder: Path) -> None:
    """A folder in the layout of datasets' Dataset.save_to_disk (written here: datasets is not a dependency)."""
    folder.mkdir(parents=True)
    _arrow_stream(pa.Table.from_pylist(records), folder / "data-00000-of-00001.arrow")
    (folder / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}],
                                                   "_fingerprint": "0", "_split": None}))
    (folder / "dataset_info.json").write_text(json.dumps({"features": {}}))


def test_qa_gsm8k_style_rows_score_with_the_math_reward(tmp_path, capsys):
    raw = [json.loads(line) for line in GSM8K.read_text().splitlines()]
    assert main(["preprocess", "qa", "--input", str(GSM8K), "--output-dir", str(tmp_path / "out")]) == 0
    assert "train: 45 rows" in capsys.readouterr().out
    train = read(tmp_path / "out" / "train.parquet")
    by_question = {r["question"]: r for r in raw}
    for row in train:
        original = by_question[row["extra_info"]["question"]]
        truth = row["reward_model"]["ground_truth"]
        assert truth == original["answer"].split("####")[-1].strip().replace(",", "")
        assert row["data_source"] == "qa_boxed" and row["ability"] == "math"
        assert row["prompt"] == [{"role": "user", "content": original["question"] + " " + MATH_INSTRUCTION}]
        # the data_source's reward: a boxed right answer scores 1, a boxed wrong one and an unboxed right one 0
        assert compute_score(row["data_source"], f"So the answer is \\boxed{{{truth}}}.", truth)["score"] == 1.0
        assert compute_score(row["data_source"], f"\\boxed{{{int(truth) + 1}}}", truth)["score"] == 0.0
        assert compute_score(row["data_source"], f"The answer is {truth}", truth)["score"] == 0.0


def test_qa_keys_boxed_and_numeric_answers_system_and_gsm8k_source(tmp_path):
    records = [{"problem": "Half of one?", "solution": "It is $\\boxed{\\frac{1}{2}}$.", "target": 0.5},
               {"problem": "Two times 3?", "solution": "2*3 = \\boxed{6}", "target": 6.0}]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "raw.parquet")
    preprocess("qa", tmp_path / "a", input_path=tmp_path / "raw.parquet", test_fraction=0.0, system="Be brief.")
    rows = read(tmp_path / "a" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["\\frac{1}{2}", "6"]  # problem/solution found
    assert rows[0]["prompt"][0] == {"role": "system", "content": "Be brief."}
    assert compute_score("qa_boxed", "\\boxed{1/2}", rows[0]["reward_model"]["ground_truth"])["score"] == 1.0

    preprocess("qa", tmp_path / "b", input_path=tmp_path / "raw.parquet", test_fraction=0.0, answer_key="target",
               data_source="openai/gsm8k")
    rows = read(tmp_path / "b" / "train.parquet")
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["0.5", "6"]  # 6.0 written as the number it is
    assert rows[1]["data_source"] == "openai/gsm8k" and rows[1]["prompt"][0]["content"].endswith(GSM8K_INSTRUCTION)
    assert compute_score("openai/gsm8k", "2*3=6\n#### 6", rows[1]["reward_model"]["ground_truth"])["score"] == 1.0

    preprocess("qa", tmp_path / "c", input_path=tmp_path / "raw.parquet", test_fraction=0.0, instruction="")
    assert read(tmp_path / "c" / "train.parquet")[1]["prompt"][0]["content"] == "Two times 3?"


def test_qa_saved_datasets_read_without_the_datasets_package(tmp_path):
    rows = [{"query": f"q{i}", "output": str(i)} for i in range(6)]
    _save_to_disk(rows[:4], tmp_path / "dd" / "train")
    _save_to_disk(rows[4:], tmp_path / "dd" / "validation")
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "validation"]}))
    paths = preprocess("qa", tmp_path / "out", input_path=tmp_path / "dd")
    train, test = read(paths["train"]), read(paths["test"])
    assert [r["extra_info"]["question"] for r in train] == ["q0", "q1", "q2", "q3"]
    assert [r["reward_model"]["ground_truth"] for r in test] == ["4", "5"]  # validation is the test split

    _save_to_disk(rows, tmp_path / "ds")  # a single saved Dataset: split by --test-fraction
    paths = preprocess("qa", tmp_path / "out2", input_path=tmp_path / "ds", test_fraction=0.5)
    assert len(read(paths["train"])) == 3 and len(read(paths["test"])) == 3


@pytest.mark.parametrize("record, args, message", [
    ({"q": "x", "a": "1"}, [], "no question key among question, problem, prompt, input, query; keys present: q, a; "
                              "name it with --question-key KEY"),
    ({"question": "x", "a": "1"}, [], "keys present: question, a; name it with --answer-key KEY"),
    ({"question": "x", "answer": "1"}, ["--answer-key", "nope"], "--answer-key 'nope' is not a key of the rows"),
    ({"question": "x", "answer": ""}, [], "row 0: field 'answer' ('') has no answer"),
    ({"question": "x", "answer": "1"}, ["--data-source", "apps"], "use `portrl preprocess code`"),
    ({"question": "x", "answer": "1"}, ["--n", "1"], None),
])
def test_qa_bad_rows_are_one_line_errors(tmp_path, capsys, record, args, message):
    (tmp_path / "raw.jsonl").write_text(json.dumps(record) + "\n")
    code = main(["preprocess", "qa", "--input", str(tmp_path / "raw.jsonl"), "--output-dir", str(tmp_path / "o"),
                 "--test-fraction", "0", *args])
    err = capsys.readouterr().err
    if message is None:
        assert code == 0 and (tmp_path / "o" / "train.parquet").is_file()
        return
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_qa_options_belong_to_qa(tmp_path, capsys):
    assert main(["preprocess", "gsm8k", "--input", str(GSM8K), "--output-dir", str(tmp_path / "o"),
                 "--question-key", "question"]) == 2
    assert "apply to qa only" in capsys.readouterr().err


def test_qa_chat_message_prompts_and_verl_reward_structs(tmp_path):
    records = [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1?"}],
                "reward_model": {"style": "rule", "ground_truth": "2"}}]
    (tmp_path / "raw.jsonl").write_text(json.dumps(records[0]) + "\n")
    preprocess("qa", tmp_path / "o", input_path=tmp_path / "raw.jsonl", test_fraction=0.0, answer_key="reward_model",
               system="ignored: the rows have one")
    row = read(tmp_path / "o" / "train.parquet")[0]
    assert row["prompt"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "1+1? " + MATH_INSTRUCTION}]
    assert row["reward_model"]["ground_truth"] == "2"
