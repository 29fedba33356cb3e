"""The structured config of a portrl run: one dataclass per group.

Groups: algorithm, data, model, actor, rollout, ref, critic, reward, reward_model, trainer, async_training, device,
sandbox (trainer and async_training in portrl/config/schema_trainer.py, the offload levers in schema_offload.py).
Names follow verl where verl has the knob, so recipes translate one to one. Batch sizes count *prompts*
(``data.train_batch_size``, ``actor.ppo_mini_batch_size``) except where the name says sequences or tokens; a step
trains on ``train_batch_size * rollout.n`` sequences. ``None`` means "decided at run time" (documented on the field).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from portrl.config.schema_agent import MultiTurnConfig
from portrl.config.schema_offload import OffloadConfig
from portrl.config.schema_trainer import AsyncTrainingConfig, TrainerConfig


# --------------------------------------------------------------------------------- algorithm
@dataclass
class KLControlConfig:
    """KL coefficient controller for KL-in-reward (fixed, or adaptive per Ziegler et al. 2019)."""

    type: str = "fixed"  # fixed | adaptive
    kl_coef: float = 0.001
    horizon: int = 10000
    target_kl: float = 0.1


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: keep only prompt groups whose metric varies."""

    enable: bool = False
    metric: str = "acc"  # acc | seq_reward | seq_final_reward
    max_num_gen_batches: int = 10  # 0 = unbounded


@dataclass
class RolloutCorrectionConfig:
    """verl's algorithm.rollout_correction (semantics: portrl.algo.rollout_correction): truncated IS weights
    (decoupled PPO with the vanilla loss), rejection of tokens / sequences outside [lower, upper], bypass mode."""

    rollout_is: Optional[str] = None  # null (off) | token | sequence: loss x min(pi_old / pi_rollout, threshold)
    rollout_is_threshold: float = 2.0  # upper truncation of the weights, > 0
    rollout_is_batch_normalize: bool = False  # divide the step's weights by their mean (token / sequence level)
    rollout_rs: Optional[str] = None  # null (off) | token | sequence | geometric: reject ratios outside the bounds
    rollout_rs_threshold: Optional[float] = None  # upper bound (> 0), required with rollout_rs
    rollout_rs_threshold_lower: Optional[float] = None  # lower bound in (0, upper]; null = 1 / rollout_rs_threshold
    rollout_token_veto_threshold: Optional[float] = None  # reject a sequence with a token ratio below it (> 0)
    bypass_mode: bool = False  # old = rollout log-probs; loss bypass_mode (portrl.algo.policy_losses_bypass)
    loss_type: str = "ppo_clip"  # ppo_clip | reinforce (bypass mode only)


@dataclass
class PFPPOConfig:
    """PF-PPO resampling of the step's batch by score (portrl.algo.pf_ppo; on with algorithm.use_pf_ppo)."""

    reweight_method: str = "pow"  # pow (|score|^weight_pow) | max_min | max_random
    weight_pow: float = 2.0  # exponent of reweight_method=pow, >= 0


@dataclass
class AlgorithmConfig:
    """The algorithm's shared keys. Each estimator's, objective's and policy loss's own options (``lam_actor``,
    ``sppo_eta``, ``dpo_beta``, ``gdpo_reward_keys``, ``reward_dpo_coef``, a plugin's, ...) are declared next to its
    function (portrl/algo/options.py) and merged in here by portrl.config.options_schema."""

    name: str = "grpo"  # the preset's name, for reports
    adv_estimator: str = "grpo"  # a name of portrl.algo's adv_estimator registry
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # estimator used for KL in the reward
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    objective: str = "policy_gradient"  # a name of portrl.algo's objective registry (policy_gradient | sppo | dpo)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # PF-PPO: resample the step's batch with replacement by weights of each response's score, after the advantages
    use_pf_ppo: bool = False
    pf_ppo: PFPPOConfig = field(default_factory=PFPPOConfig)


# -------------------------------------------------------------------------------------- data
@dataclass
class ArithDataConfig:
    """A built-in generated task (arith, arith_tool, wordprob: generated offline, deterministic by seed)."""

    num_train: int = 2000
    num_test: int = 200
    difficulty: int = 1
    seed: int = 0


