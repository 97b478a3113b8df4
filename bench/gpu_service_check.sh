#!/usr/bin/env bash
# The service on the GPU machine: controller + one CUDA worker (NVML inventory, NCCL TP group), a tiny job to
# the end, then what the worker registered, the best configs and the exported preset.
# Usage (repo root): bash bench/gpu_service_check.sh OUT
set -u
out=${1:?OUT}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 AUTOTUNE_TOKEN=gpu-check
export AUTOTUNE_CONTROLLER=http://127.0.0.1:8765
CLI=(python -c "from autotune.cli.app import main; main()")
cli() { "${CLI[@]}" "$@"; }
cli serve --db sqlite:////tmp/service.db --port 8765 > "$out/controller.log" 2>&1 &
cli worker --controller "$AUTOTUNE_CONTROLLER" --backend "${BACKEND:-cuda}" > "$out/worker.log" 2>&1 &
sleep 10
job=$(cli submit --hidden "${HIDDEN:-4096}" --tp 2 --seq "${SEQ:-4096}" --layers qkv_fprop,proj_fprop,qkv_wgrad --trials 8 --backend "${BACKEND:-cuda}" --json \
      | python -c "import json,sys; print(json.load(sys.stdin)['id'])")
echo "job $job"
timeout "${JOB_S:-150}" "${CLI[@]}" status "$job" --json > "$out/job.json" 2>&1
python - "$out/job.json" <<'PY'
import json, sys
job = json.load(open(sys.argv[1]))
print("status:", job["status"], "progress:", job["progress"])
for slot in job["slots"]:
    m = slot["best"]["measurement"]
    print(slot["slot"], slot["status"], slot["best"]["config"], "overlap", m["overlap_ms"], "gemm", m["gemm_ms"], "comm", m["comm_ms"])
PY
cli best --hidden "${HIDDEN:-4096}" --tp 2 --mbs 1 --seq "${SEQ:-4096}"
cli export --hidden "${HIDDEN:-4096}" --tp 2 --mbs 1 --seq "${SEQ:-4096}" --out "$out"
python - <<'PY'
import json, os, urllib.request
req = urllib.request.Request(os.environ["AUTOTUNE_CONTROLLER"] + "/v1/workers",
                             headers={"Authorization": "Bearer " + os.environ["AUTOTUNE_TOKEN"]})
print(json.dumps(json.load(urllib.request.urlopen(req)), indent=1)[:1500])
PY
grep -v -E "^frame|^\[rank|^Exception|Warning|warn|^$" "$out/worker.log" | tail -5
