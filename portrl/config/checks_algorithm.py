"""Config checks of the algorithm (part of :func:`portrl.config.checks.validate`).

What the algorithm's record (``portrl.algo.spec.algorithm_spec``) needs of the rest of the config and which
options apply to it: ``rollout.n > 1`` for group comparisons, an even ``rollout.n`` for pairs, the critic /
reference it reads not switched off (``critic.enable`` / ``ref.enable``), ``trainer.ref_update_freq`` only with a
reference, the options the algorithms declare (``portrl/algo/options.py``) within their declared ranges and, like
the shared estimator keys (``lam``, ``gamma``, ``norm_adv_by_std_in_grpo``), set away from their default only for an
algorithm that takes them; rollout-correction bypass mode and PF-PPO against the algorithm, the rollout-correction
bounds, PRIME's implicit PRM (``reward_model``) and the accuracy filter (``data.accuracy_*_bound``). The checks
that read the record are skipped for an unknown algorithm name (:func:`portrl.config.checks.check_registries`
reports the name).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from omegaconf import OmegaConf

from portrl.algo import AlgorithmSpec, algorithm_spec, estimator_spec, reference_enabled, registered
from portrl.algo.options import placements
from portrl.algo.registry import POLICY_LOSSES
from portrl.algo.rollout_correction import RS_LEVELS
from portrl.algo.spec import ESTIMATOR_KEYWORDS
from portrl.config.options_schema import check_declared_ranges
from portrl.config.schema import AlgorithmConfig


def check_algorithm(cfg) -> list[str]:
    """Every problem of ``cfg`` against its algorithm, in a fixed order (one line each)."""
    return (_algorithm_needs(cfg) + _options_apply(cfg) + check_declared_ranges(cfg) + _algorithm_options(cfg)
            + _rollout_correction(cfg) + _implicit_prm(cfg))


def known_algorithm(cfg) -> bool:
    """Both names are registered (unknown ones are reported by :func:`portrl.config.checks.check_registries`)."""
    a = cfg.algorithm
    return a.objective in registered("objective") and a.adv_estimator in registered("adv_estimator")


def _algorithm_needs(cfg) -> list[str]:
    """What the algorithm's record needs of the rest of the config; estimator options it cannot take."""
    if not known_algorithm(cfg):
        return []
    a, n = cfg.algorithm, cfg.rollout.n
    spec = algorithm_spec(a)
    problems = []
    what = f"algorithm.adv_estimator={a.adv_estimator!r}" if spec.estimator is not None \
        else f"algorithm.objective={a.objective!r}"
    if spec.needs_groups and n < 2:
        problems.append(f"{what} compares responses within a prompt group and needs rollout.n > 1 (got {n})")
    if spec.needs_pairs and n % 2:
        problems.append(f"algorithm.objective={a.objective!r} pairs sampled responses: rollout.n must be even "
                        f"(got {n})")
    if cfg.critic.enable is False and spec.needs_critic:
        problems.append(f"critic.enable=false, but {what} reads the critic's values: set critic.enable=null (auto) "
                        "or true, or use an estimator without a critic")
    if cfg.ref.enable is False and (spec.needs_reference or cfg.actor.use_kl_loss):
        problems.append("ref.enable=false, but the reference policy is needed (actor.use_kl_loss, "
                        "algorithm.use_kl_in_reward or the objective reads ref_log_probs): set ref.enable=null "
                        "(auto) or true")
    if cfg.trainer.ref_update_freq > 0 and not reference_enabled(cfg):
        problems.append(f"trainer.ref_update_freq={cfg.trainer.ref_update_freq} refreshes the reference policy, but "
                        f"this run has none ({what} reads no ref_log_probs, no KL term does, and ref.enable="
                        f"{'null' if cfg.ref.enable is None else 'false'}): set "
                        "ref.enable=true, use an algorithm with a reference (algorithm=spin), or ref_update_freq=0")
    return problems


def _options_apply(cfg) -> list[str]:
    """An algorithm option set away from its default (a value equal to it passes: verl's full YAML files carry every
    key) only for a chosen estimator, objective or policy loss that takes it: the declared options
    (``portrl/algo/options.py``, plugins' included) and the shared estimator keys (``gamma``, ``lam``,
    ``norm_adv_by_std_in_grpo``: ``portrl.algo.spec.ESTIMATOR_KEYWORDS``), which an estimator takes when its function
    names them. ``algorithm.lam=0.5`` with grpo, ``actor.policy_loss.dro_beta=0.1`` with vanilla would be ignored."""
    loss_mode = cfg.actor.policy_loss.loss_mode
    if not known_algorithm(cfg) or loss_mode not in registered("policy_loss"):
        return []
    spec = algorithm_spec(cfg.algorithm)
    chosen = {("objective", spec.objective.name)}
    chosen |= {("adv_estimator", spec.estimator.name)} if spec.estimator is not None else set()
    chosen |= {("policy_loss", POLICY_LOSSES.resolve(str(loss_mode)))} if spec.objective.uses_policy_loss else set()
    problems = []
    for key, (default, takers) in _option_takers().items():
        value = OmegaConf.select(cfg, key, default=default)  # missing: a config composed before a declaration
        if value != default and not chosen & set(takers):
            shown = "null" if default is None else repr(default)
            problems.append(f"{key} only applies to {_takers(cfg, spec, takers)}: its value {value!r} would be ignored "
                            f"(leave it at its default, {shown}, or choose one of those)")
    return problems


