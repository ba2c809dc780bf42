#!/usr/bin/env bash
# Build-time attention switches compared on one GPU, as one job (issue 15; the switches are the
# `TITAN_ATT_*` variables of kernels/src/attention*.rs, read when kernels are generated):
#
#   bench/attention_variants.sh build DIR NAME=VAR=VALUE[,VAR=VALUE...] ...   # here (cargo)
#   bench/attention_variants.sh run TITAN_RUN DIR [ref,bursts,ncu,steps,heldbwd,held]  # on the GPU
#
# `build` writes into DIR main's attention kernels (`DIR/main`, a `TITAN_GPU_DUMP` of the codegen
# tests pruned to the attention cases), each variant's (`DIR/NAME`: only the files that differ
# from main's; `run` fills in the rest), and 8b-4l's and Llama-3.2 1B's artifacts built by
# this checkout's titanc (release) with and without each variant's variables (`DIR/main.8b4`,
# `DIR/NAME.1b`, ...). `run` goes through the phases named (all by default), every variant and
# main one after the other in each: `ref` (kernels/tests/gpu_check.py: the reference cases, each
# kernel twice and compared bitwise), `bursts` (the perf cases matching $ONLY, default
# `perf_attention_bwd`), `ncu` (Nsight Compute's DRAM throughput and L2 hit rate on
# the kernel $NCU_KERNEL, default `perf_attention_bwd_causal`, the seq 8192 head_dim 128 one,
# and the comma-separated metrics $NCU_METRICS if set),
# `steps` (20-step runs of the models $MODELS, default `8b4 1b`: median tok/s of steps 5+ and
# the last loss), `heldbwd` (the perf cases matching $ONLY held at the power cap for $SUSTAIN
# seconds, default 2: time and energy a launch, titan's kernels only) and `held`
# (bench/attention_table.py --sustain 2: every shape's forward and backward held, PyTorch's
# SDPA beside each; 24 kernels held 3 s each, ~80-100 s a variant; $HELD_ONLY, e.g.
# `8192:128`, keeps the shapes named).
# `bursts`, `steps` and `heldbwd` go round every variant $ROUNDS times (default 2), so a drift
# of clock or temperature shows as a spread. Output to stdout; ncu's reports also to $OUT if it
# is set.
# Size to carry to a GPU machine: ~28 MB for main, ~4.5 MB a variant (two artifacts, a few PTX).
#
#   bench/attention_variants.sh build /tmp/av down=TITAN_ATT_BWD_WALK=down \
#       band4=TITAN_ATT_BWD_WALK=down-heads-inner,TITAN_ATT_BWD_BAND=4
set -euo pipefail
cd "$(dirname "$0")/.."

usage() {
    sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
}

# Keeps only the attention cases of the dump DIR.
prune() {
    python3 bench/prune_dump.py "$1" attention perf_attention
}

# Runs "$@" with the comma-separated VAR=VALUE list $1 in its environment.
with_env() {
    local vars=$1
    shift
    local -a kv=()
    [ -n "$vars" ] && IFS=, read -r -a kv <<<"$vars"
    env "${kv[@]}" "$@"
}

