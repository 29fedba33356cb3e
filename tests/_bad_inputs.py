"""The files the bad-input table of tests/test_cli_errors.py names (its ``{name}`` placeholders): rows that break
each rule of a data file, configs and YAML that do not parse or hold unknown keys, model folders that are no model,
and reward files that fail each way. :func:`write_bad_inputs` writes them all into one folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


class _PrintOnLoad:
    """Unpickled by a full pickle load it would call print(): torch's weights_only loader must refuse it."""

    def __reduce__(self):
        return (print, ("a model file ran code",))


def _write_parquet(path: Path, rows: list[dict]) -> str:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


#: model folders (config.json and the tiny tokenizer, no weights: the preflight reads only these) whose dimensions
#: do not split over some mesh: Qwen2.5-0.5B's, a family without tensor-parallel plans, grouped-query heads that
#: Ulysses cannot split, an MLP width and a vocabulary that tensor parallelism cannot, a vision-language model
MESH_MODELS = {
    "qwen_0_5b": {"model_type": "qwen2", "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                  "intermediate_size": 4864},
    "mistral": {"model_type": "mistral", "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32768,
                "intermediate_size": 14336},
    "kv6": {"model_type": "qwen2", "num_attention_heads": 12, "num_key_value_heads": 6, "vocab_size": 1024,
            "intermediate_size": 384},
    "mlp382": {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1024,
               "intermediate_size": 382},
    "vocab1001": {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1001,
                  "intermediate_size": 384},
    "qwen2_5_vl": {"model_type": "qwen2_5_vl", "text_config": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                               "vocab_size": 1024, "intermediate_size": 384}},
}


def _mesh_model_dirs(tmp: Path, f: dict[str, str]) -> None:
    from portrl.models.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("arith")
    for name, config in MESH_MODELS.items():
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps(config))
        tokenizer.save_pretrained(tmp / name)
        f[f"{name}_model"] = str(tmp / name)


def write_bad_inputs(tmp: Path) -> dict[str, str]:
    """Write every file into ``tmp``; returns placeholder name -> path (``tmp``: the folder itself)."""
    from portrl.data import make_arith_rows

    rows = make_arith_rows(8, seed=0, split="train")
    f: dict[str, str] = {"tmp": str(tmp)}
    _data_files(tmp, rows, f)
    _text_files(tmp, f)
    _model_dirs(tmp, f)
    _mesh_model_dirs(tmp, f)
    _reward_files(tmp, f)
    return f


def _data_files(tmp: Path, rows: list[dict], f: dict[str, str]) -> None:
    """Parquet and JSONL rows: each with one thing missing, wrong or undecodable; the code problems portrl ships."""
    def parquet(name: str, table: list[dict]) -> None:
        f[name] = _write_parquet(tmp / f"{name}.parquet", table)

    parquet("good", rows)
    parquet("no_prompt", [{k: v for k, v in r.items() if k != "prompt"} for r in rows])
    parquet("no_source", [{k: v for k, v in r.items() if k != "data_source"} for r in rows])
    parquet("no_reward", [{k: v for k, v in r.items() if k != "reward_model"} for r in rows])
    parquet("no_truth", [{**r, "reward_model": {"style": "rule"}} for r in rows])
    parquet("nan_truth", [{**r, "reward_model": {"style": "rule", "ground_truth": math.nan if i == 3 else float(i)}}
                          for i, r in enumerate(rows)])
    parquet("empty_truth", [{**r, "reward_model": {"style": "rule", "ground_truth": "" if i == 2 else "1"}}
                            for i, r in enumerate(rows)])
    parquet("unknown_source", [{**r, "data_source": "mystery"} for r in rows])
    parquet("prompt_str", [{**r, "prompt": "12+7="} for r in rows])
    f["empty_parquet"] = str(tmp / "empty_parquet.parquet")
    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), f["empty_parquet"])  # the columns, no rows
    from portrl.data.preprocess import preprocess

    code = preprocess("code", tmp / "code")  # the code problems shipped with portrl (data=code)
    f["code_train"], f["code_test"] = str(code["train"]), str(code["test"])
    (tmp / "bad.jsonl").write_text('{"question": "1+1?"}\n')
    f["bad_jsonl"] = str(tmp / "bad.jsonl")
    not_utf8 = pa.array([b"arith"] * 5 + [b"ari\xffth"] + [b"arith"] * 2, type=pa.binary()).view(pa.string())
    table = pa.Table.from_pylist(rows)
    pq.write_table(table.set_column(table.schema.get_field_index("data_source"), "data_source", not_utf8),
                   tmp / "not_utf8.parquet")
    f["not_utf8"] = str(tmp / "not_utf8.parquet")
    sft = pa.table({"prompt": table.column("prompt"), "response": not_utf8})
    pq.write_table(sft, tmp / "sft_not_utf8.parquet")
    f["sft_not_utf8"] = str(tmp / "sft_not_utf8.parquet")
    (tmp / "not_utf8.jsonl").write_bytes(b'{"question": "1+1?", "answer": "#### 2"}\n{"question": "\xff"}\n')
    f["jsonl_not_utf8"] = str(tmp / "not_utf8.jsonl")


