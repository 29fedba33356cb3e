"""The memory plan (portrl/plan): shapes from config.json equal the real classes' parameter counts, predicted
peaks hold within +-15 % of what a tiny run measures (the CPU's tensor count, backends/cpu/heap.py), the
preflight refuses a run that does not fit in one line, and ``portrl plan`` plans a 72B model without its weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from portrl.config.composition import compose
from portrl.errors import UserError
from portrl.plan.fit import check_fits, smallest_fix
from portrl.plan.memory import lora_params
from portrl.plan.run_plan import plan_run
from portrl.plan.shape import shape_of_folder, shape_of_raw
from portrl.trainer.preflight import TRAIN, preflight

QWEN25_72B = {"model_type": "qwen2", "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
              "num_key_value_heads": 8, "intermediate_size": 29568, "vocab_size": 152064,
              "tie_word_embeddings": False}
#: long answers, big micro-batches and no reference (under FSDP it is a whole copy per rank: it alone is 135 GiB)
LONG = ["data.max_prompt_length=1024", "data.max_response_length=4096", "actor.ppo_micro_batch_size_per_device=64",
        "actor.use_kl_loss=false"]
#: measured phase -> how far the plan may be from it
TOLERANCE = 0.15


@pytest.mark.parametrize("config", [
    Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, vocab_size=300, tie_word_embeddings=True),
    LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1,
                intermediate_size=128, vocab_size=500, tie_word_embeddings=False),
    MistralConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=256, head_dim=32),
], ids=["qwen2", "llama", "mistral"])
def test_parameter_count_is_the_real_classes(config):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert shape_of_raw(config.to_dict(), "config.json").params == sum(p.numel() for p in model.parameters())


def test_lora_parameters_are_peft_s():
    from peft import LoraConfig, get_peft_model

    config = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=300, tie_word_embeddings=True)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    model = get_peft_model(AutoModelForCausalLM.from_config(config), LoraConfig(r=4, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_params(shape_of_raw(config.to_dict(), "config.json"), 4, targets) == trainable


def test_vision_language_parameter_count_is_the_real_classes():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=96, vocab_size=400),
        vision_config=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[1]))
    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(config)
    assert shape_of_raw(config.to_dict(), "config.json").params == sum(p.numel() for p in model.parameters())


def _measured_run(tmp_path, overrides):
    """The second step's metrics of a 2-step run in a process of its own (a process's first trainer: another's
    leftovers would count in its peaks)."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "portrl", "train", "model.sft_warm_start=false", f"trainer.output_dir={out}",
           "trainer.total_steps=2", "trainer.val_before_train=false", "trainer.test_freq=0",
           "data.train_batch_size=16", "actor.ppo_mini_batch_size=16", *overrides]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "memory/peak_gib/step" in r][-1]


#: each a 2-step run of ~15 s in a process of its own: the main suite runs two, the slow suite the rest
SLOW = pytest.mark.slow


@pytest.mark.parametrize("overrides", [
    pytest.param([], id="recorded-rollout"), pytest.param(["model.gradient_checkpointing=true"], id="checkpointing"),
    pytest.param(["algorithm=ppo"], id="critic", marks=SLOW),
    pytest.param(["device.dtype=bfloat16"], id="bfloat16", marks=SLOW),
    pytest.param(["actor.lora_rank=8", "actor.optim.lr=1e-4"], id="lora", marks=SLOW)])
def test_the_plan_of_a_step_is_within_15_percent_of_its_measured_peaks(tmp_path, overrides):
    m = _measured_run(tmp_path, overrides)
    if "memory/plan_gib/gen" not in m and "memory/peak_gib/gen" not in m:
        pytest.skip("no tensor count here (no C++ compiler)")
    compared = {k.rsplit("/", 1)[1] for k in m if k.startswith("memory/plan_gib/")}
    assert {"gen", "update_actor"} <= compared and compared & {"ref", "old_log_prob", "values"}
    for phase in compared:
        predicted, measured = m[f"memory/plan_gib/{phase}"], m[f"memory/peak_gib/{phase}"]
        assert abs(predicted / measured - 1) <= TOLERANCE, (phase, predicted, measured)


def test_the_preflight_refuses_a_run_that_does_not_fit_and_a_key_lets_it_go_on(tmp_path):
    cfg = compose(overrides=["model.sft_warm_start=false", f"trainer.output_dir={tmp_path / 'run'}",
                             "device.memory_gib=0.01"])
    with pytest.raises(UserError) as e:
        preflight(cfg, TRAIN)
    line = str(e.value)
    assert "\n" not in line and "phase gen" in line and "0.01 GiB available" in line
    assert "trainer.memory_check=false" in line
    preflight(compose(overrides=["model.sft_warm_start=false", f"trainer.output_dir={tmp_path / 'run2'}",
                                 "device.memory_gib=0.01", "trainer.memory_check=false"]), TRAIN)


def _write_72b(tmp_path):
    folder = tmp_path / "qwen2.5-72b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN25_72B))
    return folder