def _option_takers() -> dict[str, tuple[Any, list[tuple[str, str]]]]:
    """Every algorithm option's key -> (its default, the (kind, name) of each algorithm that takes it)."""
    out: dict[str, tuple[Any, list[tuple[str, str]]]] = {}
    defaults = {f.name: f.default for f in dataclasses.fields(AlgorithmConfig)}
    for key in ESTIMATOR_KEYWORDS:
        takers = [("adv_estimator", n) for n in registered("adv_estimator") if estimator_spec(n).takes(key)]
        out[f"algorithm.{key}"] = (defaults[key], takers)
    for p in placements():
        out.setdefault(p.key, (p.field.default, []))[1].append((p.kind, p.name))
    return out


_WHAT = {"adv_estimator": ("estimators", "algorithm.adv_estimator"), "objective": ("objectives", "algorithm.objective"),
         "policy_loss": ("policy losses", "actor.policy_loss.loss_mode")}


def _takers(cfg, spec: AlgorithmSpec, takers: list[tuple[str, str]]) -> str:
    """``the estimators that take it (gae, vcppo_gae), not 'grpo'``: per kind of taker, the ones that take it and
    the chosen one (or that the objective uses none of that kind)."""
    parts = []
    for kind, (plural, key) in _WHAT.items():
        names = sorted({n for k, n in takers if k == kind})
        if not names:
            continue
        unused = (kind == "adv_estimator" and spec.estimator is None) or \
            (kind == "policy_loss" and not spec.objective.uses_policy_loss)
        not_chosen = f"and algorithm.objective={spec.objective.name!r} uses none" if unused \
            else f"not {OmegaConf.select(cfg, key)!r}"
        parts.append(f"the {plural} that take it ({', '.join(names)}), {not_chosen}")
    return "; or to ".join(parts) or "the algorithms that take it (none is registered)"


def _algorithm_options(cfg) -> list[str]:
    """GDPO's reward keys and weights, bypass mode and PF-PPO against the algorithm they apply to."""
    if not known_algorithm(cfg):
        return []
    a = cfg.algorithm
    spec = algorithm_spec(a)
    problems = []
    if spec.needs_sum_pi_squared and a.rollout_correction.bypass_mode:
        problems.append(f"algorithm.adv_estimator={a.adv_estimator!r} reads Σπ² of every token from the old-log-prob "
                        "pass, which algorithm.rollout_correction.bypass_mode=true skips: set bypass_mode=false or "
                        "use another estimator")
    keys, weights = a.get("gdpo_reward_keys"), a.get("gdpo_reward_weights")
    if keys is not None:
        names = [str(k) for k in keys]
        if not names or any(not k.strip() for k in names) or len(set(names)) != len(names):
            problems.append(f"algorithm.gdpo_reward_keys={names!r} must be a non-empty list of distinct names "
                            "(keys of the dict your reward function returns), or null (the summed score only)")
    if weights is not None:
        if keys is None:
            problems.append("algorithm.gdpo_reward_weights is set but algorithm.gdpo_reward_keys is null: give one "
                            "key per weight")
        elif len(weights) != len(keys):
            problems.append(f"algorithm.gdpo_reward_weights has {len(weights)} entries for {len(keys)} "
                            "gdpo_reward_keys: give one weight per key")
    rc = a.rollout_correction
    mode = str(cfg.actor.policy_loss.loss_mode)
    if rc.bypass_mode:
        if spec.estimator is None:
            problems.append(f"algorithm.rollout_correction.bypass_mode=true changes the policy-gradient loss; "
                            f"algorithm.objective={a.objective!r} has its own loss: set bypass_mode=false")
        if mode not in ("vanilla", "bypass_mode"):
            problems.append(f"algorithm.rollout_correction.bypass_mode=true uses the loss bypass_mode "
                            f"(rollout_correction.loss_type ppo_clip or reinforce), so "
                            f"actor.policy_loss.loss_mode={mode!r} would not be used: set it to vanilla or bypass_mode")
    elif mode == "bypass_mode":
        problems.append("actor.policy_loss.loss_mode='bypass_mode' needs algorithm.rollout_correction.bypass_mode=true "
                        "(the old policy is then the rollout engine's)")
    elif rc.loss_type != "ppo_clip":
        problems.append(f"algorithm.rollout_correction.loss_type={rc.loss_type!r} only applies with "
                        "algorithm.rollout_correction.bypass_mode=true")
    if a.use_pf_ppo and spec.needs_pairs:
        problems.append(f"algorithm.use_pf_ppo=true resamples rows, which breaks the response pairs of "
                        f"algorithm.objective={a.objective!r}: set use_pf_ppo=false")
    return problems


