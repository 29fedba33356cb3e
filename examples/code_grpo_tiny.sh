#!/usr/bin/env bash
# GRPO on the code problems shipped with portrl (data=code: 13 small problems in every test form: stdin/stdout,
# function calls, asserts; 12 train, 1 test), with the built-in tiny model, on the CPU. No download: the data comes
# with portrl and the model is built locally.
# Expected: the pipeline end to end (prompts, sampled programs run against each problem's tests in the sandbox,
# GRPO updates, validation, checkpoint, exported model), not learning: the reward stays 0, because the tiny model
# has never seen Python, so no program passes and GRPO has no signal. Measured on 2 CPU cores with the default
# STEPS=3: 2 min 41 s in all, 43 s a step, most of it the sandbox running 96 programs x 3 tests a step. To learn,
# give a model that writes Python (model.path=/path/to/Qwen2.5-0.5B-Instruct or larger) and more steps.
#
# Data:  written on first use by `portrl preprocess code --output-dir $DATA` (default ~/data/code).
set -euo pipefail
DEVICE=${DEVICE:-cpu}
PRESET=${PRESET:-cpu}
DATA=${DATA:-$HOME/data/code}
STEPS=${STEPS:-3}

[ -f "$DATA/train.parquet" ] || portrl preprocess code --output-dir "$DATA"
portrl train --device "$DEVICE" --preset "$PRESET" \
  algorithm=grpo data=code \
  data.train_files="[$DATA/train.parquet]" data.val_files="[$DATA/test.parquet]" \
  trainer.total_steps="$STEPS" trainer.output_dir=outputs/code_grpo_tiny "$@"
