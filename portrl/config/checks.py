"""Checks of a composed config that types alone cannot express.

* choices: names that must come from a fixed set (truncation, scheduler, loggers, registered rollout engines,
  the weight sync's mode and registered transports);
* registries: ``algorithm.objective``, ``algorithm.adv_estimator``, ``actor.policy_loss.loss_mode``,
  ``actor.loss_agg_mode``, ``actor.kl_loss_type`` and ``algorithm.kl_penalty`` must be registered in
  ``portrl.algo`` (an estimator another package registered counts);
* consistency: batch sizes divide, bounds hold, and the algorithm gets what its record
  (``portrl.algo.spec.algorithm_spec``) needs: ``rollout.n > 1`` for group comparisons, an even
  ``rollout.n`` for pairs, the critic / reference it reads not switched off (``critic.enable`` / ``ref.enable``),
  a critic for value pretraining; estimator options go to estimators that take them (the algorithm's checks live
  in portrl/config/checks_algorithm.py);
* ranges: every numeric knob with a valid range says it (:func:`check_ranges`): learning rates > 0 (0 only
  with ``optim.freeze=true``), clip ratios >= 0 with low <= high, ppo_epochs / total_steps / num_workers (or null) /
  max_ckpt_to_keep / trace_rows >= 1, save_freq / test_freq / ref_update_freq / max_nonfinite_steps / trace_freq
  >= 1 or 0 (off), KL coefficients >= 0, temperature > 0 or 0 (greedy), 0 < top_p <= 1, top_k -1 (off) or >= 1;
* asynchronous modes: ``trainer.mode`` and ``async_training`` (portrl/config/checks_async.py); multi-turn
  rollouts: ``rollout.multi_turn`` (portrl/config/checks_agent.py); the trained models' mesh sizes
  (portrl/config/checks_mesh.py);
* sandbox: every ``sandbox.packages`` entry is a top-level import name (:func:`check_sandbox`; whether it is
  installed is the preflight's check, portrl/trainer/sandbox_check.py);
* environment: ``device.env`` names only variables the backend accepts (exact names it declares; what loads code
  is refused with the reason a backend gives, :func:`check_env`);
* backend: ``device.name`` is registered; ``device.attn_impl`` / ``model.attn_impl`` and every
  ``device.kernels`` entry are implementations that backend lists in ``kernel_preferences()``;
  ``rollout.weight_transport`` is ``auto`` or one the backend offers (``weight_transports``); ``device.model`` is
  a model of the backend's peak table (``device_models``).
  Whether an implementation *runs* on a given machine is decided at run time (``portrl.ops``).

All problems are collected and raised together as one :class:`ConfigError`.
"""

from __future__ import annotations

import difflib
import keyword
from typing import Any

from omegaconf import OmegaConf

from portrl.algo import critic_enabled, estimator_spec, registered
from portrl.algo.pf_ppo import REWEIGHT_METHODS
from portrl.algo.policy_losses_bypass import LOSS_TYPES
from portrl.algo.rollout_correction import LEVELS, RS_LEVELS
from portrl.config.batch_follow import batch_problem
from portrl.config.checks_algorithm import check_algorithm, known_algorithm
from portrl.config.checks_agent import check_multi_turn
from portrl.config.checks_async import check_async
from portrl.config.checks_mesh import check_mesh
from portrl.config.placement import placement_names, placement_needs_ray
from portrl.config.presets import ConfigError
from portrl.device.backend import module_available
from portrl.device.peaks import named_model
from portrl.device.registry import BackendError, all_backends, get_backend
from portrl.device.weight_transport import SYNC_MODES, transport_names
from portrl.errors import UserError
from portrl.rollout.registry import engine_names

