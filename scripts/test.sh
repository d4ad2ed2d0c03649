#!/usr/bin/env bash
# The test suite in one command, on a fresh machine with only Rust (cargo) and Python 3:
#
#   scripts/test.sh [cargo test arguments...]
#
# 1. installs the pinned CUDA assembler tools (ptxas, cuobjdump, nvdisasm; pip wheels, no
#    GPU or CUDA toolkit) into ${FLASHCORE_TOOLS:-$HOME/.cache/flashcore-tools} with
#    scripts/install-cuda-tools.sh (nothing to do when they are already there);
# 2. puts them on PATH and in FLASHCORE_CUDA_BIN (what tests/assembly.rs looks in);
# 3. runs `cargo test --release "$@"`.
#
# Arguments go to cargo test: `scripts/test.sh --test c_header`,
# `scripts/test.sh -- --include-ignored` (on a GPU machine). .ci/run's test step is this
# script. Exit status: cargo's, or the installer's when the tools cannot be installed.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

tools_dir=${FLASHCORE_TOOLS:-$HOME/.cache/flashcore-tools}
if ! bin=$(scripts/install-cuda-tools.sh "$tools_dir"); then
    echo "scripts/test.sh: could not install the CUDA tools into $tools_dir (needs python3 with pip, and network access the first time)" >&2
    exit 1
fi
export PATH="$bin:$PATH"
export FLASHCORE_CUDA_BIN="$bin"
echo "scripts/test.sh: CUDA tools in $bin ($(ptxas --version | tail -n 1))" >&2

exec cargo test --release "$@"
