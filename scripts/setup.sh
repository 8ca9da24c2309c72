#!/usr/bin/env bash
# Install the strategy pack into ./.venv. Usage: bash scripts/setup.sh [--dev]
#   --dev   also the test tools (and Chromium for the dashboard's browser test, where apt-get can), and .venv-core
#           (below).
# On a machine without an NVIDIA GPU the CPU build of torch goes in first, so that the plain `torch`
# requirement is already met and pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0 && [[ "${1:-}" == "--dev" ]] && dev=1
# tracking: wandb, offline unless logged in (every run is logged from the first command); models: transformers, for
# the Hugging Face workloads the README's rehearsals and the GPU bench use
extras="[dashboard,tracking,models]" && ((dev)) && extras="[dev,dashboard,tracking,models]"
if ((dev)) && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]
then
  # The dashboard's browser test drives Debian's Chromium; without it that one test is skipped, saying why. (In the
  # background: apt waits on the network and dpkg while pip works.)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "note: could not install chromium; the dashboard's browser test will be skipped" &
fi
[[ -x .venv/bin/python ]] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -q --disable-pip-version-check --no-compile)
site="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${pip[@]}" "torch==2.13.0"
    .venv/bin/python -m compileall -q "$site/torch" >/dev/null 2>&1 &  # (on the core pip leaves idle meanwhile)
  fi
fi
# The rest through uv where PyPI has it (the same packages as pip takes, 56 s -> 7 s here); else pip. (uv does not
# look in pip's folder of local wheels: torch goes in first, above, and uv keeps an installed release that fits.)
if ! { "${pip[@]}" uv >/dev/null 2>&1 && .venv/bin/uv pip install -q --python .venv/bin/python -e ".${extras}"; }; then
  "${pip[@]}" -e ".${extras}"
fi
# Bytecode, compiled here on every core (pip compiles on one: 2:02 -> 1:42 here, 2 cores), the pack's own sources
# too: where PYTHONDONTWRITEBYTECODE is set (as on the developers' machine) Python never writes their bytecode, and
# every process a run or the tests start compiled the package again (0.2 s of CPU each). (|| true: a few files written
# for later Pythons do not compile, as pip's own pass would have found and passed over.)
folders=(strategies demos dashboard) && ((dev)) && folders+=(tests)
.venv/bin/python -m compileall -q -j 0 "$site" "${folders[@]}" >/dev/null 2>&1 || true
if ((dev)); then
  # .venv-core: the same install without the optional `models` extra, as a user without it has the pack. The tests
  # run there what needs no Hugging Face model (tests/python.py): Lightning's torchmetrics imports transformers
  # wherever it is installed, 2.7 s of CPU in every process that imports Lightning. Each of .venv's packages but
  # transformers is linked in (bytecode and all), so it costs no install.
  rm -rf .venv-core && python3 -m venv --without-pip .venv-core
  core="$(.venv-core/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  for entry in "$site"/*; do
    case "$(basename "$entry")" in transformers | transformers-*.dist-info) ;; *) ln -s "$entry" "$core/" ;; esac
  done
fi
wait  # (Chromium)
echo "installed: $(.venv/bin/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)')"
