"""Preflight: everything about a run that can be known before a model loads, checked before one does.

``portrl train``, ``portrl sft`` and ``portrl eval`` call :func:`preflight` right after composing the config.
It raises a :class:`~portrl.errors.UserError` (one line, exit code 2) for the first problem found:

* the device: ``device.name`` (or ``--device`` / ``$PORTRL_DEVICE``) is registered and usable here, named by
  where it came from; its dtype and ``rollout.engine`` are available on it; an explicit ``trainer.num_workers``
  is no more than the node has devices (null, auto: every device of the node, is resolved when the run starts);
  a separated placement's ``rollout.cpu_cores`` fits the cores this process may use (``Backend.split_compute``);
* the model: ``model.path`` / ``model.tokenizer_path`` / ``critic.model_path`` / ``reward.model_path`` are
  Hugging Face directories (config.json, tokenizer files; the tokenizer has a chat template); weights that are
  only pickles (``pytorch_model.bin``) hold nothing torch's safe unpickler refuses (``check_pickled_weights``);
* the meshes: each trained model's tensor, sequence and FSDP sizes fit the workers, the model's heads, key/value
  heads, MLP width and vocabulary, its family and the attention (portrl.trainer.mesh_check);
* the data: ``data.train_files`` / ``data.val_files`` exist, are parquet with the verl columns, and every row
  is valid (NaN or empty ground truths name the row; images decode, one per ``<image>`` placeholder, and a model
  with an image processor reads them); every data_source has a reward; the train split has
  ``data.train_batch_size`` prompts within ``data.max_prompt_length``; a run that needs files has them;
* the reward: ``reward.custom.path`` imports and its function scores the first row (with the row's ground
  truth as the response) without raising and returns a float or a dict with "score";
* the code sandbox: a run whose code reward or python tool runs programs locally starts one one-line program in the
  sandbox (``sandbox.packages`` installed; it starts; its isolation applies, or ``sandbox.allow_unisolated=true``
  accepts what is missing: portrl.trainer.sandbox_check);
* the warm start: ``model.sft_warm_start`` needs the generated rows of a task with built-in SFT rows (portrl.tasks:
  arith), without ``data.train_files`` (portrl.trainer.data_fit.warm_start_task);
* fitted to the user's data (portrl.trainer.data_fit, each with a log line; a value the user set is refused
  instead): an empty ``data.val_files`` becomes the test split beside the training split (or validation is off),
  a preset's ``data.train_batch_size`` / ``actor.ppo_mini_batch_size`` larger than the usable training rows are
  lowered, and a preset's SFT warm start is turned off for other data (training files included);
* checkpoints: ``trainer.resume=PATH`` and ``portrl eval --checkpoint`` name a verified checkpoint;
* loggers: the packages of ``trainer.loggers`` (tensorboard, wandb, mlflow) are installed; ``train``
  into ``trainer.output_dir`` continues only its own run (``portrl.trainer.run_dir.check_run_dir``);
* outputs: ``trainer.output_dir`` is not a file.

The built-in tiny model (``model.path`` empty) is checked through its tokenizer, built in memory. What the preflight
fits is written into the config it checks; the run's resources (model, generated data, number of workers) are
resolved next, into the read-only config the trainer takes (:func:`portrl.trainer.resources.settle_config`).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from portrl.agent.tools.config import load_tool_config
from portrl.algo import critic_enabled, implicit_prm_enabled
from portrl.data.schema import check_row
from portrl.data.validate import count_fitting_prompts, read_verl_files
from portrl.device.backend import Backend, module_available
from portrl.errors import UserError
from portrl.models import load_processor, load_tokenizer
from portrl.models.loader import check_model_dir, check_pickled_weights
from portrl.models.tokenizer import build_tokenizer
from portrl.rewards.custom import RewardFunctionError, load_custom_reward
from portrl.rewards.manager import RewardTimeoutError, _score_rows, describe_reward
from portrl.rewards.registry import UnknownDataSource, reward_kind
from portrl.rewards.time_limit import TimeLimitReached, call_with_time_limit
from portrl.rollout import engine_capabilities, engine_factory, offered_engines
from portrl.tasks import data_task, generated_task, names_where
from portrl.trainer.checkpoint import check_compatible, read_meta, verify
from portrl.trainer.data_cache import generator_options
from portrl.trainer.data_fit import fit_token_budget, fit_train_batch, fit_val_files, fit_warm_start, held_notes
from portrl.trainer.resources import TINY_VOCAB, no_train_files_message
from portrl.trainer.memory_plan import check_memory_plan, fit_auto_token_budget
from portrl.trainer.mesh_check import check_meshes
from portrl.trainer.run_dir import check_run_dir
from portrl.trainer.sandbox_check import check_remote_code_rows, check_sandbox, sandbox_users
from portrl.workers.lora import check_target_modules
from portrl.workers.placement import compute_split
from portrl.workers.setup import auto_num_workers, resolve_dtype, worker_backend

if TYPE_CHECKING:
    from portrl.config.schema import PortRLConfig

TRAIN, SFT, EVAL = "train", "sft", "eval"


def preflight(cfg: PortRLConfig, command: str = TRAIN, *, checkpoint: Optional[str] = None) -> None:
    """Check ``cfg`` for ``command`` (train, sft or eval) before any model loads; UserError on the first problem.
    What it fits to the data is logged once every check passed."""
    with held_notes(cfg):
        _preflight(cfg, command, checkpoint)


def _preflight(cfg: PortRLConfig, command: str, checkpoint: Optional[str]) -> None:
    backend = _check_device(cfg)
    tokenizer = _check_model(cfg, command)
    fit_auto_token_budget(cfg, backend)  # actor.max_tokens_per_micro_batch=auto: the largest the memory plan fits
    if command == TRAIN:
        check_meshes(cfg, backend)  # the mesh sizes against the workers, the models' dimensions and the attention
    _check_output_dir(cfg)
    if command == SFT:
        return  # its data are --train-files or a task's built-in SFT rows: portrl.cli.sft checks them
    if command == TRAIN and generated_task(cfg) is None and not cfg.data.train_files:
        raise UserError(no_train_files_message(cfg))
    if command == TRAIN:
        fit_warm_start(cfg)  # other data than a task's generated rows: a preset's warm start off with a note
        fit_val_files(cfg)  # empty (or a preset's elsewhere): the test split beside the training split, or off
        fit_token_budget(cfg)  # a null micro-batch token budget sized by the model (>= 100M parameters)
    train_rows, val_rows = _check_data(cfg, command, tokenizer)
    first = train_rows[0] if train_rows else (val_rows[0] if val_rows else _first_generated_row(cfg))
    _check_reward(cfg, first)
    tools: dict = {}
    if command in (TRAIN, EVAL) and cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.tool_config_path:
        tools = load_tool_config(str(cfg.rollout.multi_turn.tool_config_path))  # the files its tools read too
    check_remote_code_rows(cfg, [*train_rows, *val_rows])  # assert tests need the local sandbox
    check_sandbox(cfg, sandbox_users(cfg, [*train_rows, *val_rows], tools))  # a program through it, once
    if command == TRAIN:
        _check_lora_targets(cfg)
        _check_resume(cfg)
        _check_loggers(cfg)
        check_run_dir(cfg)  # another run's output_dir, an old-format or foreign checkpoint (no checksums here)
        check_memory_plan(cfg, backend)  # each phase's predicted peak against the device's memory (portrl plan)
    if checkpoint is not None:
        check_checkpoint_dir(checkpoint, "--checkpoint")


# ------------------------------------------------------------------------------------------ device
def _check_device(cfg: PortRLConfig) -> Backend:
    quiet = logging.getLogger("portrl.device.registry")  # the run logs its backend when it starts; not twice
    level = quiet.level
    quiet.setLevel(logging.WARNING)
    try:
        backend = worker_backend(cfg)  # BackendError (a UserError) naming device.name_source
    finally:
        quiet.setLevel(level)
    try:
        resolve_dtype(cfg, backend)
    except ValueError as exc:
        raise UserError(f"{exc} (device.dtype / model.dtype)") from None
    engine = str(cfg.rollout.engine)
    if engine != "auto":
        engine_factory(engine)  # a broken engine plugin: RolloutEngineError (a UserError) naming it and its error
    if engine != "auto" and engine not in offered_engines(backend):
        offered = ", ".join(offered_engines(backend)) or "none"
        raise UserError(f"rollout.engine={engine} is not available on backend {backend.name!r} here (its package is "
                        f"not installed, or the backend does not run it); available: {offered}, or auto")
    if engine != "auto" and str(cfg.trainer.mode) == "async" and cfg.async_training.partial_rollout \
            and not engine_capabilities(engine).interruptible:
        able = ", ".join(e for e in offered_engines(backend) if engine_capabilities(e).interruptible) or "none here"
        raise UserError(f"async_training.partial_rollout=true stops generations in flight, which rollout.engine="
                        f"{engine} cannot do; use an engine that can ({able}) or async_training.partial_rollout=false")
    _check_num_workers(cfg, backend)
    trainer_workers = auto_num_workers(cfg, backend)[0] if cfg.trainer.num_workers is None else None
    compute_split(cfg, backend, trainer_workers)  # rollout.cpu_cores more than the node has: UserError
    return backend


def _check_num_workers(cfg: PortRLConfig, backend: Backend) -> None:
    """An explicit ``trainer.num_workers`` fits this node; null (auto) is what the run will resolve it to
    (``auto_num_workers``, resolved and logged once by RLTrainer when the run starts), and Ray is there when that
    is more than one worker."""
    t = cfg.trainer
    if t.num_workers is None:
        n, why = auto_num_workers(cfg, backend)
        if n > 1 and not module_available("ray"):
            raise UserError(f"trainer.num_workers=null (auto) is {n} here ({why}): more than one worker runs on Ray, "
                            "but ray is not installed; pip install 'ray[default]' or set trainer.num_workers=1")
        return
    if backend.device_type == "cpu" or int(t.nnodes) > 1 or t.ray_address:
        return
    count = backend.device_count()
    if count and int(t.num_workers) > count:
        raise UserError(f"trainer.num_workers={t.num_workers} needs {t.num_workers} {backend.name} devices, "
                        f"this node has {count}; set trainer.num_workers<={count}, or null (auto: every device of "
                        "this node), or trainer.nnodes / ray_address for more nodes")


# ------------------------------------------------------------------------------------------- model
def _check_model(cfg: PortRLConfig, command: str):
    """The tokenizer the run will use, after the model directories are checked (tiny: built in memory)."""
    m = cfg.model
    if m.path:
        check_model_dir(str(m.path), "model.path", tokenizer=not m.tokenizer_path)
        check_pickled_weights(str(m.path), "model.path")
    if m.tokenizer_path:
        check_model_dir(str(m.tokenizer_path), "model.tokenizer_path", config=False, tokenizer=True)
    if command == TRAIN:
        if cfg.critic.model_path and critic_enabled(cfg):
            check_model_dir(str(cfg.critic.model_path), "critic.model_path")
            check_pickled_weights(str(cfg.critic.model_path), "critic.model_path")
        if cfg.reward.model_path:
            check_model_dir(str(cfg.reward.model_path), "reward.model_path")
            check_pickled_weights(str(cfg.reward.model_path), "reward.model_path")
        for key in ("path", "ref_path"):  # PRIME's implicit PRM and its reference
            if getattr(cfg.reward_model.model, key) and implicit_prm_enabled(cfg):
                check_model_dir(str(getattr(cfg.reward_model.model, key)), f"reward_model.model.{key}")
    tokenizer = _load_tokenizer(cfg)
    if command != SFT and getattr(tokenizer, "chat_template", None) is None:
        where = m.tokenizer_path or m.path
        raise UserError(f"the tokenizer of {str(where)!r} has no chat_template; portrl builds prompts with it: use "
                        "an instruct / chat model, or set model.tokenizer_path to a tokenizer that has one")
    return tokenizer


def _load_tokenizer(cfg: PortRLConfig):
    m = cfg.model
    if not m.path and not m.tokenizer_path:
        return build_tokenizer(TINY_VOCAB)  # what the built-in tiny model is saved with
    try:
        return load_tokenizer(str(m.tokenizer_path or m.path))
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' many ways to reject a tokenizer directory
        key = "model.tokenizer_path" if m.tokenizer_path else "model.path"
        raise UserError(f"{key} {str(m.tokenizer_path or m.path)!r}: the tokenizer does not load "
                        f"({type(exc).__name__}: {exc})".replace("\n", " ")) from exc


def _check_lora_targets(cfg: PortRLConfig) -> None:
    """``actor.lora_target_modules`` names layers of the model (with ``actor.lora_rank > 0`` and a model.path;
    the built-in tiny model is a Qwen2 like the defaults assume)."""
    if int(cfg.actor.lora_rank) <= 0 or not cfg.model.path or not module_available("peft"):
        return  # no LoRA; or the built-in model; or peft missing, which _check_loggers reports
    try:
        check_target_modules(str(cfg.model.path), list(cfg.actor.lora_target_modules))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def _check_output_dir(cfg: PortRLConfig) -> None:
    out = Path(str(cfg.trainer.output_dir)).expanduser()
    if out.exists() and not out.is_dir():
        raise UserError(f"trainer.output_dir {str(out)!r} is a file; give a directory for the run")


# -------------------------------------------------------------------------------------------- data
def _check_preprocessed(cfg: PortRLConfig, train_files: list, val_files: list) -> None:
    """A data preset's file that is not there yet (``data=gsm8k`` reads ``~/data/gsm8k/train.parquet``): one line
    with the `portrl preprocess` command that writes it. Other missing files are read_verl_files' message."""
    task = data_task(cfg)
    if task is None or task.generated or task.converter is None:
        return
    for key, files in (("data.train_files", train_files), ("data.val_files", val_files)):
        for f in files:
            if not Path(f).expanduser().exists():
                raw = "" if task.default_input else " --input RAW"  # the code task ships its problems
                raise UserError(f"{key}: dataset file {f!r} does not exist; `portrl preprocess {task.name}{raw} "
                                f"--output-dir {Path(f).parent}` writes it (see `portrl preprocess --help`)")