def _text_files(tmp: Path, f: dict[str, str]) -> None:
    """YAML that does not parse, names an unknown key or a refused setting; a file that is no data; a run folder
    whose metrics do not parse; a user's folder that holds something."""
    (tmp / "text.txt").write_text("not parquet, not JSON\n")
    f["text_file"] = str(tmp / "text.txt")
    (tmp / "bad.yaml").write_text("trainer: [unclosed\n")
    f["bad_yaml"] = str(tmp / "bad.yaml")
    (tmp / "unknown.yaml").write_text("trainer:\n  totl_steps: 3\n")
    f["unknown_key_yaml"] = str(tmp / "unknown.yaml")
    (tmp / "env.yaml").write_text("device:\n  env:\n    LD_LIBRARY_PATH: /tmp\n")
    f["env_yaml"] = str(tmp / "env.yaml")
    (tmp / "oc_env.yaml").write_text("trainer:\n  project_name: ${oc.decode:${oc.env:HOME}}\n")
    f["oc_env_yaml"] = str(tmp / "oc_env.yaml")
    (tmp / "npu.yaml").write_text("device:\n  name: npu\n")
    (tmp / "verl_sp.yaml").write_text("actor:\n  sequence_parallel_size: 2\nactor_rollout_ref:\n  actor:\n"
                                      "    ulysses_sequence_parallel_size: 4\n")
    f["verl_sp_yaml"] = str(tmp / "verl_sp.yaml")
    f["npu_yaml"] = str(tmp / "npu.yaml")
    (tmp / "bad_tool_schema.yaml").write_text("tools:\n  - name: calculator\n    tool_schema: {type: function, "
                                               "function: {name: calc, parameters: {type: array}}}\n")
    f["bad_tool_schema"] = str(tmp / "bad_tool_schema.yaml")
    (tmp / "search_tools.yaml").write_text("tools:\n  - {name: search, config: {corpus_path: none.jsonl}}\n")
    f["search_tools"] = str(tmp / "search_tools.yaml")
    (tmp / "bad_run").mkdir()
    (tmp / "bad_run" / "metrics.jsonl").write_text("{not json\n")
    f["bad_run"] = str(tmp / "bad_run")
    (tmp / "user_folder").mkdir()
    (tmp / "user_folder" / "notes.txt").write_text("keep\n")
    f["user_folder"] = str(tmp / "user_folder")


def _model_dirs(tmp: Path, f: dict[str, str]) -> None:
    """Folders that are no model: empty, a config alone, a config that does not parse, weights that are a pickle
    building more than tensors or a damaged one."""
    (tmp / "empty").mkdir()
    f["empty_dir"] = str(tmp / "empty")
    (tmp / "config_only").mkdir()
    (tmp / "config_only" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    f["config_only"] = str(tmp / "config_only")
    (tmp / "bad_config").mkdir()
    (tmp / "bad_config" / "config.json").write_text("{not json")
    (tmp / "bad_config" / "tokenizer.json").write_text("{}")
    f["bad_config"] = str(tmp / "bad_config")
    for name in ("pickled_model", "damaged_pickle"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (tmp / name / "tokenizer.json").write_text("{}")
        f[name] = str(tmp / name)
    import torch

    torch.save({"w": torch.zeros(2), "hook": _PrintOnLoad()}, tmp / "pickled_model" / "pytorch_model.bin")
    (tmp / "damaged_pickle" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a whole zip")


def _reward_files(tmp: Path, f: dict[str, str]) -> None:
    """Custom reward files: a good one, and one that does not parse, raises on import, raises or returns a string."""
    rewards = {
        "reward_good": "VALUE = 3\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                       "    return float(solution_str.strip() == ground_truth)\n",
        "reward_syntax": "def compute_score(:\n",
        "reward_import_raises": "raise RuntimeError('needs a GPU to import')\n",
        "reward_raises": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                         "    return {'score': 1 / 0}\n",
        "reward_str": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return 'yes'\n",
    }
    for name, text in rewards.items():
        (tmp / f"{name}.py").write_text(text)
        f[name] = str(tmp / f"{name}.py")