@dataclass
class DataConfig:
    name: str = "arith"  # arith | arith_tool | wordprob | gsm8k | math | dapo_math | geo3k | code | custom
    train_files: List[str] = field(default_factory=list)  # parquet in verl's schema; empty + arith = generated
    val_files: List[str] = field(default_factory=list)
    train_batch_size: int = 16  # prompts per step
    val_batch_size: Optional[int] = None  # None = the whole validation set at once
    max_prompt_length: int = 64
    max_response_length: int = 16
    filter_overlong_prompts: bool = True
    truncation: str = "error"  # error | left | right
    shuffle: bool = True
    seed: int = 0
    max_val_samples: Optional[int] = None
    arith: ArithDataConfig = field(default_factory=ArithDataConfig)
    arith_tool: ArithDataConfig = field(default_factory=ArithDataConfig)  # the tool-use task (portrl.data.arith_tool)
    wordprob: ArithDataConfig = field(default_factory=ArithDataConfig)  # the word-problem task (portrl.data.wordprob)
    # verl's accuracy filter (recipe/prime): train only on prompt groups whose mean accuracy is within the bounds,
    # generating more batches until data.train_batch_size groups pass (algorithm.filter_groups.max_num_gen_batches)
    filter_accuracy: bool = False
    accuracy_lower_bound: float = 0.2
    accuracy_upper_bound: float = 0.8
    filter_truncate: bool = False  # also drop groups with a response of >= data.max_response_length - 1 tokens


# ------------------------------------------------------------------------------------- model
@dataclass
class TinyModelConfig:
    """The model built (and cached) when ``model.path`` is empty: Qwen2 architecture, small vocabulary."""

    hidden_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    seed: int = 0


@dataclass
class ModelConfig:
    path: Optional[str] = None  # local HF directory; None = the built-in tiny model (see tiny)
    size: Optional[str] = None  # parameter-count class ("0.5b", "7b", ...): key of device.tp_by_model_size
    tokenizer_path: Optional[str] = None  # None = path
    dtype: Optional[str] = None  # None = the backend's preferred training dtype
    attn_impl: Optional[str] = None  # None = the backend's preferred varlen attention
    # recompute activations in backward; None = on for models of >= 100M parameters (portrl.workers.setup)
    gradient_checkpointing: Optional[bool] = None
    use_packing: bool = True  # padding removed in training forwards
    share_prompts: bool = True  # packed forwards run each distinct prompt of a micro-batch once
    # on-policy updates replay the hf engine's recorded rollout matmuls instead of recomputing them (one process,
    # fast decode path, shared prompts; portrl.models.forward_tape)
    reuse_rollout_forward: bool = True
    logprob_chunk_size: Optional[int] = None  # tokens per chunk of the log-prob/entropy op
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    sft_warm_start: bool = False  # run a short SFT on the task before RL (the default run sets it)
    sft_steps: int = 200
    sft_lr: float = 1e-3  # AdamW peak LR of the warm start (5% warm-up, cosine to 10%)
    sft_batch_size: int = 32  # examples per SFT step
    # end the warm start early, once the mean probability of the right response (teacher-forced, EOS
    # included) on 64 training rows reaches this, checked every 50 steps; sft_steps stays the schedule's
    # length and the cap. Leaves RL room to climb from a model that is right part of the time. None = off
    sft_target_answer_p: Optional[float] = None


# ------------------------------------------------------------------------------------- actor
@dataclass
class OptimConfig:
    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    warmup_steps: int = 0  # linear warm-up; overrides warmup_ratio when > 0
    warmup_ratio: float = 0.0  # of total_steps
    scheduler: str = "constant"  # constant | cosine | linear
    min_lr_ratio: float = 0.0
    grad_clip: float = 1.0
    # lr must be > 0; lr=0 is accepted only with freeze=true, which says on purpose that these weights stay
    # fixed (a baseline run, or a critic that only evaluates)
    freeze: bool = False


@dataclass
class PolicyLossConfig:
    """The loss mode; a loss's own options (``clip_cov_ratio``, ``kl_cov_ratio``, ``ppo_kl_coef``, ``dro_beta``) are
    declared next to it (SECTION ``actor.policy_loss``) and merged in by portrl.config.options_schema."""

    loss_mode: str = "vanilla"  # a name of portrl.algo's policy_loss registry


