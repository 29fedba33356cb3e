#!/usr/bin/env bash
# SPPO on MATH with Qwen2.5-7B-Instruct as verl's recipe runs it, rolled out with SGLang: math_sppo_qwen2.5-7b.sh
# (its header: expected score, hardware, data) with rollout.engine=sglang (backends/sglang/; CUDA or ROCm, with
# pip install -e ".[sglang]"). Partial rollout is not available with this engine (it cannot abort a generation).
set -euo pipefail
exec "$(dirname "$0")/math_sppo_qwen2.5-7b.sh" rollout.engine=sglang \
  trainer.output_dir=outputs/math_sppo_qwen2.5-7b_sglang "$@"