def _check_data(cfg: PortRLConfig, command: str, tokenizer) -> tuple[list, list]:
    d = cfg.data
    generated = generated_task(cfg) is not None
    train_files = [str(f) for f in d.train_files or []]
    val_files = [str(f) for f in d.val_files or []]
    if command == TRAIN and not train_files and not generated:
        raise UserError(no_train_files_message(cfg))
    if command == EVAL and not val_files and not generated:
        raise UserError(f"no validation data: data.val_files is empty and only data.name="
                        f"{names_where(lambda t: t.generated)} is generated (data.name={d.name!r}); pass "
                        "data.val_files=[TEST.parquet] (`portrl preprocess` writes test.parquet)")
    _check_preprocessed(cfg, [] if command == EVAL else train_files, val_files)
    train_rows, train_images = ([], None) if command == EVAL else read_verl_files(train_files, "data.train_files")
    val_rows, val_images = read_verl_files(val_files, "data.val_files")
    processor = _check_processor(cfg, train_images or val_images)
    _check_sources(cfg, train_files, train_rows, val_files, val_rows)
    g = generator_options(cfg, str(d.name)) if generated and not train_files else None  # data.<name>
    if command == TRAIN and g is not None and int(g.num_train) < int(d.train_batch_size):
        raise UserError(f"data.train_batch_size={d.train_batch_size} is more than the data.{d.name}.num_train="
                        f"{g.num_train} generated problems; raise data.{d.name}.num_train or lower the batch")
    if command == TRAIN and train_rows:
        want, limit = int(d.train_batch_size), int(d.max_prompt_length)
        usable = min(len(train_rows), want)
        if bool(d.filter_overlong_prompts):
            usable = count_fitting_prompts(train_rows, tokenizer, limit, want, processor)
        fit_train_batch(cfg, usable, len(train_rows), train_files)  # a preset's batch lowered; the user's refused
    return train_rows, val_rows