def test_a_72b_plan_needs_no_weights_and_names_a_change_that_fits(tmp_path):
    folder = _write_72b(tmp_path)
    shape = shape_of_folder(folder)
    assert 72.0e9 < shape.params < 73.0e9  # Qwen2.5-72B: 72.7B parameters
    cfg = compose(preset="h200", overrides=[f"model.path={folder}", "trainer.num_workers=64",
                                             "actor.tensor_parallel_size=8", "actor.max_tokens_per_micro_batch=65536",
                                             "model.gradient_checkpointing=false", *LONG])
    memory = int(139.8 * 2**30)
    assert plan_run(cfg, shape, 64, memory).fits is False
    fix = smallest_fix(cfg, shape, 64, memory)
    assert fix == "model.gradient_checkpointing=True"
    key, value = fix.split("=")
    fixed = compose(preset="h200", overrides=[f"model.path={folder}", "trainer.num_workers=64",
                                               "actor.tensor_parallel_size=8", "actor.max_tokens_per_micro_batch=65536",
                                               f"{key}={value.lower()}", *LONG])
    assert check_fits(fixed, shape, 64, memory).fits


def test_portrl_plan_prints_json_and_refuses_a_folder_without_config_json(tmp_path):
    folder = _write_72b(tmp_path)
    cmd = [sys.executable, "-m", "portrl", "plan", "--preset", "h100", f"model.path={folder}", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plan = json.loads(out.stdout)
    assert plan["fits"] is False and plan["memory_source"] == "device.memory_gib"
    assert {"gen", "logp", "update_actor"} <= set(plan["phases"])
    assert plan["step_floor_s"]["update"] > 0 and "H100" in plan["peaks"]  # the peak table's datasheet figure
    empty = tmp_path / "empty"
    empty.mkdir()
    bad = subprocess.run([sys.executable, "-m", "portrl", "plan", f"model.path={empty}"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "config.json" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_auto_token_budget_is_the_largest_the_plan_fits_and_needs_a_memory_figure(tmp_path):
    from portrl.plan.fit import AUTO_HEADROOM
    from portrl.trainer.memory_plan import resolve_auto_budget

    folder = tmp_path / "qwen2.5-0.5b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**QWEN25_72B, "hidden_size": 896, "num_hidden_layers": 24,
                                                    "num_attention_heads": 14, "num_key_value_heads": 2,
                                                    "intermediate_size": 4864, "vocab_size": 151936,
                                                    "tie_word_embeddings": True}))
    shape = shape_of_folder(folder)
    overrides = [f"model.path={folder}", "data=gsm8k", "actor.ppo_micro_batch_size_per_device=256",
                 "model.gradient_checkpointing=false", "rollout.gpu_memory_utilization=0.3",
                 "actor.max_tokens_per_micro_batch=auto"]
    cfg = compose(preset="h100", overrides=overrides)
    memory = 32 * 2**30
    resolve_auto_budget(cfg, shape, 1, memory)
    budget = cfg.actor.max_tokens_per_micro_batch
    assert isinstance(budget, int) and budget % 256 == 0
    room = int(memory * AUTO_HEADROOM)
    at = compose(preset="h100", overrides=[*overrides[:-1], f"actor.max_tokens_per_micro_batch={budget}"])
    above = compose(preset="h100", overrides=[*overrides[:-1], f"actor.max_tokens_per_micro_batch={budget + 256}"])
    assert plan_run(at, shape, 1, room).fits and not plan_run(above, shape, 1, room).fits
    with pytest.raises(UserError, match="device.memory_gib"):
        resolve_auto_budget(compose(preset="h100", overrides=overrides), shape, 1, None)


def test_a_token_budget_that_is_not_a_number_null_or_auto_is_refused():
    from portrl.config.presets import ConfigError

    with pytest.raises(ConfigError, match="null or auto"):
        compose(overrides=["actor.max_tokens_per_micro_batch=lots"])


def test_the_step_time_floor_is_bound_by_reads_or_flops_and_scales_with_epochs(tmp_path):
    from portrl.device.peaks import PeakThroughput
    from portrl.plan.memory import Workload
    from portrl.plan.step_time import step_floor

    shape = shape_of_folder(_write_72b(tmp_path))
    w = Workload(prompts=4, n=4, prompt_len=256, response_len=512, micro_tokens=0, response_tokens_micro=0)
    cfg = compose(preset="h100", overrides=[f"model.path={tmp_path / 'qwen2.5-72b'}"])
    slow_memory = step_floor(cfg, shape, w, PeakThroughput(1e15, 1e9, "x"), 2, checkpointing=True)
    slow_flops = step_floor(cfg, shape, w, PeakThroughput(1e9, 1e15, "x"), 2, checkpointing=True)
    assert slow_memory.rollout_bound == "memory reads" and slow_flops.rollout_bound == "FLOPs"
    twice = compose(preset="h100", overrides=[f"model.path={tmp_path / 'qwen2.5-72b'}", "actor.ppo_epochs=2"])
    again = step_floor(twice, shape, w, PeakThroughput(1e15, 1e9, "x"), 2, checkpointing=True)
    assert again.update_s == pytest.approx(2 * slow_memory.update_s)
    no_recompute = step_floor(cfg, shape, w, PeakThroughput(1e15, 1e9, "x"), 2, checkpointing=False)
    assert 0.7 < no_recompute.update_s / slow_memory.update_s < 0.8  # 6 N T against 8 N T on the layers
