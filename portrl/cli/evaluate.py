"""``portrl eval [--model DIR | --checkpoint CKPT] [--report R.json] [run options]``: accuracy on a dataset.

Generates with the validation sampling settings (``rollout.val_kwargs``: greedy by default, mean@n
otherwise) on ``data.val_files`` (or the generated arith test split), scores with the rule rewards
and prints accuracy and score per data source. ``--model`` is a transformers directory (for example
the ``hf`` export of a run); ``--checkpoint`` is a ``global_step_N`` directory of a run, loaded on top
of ``model.path``.

Heavy modules (torch, transformers, the trainer) are imported when the command runs, so that ``portrl --help``
and ``portrl eval --help`` stay fast.
"""

from __future__ import annotations

import json
from pathlib import Path

from portrl.cli.run_options import ExtraOption, add_run_arguments, compose_from, options_parser, parse_run_options
from portrl.errors import UserError
from portrl.outputs import ON_EXISTING, claim, publish
from portrl.user_files import temp_name

PROG = "portrl eval"
EXTRA: list[ExtraOption] = [
    (("--model",), {"default": None, "help": "a local transformers model directory (sets model.path)"}),
    (("--checkpoint",), {"default": None, "help": "a run checkpoint directory (global_step_N) to load"}),
    (("--report",), {"default": None, "help": "also write the metrics as JSON here (a new file)"}),
    (("--on-existing",), {"choices": ON_EXISTING, "default": "refuse",
                          "help": "a --report that exists: refuse (default) or move_aside (rename it to "
                                  "<name>.old-<time>)"}),
]
# Evaluation trains nothing: no checkpoint resume, no KL term; the workers only training needs (reference policy,
# critic, PRIME's reward model) are switched off after the config is checked (:func:`evaluation_config`), so an
# algorithm that needs them for training (ppo, online_dpo, prime, ...) still evaluates.
EVAL_OVERRIDES = ["actor.use_kl_loss=false",
                  "algorithm.use_kl_in_reward=false", "trainer.resume=off", "trainer.val_before_train=true",
                  "trainer.loggers=[]", "trainer.export_hf=false", "trainer.plot=false"]

REST_AFTER = 0  # everything after the command is parsed by this module


def add_arguments(parser) -> None:
    add_run_arguments(parser)


def evaluation_config(cfg):
    """``cfg`` (checked as the training run it came from) without the workers only training uses; a step
    between composition and the preflight (the config is settled, read-only, after the preflight)."""
    for section in (cfg.ref, cfg.critic, cfg.reward_model):
        section.enable = False
    return cfg


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "Accuracy of a model on a dataset.", EXTRA), args.rest)  # --help exits
    from portrl.models.loader import check_model_dir
    from portrl.trainer import RLTrainer
    from portrl.trainer.preflight import EVAL, preflight
    from portrl.trainer.resources import settle_config

    extra = list(EVAL_OVERRIDES)
    if opts.model:
        check_model_dir(opts.model, "--model")  # named as the user gave it (it becomes model.path)
        extra.append(f"model.path={opts.model}")
    cfg = evaluation_config(compose_from(opts, extra))  # bad input anywhere below: a UserError (portrl.cli.main)
    if opts.report and not Path(opts.report).expanduser().absolute().parent.is_dir():
        raise UserError(f"--report {opts.report}: the folder {str(Path(opts.report).parent)!r} does not exist")
    preflight(cfg, EVAL, checkpoint=opts.checkpoint)  # before the model loads
    if opts.report:
        claim(opts.report, "--report", opts.on_existing)
    trainer = RLTrainer(settle_config(cfg))  # resources resolved, then read-only
    if opts.checkpoint:
        trainer.load_checkpoint(Path(opts.checkpoint), policy_only=True)  # verified; the policy only
    metrics = trainer.validate(trainer.global_step)
    if not metrics:
        raise UserError("no validation data; set data.val_files=[TEST.parquet]")
    for key in sorted(k for k in metrics if k.startswith("val/")):
        print(f"{key:<40} {metrics[key]:.4f}")
    if opts.report:
        tmp = temp_name(opts.report)
        with open(tmp, "w") as f:
            json.dump(metrics, f, indent=2)
        publish(tmp, opts.report)
    return 0
