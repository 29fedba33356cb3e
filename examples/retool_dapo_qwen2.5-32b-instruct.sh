#!/usr/bin/env bash
# ReTool-style tool-integrated RL (Feng et al. 2025, "ReTool: Reinforcement Learning for Strategic Tool Use in
# LLMs", arXiv 2504.11536): DAPO on DAPO-Math-17k with the python tool (multi-turn: the model writes code, the
# sandbox runs it, the output comes back as a tool message), tested on AIME 2024.
# Expected (the paper): AIME 2024 67.0% with Qwen2.5-32B-Instruct after 400 training steps, against 40.0% for
# text-only RL after 1080 steps (72.5% in the paper's extended setting). The paper starts RL from a cold-start SFT
# on code-integrated reasoning traces: fine-tune first (`portrl sft --train-files SFT.parquet`, rows with the
# conversation as chat messages) and pass the result as MODEL.
# Hyperparameters of verl's recipe/retool (run_qwen2.5_32b_dapo.sh): GRPO advantages, clip 0.2 / 0.28, no KL,
# lr 1e-6, 512 prompts x 16 samples, mini-batches of 64, 8 assistant turns, 2048 prompt / 16384 trajectory tokens,
# validation with 1 sample at temperature 1.0, top_p 0.6.
# Hardware: 4 nodes x 8 accelerators of 80 GB (join the Ray cluster with trainer.ray_address).
# docs/agent_recipes.md explains the tool config and what is logged.
#
# Data:  portrl preprocess dapo_math --input /path/to/DAPO-Math-17k --output-dir ~/data/dapo_math
#        portrl preprocess dapo_math --input /path/to/AIME-2024 --output-dir ~/data/aime2024
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-32B-Instruct-retool-sft}
NGPUS=${NGPUS:-32}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=dapo data=dapo_math \
  model.path="$MODEL" model.gradient_checkpointing=true \
  data.train_files="[$HOME/data/dapo_math/train.parquet]" data.val_files="[$HOME/data/aime2024/test.parquet]" \
  data.train_batch_size=512 data.max_prompt_length=2048 data.max_response_length=16384 data.truncation=error \
  actor.optim.lr=1e-6 actor.ppo_mini_batch_size=64 \
  actor.clip_ratio_low=0.2 actor.clip_ratio_high=0.28 actor.clip_ratio_c=10.0 actor.loss_agg_mode=token-mean \
  actor.use_kl_loss=false algorithm.kl_ctrl.kl_coef=0.0 \
  rollout.n=16 rollout.temperature=1.0 rollout.val_kwargs.n=1 rollout.val_kwargs.temperature=1.0 \
  rollout.val_kwargs.top_p=0.6 rollout.tensor_model_parallel_size=4 \
  rollout.multi_turn.enable=true rollout.multi_turn.format=hermes \
  rollout.multi_turn.tool_config_path=configs/tools/python.yaml rollout.multi_turn.max_assistant_turns=8 \
  rollout.multi_turn.max_tool_response_length=2048 rollout.multi_turn.tool_response_truncate_side=middle \
  rollout.multi_turn.tool_timeout_s=30 \
  trainer.num_workers="$NGPUS" trainer.nnodes=4 trainer.total_steps=400 trainer.test_freq=5 trainer.save_freq=30 \
  trainer.output_dir=outputs/retool_dapo_qwen2.5-32b-instruct "$@"
