#!/usr/bin/env bash
# GRPO on Geometry3K (geometry problems with a diagram) with the vision-language model Qwen2.5-VL-7B-Instruct
# (verl's run_qwen2_5_vl-7b recipe hyperparameters).
# Expected: GEO3K test score about 65 (verl's baseline table reports 65.4 for Qwen2.5-VL-7B-Instruct with GRPO on
# Megatron; the score is the mean geo3k reward, 0.9 x the boxed answer + 0.1 x the <think> format).
# Hardware: 1 node x 8 accelerators of 80 GB (h100 / mi300x presets) or 8 x Ascend 910B (64 GB), tensor
# parallel 2 in the rollout. 2101 training problems: 4 steps of 512 prompts per epoch, 15 epochs.
#
# Data:  portrl preprocess geo3k --input /path/to/geometry3k/data --output-dir ~/data/geo3k
#        (hiyouga/geometry3k as downloaded: train-*.parquet and test-*.parquet with images, problem, answer)
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-VL-7B-Instruct}
NGPUS=${NGPUS:-8}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=grpo data=geo3k \
  model.path="$MODEL" model.gradient_checkpointing=true \
  data.train_files="[$HOME/data/geo3k/train.parquet]" data.val_files="[$HOME/data/geo3k/test.parquet]" \
  data.train_batch_size=512 data.max_prompt_length=1024 data.max_response_length=2048 \
  actor.optim.lr=1e-6 actor.ppo_mini_batch_size=128 actor.ppo_micro_batch_size_per_device=10 \
  actor.use_kl_loss=true actor.kl_loss_coef=0.01 actor.kl_loss_type=low_var_kl actor.entropy_coeff=0 \
  rollout.n=5 rollout.gpu_memory_utilization=0.6 rollout.tensor_model_parallel_size=2 \
  trainer.num_workers="$NGPUS" trainer.total_steps=60 trainer.test_freq=5 trainer.save_freq=20 \
  trainer.output_dir=outputs/geo3k_grpo_qwen2.5-vl-7b "$@"