def _rollout_correction(cfg) -> list[str]:
    """The bounds of ``algorithm.rollout_correction`` (portrl.algo.rollout_correction): the IS truncation > 0, its
    batch normalisation only with ``rollout_is`` in decoupled mode; with
    ``rollout_rs`` an upper bound > 0 and a lower bound in (0, upper] (null: 1 / upper, so upper >= 1); the veto > 0;
    the rejection bounds only with ``rollout_rs``; rejection only for the policy-gradient loss, outside bypass mode."""
    rc, key = cfg.algorithm.rollout_correction, "algorithm.rollout_correction."
    problems = []
    if not rc.rollout_is_threshold > 0:
        problems.append(f"{key}rollout_is_threshold={rc.rollout_is_threshold!r} must be > 0 (the IS weights' cap)")
    if rc.rollout_is_batch_normalize and (rc.rollout_is is None or rc.bypass_mode):
        problems.append(f"{key}rollout_is_batch_normalize=true normalises the IS weights of decoupled mode: set "
                        f"{key}rollout_is (token or sequence) and bypass_mode=false")
    upper, lower = rc.rollout_rs_threshold, rc.rollout_rs_threshold_lower
    if rc.rollout_rs is None:
        for name, value in (("rollout_rs_threshold", upper), ("rollout_rs_threshold_lower", lower)):
            if value is not None:
                problems.append(f"{key}{name}={value!r} only applies with {key}rollout_rs set (token, sequence or "
                                "geometric)")
    elif rc.rollout_rs not in RS_LEVELS:
        pass  # reported by check_choices
    elif upper is None or not upper > 0:
        problems.append(f"{key}rollout_rs_threshold={upper!r} must be set, > 0, with {key}rollout_rs="
                        f"{rc.rollout_rs!r} (the upper bound of the ratio pi_old / pi_rollout)")
    elif lower is None and upper < 1:
        problems.append(f"{key}rollout_rs_threshold={upper!r} must be >= 1 when rollout_rs_threshold_lower is null "
                        f"(its default 1 / upper = {1 / upper:g} would exceed the upper bound)")
    elif lower is not None and not 0 < lower <= upper:
        problems.append(f"{key}rollout_rs_threshold_lower={lower!r} must be in (0, rollout_rs_threshold={upper!r}]")
    veto = rc.rollout_token_veto_threshold
    if veto is not None and not veto > 0:
        problems.append(f"{key}rollout_token_veto_threshold={veto!r} must be > 0, or null (no veto)")
    if rc.rollout_rs is not None or veto is not None:
        if rc.bypass_mode:
            problems.append(f"{key}rollout_rs / rollout_token_veto_threshold reject by the ratio pi_old / pi_rollout, "
                            f"which bypass mode fixes at 1: set {key}bypass_mode=false")
        if known_algorithm(cfg) and algorithm_spec(cfg.algorithm).estimator is None:
            problems.append(f"{key}rollout_rs / rollout_token_veto_threshold apply to the policy-gradient loss; "
                            f"algorithm.objective={cfg.algorithm.objective!r} has its own: set them to null")
    return problems


def _implicit_prm(cfg) -> list[str]:
    """PRIME's implicit PRM (``reward_model``) and verl's accuracy filter (``data.filter_accuracy``)."""
    problems = []
    rm, d = cfg.reward_model, cfg.data
    if rm.enable is False and known_algorithm(cfg) and algorithm_spec(cfg.algorithm).needs_implicit_rewards:
        problems.append(f"reward_model.enable=false, but algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} reads "
                        "the implicit PRM's rewards: set reward_model.enable=null (auto) or true")
    if rm.model.beta_train <= 0:
        problems.append(f"reward_model.model.beta_train={rm.model.beta_train!r} must be > 0")
    if rm.mini_batch_size is not None and (rm.mini_batch_size < 1 or d.train_batch_size % rm.mini_batch_size):
        problems.append(f"reward_model.mini_batch_size={rm.mini_batch_size} must be >= 1 and divide "
                        f"data.train_batch_size={d.train_batch_size} (prompts), or null (actor.ppo_mini_batch_size)")
    if not 0 <= d.accuracy_lower_bound <= d.accuracy_upper_bound <= 1:
        problems.append(f"data.accuracy_lower_bound={d.accuracy_lower_bound!r} and data.accuracy_upper_bound="
                        f"{d.accuracy_upper_bound!r} must satisfy 0 <= lower <= upper <= 1 (mean accuracy of a group)")
    return problems