CHOICES: dict[str, tuple[Any, ...]] = {
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "algorithm.filter_groups.metric": ("acc", "seq_reward", "seq_final_reward"),
    "data.truncation": ("error", "left", "right"),
    "actor.optim.scheduler": ("constant", "cosine", "linear"),
    "critic.optim.scheduler": ("constant", "cosine", "linear"),
    "actor.strategy": ("auto", "fsdp", "ddp"),
    "rollout.placement": placement_names(),
    "rollout.weight_sync_mode": SYNC_MODES,
    "reward.on_timeout": ("error", "zero"),
    "model.dtype": (None, "float32", "bfloat16", "float16"),
    "device.dtype": (None, "float32", "bfloat16", "float16"),
    "algorithm.rollout_correction.loss_type": LOSS_TYPES,
    "algorithm.rollout_correction.rollout_is": (None, *LEVELS),
    "algorithm.rollout_correction.rollout_rs": (None, *RS_LEVELS),
    "algorithm.pf_ppo.reweight_method": REWEIGHT_METHODS,
    "reward_model.model.update": ("before", "after", "none"),
    "reward_model.model.loss_type": ("ce", "dpo"),
    "reward_model.model.optim.scheduler": ("constant", "cosine", "linear"),
    "reward_model.prime_norm": ("batch_norm", "none"),
}
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
REGISTRY_KEYS = {
    "algorithm.objective": "objective",
    "algorithm.adv_estimator": "adv_estimator",
    "actor.policy_loss.loss_mode": "policy_loss",
    "actor.loss_agg_mode": "loss_agg_mode",
    "actor.kl_loss_type": "kl_penalty",
    "algorithm.kl_penalty": "kl_penalty",
}


def _get(cfg, dotted: str) -> Any:
    return OmegaConf.select(cfg, dotted)


def check_choices(cfg) -> list[str]:
    problems = []
    for key, allowed in CHOICES.items():
        value = _get(cfg, key)
        if value not in allowed:
            problems.append(f"{key}={value!r} is not one of {', '.join(map(repr, allowed))}")
    engines = ["auto", *engine_names()]
    if cfg.rollout.engine not in engines:
        problems.append(f"rollout.engine={cfg.rollout.engine!r} is not one of {', '.join(map(repr, engines))}")
    offered = [t for b in all_backends() for t in b.weight_transports]  # a backend registers its own on import
    transports = ["auto", *dict.fromkeys([*transport_names(), *offered])]
    if cfg.rollout.weight_transport not in transports:
        problems.append(f"rollout.weight_transport={cfg.rollout.weight_transport!r} is not one of "
                        f"{', '.join(map(repr, transports))}")
    bad = [x for x in cfg.trainer.loggers if x not in LOGGERS]
    if bad:
        problems.append(f"trainer.loggers has {bad}; valid loggers: {', '.join(LOGGERS)}")
    return problems


def check_registries(cfg) -> list[str]:
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
    elif problem := batch_problem(int(d.train_batch_size), int(a.ppo_mini_batch_size)):  # the keys and valid values
        problems.append(problem)
    if a.ppo_micro_batch_size_per_device < 1:
        problems.append("actor.ppo_micro_batch_size_per_device must be >= 1")
    budget = a.max_tokens_per_micro_batch
    if budget is not None and budget != "auto" and (isinstance(budget, bool) or not isinstance(budget, int)
                                                    or budget < 1):
        problems.append(f"actor.max_tokens_per_micro_batch={budget!r} must be a number of tokens >= 1, null or auto")
    if r.n < 1:
        problems.append(f"rollout.n={r.n} must be >= 1")
    problems += check_algorithm(cfg)  # what the algorithm needs of the config (portrl/config/checks_algorithm.py)
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
    if c.pretrain_steps > 0 and known_algorithm(cfg) and not critic_enabled(cfg):
        critics = [n for n in registered("adv_estimator") if estimator_spec(n).needs_critic]
        problems.append(f"critic.pretrain_steps={c.pretrain_steps} pretrains a critic, but none runs: set "
                        f"critic.enable=true or use an estimator with a critic ({', '.join(critics)})")
    return problems