@dataclass
class ActorConfig:
    ppo_mini_batch_size: int = 16  # prompts per optimizer step (times rollout.n sequences)
    ppo_micro_batch_size_per_device: int = 16  # sequences per forward/backward (gradient accumulation)
    # tokens per micro-batch the forward runs (a shared prompt once); null: rows alone; auto: the most the plan fits
    max_tokens_per_micro_batch: Any = None
    ppo_epochs: int = 1
    shuffle: bool = False
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None  # None = clip_ratio
    clip_ratio_high: Optional[float] = None  # None = clip_ratio
    clip_ratio_c: float = 3.0  # dual-clip bound (> 1)
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    positive_lm_coef: float = 0.0  # VAPO positive-example LM loss weight (0 = off)
    # SAPO's tau_pos / tau_neg and SPPO's sppo_eta are declared by their loss / objective (portrl.algo.options)
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    strategy: str = "auto"  # auto | fsdp | ddp (auto: fsdp where it runs, ddp otherwise)
    # ranks that split each weight matrix, tensor parallel (Qwen2 / Qwen2.5, Llama, Qwen2.5-VL's language model);
    # the reference model follows the actor's mesh (portrl/device/mesh_shape.py), all three sizes
    tensor_parallel_size: int = 1
    # ranks that split each packed sequence, Ulysses sequence parallel (attention heads exchanged all-to-all; needs
    # model.use_packing and one of portrl's attention implementations)
    sequence_parallel_size: int = 1
    # ranks of one FSDP shard group: -1 = all data x sequence ranks; else a multiple of sequence_parallel_size that
    # divides trainer.num_workers / tensor_parallel_size, the groups replicated (HSDP), as verl's fsdp_size
    fsdp_size: int = -1
    lora_rank: int = 0  # > 0 trains LoRA adapters (peft); merged weights go to the rollout engine
    lora_alpha: int = 16
    lora_target_modules: List[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    freeze_vision_tower: bool = False  # vision-language models: the vision tower gets no updates (default: it trains)
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # state kept on the host between calls


# ----------------------------------------------------------------------------------- rollout
@dataclass
class ValidationSamplingConfig:
    n: int = 1
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1


@dataclass
class RolloutConfig:
    engine: str = "auto"  # auto (the backend's first available) or a name the backend offers (portrl devices)
    n: int = 4  # responses per prompt
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    gpu_memory_utilization: float = 0.5  # share of device memory the rollout engine may take
    tensor_model_parallel_size: int = 1  # compose() fills it from device.tp_by_model_size[model.size] unless set
    max_num_batched_tokens: Optional[int] = None  # engine token budget per scheduler step; None = engine default
    enforce_eager: bool = False
    enable_sleep_mode: bool = True
    placement: str = "colocated"  # colocated (actor and rollout in one process) | separated
    num_rollout_workers: int = 1  # separated placement only
    cpu_cores: Optional[int] = None  # separated, cpu backend: cores of all rollout workers; None = by worker count
    weight_sync_bucket_mb: int = 64
    weight_sync_mode: str = "bucketed"  # full | bucketed | delta (portrl/device/weight_transport.py)
    weight_transport: str = "auto"  # auto (the backend's first that fits) | broadcast | shared_memory
    val_kwargs: ValidationSamplingConfig = field(default_factory=ValidationSamplingConfig)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)  # agentic rollouts (portrl/agent/)


# --------------------------------------------------------------------------- ref / critic / reward
@dataclass
class RefConfig:
    enable: Optional[bool] = None  # None = when a KL term (loss or reward) needs it
    param_offload: bool = False  # the reference waits in host memory, on the device only for its log-probs


@dataclass
class CriticConfig:
    enable: Optional[bool] = None  # None = when the advantage estimator needs values (gae)
    model_path: Optional[str] = None  # None = initialised from the actor's model with a value head
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    cliprange_value: float = 0.5
    loss_agg_mode: Optional[str] = None  # None = the actor's
    ppo_epochs: Optional[int] = None  # None = the actor's
    warmup_steps: int = 0  # critic-only steps before the actor starts updating (VC-PPO value pretraining)
    # value pretraining (VAPO): critic-only steps on rollouts of the starting policy before RL step 1, not counted in
    # trainer.total_steps; pretrain_steps caps them, pretrain_target_ev stops early (portrl.trainer.value_pretrain)
    pretrain_steps: int = 0
    pretrain_target_ev: Optional[float] = None
    tensor_parallel_size: int = 1  # the critic's mesh, as actor.tensor_parallel_size
    sequence_parallel_size: int = 1  # the critic's mesh, as actor.sequence_parallel_size
    fsdp_size: int = -1  # the critic's mesh, as actor.fsdp_size
    offload: OffloadConfig = field(default_factory=OffloadConfig)  # as actor.offload


@dataclass
class CustomRewardConfig:
    path: Optional[str] = None  # a Python file defining the function
    name: str = "compute_score"


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    len: int = 4
    penalty_factor: float = 1.0


@dataclass
class CodeRewardConfig:
    """The code reward (data_source codecontests, apps, codeforces, taco, leetcode): portrl.rewards.code."""

    continuous: bool = True  # share passed of the first 10 cases (verl); false: 1 only when every case passes
    timeout_s: float = 10.0  # wall-time limit of one case (one sandbox run), seconds (verl's per-case limit)
    memory_mb: int = 1024  # address-space limit of one case
    max_workers: int = 4  # sandbox runs at a time, per reward process
    sandbox_fusion_url: Optional[str] = None  # run the cases on this SandboxFusion service instead (its /run_code)


