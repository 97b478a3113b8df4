#!/usr/bin/env bash
# One device call that puts TransformerEngine on a lent GPU machine and checks it: `bench/te_install.sh` from
# WHEEL_DIR (the parts `bench/te_fetch.sh` wrote, already parked on the machine), then `bench/te_check.py`
# (the import, and TE's one-GPU GEMM path beside cuBLAS), then, where two GPUs are present, the te backend's
# own tests (`tests/test_te_gpu.py`: slots measured through TE, a TransformerLayer step).
# Usage (repo root): AUTOTUNE_COMMIT=$(git rev-parse HEAD) bash bench/gpu_te.sh WHEEL_DIR OUTDIR [TARGET]
set -u
wheels=${1:?WHEEL_DIR}
out=${2:?OUTDIR}
target=${3:-/tmp/te_site}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${INSTALL_S:-420}" bash bench/te_install.sh "$wheels" "$target" 2>&1 | tail -6 | tee "$out/te_install.txt"
export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
timeout "${CHECK_S:-150}" python3 bench/te_check.py --out "$out/te_check_h200.json" 2>&1 | tail -14
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then
    timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider -x tests/test_te_gpu.py 2>&1 | tail -15 | tee "$out/te_gpu_tests.txt"
fi