def _check_processor(cfg: PortRLConfig, image_row: Optional[str]):
    """The model's processor when the data has images (``image_row``: where the first is), else None; a model
    without an image processor is a UserError (it cannot read the images)."""
    if image_row is None:
        return None
    path = cfg.model.path
    try:
        processor = load_processor(str(path)) if path else None
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - transformers' many ways to reject a processor's files
        raise UserError(f"model.path {str(path)!r}: the image processor does not load ({type(exc).__name__}: "
                        f"{exc})".replace("\n", " ")) from exc
    if processor is None:
        model = f"model.path {str(path)!r}" if path else "the built-in tiny model (model.path empty)"
        raise UserError(f"the data has images ({image_row}), but {model} has no image processor "
                        "(preprocessor_config.json); train on images with a vision-language model such as "
                        "Qwen2.5-VL-7B-Instruct, or use text-only data")
    return processor


def _check_sources(cfg: PortRLConfig, train_files, train_rows, val_files, val_rows) -> None:
    """Every data_source has a built-in reward, unless a custom reward scores all rows."""
    if cfg.reward.custom.path or cfg.reward.model_path:
        return
    for files, rows in ((train_files, train_rows), (val_files, val_rows)):
        for source in sorted({r[1] for r in rows}):
            try:
                reward_kind(source)
            except UnknownDataSource as exc:
                raise UnknownDataSource(f"{', '.join(files)}: {exc}") from None


