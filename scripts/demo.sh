#!/usr/bin/env bash
# The main job: compile the debug Llama-3 ahead of time into an artifact (fused kernels, memory
# plan, schedule) and train it on the bundled text with titan-run's CPU backend, printing the
# loss of every step and the predicted peak memory.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

STEPS=${STEPS:-200}
cargo build --release --locked -p titan-compiler -p titan-runtime
# build/ holds only what this script writes; an older demo left graph files where the artifact goes.
if [ -d build/debug ] && [ ! -f build/debug/manifest.json ]; then rm -rf build/debug; fi
target/release/titanc build examples/llama3-debug.ir -o build/debug \
    --lr 3e-3 --warmup-steps 10 --decay-steps "$((STEPS - 10))" --decay cosine --min-lr-ratio 0.1 \
    --weight-decay 0.01
target/release/titan-run build/debug --steps "$STEPS"
