"""Checks of a composed config that types alone cannot express.

* choices: names that must come from a fixed set (truncation, scheduler, loggers, registered rollout engines);
* registries: ``algorithm.adv_estimator``, ``actor.policy_loss.loss_mode``, ``actor.loss_agg_mode``,
  ``actor.kl_loss_type`` and ``algorithm.kl_penalty`` must be registered in ``portrl.algo``;
* consistency: batch sizes divide, group-based estimators get ``rollout.n > 1``, bounds hold;
* backend: ``device.name`` is registered; ``device.attn_impl`` / ``model.attn_impl`` and every
  ``device.kernels`` entry are implementations that backend lists in ``kernel_preferences()``.
  Whether an implementation *runs* on a given machine is decided at run time (``portrl.ops``).

All problems are collected and raised together as one :class:`ConfigError`.
"""

from __future__ import annotations

from typing import Any

from portrl.config.presets import ConfigError

CHOICES: dict[str, tuple[Any, ...]] = {
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.filter_groups.metric": ("acc", "seq_reward", "seq_final_reward"),
    "algorithm.objective": ("policy_gradient", "sppo", "dpo"),
    "algorithm.dpo_loss_type": ("sigmoid", "ipo"),
    "data.truncation": ("error", "left", "right"),
    "actor.optim.scheduler": ("constant", "cosine", "linear"),
    "critic.optim.scheduler": ("constant", "cosine", "linear"),
    "actor.strategy": ("auto", "fsdp", "ddp"),
    "rollout.placement": ("colocated", "separated"),
    "model.dtype": (None, "float32", "bfloat16", "float16"),
    "device.dtype": (None, "float32", "bfloat16", "float16"),
}
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
#: estimators whose baseline is the prompt group: one response per prompt gives no signal
GROUP_ESTIMATORS = ("grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "gpg", "opo",
                    "reinforce_plus_plus_baseline", "gdpo")
GAE_ESTIMATORS = ("gae", "vcppo_gae", "vapo_gae")
REGISTRY_KEYS = {
    "algorithm.adv_estimator": "adv_estimator",
    "actor.policy_loss.loss_mode": "policy_loss",
    "actor.loss_agg_mode": "loss_agg_mode",
    "actor.kl_loss_type": "kl_penalty",
    "algorithm.kl_penalty": "kl_penalty",
}


def _get(cfg, dotted: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.select(cfg, dotted)


def check_choices(cfg) -> list[str]:
    problems = []
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}")
    from portrl.rollout.registry import engine_names  # registered engines, installed or not

    engines = ["auto", *engine_names()]
    if cfg.rollout.engine not in engines:
        problems.append(f"rollout.engine={cfg.rollout.engine!r} is not one of {', '.join(map(repr, engines))}")
    bad = [x for x in cfg.trainer.loggers if x not in LOGGERS]
    if bad:
        problems.append(f"trainer.loggers has {bad}; valid loggers: {', '.join(LOGGERS)}")
    return problems


def check_registries(cfg) -> list[str]:
    from portrl.algo import registered

    problems = []
    for key, kind in REGISTRY_KEYS.items():
        value = _get(cfg, key)
        names = registered(kind)
        if value not in names:
            problems.append(f"{key}={value!r} is not a registered {kind}; registered: {', '.join(names)}")
    return problems


