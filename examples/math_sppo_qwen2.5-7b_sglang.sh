#!/usr/bin/env bash
# SPPO (self-play preference optimisation, arXiv 2405.00675) on MATH with Qwen2.5-7B-Instruct,
# following verl's SPPO recipe, which rolls out with SGLang: the same run with rollout.engine=sglang
# (backends/sglang/; pip install -e ".[sglang]" on a CUDA or ROCm machine).
# Expected: MATH test accuracy 46.6 -> 65.6 after 20 epochs on 4 GPUs (the recipe's reported result).
# Hardware: 1 node x 4 accelerators of 80 GB.
#
# Data:  portrl preprocess math --input /path/to/MATH-lighteval --output-dir ~/data/math
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-7B-Instruct}
NGPUS=${NGPUS:-4}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=sppo data=math \
  model.path="$MODEL" model.gradient_checkpointing=true \
  data.train_files="[$HOME/data/math/train.parquet]" data.val_files="[$HOME/data/math/test.parquet]" \
  data.train_batch_size=1024 data.max_prompt_length=1024 data.max_response_length=512 \
  actor.optim.lr=1e-6 actor.ppo_mini_batch_size=256 actor.ppo_micro_batch_size_per_device=16 \
  actor.sppo_eta=1.0 algorithm.sppo_eta=1.0 \
  rollout.n=1 rollout.engine=sglang rollout.gpu_memory_utilization=0.5 rollout.tensor_model_parallel_size=2 \
  trainer.num_workers="$NGPUS" trainer.total_steps=140 trainer.test_freq=5 trainer.save_freq=20 \
  trainer.output_dir=outputs/math_sppo_qwen2.5-7b_sglang "$@"
