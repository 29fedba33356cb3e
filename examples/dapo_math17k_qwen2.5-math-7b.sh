#!/usr/bin/env bash
# DAPO (arXiv 2503.14476) on DAPO-Math-17k with Qwen2.5-Math-7B, tested on AIME 2024.
# Expected: AIME 2024 avg@32 about 36 (verl's DAPO reproduction reports 36.3; the paper reports 50
# with Qwen2.5-32B).
# Hardware: 2 nodes x 8 accelerators of 80 GB (join the Ray cluster with trainer.ray_address).
# Hyperparameters of the DAPO recipe: clip_ratio_low 0.2 / high 0.28, token-mean loss, overlong
# buffer 4096 with factor 1.0, dynamic sampling on acc, no KL, lr 1e-6, 16 samples per prompt.
#
# Data:  portrl preprocess dapo_math --input /path/to/DAPO-Math-17k --output-dir ~/data/dapo_math
#        portrl preprocess dapo_math --input /path/to/AIME-2024 --output-dir ~/data/aime2024
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-Math-7B}
NGPUS=${NGPUS:-16}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=dapo data=dapo_math \
  model.path="$MODEL" model.gradient_checkpointing=true \
  data.train_files="[$HOME/data/dapo_math/train.parquet]" data.val_files="[$HOME/data/aime2024/test.parquet]" \
  data.train_batch_size=512 data.max_prompt_length=2048 data.max_response_length=20480 \
  actor.optim.lr=1e-6 actor.optim.warmup_steps=10 actor.ppo_mini_batch_size=32 \
  actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.28 actor.loss_agg_mode=token-mean \
  reward.overlong_buffer.enable=true reward.overlong_buffer.len=4096 reward.overlong_buffer.penalty_factor=1.0 \
  algorithm.filter_groups.enable=true algorithm.filter_groups.metric=acc algorithm.filter_groups.max_num_gen_batches=10 \
  rollout.n=16 rollout.temperature=1.0 rollout.top_p=1.0 rollout.val_kwargs.n=32 rollout.val_kwargs.temperature=1.0 \
  rollout.val_kwargs.top_p=0.7 rollout.tensor_model_parallel_size=4 \
  trainer.num_workers="$NGPUS" trainer.nnodes=2 trainer.total_steps=400 trainer.test_freq=5 trainer.save_freq=10 \
  trainer.output_dir=outputs/dapo_math17k_qwen2.5-math-7b "$@"