def _first_generated_row(cfg: PortRLConfig):
    """The first generated row of a generated task (the data of a run without files), checked like a file's
    rows; None for other data."""
    task = generated_task(cfg)
    if task is None:
        return None
    a = generator_options(cfg, task.name)
    return check_row(task.generate(1, int(a.seed), int(a.difficulty), "train")[0], f"<{task.name}>", 0)


# ------------------------------------------------------------------------------------------ reward
def _check_reward(cfg: PortRLConfig, first_row) -> None:
    """The custom reward imports, and scores one row (its ground truth as the response) without raising."""
    custom = cfg.reward.custom
    if not custom.path:
        return
    load_custom_reward(str(custom.path), str(custom.name))  # RewardFileError naming the file
    if first_row is None:
        return
    messages, source, truth, extra = first_row[:4]
    custom_fn = (str(custom.path), str(custom.name))
    limit = float(cfg.reward.timeout_s) if cfg.reward.timeout_s else None
    try:
        call_with_time_limit(lambda: _score_rows(custom_fn, {}, [(0, source, truth, truth, extra)]), limit)
    except TimeLimitReached:
        raise RewardTimeoutError(f"{describe_reward(custom_fn)} did not score one row within reward.timeout_s="
                                 f"{limit:g}s (preflight: the first data row scored with its ground truth as the "
                                 "response); make it faster or raise reward.timeout_s") from None
    except RewardFunctionError as exc:
        raise RewardFunctionError(f"{exc} (preflight: the first data row scored with its ground truth as the "
                                  "response); fix the function before training") from None


