#!/usr/bin/env bash
# Run one leg of the parity matrix (ci/matrix.yaml): `bash ci/parity.sh LEG` inside the leg's image, from
# the repository root. Reports go to ci/reports/LEG/: ops-<device>-<dtype>.json per dtype, replay-<device>.json
# (the committed cpu goldens) and e2e-<device>.json. Every tier runs even if an earlier one fails; the exit
# status is 1 when any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
export TORCH_DEVICE_BACKEND_AUTOLOAD="${TORCH_DEVICE_BACKEND_AUTOLOAD:-1}"
LEG="${1:?usage: ci/parity.sh LEG (a name from ci/matrix.yaml)}"
PY="${PYTHON:-python3}"
settings="$("$PY" ci/matrix.py leg "$LEG")" || exit 2
eval "$settings"
if [ "$DEVICE" = cpu ]; then export TORCH_DEVICE_BACKEND_AUTOLOAD=0; fi
OUT="ci/reports/$LEG"
mkdir -p "$OUT"
status=0
for tier in $TIERS; do
    case "$tier" in
        ops)
            for dtype in $DTYPES; do
                portrl parity ops --device "$DEVICE" --dtype "$dtype" --report "$OUT/ops-$DEVICE-$dtype.json" || status=1
            done ;;
        replay)
            portrl parity replay --device "$DEVICE" --golden tests/goldens/cpu --report "$OUT/replay-$DEVICE.json" || status=1 ;;
        e2e)
            portrl parity e2e --device "$DEVICE" --preset "$PRESET" --report "$OUT/e2e-$DEVICE.json" || status=1 ;;
        *)
            echo "ci/parity.sh: unknown tier $tier" >&2; status=1 ;;
    esac
done
exit "$status"
