#!/usr/bin/env bash
# The checks that need a GPU, in one call of a GPU machine that has Python,
# torch, numpy, aiohttp, pytest... but not the rest of kvstore's dependencies
# and no network: those come as wheels (scripts/device-wheels.sh, into .whl,
# carried with the working tree). From the repository root:
#
#   scripts/device-check.sh [DEVICE]      # default cuda; cpu tries it without a GPU
#
# 1. the device tier's contract tests and the tiered store's device test
#    (tests/storage, KVSTORE_TEST_DEVICE=DEVICE);
# 2. the paged-cache gather/scatter tests (tests/test_paged.py) on DEVICE;
# 3-5. python -m kvstore.bench.device: a holder GET into device memory, the
#    vLLM connector's gather/scatter on a realistic cache, the reference
#    engine's fetch against its recompute (GB/s and seconds).
#
# Figures (each step's outcome, the test summaries, the tables) go to
# $OUT/device.txt and everything to $OUT/log.txt (OUT: default
# /tmp/kvstore-device-check); the figures are printed at the end. Every step
# is bounded by `timeout`, and all of them by BUDGET seconds (default 330).
# Environment: PYTHON (default python3), WHEELS (default .whl; a missing
# folder: the Python's own packages), SITE (where the wheels go, default
# /tmp/kvstore-site). kvstore runs from this tree (PYTHONPATH), without its C
# extension (kvstore.native falls back to the same loops in Python).
set -uo pipefail
cd "$(dirname "$0")/.."
device=${1:-cuda}
out=${OUT:-/tmp/kvstore-device-check}
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/kvstore-site}
deadline=$((SECONDS + ${BUDGET:-330}))
mkdir -p "$out"
figures=$out/device.txt
log=$out/log.txt
: >"$figures"
: >"$log"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 KVSTORE_TEST_DEVICE=$device
failed=0

note() { echo "$*" | tee -a "$log" >>"$figures"; }

# step NAME SECONDS COMMAND...: the command's output to the log; its outcome,
# time and (for pytest) summary line to the figures.
step() {
    local name=$1 limit=$2 start=$SECONDS rc left offset summary
    shift 2
    left=$((deadline - SECONDS))
    if ((left < 15)); then
        note "SKIP  $name (out of time)"
        failed=1
        return 1
    fi
    ((limit > left)) && limit=$left
    offset=$(stat -c %s "$log")
    echo "=== $name (at most ${limit}s): $*" >>"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
    rc=$?
    summary=""
    if [[ $2 == -m && $3 == pytest ]]; then # its closing line
        summary=$(tail -c +$((offset + 1)) "$log" | grep -E "passed|failed|error|no tests ran" |
            tail -n 1)
    elif [[ $2 == -c ]]; then # what it printed last
        summary=$(tail -c +$((offset + 1)) "$log" | tail -n 1)
    fi
    if ((rc == 0)); then
        note "PASS  $name ($((SECONDS - start)) s) $summary"
    elif ((rc == 124 || rc == 137)); then
        note "TIME  $name: stopped after ${limit}s $summary"
        failed=1
    else
        note "FAIL  $name: exit $rc ($((SECONDS - start)) s) $summary"
        failed=1
    fi
    return "$rc"
}

finish() {
    echo "=== figures ($figures)"
    cat "$figures"
    if ((failed)); then
        echo "=== the log's last lines ($log)"
        tail -n 60 "$log"
    fi
    exit "$failed"
}

note "kvstore device check: $device, $(date -u +%FT%TZ), $(git rev-parse --short HEAD 2>/dev/null || echo 'no git')$(git diff --quiet HEAD -- 2>/dev/null || echo ' and changes to it')"
if [[ $device == cuda* ]] && command -v nvidia-smi >/dev/null; then
    timeout 15 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
        2>&1 | tee -a "$log" >>"$figures"
fi

if [[ -d $wheels ]]; then
    rm -rf "$site"
    step "install $(ls "$wheels" | wc -l) wheels from $wheels" 60 \
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl || finish
    export PYTHONPATH=$site:$PWD
else
    export PYTHONPATH=$PWD
fi

step "imports" 45 "$py" -c "
import sys, torch, kvstore.serve, kvstore.fetch, kvstore.native
from kvstore.bench.device import describe
print(sys.version.split()[0], describe('$device'), 'native', kvstore.native.NATIVE)
if torch.device('$device').type == 'cuda':
    assert torch.cuda.is_available(), 'torch sees no CUDA device'
    torch.ones(1, device='$device')
" || finish

pytest=("$py" -m pytest -q -p no:cacheprovider)
step "device tier tests on $device" 60 "${pytest[@]}" tests/storage/test_tier_contract.py \
    tests/storage/test_manager.py::test_device_tier_in_the_store -k device
step "paged gather/scatter tests on $device" 60 "${pytest[@]}" tests/test_paged.py

bench=("$py" -m kvstore.bench.device --device "$device" --append "$figures")
step "holder GET into $device memory" 60 "${bench[@]}" --section holder
step "paged gather/scatter on $device" 60 "${bench[@]}" --section paged
step "reference engine on $device: fetch vs recompute" 75 "${bench[@]}" --section engine
finish
