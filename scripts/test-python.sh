#!/usr/bin/env bash
# The Python package's tests, on a machine with cargo and Python 3 (no GPU needed):
#
#   scripts/test-python.sh [pytest arguments...]
#
# 1. makes (once) a virtual environment with the pinned torch, transformers and pytest of
#    python/requirements-test.txt, under ${FLASHCORE_TOOLS:-$HOME/.cache/flashcore-tools};
# 2. builds the wheel (`pip wheel ./python`: cargo build --release --lib, then the package);
# 3. installs it into that environment and runs pytest on python/tests from outside the
#    source tree, so the tests import the installed wheel. Without a GPU the GPU tests
#    skip; the CPU ones (import, the C ABI's errors through ctypes, fake-tensor shapes,
#    torch.compile tracing, transformers registration) run.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
root=$(pwd)

tools_dir=${FLASHCORE_TOOLS:-$HOME/.cache/flashcore-tools}
req=python/requirements-test.txt
venv="$tools_dir/pyenv-$(sha256sum "$req" | cut -c1-12)"
if [[ ! -f $venv/.complete ]]; then
    echo "scripts/test-python.sh: creating $venv (torch, transformers, pytest; once)" >&2
    rm -rf "$venv"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check -r "$req"
    touch "$venv/.complete" # an interrupted install is redone, not reused
fi

rm -rf target/wheels
"$venv/bin/pip" wheel --quiet --disable-pip-version-check --no-deps -w target/wheels ./python
wheel=$(ls target/wheels/flashcore-*.whl)
echo "scripts/test-python.sh: built $wheel" >&2
"$venv/bin/pip" install --quiet --disable-pip-version-check --force-reinstall --no-deps "$wheel"

cd /
exec "$venv/bin/python" -m pytest -q -p no:cacheprovider "$root/python/tests" "$@"
