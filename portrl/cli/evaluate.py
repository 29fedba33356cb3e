"""``portrl eval [--model DIR | --checkpoint CKPT] [--report R.json] [run options]``: accuracy on a dataset.

Generates with the validation sampling settings (``rollout.val_kwargs``: greedy by default, mean@n
otherwise) on ``data.val_files`` (or the generated arith test split), scores with the rule rewards
and prints accuracy and score per data source. ``--model`` is a transformers directory (for example
the ``hf`` export of a run); ``--checkpoint`` is a ``global_step_N`` directory of a run, which is all it needs:
the model it was trained from (``model.path``, ``model.tokenizer_path``, the built-in tiny model's ``model.tiny.*``,
``actor.lora_rank``) is read from its manifest (the run identity it records) and used where the command line
(``key=value``, ``--model``, ``--config``) sets none of them; a model the command line names that is not the one
the checkpoint was trained from is refused with one line naming the keys.

Progress: the rows are scored in chunks of ``data.val_batch_size`` (when the command line sets none: one training
step's worth of generation, ``data.train_batch_size * rollout.n`` responses) and a line ``scored 16/64 rows``
goes to stderr after each chunk; at the end it prints the metrics and which file(s) it scored, how many rows.

Heavy modules (torch, transformers, the trainer) are imported when the command runs, so that ``portrl --help``
and ``portrl eval --help`` stay fast.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any, Dict

from portrl.cli.run_options import ExtraOption, add_run_arguments, compose_from, options_parser, parse_run_options
from portrl.errors import RunFailed, UserError
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


def checkpoint_model(path: str) -> Dict[str, Any]:
    """The model keys (``model.*``, ``actor.lora_rank``) of the run identity checkpoint ``path`` records; {} when
    ``path`` is no readable checkpoint (the preflight then says what is wrong with it)."""
    from portrl.trainer.run_identity import MODEL_KEYS  # noqa: PLC0415  (CLI start-up: loaded by the command)

    try:
        manifest = json.loads((Path(path).expanduser() / "manifest.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return {}
    meta = manifest.get("meta") if isinstance(manifest, dict) else None
    identity = meta.get("identity") if isinstance(meta, dict) else None
    return {k: v for k, v in identity.items() if k.startswith(MODEL_KEYS)} if isinstance(identity, dict) else {}


def checkpoint_overrides(saved: Dict[str, Any], user_keys: frozenset) -> list[str]:
    """``key=value`` overrides that give a run the model of a checkpoint (``saved``: :func:`checkpoint_model`),
    except the keys in ``user_keys`` (set on the command line, which wins). The built-in tiny model
    (``model.path`` ``<tiny>``) keeps ``model.path`` unset and gets its ``model.tiny.*``."""
    from portrl.trainer.run_identity import TINY  # noqa: PLC0415  (CLI start-up: loaded by the command)

    out = []
    for key, value in sorted(saved.items()):
        if key in user_keys or (key == "model.path" and value == TINY):
            continue
        if key.startswith("model.tiny.") and "model.path" in user_keys:
            continue  # the user's own model: the tiny model's shape says nothing about it
        out.append(f"{key}={json.dumps(value)}")  # JSON is YAML: strings quoted, null, numbers
    return out


def check_checkpoint_model(cfg, checkpoint: str, saved: Dict[str, Any]) -> None:
    """UserError when ``cfg`` names another model than the one checkpoint ``checkpoint`` was trained from (its
    ``saved`` model keys), or when that model is no longer where the checkpoint says."""
    from portrl.trainer.run_identity import MODEL_KEYS, TINY, identity_diff, run_identity  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if not saved:
        return
    mine = {k: v for k, v in run_identity(cfg).items() if k.startswith(MODEL_KEYS)}
    diff = identity_diff(saved, mine)
    if any(d.startswith("model.path:") for d in diff):  # another model: the tiny model's shape is beside the point
        diff = [d for d in diff if not d.startswith("model.tiny.")]
    if diff:
        raise UserError(f"--checkpoint {checkpoint} was trained from another model than this command names "
                        f"({'; '.join(diff)}); eval takes the model from the checkpoint: drop those keys (and "
                        f"--model) from the command line, or give the checkpoint of a run of this model")
    path = saved.get("model.path")
    if path != TINY and isinstance(path, str) and not Path(path).is_dir():
        raise UserError(f"--checkpoint {checkpoint} was trained from model.path={path}, which is not on this "
                        f"machine: give that model's folder with model.path=DIR")


class ScoringProgress:
    """The reward scorer of a validation, counting the rows it scored and writing ``scored k/N rows`` to stderr
    after each chunk (``n``: responses per row, ``rollout.val_kwargs.n``). Everything else is the scorer's."""

    def __init__(self, reward: Any, total: int, n: int):
        self._reward, self.total, self.n, self.done = reward, total, max(1, n), 0
        self._t0 = time.perf_counter()

    def compute_reward(self, batch: Any) -> Any:
        out = self._reward.compute_reward(batch)
        self.done += len(batch.meta["data_source"]) // self.n
        print(f"{PROG}: scored {self.done}/{self.total} rows ({time.perf_counter() - self._t0:.0f} s)",
              file=sys.stderr, flush=True)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reward, name)


