#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one run (docs/gpu.md): the GPU tests, the host's cost of
# queuing a save's copies (bench/gpu_copy_issue.py), the profile of a save's step
# (bench/save_step_profile.py), then the training-loop cost of a checkpoint on the GPU
# (bench/gpu_loop_cost.py).
#
#   ./scripts/gpu_check.sh              # logs and figures under $OUT (default /tmp/bcp-gpu-check)
#   GPU_CHECK_MODELS="1.3gb" ./scripts/gpu_check.sh
#   GPU_CHECK_SAVES=4 GPU_CHECK_EVERY_S=3 GPU_CHECK_BENCH_S=150 ./scripts/gpu_check.sh  # shorter
#   GPU_CHECK_STAGES="tests copies" ./scripts/gpu_check.sh   # some stages (tests copies profile loop)
#   GPU_CHECK_MODES="ours-overlapped,dcp-async" ./scripts/gpu_check.sh   # bench/gpu_loop_cost.py --modes
#
# It uses the machine's own Python with PyTorch (PYTHON, default python3); packages that
# Python lacks may be given as wheels in .whl/ (a machine with no package index).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/bcp-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/bcp-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/bcp-site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'NO CUDA')"
df -h "${TMPDIR:-/tmp}" | tail -1

STAGES=" ${GPU_CHECK_STAGES:-tests copies profile loop} "
status=0
[[ $STAGES == *" tests "* ]] && { "$PY" -m pytest -p no:cacheprovider -m gpu -q -rs --timeout 300 \
    tests/distributed/test_gpu_paths.py tests/distributed/test_overlapped_snapshot.py \
    tests/unit/test_direct_writes.py 2>&1 | tee "$OUT/gpu_tests.log" || status=1; }

[[ $STAGES == *" copies "* ]] && { timeout 120 "$PY" bench/gpu_copy_issue.py --gb 3.56 --reps 3 2>&1 \
    | tee "$OUT/copy_issue.log" || status=1; }

# the whole arena (overlapped, blocking), then a 256 MiB ring (the copy in rounds)
for variant in overlapped blocking ring; do
    [[ $STAGES == *" profile "* ]] || break
    args=(--snapshot "$variant")
    [[ $variant == ring ]] && args=(--snapshot overlapped --staging-max-bytes $((256 << 20)))
    timeout 120 "$PY" bench/save_step_profile.py --model 3.56gb --before 1 --after 3 "${args[@]}" \
        2>&1 | grep -v USDT | tee "$OUT/save_step_$variant.log" || status=1
done

for model in ${GPU_CHECK_MODELS:-3.56gb 1.3gb}; do
    [[ $STAGES == *" loop "* ]] || break
    timeout "${GPU_CHECK_BENCH_S:-240}" "$PY" bench/gpu_loop_cost.py --model "$model" ${GPU_CHECK_MODES:+--modes "$GPU_CHECK_MODES"} \
        --saves "${GPU_CHECK_SAVES:-5}" --every-s "${GPU_CHECK_EVERY_S:-5}" --json "$OUT/loop_$model.json" 2>&1 \
        | tee "$OUT/loop_$model.log" || status=1
done
exit $status
