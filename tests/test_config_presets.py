"""Every device preset x every algorithm preset composes and validates, kernels included."""

import pytest

from portrl.config import compose, list_presets, load_preset
from portrl.device import get_backend

DEVICES = list_presets("device")
ALGORITHMS = list_presets("algorithm")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_device_x_algorithm_validates(device, algorithm):
    cfg = compose(preset=device, algorithm=algorithm)  # check=True: choices, registries, backend kernels
    prefs = get_backend(cfg.device.name).kernel_preferences()
    assert cfg.device.attn_impl in prefs["attention_varlen"]
    for op, impl in cfg.device.kernels.items():
        assert impl in prefs[op], (device, op, impl)


@pytest.mark.parametrize("device", DEVICES)
def test_device_preset_fields(device):
    cfg = compose(preset=device)
    assert cfg.device.dtype == ("float32" if device == "cpu" else "bfloat16")
    assert cfg.rollout.engine in ("hf", "vllm") and 0 < cfg.rollout.gpu_memory_utilization <= 1
    assert cfg.device.tp_by_model_size["7b"] >= 1
    if device != "cpu":
        budget = cfg.actor.max_tokens_per_micro_batch
        assert budget and budget % 4096 == 0 and cfg.device.env
    from importlib import resources

    text = resources.files("portrl.configs").joinpath("device", f"{device}.yaml").read_text()
    assert text.startswith("# Device preset")
    assert device == "cpu" or ("Memory:" in text and "Sizing rule" in text)


def test_budgets_grow_with_card_memory():
    memory_gb = {"ascend-910b": 64, "ascend-910c": 64, "a100": 80, "h100": 80, "h200": 141, "mi300x": 192,
                 "mi325x": 256}  # 910C: per die (each die is one device)
    budgets = {d: compose(preset=d).actor.max_tokens_per_micro_batch for d in memory_gb}
    order = sorted(memory_gb, key=memory_gb.get)
    assert [budgets[d] for d in order] == sorted(budgets[d] for d in order)
    assert budgets["h200"] > budgets["h100"] and budgets["mi325x"] > budgets["mi300x"]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_algorithm_presets_cite_and_keep_tiny_setup_workable(algorithm):
    from importlib import resources

    text = resources.files("portrl.configs").joinpath("algorithm", f"{algorithm}.yaml").read_text()
    assert text.startswith("#") and ("arXiv" in text or "recipe" in text)
    raw = load_preset("algorithm", algorithm)
    assert "optim" not in raw.get("actor", {}), "learning rates belong to model/data presets"
    assert "train_batch_size" not in raw.get("data", {})
    cfg = compose(algorithm=algorithm, model="tiny", data="arith")  # the tiny CPU setup validates
    assert cfg.algorithm.name == algorithm


def test_reference_hyperparameters():
    dapo = compose(algorithm="dapo", overrides=["data.max_response_length=20480"])
    assert (dapo.actor.clip_ratio_low, dapo.actor.clip_ratio_high) == (0.2, 0.28)
    assert dapo.actor.loss_agg_mode == "token-mean" and dapo.reward.overlong_buffer.len == 4096
    assert dapo.algorithm.filter_groups.enable and not dapo.actor.use_kl_loss
    grpo = compose(algorithm="grpo")
    assert grpo.actor.use_kl_loss and grpo.actor.kl_loss_type == "low_var_kl" and grpo.actor.kl_loss_coef == 0.001
    assert grpo.rollout.n > 1
    gspo = compose(algorithm="gspo")
    assert (gspo.actor.clip_ratio_low, gspo.actor.clip_ratio_high) == (3e-4, 4e-4)
    assert gspo.actor.loss_agg_mode == "seq-mean-token-mean"
    dr = compose(algorithm="dr_grpo")
    assert not dr.algorithm.norm_adv_by_std_in_grpo and dr.actor.loss_agg_mode == "seq-mean-token-sum-norm"
    vapo = compose(algorithm="vapo")
    assert vapo.algorithm.lam_critic == 1.0 and vapo.algorithm.vapo_alpha == 0.05 and vapo.actor.positive_lm_coef > 0
    assert vapo.critic.enable and vapo.critic.pretrain_steps == 50 and vapo.critic.warmup_steps == 0
    assert compose(algorithm="sppo").algorithm.objective == "sppo"
    dpo = compose(algorithm="online_dpo")
    assert dpo.algorithm.objective == "dpo" and dpo.algorithm.dpo_beta == 0.1 and dpo.rollout.n % 2 == 0
    assert compose(algorithm="ppo").algorithm.adv_estimator == "gae"
    assert compose(algorithm="reinforce_pp").algorithm.adv_estimator == "reinforce_plus_plus"


@pytest.mark.parametrize("data", list_presets("data"))
def test_data_presets(data):
    cfg = compose(data=data)
    assert cfg.data.name == data and cfg.data.train_batch_size % cfg.actor.ppo_mini_batch_size == 0
    if data not in ("arith", "arith_tool", "wordprob"):  # generated tasks: no files
        assert cfg.data.train_files[0].endswith(f"/data/{data}/train.parquet")
        assert cfg.data.val_files[0].endswith(f"/data/{data}/test.parquet")


@pytest.mark.parametrize("model", list_presets("model"))
def test_model_presets(model):
    cfg = compose(model=model)
    assert cfg.model.size and (cfg.model.path is None) == (model == "tiny")
