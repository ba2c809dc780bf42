#!/usr/bin/env bash
# scatter_add's hot-block split against the kernel before it, as one GPU job (docs/notes.md,
# Kernels, "scatter_add's hot blocks spread over 8 CTAs"):
#
#   bench/scatter_check.sh build DIR            # here
#   bench/scatter_check.sh run TITAN_RUN DIR    # on the GPU
#
# `build` writes the `scatter` cases of the codegen tests' GPU dump and Llama-3.2 1B's and
# 8b-4l's artifacts, built by this checkout (release) with `TITAN_SCATTER_SPLIT=1` (`DIR/base`,
# `DIR/base.1b`, ...: one CTA per block of rows, the kernel before the split) and with the
# default (`DIR/new`, ...). `run` checks the reference cases (each kernel against the
# interpreter, exactly, and twice; rule 12's scatter into a tensor, apart from it, over it and
# into a row shard), times the perf cases (`perf_scatter_add`: uniform ids;
# `perf_scatter_add_bytes`: every id below 256, the bundled corpus; `perf_scatter_add_into`:
# uniform ids into a tensor, written over it) two rounds, and runs both models 20 steps on the
# bundled corpus and on uniform random tokens: median tok/s of steps 5+ and the last loss,
# which must be the same bits for every variant. `VARIANTS` (default `base new`) names the
# artifacts the steps run: others built by hand into `DIR/NAME.1b` (`DIR/main.1b` by main's
# `titanc`, say) join the comparison; a missing one is reported and skipped. Carry ~25 MB.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Keeps only the scatter cases of the dump DIR.
prune() {
    python3 bench/prune_dump.py "$1" scatter perf_scatter
}

# Dumps the scatter cases and builds both models with the environment "$@" into $out{,.1b,.8b4}.
build_variant() {
    local out=$1
    shift
    env "$@" TITAN_GPU_DUMP="$out" cargo test -q --release -p titan-kernels --test codegen gpu_reference_dump >/dev/null
    prune "$out"
    for m in 8b4 1b; do
        env "$@" target/release/titanc build "$dir/$m.ir" -o "$out.$m" >"$out.$m.build.log"
    done
}

[ $# -ge 2 ] || usage
case $1 in
build)
    mkdir -p "$2"
    dir=$(cd "$2" && pwd)
    cargo build -q --release --bin titanc
    target/release/titanc new llama3 --preset 8b --n-layers 4 -o "$dir/8b4.ir"
    target/release/titanc new llama3 --preset 1b -o "$dir/1b.ir"
    rm -rf "$dir/base" "$dir/new" "$dir"/base.* "$dir"/new.*
    build_variant "$dir/base" TITAN_SCATTER_SPLIT=1
    build_variant "$dir/new" TITAN_SCATTER_SPLIT=8
    ;;
run)
    [ $# -ge 3 ] || usage
    run=$2
    dir=$3
    nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader || true
    echo "== ref"
    for n in base new; do
        echo "-- $n"
        TITAN_GPU_ONLY=scatter timeout 120 python3 kernels/tests/gpu_check.py "$dir/$n" 2>&1 | tail -7 | cut -c1-220 || true
    done
    echo "== perf"
    for r in 1 2; do for n in base new; do
        echo "-- $n round $r"
        TITAN_GPU_ONLY=perf_scatter timeout 120 python3 kernels/tests/gpu_check.py "$dir/$n" perf 2>&1 | grep -i scatter | cut -c1-200 || true
    done; done
    echo "== steps"
    python3 -c "
import numpy as np
np.random.default_rng(0).integers(0, 128256, 1 << 20, dtype=np.uint32).tofile('/tmp/sc_tok.bin')"
    for data in bundled random; do for m in 1b 8b4; do for n in ${VARIANTS:-base new}; do
        extra=()
        [ "$data" = random ] && extra=(--data /tmp/sc_tok.bin --data-format u32)
        rm -f /tmp/sc_m.jsonl
        if [ ! -d "$dir/$n.$m" ]; then
            echo "$m $n $data: no $dir/$n.$m"
            continue
        fi
        if timeout 150 "$run" "$dir/$n.$m" --backend cuda "${extra[@]}" --steps 20 --metrics /tmp/sc_m.jsonl --log-every 1 >/tmp/sc_out.txt 2>&1; then
            python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('/tmp/sc_m.jsonl')]
print('$m $n $data', round(statistics.median(r['tokens_per_s'] for r in rows[4:])), 'loss', rows[-1]['loss'])"
        else
            echo "$m $n $data failed"
            tail -3 /tmp/sc_out.txt
        fi
    done; done; done
    ;;
*) usage ;;
esac