[ $# -ge 2 ] || usage
cmd=$1
case "$cmd" in
build)
    dir=$2
    shift 2
    # titanc of this checkout (a stale one would build the artifacts without the switches).
    cargo build -q --release --bin titanc
    titanc=target/release/titanc
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    "$titanc" new llama3 --preset 8b --n-layers 4 -o "$dir/8b4.ir"
    "$titanc" new llama3 --preset 1b -o "$dir/1b.ir"
    : >"$dir/variants.txt"
    for spec in "main=" "$@"; do
        name=${spec%%=*}
        vars=${spec#*=}
        [ -n "$name" ] && [ "$name" != "$spec" ] || { echo "attention_variants: '$spec' is not NAME=VAR=VALUE[,...]" >&2; exit 2; }
        rm -rf "${dir:?}/$name"
        with_env "$vars" env TITAN_GPU_DUMP="$dir/$name" cargo test -q --release -p titan-kernels --test codegen gpu_reference_dump >/dev/null
        prune "$dir/$name"
        if [ "$name" != main ]; then
            same=0
            for f in "$dir/$name"/*; do
                b=$(basename "$f")
                case $b in cases.json | perf.json) continue ;; esac
                if cmp -s "$f" "$dir/main/$b"; then rm "$f"; same=$((same + 1)); fi
            done
            ndiff=$(find "$dir/$name" -name '*.ptx' | wc -l)
            echo "$name: $ndiff kernels differ from main's ($same files the same)"
            # The switches are read as they are spelt: an unknown name or value builds main's kernels.
            [ "$ndiff" -gt 0 ] || echo "attention_variants: warning: $name ($vars) changes no attention kernel" >&2
        fi
        for m in 8b4 1b; do
            with_env "$vars" "$titanc" build "$dir/$m.ir" -o "$dir/$name.$m" >"$dir/$name.$m.build.log"
        done
        echo "$name $vars" >>"$dir/variants.txt"
    done
    ;;
run)
    [ $# -ge 3 ] || usage
    run=$2
    dir=$3
    # `gpu_check.py DIR perf` on the cases matching $ONLY, every variant $ROUNDS times, held at
    # the power cap for $1 seconds if it is not empty; prints its lines matching $2.
    perf_rounds() {
        for r in $(seq "${ROUNDS:-2}"); do for n in $names; do
            echo "-- $n round $r"
            TITAN_GPU_RANDOM=1 TITAN_GPU_SUSTAIN=$1 TITAN_GPU_ONLY=${ONLY:-perf_attention_bwd} timeout 240 python3 kernels/tests/gpu_check.py "$dir/$n" perf >/tmp/av_perf.txt 2>&1 || { echo "$n: gpu_check.py perf exited $?"; tail -3 /tmp/av_perf.txt; }
            grep "$2" /tmp/av_perf.txt || true
        done; done
    }
    phases=${4:-ref,bursts,ncu,steps,held}
    names=$(cut -d' ' -f1 "$dir/variants.txt")
    for n in $names; do [ "$n" = main ] || cp -n "$dir/main/"* "$dir/$n/"; done
    chmod +x "$run"
    nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm --format=csv,noheader || true
    cat "$dir/variants.txt"
    for phase in ${phases//,/ }; do
        echo "== $phase"
        case $phase in
        ref)
            for n in $names; do
                echo "-- $n"
                timeout 180 python3 kernels/tests/gpu_check.py "$dir/$n" >/tmp/av_ref.txt 2>&1 || echo "$n: gpu_check.py exited $?"
                grep -iE "fail|differ|mismatch|error" /tmp/av_ref.txt | cut -c1-200 | head -8 || true
                tail -1 /tmp/av_ref.txt
            done
            ;;
        bursts) perf_rounds "" "^perf_" ;;
        ncu)
            ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
            k=${NCU_KERNEL:-perf_attention_bwd_causal}
            for n in $names; do
                rep=${OUT:-/tmp}/ncu_${n}_$k.txt
                extra=()
                [ -n "${NCU_METRICS:-}" ] && extra=(--metrics "$NCU_METRICS")
                TITAN_GPU_RANDOM=1 TITAN_GPU_ONLY=$k timeout 150 "$ncu" -k "regex:^$k\$" --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis "${extra[@]}" python3 kernels/tests/gpu_check.py "$dir/$n" perf >"$rep" 2>&1 || echo "$n: ncu failed ($rep)"
                echo "-- $n"
                grep -E "Duration|DRAM Throughput|L2 Hit Rate|Memory Throughput${NCU_METRICS:+|${NCU_METRICS//,/|}}" "$rep" || true
            done
            ;;
        steps)
            python3 -c "
import numpy as np
np.random.default_rng(0).integers(0, 128256, 1 << 20, dtype=np.uint32).tofile('/tmp/av_tok.bin')" || echo "steps: no token file (numpy)"
            for r in $(seq "${ROUNDS:-2}"); do for m in ${MODELS:-8b4 1b}; do for n in $names; do
                rm -f /tmp/av_m.jsonl
                if timeout 150 "$run" "$dir/$n.$m" --backend cuda --data /tmp/av_tok.bin --data-format u32 --steps 20 --metrics /tmp/av_m.jsonl --log-every 1 >/tmp/av_out.txt 2>&1; then
                    python3 -c "
import json, statistics
rows = [json.loads(l) for l in open('/tmp/av_m.jsonl')]
print('$m $n round $r', round(statistics.median(r['tokens_per_s'] for r in rows[4:])), 'loss', rows[-1]['loss'])"
                else
                    echo "$m $n round $r failed"
                    tail -5 /tmp/av_out.txt
                fi
            done; done; done
            ;;
        heldbwd) perf_rounds "${SUSTAIN:-2}" "^held " ;;
        held)
            for n in $names; do
                echo "-- $n"
                timeout 240 python3 bench/attention_table.py --dump "$dir/$n" --sustain 2 ${HELD_ONLY:+--only "$HELD_ONLY"} 2>&1 | sed -n '/^Sustained/,$p' || true
            done
            ;;
        *) echo "attention_variants: unknown phase '$phase'" >&2; exit 2 ;;
        esac
    done
    ;;
*) usage ;;
esac
