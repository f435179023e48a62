#!/usr/bin/env bash
# GPU check of the Triton attention kernels (a few minutes on one GPU; installs nothing).
#   1. tests/test_kernels.py compiled on CUDA (the same cases the CPU runs under the interpreter);
#   2. `lengthwise bench attention`: correctness on CUDA, then decode attention at batch 64 x
#      context 2048, 32/8 heads, head_dim 128, bf16: bandwidth vs peak and time vs torch SDPA.
# Python: $PYTHON if set, else .venv/bin/python when the venv exists, else the machine's python3
# (which must hold torch with CUDA, triton, pytest and pytest-timeout), the repo on PYTHONPATH.
# Without CUDA the tests run under the interpreter and the bench says it needs a GPU. Results go
# to $OUT (or out/gpu_check).
# Arguments go to the bench, e.g. `scripts/gpu_check.sh --sweep wide`.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS="${OUT:-out/gpu_check}"
mkdir -p "$RESULTS"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
unset TRITON_INTERPRET
"$PY" - <<'PY' 2>&1 | tee "$RESULTS/env.txt"
import sys, torch, triton
print("python", sys.version.split()[0], "torch", torch.__version__, "triton", triton.__version__)
print("cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "-")
PY

status=0
timeout 300 "$PY" -m pytest tests/test_kernels.py -q -p no:cacheprovider --timeout 240 \
    --junitxml="$RESULTS/test_kernels.xml" 2>&1 | tee "$RESULTS/test_kernels.log" || status=1
timeout 420 "$PY" -m training.cli bench attention --out "$RESULTS" "$@" 2>&1 | tee "$RESULTS/bench.log" || status=1
echo "gpu_check: $([ $status = 0 ] && echo passed || echo FAILED); results in $RESULTS"
exit $status
