#!/usr/bin/env bash
# One device call on the one-GPU machine: the GEMM benchmarks (BF16 and FP8, fused ring kernels included), the
# BF16 ring benchmark and the Gluon scatter kernel beside the Triton one, each writing its JSON to OUTDIR (named
# for the GPU: gemm_h200.json on an H200), then the compiled kernel tests.
# The compiled tests compile every tile config at both dtypes on a cold Triton cache (the ring kernels' BF16 and
# FP8 checks take minutes each): pytest-xdist runs them side by side, one process each, under TESTS_S.
# Usage (repo root): AUTOTUNE_COMMIT=$(git rev-parse HEAD) bash bench/gpu_single.sh OUTDIR
# A limit of 0 skips its step (GEMM_S=0 RING_S=0 GLUON_S=0 leaves the tests alone; TESTS_S=0 the benchmarks'
# call), so that the two halves fit two device calls of ten minutes each.
set -u
out=${1:?OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -o 'H[0-9]*' | tr H h)
gpu=${gpu:-gpu}
[ "${GEMM_S:-200}" = 0 ] || timeout "${GEMM_S:-200}" python3 bench/gemm_bench.py --out "$out/gemm_$gpu.json" 2>&1 | tail -8
[ "${GEMM_S:-200}" = 0 ] || timeout "${GEMM_S:-200}" python3 bench/gemm_bench.py --dtype fp8 --out "$out/gemm_fp8_$gpu.json" 2>&1 | tail -8
if [ "${RING_S:-120}" != 0 ]; then
    timeout "${RING_S:-120}" python3 bench/ring_bench.py --out "$out/ring_$gpu.json" > "$out/ring_$gpu.txt" 2>&1
    tail -3 "$out/ring_$gpu.txt"
fi
if [ "${GLUON_S:-120}" != 0 ]; then
    timeout "${GLUON_S:-120}" python3 bench/gluon_ring_check.py --skip-checks --out "$out/gluon_ring_$gpu.json" \
        > "$out/gluon_ring_$gpu.txt" 2>&1
    tail -1 "$out/gluon_ring_$gpu.txt"
fi
[ "${TESTS_S:-420}" = 0 ] || timeout "${TESTS_S:-420}" python3 -m pytest -q -p no:cacheprovider -n 4 -rA \
    tests/test_gemm.py tests/test_ring_gemm.py tests/test_ring_gluon.py tests/test_flag_kernels.py -k "compiled or cuda" 2>&1 | tail -15 | tee "$out/compiled_$gpu.txt"
