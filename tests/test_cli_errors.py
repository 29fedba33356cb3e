"""Every command's bad inputs: one line on stderr, exit code 2, no traceback, stopped before any model loads.

The table runs in-process through ``portrl.cli.main`` (a model load there fails the test: see ``no_heavy_work``);
a few rows run again as real ``portrl`` subprocesses to prove the exit code and the missing traceback end to end.
Argument strings use ``{name}`` placeholders for the files the ``inputs`` fixture writes.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from portrl.cli import main

Q = ["device.num_threads=1", "trainer.progress_bar=false"]  # every train / sft / eval row: quiet, one thread

# (id, argv, key phrase of the message, env)
CASES: list[tuple[str, list[str], str, dict]] = [
    # ---------------------------------------------------------------- config values (train / sft / eval / config)
    ("lr-zero", ["train", "actor.optim.lr=0"], "actor.optim.lr=0.0 must be > 0", {}),
    ("lr-negative", ["train", "actor.optim.lr=-1e-6"], "actor.optim.lr=-1e-06 must be > 0", {}),
    ("critic-lr-negative", ["train", "critic.optim.lr=-1"], "critic.optim.lr=-1.0 must be > 0", {}),
    ("freeze-with-lr", ["train", "actor.optim.freeze=true"], "actor.optim.freeze=true needs actor.optim.lr=0", {}),
    ("sft-lr-zero", ["train", "model.sft_lr=0"], "model.sft_lr=0.0 must be > 0", {}),
    ("clip-negative", ["train", "actor.clip_ratio=-0.1"], "actor.clip_ratio=-0.1 must be >= 0", {}),
    ("clip-high-negative", ["train", "actor.clip_ratio_high=-0.2"], "actor.clip_ratio_high=-0.2 must be >= 0", {}),
    ("clip-low-above-high", ["train", "actor.clip_ratio_low=0.3", "actor.clip_ratio_high=0.2"],
     "actor.clip_ratio_low=0.3 must be <= actor.clip_ratio_high=0.2", {}),
    ("clip-low-above-default-high", ["train", "actor.clip_ratio_low=0.5"], "must be <= actor.clip_ratio=0.2", {}),
    ("ppo-epochs-zero", ["train", "actor.ppo_epochs=0"], "actor.ppo_epochs=0 must be >= 1", {}),
    ("critic-ppo-epochs-zero", ["train", "critic.ppo_epochs=0"], "critic.ppo_epochs=0 must be >= 1", {}),
    ("total-steps-zero", ["train", "trainer.total_steps=0"], "trainer.total_steps=0 must be >= 1", {}),
    ("total-steps-negative", ["train", "trainer.total_steps=-5"], "trainer.total_steps=-5 must be >= 1", {}),
    ("parity-rollout-unknown-engine", ["parity", "rollout", "--device", "cpu", "--engine", "turbo"],
     "rollout engine 'turbo' (--engine) is not offered by backend 'cpu' here", {}),
    ("profile-step-after-the-run", ["train", "trainer.total_steps=4", "trainer.profile.steps=[2,9]"],
     "trainer.profile.steps=[2, 9] has [9]: each must be a step in 1..4", {}),
    ("num-workers-zero", ["train", "trainer.num_workers=0"], "trainer.num_workers=0 must be >= 1", {}),
    ("nnodes-zero", ["train", "trainer.nnodes=0"], "trainer.nnodes=0 must be >= 1", {}),
    ("save-freq-negative", ["train", "trainer.save_freq=-1"], "trainer.save_freq=-1 must be >= 1, or 0", {}),
    ("test-freq-negative", ["train", "trainer.test_freq=-2"], "trainer.test_freq=-2 must be >= 1, or 0", {}),
    ("max-ckpt-zero", ["train", "trainer.max_ckpt_to_keep=0"], "trainer.max_ckpt_to_keep=0 must be >= 1", {}),
    ("max-nonfinite-negative", ["train", "trainer.max_nonfinite_steps=-1"],
     "trainer.max_nonfinite_steps=-1 must be >= 1 (stop after that many steps in a row", {}),
    ("max-nonfinite-not-int", ["train", "trainer.max_nonfinite_steps=1.5"], "trainer.max_nonfinite_steps expects int",
     {}),
    ("max-nonfinite-word", ["train", "trainer.max_nonfinite_steps=never"], "trainer.max_nonfinite_steps expects int",
     {}),
    ("kl-coef-negative", ["train", "algorithm.kl_ctrl.kl_coef=-0.1"], "algorithm.kl_ctrl.kl_coef=-0.1 must be >= 0", {}),
    ("kl-loss-coef-negative", ["train", "actor.kl_loss_coef=-1"], "actor.kl_loss_coef=-1.0 must be >= 0", {}),
    ("temperature-negative", ["train", "rollout.temperature=-1"], "rollout.temperature=-1.0 must be > 0", {}),
    ("top-p-zero", ["train", "rollout.top_p=0"], "rollout.top_p=0.0 must be in (0, 1]", {}),
    ("top-p-above-one", ["train", "rollout.top_p=1.5"], "rollout.top_p=1.5 must be in (0, 1]", {}),
    ("top-k-below", ["train", "rollout.top_k=-2"], "rollout.top_k=-2 must be -1", {}),
    ("top-k-zero", ["train", "rollout.top_k=0"], "rollout.top_k=0 must be -1", {}),
    ("val-temperature-negative", ["eval", "rollout.val_kwargs.temperature=-0.5"],
     "rollout.val_kwargs.temperature=-0.5 must be > 0", {}),
    ("val-top-p-zero", ["eval", "rollout.val_kwargs.top_p=0"], "rollout.val_kwargs.top_p=0.0 must be in (0, 1]", {}),
    ("val-n-zero", ["eval", "rollout.val_kwargs.n=0"], "rollout.val_kwargs.n=0 must be >= 1", {}),
    ("rollout-cpu-cores-zero", ["train", "rollout.cpu_cores=0"], "rollout.cpu_cores=0 must be >= 1", {}),
    ("rollout-cpu-cores-too-many", ["train", "rollout.placement=separated", "rollout.cpu_cores=4096"],
     "rollout.cpu_cores=4096 is more than the", {}),
    ("sft-steps-zero-warm", ["train", "model.sft_warm_start=true", "model.sft_steps=0"],
     "model.sft_steps=0 must be >= 1", {}),
    ("batch-zero", ["train", "data.train_batch_size=0"], "must be >= 1", {}),
    ("batch-not-multiple", ["train", "data.train_batch_size=6", "actor.ppo_mini_batch_size=4"], "must be a multiple", {}),
    ("rollout-n-zero", ["train", "rollout.n=0"], "rollout.n=0 must be >= 1", {}),
    ("max-prompt-zero", ["train", "data.max_prompt_length=0"], "must be >= 1", {}),
    ("unknown-key", ["train", "actor.optim.lrr=1"], "Did you mean 'actor.optim.lr'", {}),
    ("wrong-type", ["train", "trainer.total_steps=abc"], "trainer.total_steps expects int", {}),
    ("unknown-algorithm", ["train", "algorithm=nosuch"], "unknown algorithm preset 'nosuch'", {}),
    ("unknown-engine", ["train", "rollout.engine=nosuch"], "rollout.engine='nosuch' is not one of", {}),
    ("unknown-logger", ["train", "trainer.loggers=[nosuch]"], "valid loggers", {}),
    ("logger-not-installed", ["train", "trainer.loggers=[console,mlflow]"], "trainer.loggers has mlflow, which is not "
                                                                          "installed", {}),
    ("override-not-kv", ["train", "nosuch"], "is not key=value", {}),
    ("override-bad-yaml", ["train", "data.train_files=[a, b"], "the value is not valid YAML (expected ',' or ']'", {}),
    ("config-missing", ["train", "--config", "{tmp}/missing.yaml"], "no such file", {}),
    ("config-bad-yaml", ["train", "--config", "{bad_yaml}"], "is not valid YAML", {}),
    ("config-unknown-key", ["train", "--config", "{unknown_key_yaml}"], "unknown config key 'trainer.totl_steps'", {}),
    ("config-show-bad", ["config", "show", "actor.ppo_epochs=0"], "actor.ppo_epochs=0 must be >= 1", {}),
    ("env-pythonpath", ["train", "device.env.PYTHONPATH=/tmp"], "device.env.PYTHONPATH is not accepted", {}),
    ("env-ld-preload", ["train", "device.env.LD_PRELOAD=/tmp/x.so"], "device.env.LD_PRELOAD is not accepted", {}),
    ("env-in-config-file", ["config", "show", "--config", "{env_yaml}"], "accepted: variables", {}),
    ("oc-env-override", ["train", "trainer.experiment_name=${{oc.env:HOME}}"],
     "override trainer.experiment_name=${{oc.env:HOME}}: trainer.experiment_name reads an environment variable", {}),
    ("oc-env-in-config-file", ["config", "show", "--config", "{oc_env_yaml}"],
     "oc_env.yaml: trainer.project_name reads an environment variable (${{oc.env:...}}), which portrl refuses", {}),
    ("resume-missing", ["train", "trainer.resume={tmp}/no_ckpt"], "no such checkpoint directory", {}),
    ("resume-not-ckpt", ["train", "trainer.resume={empty_dir}"], "trainer.resume", {}),
    # ---------------------------------------------------------------- CLI flags
    ("unknown-command", ["nosuch"], "invalid choice: 'nosuch'", {}),
    ("bad-log-level", ["--log-level", "LOUD", "devices"], "invalid choice: 'LOUD'", {}),
    ("devices-bad-flag", ["devices", "--bogus"], "unrecognized arguments: --bogus", {}),
    ("train-bad-flag", ["train", "--bogus"], "unrecognized arguments: --bogus", {}),
    ("sft-steps-not-int", ["sft", "--steps", "abc"], "invalid int value: 'abc'", {}),
    ("sft-steps-zero", ["sft", "--steps", "0"], "--steps 0 must be >= 1", {}),
    ("sft-lr-zero-flag", ["sft", "--lr", "0"], "--lr 0.0 must be > 0", {}),
    ("sft-batch-zero", ["sft", "--batch-size", "0"], "--batch-size 0 must be >= 1", {}),
    ("sft-output-is-file", ["sft", "--output", "{text_file}"], "--output", {}),
    ("config-bad-action", ["config", "nosuch"], "invalid choice: 'nosuch'", {}),
    ("config-show-bad-device", ["config", "show", "--device", "nosuch"], "unknown device 'nosuch'", {}),
    ("config-show-bad-preset", ["config", "show", "--preset", "nosuch"], "unknown device preset 'nosuch'", {}),
    ("preprocess-bad-task", ["preprocess", "nosuch", "--output-dir", "{tmp}/pp"], "invalid choice: 'nosuch'", {}),
    ("preprocess-no-output", ["preprocess", "arith"], "--output-dir", {}),
    ("preprocess-n-zero", ["preprocess", "arith", "--output-dir", "{tmp}/pp", "--n", "0"], "--n must be positive", {}),
    ("preprocess-fraction", ["preprocess", "arith", "--output-dir", "{tmp}/pp", "--test-fraction", "1.5"],
     "--test-fraction", {}),
    ("preprocess-difficulty", ["preprocess", "arith", "--output-dir", "{tmp}/pp", "--difficulty", "11"],
     "difficulty", {}),
    ("preprocess-no-input", ["preprocess", "gsm8k", "--output-dir", "{tmp}/pp"], "gsm8k needs --input", {}),
    ("preprocess-missing-input", ["preprocess", "gsm8k", "--input", "{tmp}/none.jsonl", "--output-dir", "{tmp}/pp"],
     "does not exist", {}),
    ("preprocess-bad-records", ["preprocess", "gsm8k", "--input", "{bad_jsonl}", "--output-dir", "{tmp}/pp"],
     "bad.jsonl", {}),
    ("preprocess-arith-input", ["preprocess", "arith", "--input", "{text_file}", "--output-dir", "{tmp}/pp"],
     "takes no --input", {}),
    ("plot-missing", ["plot", "{tmp}/norun"], "metrics.jsonl does not exist", {}),
    ("plot-bad-jsonl", ["plot", "{bad_run}"], "metrics.jsonl", {}),
    ("parity-no-sub", ["parity"], "required", {}),
    ("parity-replay-missing", ["parity", "replay", "--golden", "{tmp}/nogolden"], "is not a golden", {}),
    ("parity-compare-missing", ["parity", "compare", "{tmp}/none.json"], "none.json", {}),
    ("parity-compare-not-json", ["parity", "compare", "{text_file}"], "is not valid JSON", {}),
    ("parity-ops-size", ["parity", "ops", "--report", "{tmp}/r.json", "--size", "huge"], "unknown parity size 'huge' (--size); valid: standard,", {}),
    ("parity-ops-bad-device", ["parity", "ops", "--report", "{tmp}/r.json", "--device", "nosuch"],
     "unknown device 'nosuch'", {}),
    ("parity-e2e-envelope", ["parity", "e2e", "--envelope", "{tmp}/none.json"], "no envelope", {}),
    ("doctor-bad-device", ["doctor", "--device", "nosuch"], "unknown device 'nosuch'", {}),
    # ---------------------------------------------------------------- data files
    ("train-file-missing", ["train", "data.train_files=[{tmp}/none.parquet]"], "does not exist", {}),
    ("preset-data-not-preprocessed", ["train", "data=gsm8k", "data.train_files=[{tmp}/gsm8k/train.parquet]"],
     "`portrl preprocess gsm8k --input RAW --output-dir", {}),
    ("val-file-missing", ["train", "data.train_files=[{good}]", "data.val_files=[{tmp}/none.parquet]"],
     "does not exist", {}),
    ("train-file-not-parquet", ["train", "data.train_files=[{text_file}]"], "cannot be read as parquet", {}),
    ("no-prompt-column", ["train", "data.train_files=[{no_prompt}]"], "no column 'prompt'", {}),
    ("no-data-source-column", ["train", "data.train_files=[{no_source}]"], "no column 'data_source'", {}),
    ("no-reward-model-column", ["train", "data.train_files=[{no_reward}]"], "no column 'reward_model'", {}),
    ("ground-truth-missing", ["train", "data.train_files=[{no_truth}]"], "reward_model.ground_truth", {}),
    ("ground-truth-nan", ["train", "data.train_files=[{nan_truth}]"], "row 3: field 'reward_model.ground_truth' is NaN", {}),
    ("ground-truth-empty", ["train", "data.train_files=[{empty_truth}]"], "row 2: field 'reward_model.ground_truth' is empty", {}),
    ("unknown-data-source", ["train", "data.train_files=[{unknown_source}]"], "no built-in reward for data_source 'mystery'", {}),
    ("prompt-not-list", ["train", "data.train_files=[{prompt_str}]"], "must be a non-empty list of chat messages", {}),
    ("empty-parquet", ["train", "data.train_files=[{empty_parquet}]"], "has no rows", {}),
    ("batch-over-dataset", ["train", "data.train_files=[{good}]", "data.train_batch_size=16",
                            "actor.ppo_mini_batch_size=16"], "data.train_batch_size=16", {}),
    ("all-prompts-too-long", ["train", "data.train_files=[{good}]", "data.max_prompt_length=3", "data.train_batch_size=4",
                              "actor.ppo_mini_batch_size=4"], "only 0 of the 8 rows", {}),
    ("bad-val-file", ["train", "data.train_files=[{good}]", "data.val_files=[{no_prompt}]"], "no column 'prompt'", {}),
    ("named-data-no-files", ["train", "data.name=gsm8k"], "data.train_files is empty", {}),
    ("warm-start-other-data", ["train", "data.name=gsm8k", "data.train_files=[{good}]", "model.sft_warm_start=true"],
     "model.sft_warm_start trains on the generated rows of data.name=arith, arith_tool", {}),
    ("warm-start-own-files", ["train", "data.train_files=[{good}]", "model.sft_warm_start=true"],
     "not on data.train_files=", {}),
    ("sft-files-missing", ["sft", "--train-files", "{tmp}/none.parquet"], "does not exist", {}),
    ("sft-no-response", ["sft", "--train-files", "{good}"], "no column 'response'", {}),
    ("sft-named-data-no-files", ["sft", "data.name=gsm8k"], "--train-files is required", {}),
    ("eval-no-val-data", ["eval", "data.name=gsm8k", "data.train_files=[{good}]"], "no validation data", {}),
    ("eval-report-dir-missing", ["eval", "--report", "{tmp}/nodir/r.json"], "--report", {}),
    # ---------------------------------------------------------------- model directories
    ("model-missing", ["train", "model.path={tmp}/nomodel"], "does not exist", {}),
    ("model-is-file", ["train", "model.path={text_file}"], "is not a directory", {}),
    ("model-empty-dir", ["train", "model.path={empty_dir}"], "has no config.json", {}),
    ("model-no-tokenizer", ["train", "model.path={config_only}"], "no tokenizer files", {}),
    ("model-bad-config", ["train", "model.path={bad_config}"], "config.json", {}),
    ("tokenizer-missing", ["train", "model.tokenizer_path={tmp}/notok"], "does not exist", {}),
    ("critic-model-missing", ["train", "algorithm=ppo", "critic.model_path={tmp}/nocritic"], "critic.model_path", {}),
    ("eval-model-missing", ["eval", "--model", "{tmp}/nomodel"], "does not exist", {}),
    ("eval-model-empty", ["eval", "--model", "{empty_dir}"], "has no config.json", {}),
    ("sft-model-missing", ["sft", "model.path={tmp}/nomodel"], "does not exist", {}),
    ("eval-model-no-tokenizer", ["eval", "--model", "{config_only}"], "no tokenizer files", {}),
    ("reward-model-missing", ["train", "reward.model_path={tmp}/norm"], "reward.model_path", {}),
    ("output-dir-is-file", ["train", "trainer.output_dir={text_file}"], "trainer.output_dir", {}),
    ("val-batch-zero", ["eval", "data.val_batch_size=0"], "data.val_batch_size=0 must be >= 1", {}),
    # ---------------------------------------------------------------- checkpoints (eval --checkpoint)
    ("ckpt-missing", ["eval", "--checkpoint", "{tmp}/global_step_1"], "no such checkpoint directory", {}),
    ("ckpt-is-file", ["eval", "--checkpoint", "{text_file}"], "is not a directory", {}),
    ("ckpt-not-a-ckpt", ["eval", "--checkpoint", "{empty_dir}"], "is not a checkpoint", {}),
    # ---------------------------------------------------------------- reward files
    ("reward-file-missing", ["train", "reward.custom.path={tmp}/none.py"], "does not exist", {}),
    ("reward-syntax-error", ["train", "reward.custom.path={reward_syntax}"], "failed to import: SyntaxError", {}),
    ("reward-import-raises", ["train", "reward.custom.path={reward_import_raises}"], "failed to import: RuntimeError", {}),
    ("reward-no-function", ["train", "reward.custom.path={reward_good}", "reward.custom.name=nosuch"],
     "defines no 'nosuch'", {}),
    ("reward-not-callable", ["train", "reward.custom.path={reward_good}", "reward.custom.name=VALUE"],
     "not a function", {}),
    ("reward-raises", ["train", "reward.custom.path={reward_raises}"], "raised on row 0 (data_source 'arith'): "
                                                                        "ZeroDivisionError", {}),
    ("reward-returns-str", ["train", "reward.custom.path={reward_str}"], "returned str", {}),
    ("reward-is-dir", ["train", "reward.custom.path={empty_dir}"], "reward.custom.path", {}),
    # ---------------------------------------------------------------- devices
    ("device-unknown", ["train", "--device", "nosuch"], "unknown device 'nosuch'", {}),
    ("device-npu-flag", ["train", "--device", "npu"], "device 'npu' (from --device) is not usable here", {}),
    ("device-npu-env", ["train"], "device 'npu' (from $PORTRL_DEVICE) is not usable here", {"PORTRL_DEVICE": "npu"}),
    ("device-npu-env-unknown", ["train"], "unknown device 'nosuch'", {"PORTRL_DEVICE": "nosuch"}),
    ("device-cuda-override", ["train", "device=cuda"], "device 'cuda' (from override device=cuda) is not usable", {}),
    ("device-name-override", ["train", "device.name=rocm"], "(from override device.name=rocm) is not usable", {}),
    ("device-preset", ["train", "--preset", "ascend-910b"], "(from preset ascend-910b) is not usable", {}),
    ("device-config-file", ["train", "--config", "{npu_yaml}"], "npu.yaml) is not usable", {}),
    ("device-preset-mismatch", ["train", "--device", "cpu", "--preset", "h100"], "is for device 'cuda', not 'cpu'", {}),
    ("device-bad-kernel", ["train", "--device", "cpu", "device.kernels.rms_norm=nosuch"], "device.kernels.rms_norm", {}),
    ("sft-device-npu", ["sft", "--device", "npu"], "device 'npu' (from --device) is not usable here", {}),
    ("engine-not-here", ["train", "rollout.engine=vllm"], "rollout.engine=vllm is not available on backend 'cpu'", {}),
    ("dtype-not-here", ["train", "--device", "cpu", "device.dtype=float16"], "dtype 'float16' is not supported", {}),
    ("eval-device-npu", ["eval", "--device", "npu"], "device 'npu' (from --device) is not usable here", {}),
    # ---------------------------------------------------------------- text that is not UTF-8, pickled weights
    ("parquet-not-utf8", ["train", "data.train_files=[{not_utf8}]"], "row 5: column 'data_source' holds text that "
                                                                       "is not valid UTF-8", {}),
    ("sft-parquet-not-utf8", ["sft", "--train-files", "{sft_not_utf8}"], "column 'response' holds text that is not "
                                                                          "valid UTF-8", {}),
    ("preprocess-jsonl-not-utf8", ["preprocess", "gsm8k", "--input", "{jsonl_not_utf8}", "--output-dir", "{tmp}/pp"],
     "line 2 is not valid UTF-8", {}),
    ("model-pickled-code", ["train", "model.path={pickled_model}"], "pytorch_model.bin is a pickle that builds more "
                                                                     "than tensors", {}),
    ("eval-model-pickled-code", ["eval", "--model", "{pickled_model}"], "pytorch_model.bin is a pickle", {}),
    ("model-pickle-damaged", ["train", "model.path={damaged_pickle}"], "cannot be read as PyTorch weights", {}),
    # ---------------------------------------------------------------- output paths that hold something
    ("sft-output-not-empty", ["sft", "--output", "{tmp}"], "is a non-empty folder that this command did not write", {}),
    ("eval-report-exists", ["eval", "--report", "{text_file}"], "is an existing file that this command did not write",
     {}),
    ("train-output-users-files", ["train", "trainer.output_dir={user_folder}"], "holds files that are not a portrl "
                                                                                "run (notes.txt)", {}),
    ("on-existing-bad", ["plot", "{bad_run}", "--on-existing", "overwrite"], "invalid choice: 'overwrite'", {}),
    # ---------------------------------------------------------------- multi-turn rollouts (portrl/agent/)
    ("tool-parser-unknown", ["train", "rollout.multi_turn.enable=true", "rollout.multi_turn.format=mistral"],
     "rollout.multi_turn.format='mistral' is not a tool-call parser; valid: hermes", {}),
    ("tool-config-missing", ["train", "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path={tmp}/no.yaml"],
     "tool config '{tmp}/no.yaml' does not exist", {}),
    ("tool-schema-malformed", ["train", "rollout.multi_turn.enable=true",
                               "rollout.multi_turn.tool_config_path={bad_tool_schema}"], "tools[0]", {}),
    ("search-corpus-missing", ["train", "rollout.multi_turn.enable=true",
                               "rollout.multi_turn.tool_config_path={search_tools}"],
     "search corpus '{tmp}/none.jsonl' does not exist (config.corpus_path of the search tool)", {}),
    ("interaction-config-missing", ["train", "rollout.multi_turn.enable=true",
                                    "rollout.multi_turn.interaction_config_path={tmp}/none.yaml"],
     "interaction config '{tmp}/none.yaml' does not exist", {}),
    ("truncate-side-bad", ["train", "rollout.multi_turn.tool_response_truncate_side=top"],
     "rollout.multi_turn.tool_response_truncate_side='top' is not one of 'left', 'right', 'middle'", {}),
    # ---------------------------------------------------------------- the code sandbox (sandbox.*; a platform that
    # refuses it: SANDBOX_FAULT_CASES below)
    ("sandbox-package-not-a-name", ["train", "sandbox.packages=[numpy,scikit-learn]"],
     "sandbox.packages has 'scikit-learn', which is not an importable name", {}),
    ("sandbox-package-not-installed", ["train", "data=code", "data.train_files=[{code_train}]",
                                       "data.val_files=[{code_test}]", "sandbox.packages=[numpy,portrl_no_such_pkg]"],
     "sandbox.packages has portrl_no_such_pkg, which is not installed in this interpreter", {}),
    ("sandbox-package-python-tool", ["train", "rollout.multi_turn.enable=true",
                                     "rollout.multi_turn.tool_config_path=configs/tools/python.yaml",
                                     "sandbox.packages=[portrl_no_such_pkg]"],
     "(needed by the python tool (rollout.multi_turn.tool_config_path))", {}),
    ("sandbox-fusion-assert-rows", ["train", "data=code", "data.train_files=[{code_train}]",
                                    "data.val_files=[{code_test}]", "reward.code.sandbox_fusion_url=http://127.0.0.1:9"],
     "has assert- or check()-style code tests, which are judged in a sandbox beside the program's", {}),
]
SUBPROCESS_IDS = ["device-npu-flag", "ground-truth-nan", "reward-import-raises", "ckpt-not-a-ckpt", "plot-missing",
                  "sft-output-not-empty", "oc-env-override",
                  "lr-zero", "unknown-command"]
TRAINING_COMMANDS = ("train", "sft", "eval")


class _PrintOnLoad:
    """Unpickled by a full pickle load it would call print(): torch's weights_only loader must refuse it."""

    def __reduce__(self):
        return (print, ("a model file ran code",))


