#!/usr/bin/env bash
# Installs TransformerEngine for PyTorch into a folder, on a GPU host that cannot reach PyPI.
#
#   bench/te_install.sh WHEEL_DIR [TARGET]      then: export PYTHONPATH=TARGET:$PYTHONPATH
#
# A host with network needs none of this: `pip install --no-build-isolation "transformer-engine[pytorch]"`,
# or use an NGC PyTorch container, which ships TE.  Our lent GPU machines reach nothing, and one call may carry
# at most 64 MiB, so the 276 MB core wheel travels in parts.  WHEEL_DIR holds (fetched on a machine with
# network; `bench/te_fetch.sh` writes exactly this):
#   part_0 part_1 ...                 the core wheel transformer_engine_cu13-<ver>-*.whl split with `split -d -a 1`
#   core.sha256                       its checksum and file name (sha256sum's output line)
#   transformer_engine-<ver>-*.whl    the meta package: TE checks that it is installed, at the core's version
#   transformer_engine_torch-<ver>.tar.gz   the PyTorch extension's source: built here against this host's
#                                     torch, the only build that matches its ABI (about 3 minutes, 32 cores)
#   any other *.whl                   pure-Python dependencies the host lacks (pydantic and its parts, ...)
# TE then imports with UB_SKIPMC=1 (userbuffers over CUDA IPC: we never use NVLink multicast) and
# CUDA_DEVICE_MAX_CONNECTIONS=1 (TE's overlap needs one hardware queue on Hopper); the check below sets both.
set -euo pipefail

wheels=$(cd "${1:?usage: te_install.sh WHEEL_DIR [TARGET]}" && pwd)
target=${2:-/tmp/te_site}
mkdir -p "$target"

read -r sum core_name < "$wheels/core.sha256"
core="$target/.wheels/$core_name"
mkdir -p "$target/.wheels"
cat "$wheels"/part_? > "$core"
echo "$sum  $core" | sha256sum --check --quiet || { echo "error: $core_name: checksum mismatch (a part is missing or cut short)" >&2; exit 1; }

pip_install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" "$@"; }
extra=$(find "$wheels" -maxdepth 1 -name '*.whl' ! -name 'transformer_engine*')
# shellcheck disable=SC2086  # one argument per wheel
[ -n "$extra" ] && pip_install $extra
pip_install "$wheels"/transformer_engine-*.whl "$core"

export PYTHONPATH="$target${PYTHONPATH:+:$PYTHONPATH}"
build=$(mktemp -d)
tar -xzf "$wheels"/transformer_engine_torch-*.tar.gz -C "$build"
start=$SECONDS
(cd "$build"/transformer_engine_torch-* &&
    NVTE_PYTORCH_FORCE_BUILD=TRUE NVTE_CUDA_ARCHS=${NVTE_CUDA_ARCHS:-90} MAX_JOBS=${MAX_JOBS:-$(nproc)} \
        python3 -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$target/.wheels" . )
echo "built transformer_engine_torch in $((SECONDS - start)) s"
# pip --target --upgrade replaces whole top-level folders, and the extension's wheel ships files under
# transformer_engine/ too: installed straight into the target it would delete the core's Python package.
ext=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$ext" "$target"/.wheels/transformer_engine_torch-*.whl
cp -r "$ext"/. "$target"/

UB_SKIPMC=1 CUDA_DEVICE_MAX_CONNECTIONS=1 python3 - <<'EOF'
import importlib.metadata as md

import torch
import transformer_engine.pytorch as te

versions = {name: md.version(name) for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch")}
print("transformer_engine.pytorch imports:", versions, "torch", torch.__version__, "initialize_ub" in dir(te))
EOF
echo "next, from the repository root: PYTHONPATH=$target\${PYTHONPATH:+:\$PYTHONPATH} python3 bench/te_check.py --out bench/results/te_check_h200.json"
