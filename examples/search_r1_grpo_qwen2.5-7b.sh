#!/usr/bin/env bash
# Search-R1-style retrieval-augmented RL (Jin et al. 2025, "Search-R1: Training LLMs to Reason and Leverage Search
# Engines with Reinforcement Learning", arXiv 2503.09516): GRPO with the local `search` tool (BM25 over a corpus
# file, no retrieval server) on NQ + HotpotQA, exact-match reward on the <answer> tag (data_source searchR1_*).
# Expected (the paper's Table 2 as two summaries quote it: exact match averaged over NQ, TriviaQA, PopQA, HotpotQA,
# 2WikiMultiHopQA, Musique, Bamboogle): Qwen2.5-7B base 0.431 against 0.304 for RAG; the abstract (read directly)
# reports +24% (7B) and +20% (3B) over RAG baselines. The paper retrieves with E5 (dense) over the 2018 Wikipedia
# dump, 3 passages a query; BM25 is a weaker retriever, so expect lower scores (docs/agent_recipes.md: what was
# checked and how).
# Hyperparameters of the authors' train_grpo.sh (PeterGriffinJin/Search-R1): lr 1e-6 with 28.5% warm-up,
# 512 prompts x 5 samples, mini-batches of 256, KL loss 0.001 (low_var_kl), temperature 1, top-3 passages,
# 500 tokens a model turn and a retrieval; up to 4 assistant turns (the paper's action budget).
# Hardware: 1 node x 8 accelerators of 80 GB.
#
# Data:  verl's examples/data_preprocess/preprocess_search_r1_dataset.py writes ~/data/searchR1/{train,test}.parquet
#        (data_source searchR1_nq, ..., the search tool named in the prompt); the corpus is Search-R1's
#        wiki-18.jsonl (one {"id", "contents"} passage a line) at the path of configs/tools/search.yaml.
set -euo pipefail
DEVICE=${DEVICE:-cuda}
PRESET=${PRESET:-h100}
MODEL=${MODEL:-$HOME/models/Qwen2.5-7B}
NGPUS=${NGPUS:-8}

portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=grpo data.name=searchR1 \
  model.path="$MODEL" model.gradient_checkpointing=true \
  data.train_files="[$HOME/data/searchR1/train.parquet]" data.val_files="[$HOME/data/searchR1/test.parquet]" \
  data.train_batch_size=512 data.max_prompt_length=1024 data.max_response_length=3584 \
  actor.optim.lr=1e-6 actor.optim.warmup_ratio=0.285 actor.ppo_mini_batch_size=256 \
  actor.use_kl_loss=true actor.kl_loss_coef=0.001 actor.kl_loss_type=low_var_kl \
  rollout.n=5 rollout.temperature=1.0 \
  rollout.multi_turn.enable=true rollout.multi_turn.format=hermes \
  rollout.multi_turn.tool_config_path=configs/tools/search.yaml rollout.multi_turn.max_assistant_turns=4 \
  rollout.multi_turn.max_tool_response_length=2000 rollout.multi_turn.tool_response_truncate_side=right \
  trainer.num_workers="$NGPUS" trainer.total_steps=1005 trainer.test_freq=50 trainer.save_freq=100 \
  trainer.output_dir=outputs/search_r1_grpo_qwen2.5-7b "$@"