def progress_chunk(cfg) -> int:
    """Prompts per validation chunk when the command line sets no ``data.val_batch_size``: the responses of one
    training step (``data.train_batch_size * rollout.n``), as prompts of ``rollout.val_kwargs.n`` responses."""
    return max(1, math.ceil(int(cfg.data.train_batch_size) * int(cfg.rollout.n) / max(1, int(cfg.rollout.val_kwargs.n))))


def run(args) -> int:
    opts = parse_run_options(options_parser(PROG, "Accuracy of a model on a dataset.", EXTRA), args.rest)  # --help exits
    from portrl.device import check_cli_device, config_backend  # noqa: PLC0415  (CLI start-up: loaded by the command)

    check_cli_device(opts.device, opts.overrides, preset=opts.preset, config_file=opts.config)  # before torch loads
    from portrl.config.composition import explicit_keys  # noqa: PLC0415  (CLI start-up: loaded by the command)

    extra = list(EVAL_OVERRIDES) + ([f"model.path={opts.model}"] if opts.model else [])
    given = compose_from(opts, extra)  # bad input: a UserError (portrl.cli.main)
    config_backend(given)  # a device that is not here: one line before the model and trainer modules load
    from portrl.models.loader import check_model_dir  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer import RLTrainer  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.preflight import EVAL, preflight  # noqa: PLC0415  (CLI start-up: loaded by the command)
    from portrl.trainer.resources import settle_config  # noqa: PLC0415  (CLI start-up: loaded by the command)

    if opts.model:
        check_model_dir(opts.model, "--model")  # named as the user gave it (it becomes model.path)
    saved = checkpoint_model(opts.checkpoint) if opts.checkpoint else {}
    user_keys = explicit_keys(given) or frozenset()
    from_ckpt = checkpoint_overrides(saved, user_keys)
    if any(o.startswith(("model.path=", "model.tiny.")) for o in from_ckpt):  # the model it takes, said once
        print(f"{PROG}: the model of {opts.checkpoint}: {' '.join(from_ckpt)}", file=sys.stderr)
    cfg = evaluation_config(compose_from(opts, [*from_ckpt, *extra]))  # the user's overrides come after: they win
    check_checkpoint_model(cfg, opts.checkpoint, saved)
    if "data.val_batch_size" not in user_keys and cfg.data.val_batch_size is None:
        cfg.data.val_batch_size = progress_chunk(cfg)
    if opts.report and not Path(opts.report).expanduser().absolute().parent.is_dir():
        raise UserError(f"--report {opts.report}: the folder {str(Path(opts.report).parent)!r} does not exist")
    preflight(cfg, EVAL, checkpoint=opts.checkpoint)  # before the model loads
    if opts.report:
        claim(opts.report, "--report", opts.on_existing)
    trainer = RLTrainer(settle_config(cfg))  # resources resolved, then read-only
    if opts.checkpoint:
        trainer.load_checkpoint(Path(opts.checkpoint), policy_only=True)  # verified; the policy only
    total = len(trainer.val_prompts) if trainer.val_prompts is not None else 0
    trainer.reward = ScoringProgress(trainer.reward, total, int(trainer.cfg.rollout.val_kwargs.n))
    try:
        metrics = trainer.validate(trainer.global_step)
    except Exception as exc:  # a tool whose sandbox stopped working: one line, as a training run ends with
        from portrl.trainer.run_end import tool_unusable  # noqa: PLC0415  (CLI start-up: loaded by the command)

        unusable = tool_unusable(exc)
        if unusable is None:
            raise
        raise RunFailed(f"{PROG}: error: the evaluation stopped: {' '.join(str(unusable).split())}") from exc
    if not metrics:
        raise UserError("no validation data; set data.val_files=[TEST.parquet]")
    for key in sorted(k for k in metrics if k.startswith("val/")):
        print(f"{key:<40} {metrics[key]:.4f}")
    files = ", ".join(str(f) for f in trainer.cfg.data.val_files)
    model = f"checkpoint {opts.checkpoint}" if opts.checkpoint else f"model {trainer.cfg.model.path}"
    print(f"scored {total} rows of {files} with {model}")
    if opts.report:
        tmp = temp_name(opts.report)
        with open(tmp, "w") as f:
            json.dump(metrics, f, indent=2)
        publish(tmp, opts.report)
    return 0
