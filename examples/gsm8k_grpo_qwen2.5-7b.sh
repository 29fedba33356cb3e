#!/usr/bin/env bash
# GRPO on GSM8K with Qwen2.5-7B-Instruct (verl's run_qwen2-7b recipe hyperparameters).
# Expected: GSM8K test accuracy about 89-90 (verl's baseline table reports 89.8 for Qwen2-7B-Instruct
# with GRPO/FSDP2, and 93.4 for Qwen2.5-7B-Instruct with GRPO-LoRA rank 32).
# Hardware: 1 node x 8 accelerators of 80 GB (h100 / mi300x presets) or 8 x Ascend 910B (64 GB) with
# tensor parallel 2.
#
# Data:  portrl preprocess gsm8k --input /path/to/gsm8k/main --output-dir ~/data/gsm8k
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-7B-Instruct}
NGPUS=${NGPUS:-8}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=grpo data=gsm8k \
  model.path="$MODEL" model.gradient_checkpointing=true \
  data.train_files="[$HOME/data/gsm8k/train.parquet]" data.val_files="[$HOME/data/gsm8k/test.parquet]" \
  data.train_batch_size=1024 data.max_prompt_length=512 data.max_response_length=1024 \
  actor.optim.lr=1e-6 actor.ppo_mini_batch_size=256 actor.ppo_micro_batch_size_per_device=32 \
  actor.use_kl_loss=true actor.kl_loss_coef=0.001 actor.kl_loss_type=low_var_kl actor.entropy_coeff=0 \
  rollout.n=5 rollout.gpu_memory_utilization=0.6 rollout.tensor_model_parallel_size=2 \
  trainer.num_workers="$NGPUS" trainer.total_steps=105 trainer.test_freq=5 trainer.save_freq=20 \
  trainer.output_dir=outputs/gsm8k_grpo_qwen2.5-7b "$@"
