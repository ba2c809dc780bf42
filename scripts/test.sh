#!/usr/bin/env bash
# Run every test of the workspace (installs the toolchain first if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"
cargo test --workspace --locked