@dataclass
class RewardConfig:
    custom: CustomRewardConfig = field(default_factory=CustomRewardConfig)
    code: CodeRewardConfig = field(default_factory=CodeRewardConfig)
    model_path: Optional[str] = None  # a local HF sequence-classification reward model
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    num_workers: int = 4  # processes for rule scoring of large batches
    # wall-clock limit on scoring one batch with rule rewards (built-in or custom), seconds; None = no limit
    timeout_s: Optional[float] = 300.0
    on_timeout: str = "error"  # error (stop the run, naming the function) | zero (score the rest 0, warn)


@dataclass
class ImplicitPRMModelConfig:
    """PRIME's implicit process reward model (verl recipe/prime's reward_model.model): a causal LM whose token
    rewards are beta_train * log(pi_rm / pi_ref), trained online on the outcome labels (portrl.workers.implicit_prm)."""

    path: Optional[str] = None  # None = the policy's starting weights (model.path, after any SFT warm start)
    ref_path: Optional[str] = None  # its frozen reference; None = the policy's starting weights
    update: str = "before"  # before (train, then score) | after (score, then train) | none (never trained)
    beta_train: float = 0.05  # beta of the implicit reward and of the ce loss
    # ce: BCE of sigmoid(beta * summed log-ratio) against the 0/1 accuracy; dpo: each row against the other side of
    # its prompt group (verl's detached dpo loss, portrl.algo.implicit_prm.prm_dpo_loss)
    loss_type: str = "ce"
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-6))
    tensor_parallel_size: int = 1  # the PRM's mesh, as actor.tensor_parallel_size
    sequence_parallel_size: int = 1  # the PRM's mesh, as actor.sequence_parallel_size
    fsdp_size: int = -1  # the PRM's mesh, as actor.fsdp_size


@dataclass
class RewardModelConfig:
    """verl's reward_model section for PRIME's implicit PRM (the sequence-classification scorer is reward.model_path)."""

    enable: Optional[bool] = None  # None = when the advantage estimator reads implicit rewards (prime)
    model: ImplicitPRMModelConfig = field(default_factory=ImplicitPRMModelConfig)
    prime_norm: str = "batch_norm"  # batch_norm (rewards / the batch's largest |return-to-go|) | none
    mini_batch_size: Optional[int] = None  # prompts per PRM optimizer step (x rollout.n rows); None = the actor's


# ----------------------------------------------------------------------------------- sandbox
#: what ``sandbox.packages`` holds by default: the packages a sandboxed program may import besides the standard library
DEFAULT_SANDBOX_PACKAGES = ("numpy",)


@dataclass
class SandboxConfig:
    """The local code sandbox (portrl/rewards/sandbox.py) of the code reward and the built-in python tool."""

    # accept running programs without the isolation the platform refuses (namespaces: Docker's default seccomp profile,
    # unprivileged user namespaces off): the program can then read every file its uid may read (the checkout, the
    # training data and its ground truths), reach the network and see the machine's processes; every validation
    # line says UNISOLATED. false: such a run stops at start-up with one line naming what is missing
    allow_unisolated: bool = False
    # packages a sandboxed program may import besides the standard library (top-level import names, installed in
    # the run's interpreter); nothing else of the interpreter's site-packages is visible to it
    packages: List[str] = field(default_factory=lambda: list(DEFAULT_SANDBOX_PACKAGES))


# ------------------------------------------------------------------------------------ device
@dataclass
class DeviceConfig:
    name: str = "auto"  # a registered backend name (portrl devices) or auto
    name_source: Optional[str] = None  # where name came from, for error messages (set by compose(); None: default)
    preset: Optional[str] = None  # the device preset that was applied, for reports
    dtype: Optional[str] = None  # overrides model.dtype when set
    attn_impl: Optional[str] = None  # overrides model.attn_impl when set
    kernels: Dict[str, str] = field(default_factory=dict)  # op -> implementation name
    tp_by_model_size: Dict[str, int] = field(default_factory=dict)  # e.g. {"7b": 1, "70b": 8}
    # extra env vars for workers: only the exact names the backend accepts (Backend.accepted_env: its declared_env
    # and env_presets); a loader, plugin or hook variable (LD_PRELOAD, RAY_JEMALLOC_LIB_PATH) is refused with why
    env: Dict[str, str] = field(default_factory=dict)
    num_threads: Optional[int] = None  # torch intra-op threads on CPU
    # the device model of the backend's peak table (h100, mi300x: each device preset sets its own; None = detected
    # from the device's name); MFU and the rooflines divide by its peaks (docs/performance.md)
    model: Optional[str] = None
    # GiB of one device (each device preset sets it); None = the backend's figure at run time (the CPU: physical
    # memory over the run's workers). The memory plan checks each phase's peak against it
    memory_gib: Optional[float] = None


@dataclass
class PortRLConfig:
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    async_training: AsyncTrainingConfig = field(default_factory=AsyncTrainingConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