def _write_parquet(path: Path, rows: list[dict]) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    """The files the table's placeholders name (one tiny model dir, parquet variants, reward files, YAML)."""
    from portrl.data import make_arith_rows

    tmp = tmp_path_factory.mktemp("bad_inputs")
    rows = make_arith_rows(8, seed=0, split="train")
    f: dict[str, str] = {"tmp": str(tmp)}

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
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows).slice(0, 0), f["empty_parquet"])  # the columns, no rows
    (tmp / "text.txt").write_text("not parquet, not JSON\n")
    f["text_file"] = str(tmp / "text.txt")
    (tmp / "empty").mkdir()
    f["empty_dir"] = str(tmp / "empty")
    (tmp / "config_only").mkdir()
    (tmp / "config_only" / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    f["config_only"] = str(tmp / "config_only")
    (tmp / "bad_config").mkdir()
    (tmp / "bad_config" / "config.json").write_text("{not json")
    (tmp / "bad_config" / "tokenizer.json").write_text("{}")
    f["bad_config"] = str(tmp / "bad_config")
    (tmp / "bad.yaml").write_text("trainer: [unclosed\n")
    f["bad_yaml"] = str(tmp / "bad.yaml")
    (tmp / "unknown.yaml").write_text("trainer:\n  totl_steps: 3\n")
    f["unknown_key_yaml"] = str(tmp / "unknown.yaml")
    (tmp / "env.yaml").write_text("device:\n  env:\n    LD_LIBRARY_PATH: /tmp\n")
    f["env_yaml"] = str(tmp / "env.yaml")
    (tmp / "oc_env.yaml").write_text("trainer:\n  project_name: ${oc.decode:${oc.env:HOME}}\n")
    f["oc_env_yaml"] = str(tmp / "oc_env.yaml")
    (tmp / "npu.yaml").write_text("device:\n  name: npu\n")
    f["npu_yaml"] = str(tmp / "npu.yaml")
    (tmp / "bad_tool_schema.yaml").write_text("tools:\n  - name: calculator\n    tool_schema: {type: function, "
                                               "function: {name: calc, parameters: {type: array}}}\n")
    f["bad_tool_schema"] = str(tmp / "bad_tool_schema.yaml")
    (tmp / "search_tools.yaml").write_text("tools:\n  - {name: search, config: {corpus_path: none.jsonl}}\n")
    f["search_tools"] = str(tmp / "search_tools.yaml")
    from portrl.data.preprocess import preprocess

    code = preprocess("code", tmp / "code")  # the code problems shipped with portrl (data=code)
    f["code_train"], f["code_test"] = str(code["train"]), str(code["test"])
    (tmp / "bad.jsonl").write_text('{"question": "1+1?"}\n')
    f["bad_jsonl"] = str(tmp / "bad.jsonl")
    (tmp / "bad_run").mkdir()
    (tmp / "bad_run" / "metrics.jsonl").write_text("{not json\n")
    f["bad_run"] = str(tmp / "bad_run")
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
    for name in ("pickled_model", "damaged_pickle"):
        (tmp / name).mkdir()
        (tmp / name / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
        (tmp / name / "tokenizer.json").write_text("{}")
        f[name] = str(tmp / name)
    import torch

    torch.save({"w": torch.zeros(2), "hook": _PrintOnLoad()}, tmp / "pickled_model" / "pytorch_model.bin")
    (tmp / "damaged_pickle" / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a whole zip")
    (tmp / "user_folder").mkdir()
    (tmp / "user_folder" / "notes.txt").write_text("keep\n")
    f["user_folder"] = str(tmp / "user_folder")
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
    return f


@pytest.fixture
def no_heavy_work(monkeypatch, tmp_path):
    """Any model load, worker start or training step in a table row fails the test (it must stop before)."""
    import transformers

    def refuse(*args, **kwargs):
        raise AssertionError("heavy work started: a model load was reached")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setenv("PORTRL_CACHE", str(tmp_path / "cache"))  # the tiny model would be written here
    monkeypatch.delenv("PORTRL_DEVICE", raising=False)
    monkeypatch.delenv("PORTRL_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)


def _argv(argv: list[str], files: dict[str, str]) -> list[str]:
    out = [a.format(**files) for a in argv]
    if out and out[0] in TRAINING_COMMANDS:
        out += Q
    return ["--log-level", "WARNING", *out]


def _run_in_process(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exc:  # argparse's usage errors
        return int(exc.code)


@pytest.mark.parametrize("case_id, argv, phrase, env", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_clearly(case_id, argv, phrase, env, inputs, no_heavy_work, monkeypatch, capsys):
    if case_id == "logger-not-installed" and importlib.util.find_spec("mlflow") is not None:
        pytest.skip("mlflow is installed here")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = _run_in_process(_argv(argv, inputs))
    err = capsys.readouterr().err
    assert rc == 2, f"exit code {rc}, stderr: {err}"
    assert "Traceback" not in err
    assert phrase.format(**inputs) in err
    lines = [line for line in err.splitlines() if line.strip() and " WARNING " not in line]
    if "usage:" in err:  # argparse: its usage, then one "error:" line
        assert lines[-1].startswith("portrl") and ": error: " in lines[-1], err
    else:
        assert len(lines) == 1 and lines[0].startswith(f"portrl {argv[0]}: error: "), err


def test_table_covers_every_command():
    commands = {c[1][2] if c[1][0] == "--log-level" else c[1][0] for c in CASES}
    assert {"train", "sft", "eval", "preprocess", "parity", "plot", "config", "doctor", "devices"} <= commands
    assert len(CASES) >= 80 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case_id", SUBPROCESS_IDS)
def test_bad_input_end_to_end(case_id, inputs, tmp_path):
    """The real ``portrl`` executable: exit code 2, one line, no traceback."""
    _, argv, phrase, env = next(c for c in CASES if c[0] == case_id)
    bin_dir = Path(sys.executable).parent
    full_env = {**os.environ, "PORTRL_CACHE": str(tmp_path / "cache"), **env}
    full_env.pop("PORTRL_DEBUG", None)
    proc = subprocess.run([str(bin_dir / "portrl"), *_argv(argv, inputs)[2:]], capture_output=True, text=True,
                          env=full_env, cwd=tmp_path, timeout=120)  # the default log level: INFO
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert phrase.format(**inputs) in proc.stderr
    if "usage:" not in proc.stderr:
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_debug_shows_the_traceback(inputs, no_heavy_work, monkeypatch, capsys):
    assert _run_in_process(["--debug", "train", "actor.optim.lr=0"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "portrl train: error: " in err
    monkeypatch.setenv("PORTRL_DEBUG", "1")
    assert _run_in_process(["train", "actor.optim.lr=0"]) == 2
    assert "Traceback" in capsys.readouterr().err


def test_version(capsys):
    import portrl

    assert _run_in_process(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"portrl {portrl.__version__}"


def test_internal_error_keeps_its_traceback(monkeypatch):
    """An exception that is not a UserError is an internal error: main lets it propagate."""
    import portrl.cli.devices as devices

    def boom(args):
        raise KeyError("internal")

    monkeypatch.setattr(devices, "run", boom)
    with pytest.raises(KeyError):
        main(["devices"])


def test_run_stopped_exit_code(monkeypatch, capsys):
    import portrl.cli.devices as devices
    from portrl.errors import RunStopped

    def stop(args):
        raise RunStopped("stopped by SIGTERM at step 3; resume with the same command", 143)

    monkeypatch.setattr(devices, "run", stop)
    assert main(["devices"]) == 143
    assert capsys.readouterr().err.strip() == "stopped by SIGTERM at step 3; resume with the same command"


@pytest.mark.parametrize("overrides", [
    ["actor.optim.lr=0", "actor.optim.freeze=true"],  # 0 only with an explicit freeze
    ["rollout.temperature=0", "rollout.top_k=5", "rollout.top_p=1"],  # greedy; top-k on
    ["trainer.save_freq=0", "trainer.test_freq=0"],  # the documented "off"
    ["actor.clip_ratio_low=0.2", "actor.clip_ratio_high=0.28"],  # DAPO's clip-higher
    ["device.env.NCCL_DEBUG=INFO", "device.env.CUBLAS_WORKSPACE_CONFIG=:4096:8", "device.env.OMP_NUM_THREADS=2"],
])
def test_valid_edges_are_accepted(overrides):
    from portrl.config import compose

    compose(overrides=overrides)


@pytest.mark.parametrize("preset", ["cpu", "a100", "h100", "h200", "mi300x", "mi325x", "ascend-910b", "ascend-910c"])
def test_every_device_preset_env_is_accepted(preset):
    """The shipped presets' device.env (TASK_QUEUE_ENABLE is declared by the npu backend) pass the allow-list."""
    from portrl.config import compose

    compose(preset=preset)


def test_workers_need_ray(monkeypatch):
    import portrl.config.checks as checks_mod  # imports module_available by name: patch it where it is used
    from portrl.config import ConfigError, compose

    real = checks_mod.module_available
    monkeypatch.setattr(checks_mod, "module_available", lambda m: False if m == "ray" else real(m))
    with pytest.raises(ConfigError, match="trainer.num_workers=2 .*ray is not installed"):
        compose(overrides=["trainer.num_workers=2"])
    compose(overrides=["trainer.num_workers=1"])


def test_install_commands_are_pinned_to_a_compatibility_row_and_spelled_as_the_readme():
    """What `portrl devices` tells a user to run installs one known row and appears verbatim in the docs."""
    from portrl.backends.cuda.backend import TORCH_CUDA_INSTALL, CUDABackend
    from portrl.backends.npu.backend import NPU_INSTALL
    from portrl.backends.rocm.backend import TORCH_ROCM_INSTALL, ROCmBackend

    docs = Path(__file__).resolve().parents[1] / "docs"
    readme = "".join(p.read_text() for p in sorted(docs.rglob("*.md")))
    for message, torch_pin in ((TORCH_CUDA_INSTALL, CUDABackend.compat_rows[0].pins["torch"]),
                               (TORCH_ROCM_INSTALL, "2.9.0"), (NPU_INSTALL, "2.10.0")):
        command = message.split(": ", 1)[1]
        assert f'pip install "torch=={torch_pin}" --index-url https://download.pytorch.org/whl/' in command
        for part in command.split(" && "):
            assert part in readme, part
    assert any(r.pins.get("torch") == "2.9.0" and r.pins.get("ROCm") == "6.4" for r in ROCmBackend.compat_rows)


def test_optional_packages_are_checked_before_the_model_loads(inputs, no_heavy_work, monkeypatch, capsys):
    """LoRA without peft and a logger whose package is missing stop in the preflight (faked as missing here)."""
    import portrl.trainer.preflight as preflight_mod

    real = preflight_mod.module_available
    monkeypatch.setattr(preflight_mod, "module_available", lambda m: False if m in ("peft", "wandb") else real(m))
    assert _run_in_process(_argv(["train", "actor.lora_rank=8"], inputs)) == 2
    assert "actor.lora_rank=8 trains LoRA adapters with peft, which is not installed" in capsys.readouterr().err
    assert _run_in_process(_argv(["train", "trainer.loggers=[wandb]"], inputs)) == 2
    assert 'pip install "wandb>=0.18"' in capsys.readouterr().err


def test_a_dead_worker_is_one_line_with_the_checkpoint(monkeypatch, capsys):
    """A worker that died or stopped answering is not the user's input (exit 1, not 2), but the user still gets
    one line naming the worker and where to resume, not a traceback; --debug adds the traceback."""
    import portrl.cli.train as train
    from portrl.workers.ray_calls import WorkerDiedError

    def died(args):
        raise WorkerDiedError("actor rank 1 (node 127.0.0.1, pid 4242)", RuntimeError("killed\nby the OOM killer"),
                              checkpoint="outputs/run/checkpoints/global_step_3")

    monkeypatch.setattr(train, "run", died)
    assert main(["train"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("portrl train: error: worker actor rank 1 (node 127.0.0.1, pid 4242) died")
    assert "resume from the last good checkpoint outputs/run/checkpoints/global_step_3" in err
    assert main(["--debug", "train"]) == 1 and "Traceback" in capsys.readouterr().err


def test_lora_targets_that_are_no_layer_of_the_model_stop_in_the_preflight(inputs, no_heavy_work, tmp_path, capsys):
    """A misspelt actor.lora_target_modules is one line naming the model's linear layers, before any model loads
    (the model is built from its config.json on the meta device)."""
    from portrl.models import write_tiny_model

    model = write_tiny_model(tmp_path / "m", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    capsys.readouterr()  # the writer's progress bar
    argv = ["train", f"model.path={model}", "actor.lora_rank=4", "actor.lora_target_modules=[qproj,v_proj]"]
    assert _run_in_process(_argv(argv, inputs)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "actor.lora_target_modules ['qproj'] are not modules of Qwen2ForCausalLM" in err[0]
    assert "q_proj" in err[0] and "all-linear" in err[0]


# (id, platform fault (tests/_sandbox_faults.py), argv, key phrase): the real `portrl` on a platform that refuses the
# code sandbox, made with a seccomp filter on its process; the start-up check stops it before any model loads
SANDBOX_FAULT_CASES = [
    ("sandbox-isolation-refused", "namespaces",
     ["train", "data=code", "data.train_files=[{code_train}]", "data.val_files=[{code_test}]"],
     "sandbox.allow_unisolated=true"),
    ("sandbox-cannot-start", "setrlimit",
     ["train", "data=code", "data.train_files=[{code_train}]", "data.val_files=[{code_test}]"],
     "the code sandbox cannot start a program here, and the code reward (data_source "),
    ("sandbox-isolation-refused-python-tool", "namespaces",
     ["train", "rollout.multi_turn.enable=true", "rollout.multi_turn.tool_config_path=configs/tools/python.yaml"],
     "(needed by the python tool (rollout.multi_turn.tool_config_path))"),
]


@pytest.mark.parametrize("case_id, fault, argv, phrase", SANDBOX_FAULT_CASES, ids=[c[0] for c in SANDBOX_FAULT_CASES])
def test_a_platform_that_refuses_the_sandbox_stops_the_run_at_start_up(case_id, fault, argv, phrase, inputs,
                                                                        tmp_path):
    """Exit code 2, one line, no traceback, before any model loads (no tiny model in the cache, no run folder)."""
    from _sandbox_faults import command_under, seccomp_available

    if not seccomp_available():
        pytest.skip("no seccomp here to refuse the sandbox with")
    portrl = str(Path(sys.executable).parent / "portrl")
    out = tmp_path / "run"
    env = {**os.environ, "PORTRL_CACHE": str(tmp_path / "cache")}
    env.pop("PORTRL_DEBUG", None)
    full = [portrl, *_argv(argv, inputs)[2:], f"trainer.output_dir={out}"]
    proc = subprocess.run(command_under(fault, full), capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and " WARNING " not in line]
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert len(lines) == 1 and lines[0].startswith("portrl train: error: "), proc.stderr
    assert phrase.format(**inputs) in lines[0], lines[0]
    assert not out.exists() and not list((tmp_path / "cache").rglob("*.safetensors"))  # no model was written
