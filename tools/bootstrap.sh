#!/usr/bin/env bash
# Set up this project in ./.venv on a fresh machine, then exit.
#
#   bash tools/bootstrap.sh [EXTRAS]     EXTRAS: pip extras to install (default: tensorboard,hf)
#
# Installs PyTorch first, because a bare `torch` requirement makes pip pick a multi-GB CUDA
# build: where there is no GPU, the CPU build (torch==${TORCH_VERSION}); where `nvidia-smi` works,
# the default (CUDA) build. A torch already in the venv is kept. Set TORCH_SPEC to choose yourself.
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="${1:-tensorboard,hf}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if [ -n "${TORCH_SPEC:-}" ]; then
    "${PIP[@]}" "$TORCH_SPEC"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    "${PIP[@]}" "torch>=2.6"
  else
    "${PIP[@]}" "torch==${TORCH_VERSION}"
  fi
fi

"${PIP[@]}" -e ".[${EXTRAS}]"
echo "bootstrap: ready (.venv, extras: ${EXTRAS}, $(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
