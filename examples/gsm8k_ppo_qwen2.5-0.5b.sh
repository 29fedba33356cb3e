#!/usr/bin/env bash
# PPO on GSM8K with Qwen2.5-0.5B-Instruct.
# Expected: GSM8K test accuracy 36.4 (the instruct checkpoint) -> about 56.7 after 15 epochs
# (verl's baseline table, docs/algo/baseline.md: batch 256, prompt 1024, response 512).
# Hardware: 1 node, 1-8 accelerators of >= 40 GB. Choose the backend with DEVICE=cuda|rocm|npu and the
# matching preset (h100, mi300x, ascend-910b, ...).
#
# Data:  portrl preprocess gsm8k --input /path/to/gsm8k/main --output-dir ~/data/gsm8k
# Model: a local copy of Qwen/Qwen2.5-0.5B-Instruct (portrl never downloads at run time).
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-0.5B-Instruct}
NGPUS=${NGPUS:-1}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=ppo data=gsm8k \
  model.path="$MODEL" \
  data.train_files="[$HOME/data/gsm8k/train.parquet]" data.val_files="[$HOME/data/gsm8k/test.parquet]" \
  data.train_batch_size=256 data.max_prompt_length=1024 data.max_response_length=512 \
  actor.optim.lr=1e-6 actor.ppo_mini_batch_size=64 actor.ppo_micro_batch_size_per_device=4 \
  critic.optim.lr=1e-5 algorithm.kl_ctrl.kl_coef=0.001 \
  rollout.n=1 rollout.gpu_memory_utilization=0.4 \
  trainer.num_workers="$NGPUS" trainer.total_steps=435 trainer.test_freq=10 trainer.save_freq=50 \
  trainer.output_dir=outputs/gsm8k_ppo_qwen2.5-0.5b "$@"
