#!/usr/bin/env bash
# Installs the offline CUDA assembler tools (ptxas, cuobjdump, nvdisasm) from PyPI wheels
# into DIR, with no CUDA toolkit, no GPU and no root. Used by scripts/test.sh (the test
# suite's one command, which .ci/run calls) for tests/assembly.rs, which needs ptxas and
# cuobjdump on PATH or in $FLASHCORE_CUDA_BIN.
#
#   scripts/install-cuda-tools.sh DIR
#
# Prints the bin directory (DIR/nvidia/cu13/bin) as its last line of stdout; everything
# else goes to stderr, so `BIN=$(scripts/install-cuda-tools.sh DIR)` works.
# Idempotent: does nothing when DIR/nvidia/cu13/bin/ptxas already runs.
#
# The versions are pinned as a combination known to work together: the 13.0 nvcc wheel
# carries ptxas, cuobjdump and nvdisasm come from their own 13.x wheels.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: $0 DIR" >&2
    exit 2
fi

dir=$1
bin="$dir/nvidia/cu13/bin"
pkgs=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-cuobjdump==13.5.37
    nvidia-cuda-nvdisasm==13.5.37
)

tools_work() {
    "$bin/ptxas" --version >/dev/null 2>&1 &&
        "$bin/cuobjdump" --version >/dev/null 2>&1 &&
        [[ -x "$bin/nvdisasm" ]]
}

if tools_work; then
    echo "install-cuda-tools: ptxas already present in $bin" >&2
else
    py=${PYTHON:-}
    if [[ -z "$py" ]]; then
        for cand in python3 python; do
            if command -v "$cand" >/dev/null 2>&1; then
                py=$cand
                break
            fi
        done
    fi
    if [[ -z "$py" ]]; then
        echo "install-cuda-tools: python3 with pip is needed" >&2
        exit 1
    fi
    if ! "$py" -m pip --version >/dev/null 2>&1; then
        echo "install-cuda-tools: $py has no pip module; install pip (e.g. apt-get install python3-pip) or set PYTHON" >&2
        exit 1
    fi
    mkdir -p "$dir"
    echo "install-cuda-tools: pip install --target $dir ${pkgs[*]}" >&2
    # --upgrade: replace a partial earlier install in DIR instead of refusing to overwrite.
    "$py" -m pip install --quiet --disable-pip-version-check --no-input --upgrade \
        --target "$dir" "${pkgs[@]}" >&2
    # Wheels do not always keep the executable bit.
    for t in ptxas cuobjdump nvdisasm; do
        [[ -f "$bin/$t" ]] && chmod +x "$bin/$t"
    done
    if ! tools_work; then
        echo "install-cuda-tools: installed, but $bin/ptxas or cuobjdump does not run" >&2
        ls -l "$bin" >&2 || true
        exit 1
    fi
fi

echo "$bin"
