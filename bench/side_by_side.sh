#!/usr/bin/env bash
# Issue 15's and issue 12's side-by-side benchmarks on one GPU, as one job:
#
#   bench/side_by_side.sh build TITANC DIR    # where titanc is (no GPU needed): the artifacts
#   bench/side_by_side.sh run TITAN_RUN DIR [all|models|float8|gemms]   # on the GPU, with PyTorch
#
# `build` writes into DIR the 8b-4l artifact (Llama-3 8B dims, 4 layers, seq 8192), Llama-3.2
# 1B's (16 layers, seq 8192, tied embeddings as the released model), and 8b-4l's float8
# variants (each recipe, rowwise, rowwise_with_gw_hp and tensorwise, with the filter empty and
# with the output head filtered). `run` runs bench/torch/llama_baseline.py on them: titan-run against
# PyTorch eager and torch.compile per block at both precision policies, per config, with the
# per-class breakdown (`models`), then the float8 side by side against torch.compile + torchao
# with the same recipe and filter (`float8`; needs torchao, e.g. 0.18). Every run goes one after
# the other on the same GPU. (The PyTorch model computes RoPE without Llama 3.1's frequency
# scaling, which titan's 1B applies: the same work, so it does not change the speed.) `gemms`
# times every GEMM of 8b-4l's bf16 and rowwise steps as PyTorch runs it, beside titan's
# (bench/torch/gemm_compare.py).
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

[ $# -ge 3 ] || usage
cmd=$1
tool=$2
dir=$3
what=${4:-all}

case "$cmd" in
build)
    mkdir -p "$dir"
    "$tool" new llama3 --preset 8b --n-layers 4 -o "$dir/8b4.ir"
    "$tool" new llama3 --preset 1b -o "$dir/1b.ir"
    for spec in "8b4:8b4.ir:" "1b:1b.ir:" \
        "8b4-rowwise:8b4.ir:--float8 rowwise" \
        "8b4-rowwise-head-bf16:8b4.ir:--float8 rowwise --float8-filter output" \
        "8b4-rowwise_with_gw_hp:8b4.ir:--float8 rowwise_with_gw_hp" \
        "8b4-rowwise_with_gw_hp-head-bf16:8b4.ir:--float8 rowwise_with_gw_hp --float8-filter output" \
        "8b4-tensorwise:8b4.ir:--float8 tensorwise" \
        "8b4-tensorwise-head-bf16:8b4.ir:--float8 tensorwise --float8-filter output"; do
        IFS=: read -r name ir flags <<<"$spec"
        # shellcheck disable=SC2086  # flags are words
        "$tool" build "$dir/$ir" -o "$dir/$name" $flags >"$dir/$name.build.log"
        echo "built $dir/$name"
    done
    ;;
run)
    base=(python3 bench/torch/llama_baseline.py --titan-run "$tool")
    if [ "$what" = all ] || [ "$what" = models ]; then
        echo "## 8b-4l"
        "${base[@]}" --artifact "$dir/8b4"
        echo "## Llama-3.2 1B"
        "${base[@]}" --artifact "$dir/1b" --dim 2048 --n-layers 16 --n-heads 32 --n-kv-heads 8 --ffn 8192 --tie-embeddings
    fi
    if [ "$what" = all ] || [ "$what" = gemms ]; then
        for a in 8b4 8b4-rowwise; do
            echo "## GEMMs of $a"
            python3 bench/torch/gemm_compare.py "$dir/$a" --titan-run "$tool"
        done
    fi
    if [ "$what" = all ] || [ "$what" = float8 ]; then
        echo "## 8b-4l float8"
        "${base[@]}" --float8-artifacts "bf16=$dir/8b4,rowwise=$dir/8b4-rowwise,rowwise:output=$dir/8b4-rowwise-head-bf16,rowwise_with_gw_hp=$dir/8b4-rowwise_with_gw_hp,rowwise_with_gw_hp:output=$dir/8b4-rowwise_with_gw_hp-head-bf16,tensorwise=$dir/8b4-tensorwise,tensorwise:output=$dir/8b4-tensorwise-head-bf16"
    fi
    ;;
*)
    usage
    ;;
esac
