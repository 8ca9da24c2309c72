#!/usr/bin/env bash
# Install the strategy pack into ./.venv. Usage: bash scripts/setup.sh [--dev]
#   --dev   also the test tools.
# On a machine without an NVIDIA GPU the CPU build of torch goes in first, so that the plain `torch`
# requirement is already met and pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[[ "${1:-}" == "--dev" ]] && extras="[dev]"
[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  .venv/bin/python -c "import torch" 2>/dev/null || "${pip[@]}" "torch==2.13.0"
fi
"${pip[@]}" -e ".${extras}"
echo "installed: $(.venv/bin/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)')"
