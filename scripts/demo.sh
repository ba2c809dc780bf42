#!/usr/bin/env bash
# The main job: generate the debug Llama-3 model, lower it to a training step, and train it on
# the bundled text with the CPU reference backend, printing the loss of every step.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
[ -f "$HOME/.cargo/env" ] && . "$HOME/.cargo/env"

STEPS=${STEPS:-200}
cargo build --release --locked -p titan-compiler -p titan-runtime
mkdir -p build/debug
target/release/titanc new llama3 --preset debug -o build/debug/model.ir
target/release/titanc lower build/debug/model.ir --to train \
    --lr 3e-3 --warmup-steps 10 --decay-steps "$((STEPS - 10))" --decay cosine --min-lr-ratio 0.1 \
    --weight-decay 0.01 -o build/debug/train.ir
target/release/titan-run build/debug/train.ir --steps "$STEPS" --data examples/data/tiny_corpus.txt