class _Problems(list):
    """The problems found so far (one line each) and how a range check adds one."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg

    def need(self, ok: bool, key: str, rule: str) -> None:
        """Add ``key=<value> <rule>`` unless ``ok``."""
        if not ok:
            self.append(f"{key}={_get(self.cfg, key)!r} {rule}")


def check_ranges(cfg) -> list[str]:
    """Numeric knobs outside their valid range, each with the range in the message."""
    p = _Problems(cfg)
    for check in (_optimizer_ranges, _policy_ranges, _sampling_and_data_ranges, _run_ranges):
        check(cfg, p)
    return list(p)


def _optimizer_ranges(cfg, p: _Problems) -> None:
    """The optimizers of the trained models and the SFT warm start's settings."""
    for group in ("actor", "critic", "reward_model.model"):
        o = _get(cfg, group).optim
        if o.lr == 0 and o.freeze:
            pass  # an explicit freeze: the weights stay fixed
        elif o.freeze:
            p.append(f"{group}.optim.freeze=true needs {group}.optim.lr=0 (got {o.lr!r}); "
                     "drop freeze to train")
        else:
            p.need(o.lr > 0, f"{group}.optim.lr", f"must be > 0 (or 0 with {group}.optim.freeze=true to keep "
                                                     "the weights fixed on purpose)")
        p.need(o.weight_decay >= 0, f"{group}.optim.weight_decay", "must be >= 0")
        p.need(o.eps > 0, f"{group}.optim.eps", "must be > 0")
        p.need(o.warmup_steps >= 0, f"{group}.optim.warmup_steps", "must be >= 0")
        p.need(0 <= o.warmup_ratio < 1, f"{group}.optim.warmup_ratio", "must be in [0, 1)")
        p.need(0 <= o.min_lr_ratio <= 1, f"{group}.optim.min_lr_ratio", "must be in [0, 1]")
    m = cfg.model
    p.need(m.sft_lr > 0, "model.sft_lr", "must be > 0")
    if m.sft_warm_start:
        p.need(m.sft_steps >= 1, "model.sft_steps", "must be >= 1 when model.sft_warm_start=true")
        p.need(m.sft_batch_size >= 1, "model.sft_batch_size", "must be >= 1 when model.sft_warm_start=true")


def _policy_ranges(cfg, p: _Problems) -> None:
    """The policy loss's clipping and coefficients, PF-PPO and the KL controller."""
    a = cfg.actor
    p.need(a.clip_ratio >= 0, "actor.clip_ratio", "must be >= 0")
    for side in ("low", "high"):
        value = a[f"clip_ratio_{side}"]
        p.need(value is None or value >= 0, f"actor.clip_ratio_{side}", "must be >= 0 (or null: actor.clip_ratio)")
    low = a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low
    high = a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high
    if low >= 0 and high >= 0 and low > high:
        low_key = "actor.clip_ratio_low" if a.clip_ratio_low is not None else "actor.clip_ratio"
        high_key = "actor.clip_ratio_high" if a.clip_ratio_high is not None else "actor.clip_ratio"
        p.append(f"{low_key}={low!r} must be <= {high_key}={high!r} (the clip range is [1 - low, 1 + high])")
    p.need(a.ppo_epochs >= 1, "actor.ppo_epochs", "must be >= 1")
    p.need(cfg.critic.ppo_epochs is None or cfg.critic.ppo_epochs >= 1, "critic.ppo_epochs",
           "must be >= 1 (or null: actor.ppo_epochs)")
    p.need(a.kl_loss_coef >= 0, "actor.kl_loss_coef", "must be >= 0")
    p.need(a.entropy_coeff >= 0, "actor.entropy_coeff", "must be >= 0")
    p.need(cfg.algorithm.pf_ppo.weight_pow >= 0, "algorithm.pf_ppo.weight_pow", "must be >= 0")
    k = cfg.algorithm.kl_ctrl
    p.need(k.kl_coef >= 0, "algorithm.kl_ctrl.kl_coef", "must be >= 0")
    if k.type == "adaptive":
        p.need(k.target_kl > 0, "algorithm.kl_ctrl.target_kl", "must be > 0 with kl_ctrl.type=adaptive")
        p.need(k.horizon >= 1, "algorithm.kl_ctrl.horizon", "must be >= 1 with kl_ctrl.type=adaptive")