# ----------------------------------------------------------------------------------- checkpoints
def _check_resume(cfg: PortRLConfig) -> None:
    resume = str(cfg.trainer.resume)
    if resume in ("auto", "off"):
        return
    check_checkpoint_dir(resume, "trainer.resume")


#: optional loggers -> the requirement of the ``logging`` extra (pyproject.toml)
LOGGER_PACKAGES = {"tensorboard": "tensorboard>=2.16", "wandb": "wandb>=0.18", "mlflow": "mlflow>=2.16"}


def _check_loggers(cfg: PortRLConfig) -> None:
    """Optional packages the run will import: the loggers' and, for LoRA, peft."""
    if int(cfg.actor.lora_rank) > 0 and not module_available("peft"):
        raise UserError(f"actor.lora_rank={cfg.actor.lora_rank} trains LoRA adapters with peft, which is not installed; "
                        "pip install \"peft>=0.13\", or actor.lora_rank=0 for full fine-tuning")
    for name in cfg.trainer.loggers:
        if name in LOGGER_PACKAGES and not module_available(name):
            raise UserError(f"trainer.loggers has {name}, which is not installed; pip install "
                            f"\"{LOGGER_PACKAGES[name]}\" (or pip install -e \".[logging]\" in the portrl checkout), or "
                            f"drop it: trainer.loggers=[console,jsonl]")


def check_checkpoint_dir(path: str, key: str) -> Path:
    """``path`` as a Path, checked to be a directory holding a checkpoint that matches its manifest."""
    p = Path(path).expanduser()
    if not p.is_dir():
        what = "no such checkpoint directory" if not p.exists() else "is not a directory"
        raise UserError(f"{key}={path}: {what}; give a run's checkpoint, <trainer.output_dir>/checkpoints/"
                        f"global_step_N" + (" (or trainer.resume=auto / off)" if key == "trainer.resume" else ""))
    problem = verify(p)
    if problem is not None:
        raise UserError(f"{key}={path} is not a checkpoint: {problem}; give a run's checkpoint, "
                        "<trainer.output_dir>/checkpoints/global_step_N")
    check_compatible(p, read_meta(p))  # an old (pickled) or a newer format: refused before the model loads
    return p
