#!/usr/bin/env bash
# portrl installed as a wheel (`pip install .`, as every Dockerfile does), not editable, in a fresh virtual
# environment, then a two-step `portrl train` run from outside the checkout so that nothing is imported
# from the source tree. An editable install hides a package missing from the wheel; this does not.
# Usage: bash ci/wheel_install.sh   (VENV, default .venv-wheel, is removed at the end)
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${VENV:-.venv-wheel}"
ROOT="$PWD"

rm -rf "$VENV" build
python3 -m venv "$VENV"
"$VENV/bin/pip" install "torch==2.13.0" "$ROOT"
RUN="$(mktemp -d)"
trap 'rm -rf "$RUN" "$ROOT/$VENV" "$ROOT/build"' EXIT
cd "$RUN"
"$ROOT/$VENV/bin/python" -c "import portrl; assert 'site-packages' in portrl.__file__, portrl.__file__"
HOME="$RUN" "$ROOT/$VENV/bin/portrl" --log-level WARNING train device.num_threads=1 \
    model.tiny.hidden_size=32 model.tiny.intermediate_size=64 model.tiny.num_heads=2 model.tiny.num_kv_heads=1 \
    data.arith.num_train=64 data.arith.num_test=8 data.train_batch_size=4 rollout.n=2 \
    actor.ppo_mini_batch_size=4 data.max_response_length=4 model.sft_steps=4 model.sft_batch_size=8 \
    trainer.progress_bar=false trainer.total_steps=2 trainer.test_freq=2 trainer.output_dir="$RUN/run"
test -f "$RUN/run/hf_model/config.json"
echo "ci/wheel_install.sh: wheel install and two-step train OK"