def _sampling_and_data_ranges(cfg, p: _Problems) -> None:
    """Rollout sampling (training and validation), rollout workers and the validation data."""
    for prefix, sampling in (("rollout", cfg.rollout), ("rollout.val_kwargs", cfg.rollout.val_kwargs)):
        p.need(sampling.temperature >= 0, f"{prefix}.temperature", "must be > 0, or 0 for greedy decoding")
        p.need(0 < sampling.top_p <= 1, f"{prefix}.top_p", "must be in (0, 1] (1 = off)")
        p.need(sampling.top_k == -1 or sampling.top_k >= 1, f"{prefix}.top_k", "must be -1 (off) or >= 1")
    p.need(cfg.rollout.val_kwargs.n >= 1, "rollout.val_kwargs.n", "must be >= 1")
    p.need(cfg.rollout.num_rollout_workers >= 1, "rollout.num_rollout_workers", "must be >= 1")
    p.need(cfg.rollout.cpu_cores is None or cfg.rollout.cpu_cores >= 1, "rollout.cpu_cores",
           "must be >= 1 (cores of the separated rollout workers on the cpu backend), or null (by worker count)")
    d = cfg.data
    p.need(d.val_batch_size is None or d.val_batch_size >= 1, "data.val_batch_size", "must be >= 1 (or null: all at once)")
    p.need(d.max_val_samples is None or d.max_val_samples >= 1, "data.max_val_samples", "must be >= 1 (or null: all)")


def _run_ranges(cfg, p: _Problems) -> None:
    """The trainer's steps, workers, checkpoints and time limits, and the reward workers and code sandbox."""
    t = cfg.trainer
    p.need(t.total_steps >= 1, "trainer.total_steps", "must be >= 1")
    p.need(t.num_workers is None or t.num_workers >= 1, "trainer.num_workers",
           "must be >= 1, or null (auto: every device of this node)")
    p.need(t.nnodes >= 1, "trainer.nnodes", "must be >= 1")
    p.need(t.save_freq >= 0, "trainer.save_freq", "must be >= 1, or 0 (off: one checkpoint at the end with "
                                                  "trainer.save_final)")
    p.need(t.test_freq >= 0, "trainer.test_freq", "must be >= 1, or 0 (off: no validation during training)")
    p.need(t.max_ckpt_to_keep >= 1, "trainer.max_ckpt_to_keep", "must be >= 1")
    outside = [s for s in t.profile.steps if not 1 <= s <= t.total_steps]
    p.need(not outside, "trainer.profile.steps", f"has {outside}: each must be a step in 1..{t.total_steps} "
                                                 "(trainer.total_steps)")
    p.need(t.ref_update_freq >= 0, "trainer.ref_update_freq", "must be >= 1 (refresh the reference every k steps), "
                                                              "or 0 (never)")
    p.need(cfg.reward.num_workers >= 1, "reward.num_workers", "must be >= 1")
    p.need(cfg.reward.timeout_s is None or cfg.reward.timeout_s >= 0, "reward.timeout_s",
           "must be > 0 (seconds per batch), or 0 / null (no limit)")
    p.need(t.worker_timeout_s is None or t.worker_timeout_s >= 0, "trainer.worker_timeout_s",
           "must be > 0 (seconds), or 0 / null (no limit)")
    p.need(t.max_nonfinite_steps >= 0, "trainer.max_nonfinite_steps",
           "must be >= 1 (stop after that many steps in a row with a non-finite loss or gradient), or 0 (never stop)")
    p.need(t.trace_freq >= 0, "trainer.trace_freq", "must be >= 1 (write traces every k steps), or 0 (never)")
    p.need(t.trace_rows >= 1, "trainer.trace_rows", "must be >= 1 (trajectories traced per traced step)")
    code = cfg.reward.code
    p.need(code.timeout_s > 0, "reward.code.timeout_s", "must be > 0 (seconds per test case)")
    p.need(code.memory_mb >= 64, "reward.code.memory_mb", "must be >= 64 (the interpreter itself needs ~30 MB)")
    p.need(code.max_workers >= 1, "reward.code.max_workers", "must be >= 1")
    p.need(code.sandbox_fusion_url is None or str(code.sandbox_fusion_url).startswith(("http://", "https://")),
           "reward.code.sandbox_fusion_url", "must be an http(s) URL of a SandboxFusion service, or null (local sandbox)")
    # null (auto) depends on the node's devices: the preflight checks Ray for the number it resolves to
    if (t.num_workers or 1) > 1 or t.nnodes > 1 or placement_needs_ray(cfg):
        if not module_available("ray"):
            p.append(f"trainer.num_workers={t.num_workers} (nnodes={t.nnodes}, rollout.placement="
                     f"{cfg.rollout.placement}) starts Ray workers, but ray is not installed; "
                     "pip install 'ray[default]' or use trainer.num_workers=1")