def check_consistency(cfg) -> list[str]:
    problems = []
    d, a, r = cfg.data, cfg.actor, cfg.rollout
    if d.train_batch_size < 1 or a.ppo_mini_batch_size < 1:
        problems.append("data.train_batch_size and actor.ppo_mini_batch_size must be >= 1")
    elif d.train_batch_size % a.ppo_mini_batch_size:
        problems.append(f"data.train_batch_size={d.train_batch_size} must be a multiple of "
                        f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} (prompts)")
    if a.ppo_micro_batch_size_per_device < 1:
        problems.append("actor.ppo_micro_batch_size_per_device must be >= 1")
    if r.n < 1:
        problems.append(f"rollout.n={r.n} must be >= 1")
    if cfg.algorithm.objective == "policy_gradient" and cfg.algorithm.adv_estimator in GROUP_ESTIMATORS and r.n < 2:
        problems.append(f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} compares responses within a "
                        f"prompt group and needs rollout.n > 1 (got {r.n})")
    gae_only = [k for k in ("lam_actor", "lam_critic", "vapo_alpha") if cfg.algorithm[k] is not None]
    if gae_only and cfg.algorithm.adv_estimator not in GAE_ESTIMATORS:
        problems.append(f"algorithm.{', algorithm.'.join(gae_only)} only apply to the GAE estimators "
                        f"{', '.join(GAE_ESTIMATORS)}, not {cfg.algorithm.adv_estimator!r}")
    if cfg.algorithm.objective == "dpo" and r.n % 2:
        problems.append(f"algorithm.objective='dpo' pairs sampled responses: rollout.n must be even (got {r.n})")
    if a.clip_ratio_c <= 1:
        problems.append(f"actor.clip_ratio_c={a.clip_ratio_c} must be > 1 (dual-clip bound)")
    if not 0 < r.gpu_memory_utilization <= 1:
        problems.append(f"rollout.gpu_memory_utilization={r.gpu_memory_utilization} must be in (0, 1]")
    if r.tensor_model_parallel_size < 1:
        problems.append(f"rollout.tensor_model_parallel_size={r.tensor_model_parallel_size} must be >= 1")
    ob = cfg.reward.overlong_buffer
    if ob.enable and not 0 < ob.len < d.max_response_length:
        problems.append(f"reward.overlong_buffer.len={ob.len} must be in (0, data.max_response_length="
                        f"{d.max_response_length}) when enabled")
    if d.max_prompt_length < 1 or d.max_response_length < 1:
        problems.append("data.max_prompt_length and data.max_response_length must be >= 1")
    target = cfg.model.sft_target_answer_p
    if target is not None and not 0 < target < 1:
        problems.append(f"model.sft_target_answer_p={target} must be in (0, 1) (a probability) or null")
    c = cfg.critic
    if c.pretrain_steps < 0:
        problems.append(f"critic.pretrain_steps={c.pretrain_steps} must be >= 0")
    if c.pretrain_target_ev is not None and not (c.pretrain_target_ev < 1 and c.pretrain_steps > 0):
        problems.append(f"critic.pretrain_target_ev={c.pretrain_target_ev} needs critic.pretrain_steps > 0 (the cap) "
                        "and a value < 1 (explained variance is at most 1)")
    if c.pretrain_steps > 0:
        from portrl.trainer.advantage import needs_values

        if not needs_values(cfg):
            problems.append(f"critic.pretrain_steps={c.pretrain_steps} pretrains a critic, but none runs: set "
                            "critic.enable=true or use a GAE estimator (gae, vcppo_gae, vapo_gae)")
    return problems


def check_backend(cfg) -> list[str]:
    """Names that depend on the chosen backend (skipped for ``auto``: detection happens at run time)."""
    from portrl.device.registry import BackendError, get_backend

    name = cfg.device.name
    if name == "auto":
        return []
    try:
        backend = get_backend(name)
    except BackendError as exc:
        return [f"device.name: {exc}"]
    prefs = backend.kernel_preferences()
    problems = []
    attention = prefs.get("attention_varlen", ())
    for key in ("device.attn_impl", "model.attn_impl"):
        value = _get(cfg, key)
        if value is not None and value not in attention:
            problems.append(f"{key}={value!r} is not an attention implementation of backend {name!r}; "
                            f"it lists: {', '.join(attention) or '(none)'}")
    for op, impl in cfg.device.kernels.items():
        if op not in prefs:
            problems.append(f"device.kernels.{op}: backend {name!r} has no preferences for op {op!r}; "
                            f"its ops: {', '.join(prefs) or '(none)'}")
        elif impl not in prefs[op]:
            problems.append(f"device.kernels.{op}={impl!r} is not an implementation backend {name!r} lists; "
                            f"it lists: {', '.join(prefs[op])}")
    return problems


def validate(cfg, *, registries: bool = True, backend: bool = True) -> None:
    """Raise :class:`ConfigError` listing every problem of ``cfg``; return None when it is valid."""
    problems = check_choices(cfg) + check_consistency(cfg)
    if registries:
        problems += check_registries(cfg)
    if backend:
        problems += check_backend(cfg)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
