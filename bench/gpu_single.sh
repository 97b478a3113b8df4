#!/usr/bin/env bash
# One device call on the one-GPU machine: the compiled kernel tests, then the GEMM benchmarks (BF16 and FP8,
# fused ring kernels included), each writing its JSON to OUTDIR.
# The compiled tests compile every tile config at both dtypes on a cold Triton cache: about 100 s for the GEMM,
# over 200 s for the ring kernels since their all-gather loop is one per chunk (TESTS_S bounds all three).
# Usage (repo root): AUTOTUNE_COMMIT=$(git rev-parse HEAD) bash bench/gpu_single.sh OUTDIR
set -u
out=${1:?OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout "${TESTS_S:-480}" python3 -m pytest -q -p no:cacheprovider -x \
    tests/test_gemm.py tests/test_ring_gemm.py tests/test_flag_kernels.py -k "compiled or cuda" 2>&1 | tail -15 | tee "$out/compiled_tests.txt"
timeout "${GEMM_S:-150}" python3 bench/gemm_bench.py --out "$out/gemm_h200.json" 2>&1 | tail -8
timeout "${GEMM_S:-150}" python3 bench/gemm_bench.py --dtype fp8 --out "$out/gemm_fp8_h200.json" 2>&1 | tail -8