def check_sandbox(cfg) -> list[str]:
    """``sandbox.packages``: names a program imports (``import NAME``), one top-level package each."""
    problems = []
    for name in cfg.sandbox.packages:
        text = str(name)
        if not text.isidentifier() or keyword.iskeyword(text):
            problems.append(f"sandbox.packages has {text!r}, which is not an importable name; give the top-level "
                            "name a program imports (numpy, sympy; sklearn for scikit-learn, PIL for pillow)")
        elif text == "portrl":
            problems.append("sandbox.packages has 'portrl', which a sandboxed program may never import (its package "
                            "data holds the training problems and their tests)")
    return problems


def _env_backends(cfg) -> list:
    """The backends whose variables ``device.env`` may set: the one ``device.name`` names, else (``auto``, or a
    name no backend has: check_backend reports that) every registered one."""
    try:
        return [get_backend(cfg.device.name)] if cfg.device.name != "auto" else all_backends()
    except BackendError:
        return all_backends()


def check_env(cfg) -> list[str]:
    """``device.env`` names only variables the backend accepts (``Backend.accepted_env``: exact names it declares,
    none that loads code). A variable any registered backend refuses (``Backend.env_refusals``) is reported with
    that backend's reason; any other is reported as undeclared. The accepted names follow in one more line.
    A config is data: it cannot preload a library, name a plugin or hook, or attach a debugger."""
    env = [str(k) for k in (cfg.device.env or {})]
    if not env:
        return []
    backends = _env_backends(cfg)
    refusals: dict[str, str] = {}
    for b in all_backends():
        refusals.update(b.env_refusals())
    accepted = set().union(*(b.accepted_env() for b in backends)) - set(refusals)
    one = len(backends) == 1
    undeclared = f"backend {backends[0].name!r} does not declare it" if one else "no backend declares it"
    problems = []
    for name in env:
        if name in refusals:
            problems.append(f"device.env.{name} is not accepted: {refusals[name]}")
        elif name not in accepted:
            close = difflib.get_close_matches(name, accepted, n=1, cutoff=0.85)  # typos, not relatives
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"device.env.{name} is not accepted: {undeclared}{hint}; set a variable portrl does "
                            "not know in the shell that starts portrl")
    if not problems:
        values = {name: str(v) for name, v in (cfg.device.env or {}).items()}
        return [p for b in backends for p in b.env_value_problems(values)]
    if one:
        problems.append(f"device.env accepted: variables backend {backends[0].name!r} declares, "
                        f"{', '.join(sorted(accepted))}")
    else:  # every backend's names would fill a screen: the shared ones, and how to see one backend's
        shared = set.intersection(*(set(b.accepted_env()) for b in backends)) - set(refusals)
        problems.append(f"device.env accepted: variables every backend declares, {', '.join(sorted(shared))}; "
                        f"set device.name ({', '.join(sorted(b.name for b in backends))}) to see one backend's own")
    return problems


def check_backend(cfg) -> list[str]:
    """Names that depend on the chosen backend (skipped for ``auto``: detection happens at run time)."""
    name = cfg.device.name
    if name == "auto":
        return []
    try:
        backend = get_backend(name, cfg.device.get("name_source") or "device.name")
    except BackendError as exc:
        return [str(exc)]
    prefs = backend.kernel_preferences()
    problems = []
    if cfg.device.get("model"):
        try:
            named_model(backend.device_models, str(cfg.device.model), name)
        except UserError as exc:
            problems.append(str(exc))
    transport = cfg.rollout.weight_transport
    if transport != "auto" and transport in transport_names() and transport not in backend.weight_transports:
        problems.append(f"rollout.weight_transport={transport!r} is not offered by backend {name!r}; it offers: "
                        f"auto, {', '.join(backend.weight_transports)}")
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
    problems = check_choices(cfg) + check_consistency(cfg) + check_ranges(cfg) + check_env(cfg) + check_async(cfg)
    problems += check_multi_turn(cfg) + check_sandbox(cfg) + check_mesh(cfg)
    if registries:
        problems += check_registries(cfg)
    if backend:
        problems += check_backend(cfg)
    if problems:
        raise ConfigError("invalid config:\n  - " + "\n  - ".join(problems))
