#!/usr/bin/env bash
# PyTorch parity: titan-run and the reference Llama-3 in PyTorch (tools/llama_ref.py), started
# from the same safetensors weights and fed the same batches, must agree on the loss of every one
# of the first STEPS (20) steps within a bf16 tolerance (tools/torch_parity.py).
#
#   tools/parity.sh prepare [DIR]   # here (Rust, LLVM): release titanc/titan-run, two artifacts
#   tools/parity.sh run [DIR]       # on the GPU machine (driver, CUDA 13, PyTorch), repo root
#
# Models: the debug preset (seq 64, batch 8) and an 8B-shaped model cut to 2 layers,
# `titanc new llama3 --preset 8b --n-layers 2 --seq-len 1024` (batch 1): every 8B matrix shape,
# with the sequence cut from 8192 to 1024 so 20 steps of both runs take seconds.
#
# `run`, per model: `torch_parity.py init` writes TorchTitan-style initial weights as
# safetensors (on the GPU machine: 3 GB for the 8B shape, too big to carry), titan-run trains
# STEPS steps from them (`--init-from`, `--metrics`, `--dump-batches`), then
# `torch_parity.py compare` trains the reference on the dumped batches and compares the losses.
# DIR (default parity/) is git-ignored through .git/info/exclude; logs and tables go to
# $OUT (or DIR/logs). The exit status is 1 when a model misses the tolerance or a run fails.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-parity}
steps=${STEPS:-20}
# The training flags of both sides (titanc build's and torch_parity.py's): warmup, then cosine
# decay, and clipping at 1.0, so 20 steps exercise each part of the schedule and the clip.
train_flags=(--lr 8e-4 --warmup-steps 5 --decay-steps 15 --decay cosine --min-lr-ratio 0.1
    --beta1 0.9 --beta2 0.95 --eps 1e-8 --weight-decay 0.1 --max-norm 1.0)
# MODELS picks a subset: `debug`, `8b2` (8B shapes, 2 layers, seq 1024), `8b4` (the benchmark's
# 8b-4l: 4 layers at the full seq 8192).
read -r -a models <<<"${MODELS:-debug 8b2}"

model_args() {
    case "$1" in
    debug) echo "--preset debug" ;;
    8b2) echo "--preset 8b --n-layers 2 --seq-len 1024" ;;
    8b4) echo "--preset 8b --n-layers 4" ;;
    *) echo "unknown model $1" >&2; exit 2 ;;
    esac
}

case "$mode" in
prepare)
    mkdir -p "$dir"
    if [ -d .git ] && ! grep -qx "/$dir/" .git/info/exclude 2>/dev/null; then
        mkdir -p .git/info && echo "/$dir/" >>.git/info/exclude
    fi
    # NO_BUILD=1 takes the release binaries already in target/ (a shared tree mid-edit).
    [ "${NO_BUILD:-0}" = 1 ] || cargo build --release --bin titanc --bin titan-run
    cp target/release/titan-run "$dir/titan-run"
    strip "$dir/titan-run" 2>/dev/null || true
    for m in "${models[@]}"; do
        mkdir -p "$dir/$m"
        # shellcheck disable=SC2046
        target/release/titanc new llama3 $(model_args "$m") -o "$dir/$m/model.ir"
        target/release/titanc build "$dir/$m/model.ir" -o "$dir/$m/artifact" "${train_flags[@]}"
    done
    du -sh "$dir"
    echo "prepared $dir; on the GPU machine run: tools/parity.sh run $dir (carry $dir)"
    ;;
run)
    # The CUDA libraries for titan-run only: the system's directory holds another cuDNN than
    # PyTorch's, which PyTorch then refuses (docs/performance.md, session 16).
    titan_libs=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export PYTHONUNBUFFERED=1
    out=${OUT:-$dir/logs}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    rc=0
    for m in "${models[@]}"; do
        d="$dir/$m"
        echo "== $m: $(model_args "$m")"
        rm -f "$d/metrics.jsonl" "$d/batches.bin"
        python3 tools/torch_parity.py init --ir "$d/model.ir" --out "$d/init.safetensors" --seed 0 || { rc=1; continue; }
        limit=$([ "$m" = debug ] && echo 120 || echo 300)
        if ! LD_LIBRARY_PATH=$titan_libs timeout "$limit" "$dir/titan-run" "$d/artifact" --backend cuda --steps "$steps" --init-from "$d/init.safetensors" \
            --metrics "$d/metrics.jsonl" --dump-batches "$d/batches.bin" --log-every 1 2>&1 | tee "$out/$m-titan.log"; then
            echo "error: titan-run failed on $m" >&2
            rc=1
            continue
        fi
        cp "$d/metrics.jsonl" "$out/$m-metrics.jsonl"
        python3 tools/torch_parity.py compare --ir "$d/model.ir" --init "$d/init.safetensors" --batches "$d/batches.bin" \
            --metrics "$d/metrics.jsonl" --steps "$steps" --label "$m" --table-out "$out/$m-table.md" "${train_flags[@]}" || rc=1
        rm -f "$d/init.safetensors"
    done
    exit $rc
    ;;
*)
    echo "usage: tools/parity.sh prepare [DIR] | tools/parity.sh run [DIR]" >&2
    exit 2
    ;;
esac
