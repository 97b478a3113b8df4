#!/usr/bin/env bash
# Fetches what `bench/te_install.sh` installs, on a machine with network, into DIR (default .whl/te):
# the core wheel split into parts of at most 56 MiB (one lent-GPU call carries 64 MiB with the repository),
# its checksum, the meta wheel, the PyTorch extension's source and the pure-Python wheels the GPU image lacks.
#
#   bench/te_fetch.sh [DIR] [VERSION]
#
# The parts land in DIR/part_N; a call to the GPU machine carries one of them at a time and parks it there
# (see README.md, "Measuring through TransformerEngine").
set -euo pipefail

dir=${1:-.whl/te}
version=${2:-2.20.2}
mkdir -p "$dir"
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "$@"
}
download "transformer-engine-cu13==$version" "transformer-engine==$version"
download pydantic pydantic-core annotated-types typing-inspection "typing-extensions>=4.16" nvdlfw-inspect importlib-metadata
# The extension has no wheel on PyPI; pip cannot download its source without building its metadata (which
# needs torch with CUDA), so take the file from PyPI's simple index directly.
sdist=$(curl -fsS "https://pypi.org/simple/transformer-engine-torch/" |
    grep -o "https://[^\"#]*transformer_engine_torch-$version.tar.gz" | head -1)
curl -fsS -o "$dir/transformer_engine_torch-$version.tar.gz" "$sdist"

core=$(cd "$dir" && ls transformer_engine_cu13-"$version"-*.whl)
(cd "$dir" && sha256sum "$core" > core.sha256 && split -b 56M -d -a 1 "$core" part_ && rm "$core")
ls -la "$dir"
