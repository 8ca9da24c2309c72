#!/usr/bin/env bash
# Install the strategy pack into ./.venv. Usage: bash scripts/setup.sh [--dev]
#   --dev   also the test tools (and Chromium for the dashboard's browser test, where apt-get can), and .venv-core:
#           the pack without the optional `models` extra (no transformers), where the tests run what needs no
#           Hugging Face model (docs/tests.md: Lightning's torchmetrics imports transformers wherever it is installed,
#           2.7 s of CPU in every process).
# On a machine without an NVIDIA GPU the CPU build of torch goes in first, so that the plain `torch`
# requirement is already met and pip does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
dev=0 && [[ "${1:-}" == "--dev" ]] && dev=1
# tracking: wandb, offline unless logged in (every run is logged from the first command); models: transformers, for
# the Hugging Face workloads the README's rehearsals and the GPU bench use
extras="[dashboard,tracking,models]" && ((dev)) && extras="[dev,dashboard,tracking,models]"
venvs=(.venv) && ((dev)) && venvs+=(.venv-core)
if ((dev)) && ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [[ "$(id -u)" == 0 ]]
then
  # The dashboard's browser test drives Debian's Chromium; without it that one test is skipped, saying why. (In the
  # background: apt waits on the network and dpkg while pip works.)
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) >/dev/null 2>&1 \
    || echo "note: could not install chromium; the dashboard's browser test will be skipped" &
fi

pip() { "$1/bin/python" -m pip install -q --disable-pip-version-check --no-compile "${@:2}"; }
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

# torch's CPU build, where there is no GPU, into each environment at once
torch=()
for venv in "${venvs[@]}"; do
  [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
  if { ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; } \
     && ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    pip "$venv" "torch==2.13.0" &
    torch+=($!)
  fi
done

# The rest through uv where PyPI has it (the same packages as pip takes, 56 s -> 7 s here); else pip. (uv does not
# look in pip's folder of local wheels: torch goes in first, above, and uv keeps an installed release that fits.)
install() {
  if ! { pip "$1" uv >/dev/null 2>&1 && "$1/bin/uv" pip install -q --python "$1/bin/python" -e ".$2"; }; then
    pip "$1" -e ".$2"
  fi
}
for pid in "${torch[@]}"; do wait "$pid"; done
install .venv "$extras"
((dev)) && install .venv-core "[dashboard,tracking]"

# Bytecode, compiled here on every core (pip compiles on one: 2:02 -> 1:42 here, 2 cores), the pack's own sources
# too: where PYTHONDONTWRITEBYTECODE is set (as on the developers' machine) Python never writes their bytecode, and
# every process a run or the tests start compiled the package again (0.2 s of CPU each). (|| true: a few files written
# for later Pythons do not compile, as pip's own pass would have found and passed over.)
folders=(strategies demos dashboard) && ((dev)) && folders+=(tests)
.venv/bin/python -m compileall -q -j 0 "$(site .venv)" "${folders[@]}" >/dev/null 2>&1 || true
((dev)) && { .venv-core/bin/python -m compileall -q -j 0 "$(site .venv-core)" >/dev/null 2>&1 || true; }
wait  # (Chromium)
echo "installed: $(.venv/bin/python -c 'import torch, lightning; print("torch", torch.__version__, "lightning", lightning.__version__)')"
