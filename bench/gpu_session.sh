#!/usr/bin/env bash
# One device call: the overlap benchmark on every anchor shape, then the landscapes the tuner is judged on.
# Usage (repo root, on the 2-GPU machine): bash bench/gpu_session.sh OUTDIR
set -u
out=${1:?OUTDIR}
mkdir -p "$out/landscapes"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
quiet() { grep -v -E "^frame|^\[rank|^Exception|^$|Warning|warn"; }
timeout "${BENCH_S:-560}" python bench/overlap_bench.py --runs 2 --repeats 20 --trial-timeout 20 --out "$out/overlap_h200_tp2.json" 2>&1 | quiet
for spec in h4096_s4096:qkv_fprop h8192_s8192:qkv_fprop h5120_s2048:qkv_fprop h4096_s4096:proj_fprop h8192_s8192:proj_fprop h5120_s2048:proj_fprop; do
  timeout "${LANDSCAPE_S:-100}" python bench/record_landscape.py --shape "${spec%%:*}" --slot "${spec##*:}" --repeats 10 --out "$out/landscapes" 2>&1 | quiet
done
