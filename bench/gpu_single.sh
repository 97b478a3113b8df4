#!/usr/bin/env bash
# One device call on the one-GPU machine: the GEMM benchmarks (BF16 and FP8, fused ring kernels included) and the
# BF16 ring benchmark, each writing its JSON to OUTDIR, then the compiled kernel tests.
# The compiled tests compile every tile config at both dtypes on a cold Triton cache (the ring kernels' BF16 and
# FP8 checks take minutes each): pytest-xdist runs them side by side, one process each, under TESTS_S.
# Usage (repo root): AUTOTUNE_COMMIT=$(git rev-parse HEAD) bash bench/gpu_single.sh OUTDIR
set -u
out=${1:?OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${GEMM_S:-200}" python3 bench/gemm_bench.py --out "$out/gemm_h200.json" 2>&1 | tail -8
timeout "${GEMM_S:-200}" python3 bench/gemm_bench.py --dtype fp8 --out "$out/gemm_fp8_h200.json" 2>&1 | tail -8
timeout "${RING_S:-120}" python3 bench/ring_bench.py --out "$out/ring_h200.json" > "$out/ring_h200.txt" 2>&1
tail -3 "$out/ring_h200.txt"
timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider -n 4 -rA \
    tests/test_gemm.py tests/test_ring_gemm.py tests/test_ring_gluon.py tests/test_flag_kernels.py -k "compiled or cuda" 2>&1 | tail -15 | tee "$out/compiled_tests.txt"
