#!/usr/bin/env bash
# The CUDA backend's GPU checks, prepared on a build machine (no GPU, no CUDA needed) and run on
# a GPU machine that has the NVIDIA driver and the CUDA 13 libraries but no Rust or LLVM.
#
#   tools/cuda_check.sh prepare [DIR]   # here: release binaries + artifacts into DIR (default gpu/)
#   tools/cuda_check.sh run [DIR]       # there, from the repository root: tests, a run, timings
#
# DIR holds: the runtime's `tests/cuda.rs` test binary, `titan-run`, the debug artifact (every
# kernel tested one by one against the CPU backend), a no-attention variant of the debug model
# (every kernel has GPU code, so whole steps run on the GPU and are compared with the CPU
# backend) and, with TIME=1, an 8B-shaped 4-layer artifact whose kernels are timed one by one.
# Logs go to $OUT (or DIR/logs).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-gpu}

case "$mode" in
prepare)
    mkdir -p "$dir"
    if [ -d .git ] && ! grep -qx "/$dir/" .git/info/exclude 2>/dev/null; then
        mkdir -p .git/info && echo "/$dir/" >>.git/info/exclude
    fi
    cargo build --release -p titan-compiler -p titan-runtime
    test_bin=$(cargo test --release -p titan-runtime --test cuda --no-run --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
    [ -n "$test_bin" ] || { echo "error: could not find the cuda test binary" >&2; exit 1; }
    cp "$test_bin" "$dir/cuda-test"
    cp target/release/titan-run "$dir/titan-run"
    strip "$dir/cuda-test" "$dir/titan-run" 2>/dev/null || true
    target/release/titanc build examples/llama3-debug.ir -o "$dir/debug"
    # The debug model with attention taken out (the rest of the layer kept): every kernel has PTX.
    sed -e '/%attn, %lse = attention/d' -e '/%21 = reshape(%attn)/d' \
        -e 's/linear(%21, %wo)/linear(%xn, %wo)/' \
        -e 's/%h2 = add(%h, %22) : bf16\[batch, seq, 64\]/%qr = reshape(%q_rot) : bf16[batch, seq, 64]\n    %h1 = add(%h, %qr) : bf16[batch, seq, 64]\n    %h2 = add(%h1, %22) : bf16[batch, seq, 64]/' \
        -e 's/graph @llama3_debug {/graph @llama3_noattn {/' \
        examples/llama3-debug.ir >"$dir/noattn.ir"
    target/release/titanc build "$dir/noattn.ir" -o "$dir/noattn"
    if [ "${TIME:-0}" = 1 ]; then
        target/release/titanc new llama3 --preset 8b --n-layers 4 -o "$dir/8b4.ir"
        target/release/titanc build "$dir/8b4.ir" -o "$dir/8b4"
    fi
    du -sh "$dir"
    echo "prepared $dir; on the GPU machine run: tools/cuda_check.sh run $dir"
    ;;
run)
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # NCCL: the system's, else the one PyTorch's wheels ship (nvidia-nccl).
    nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
    [ -n "$nccl_dir" ] && export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl_dir
    out=${OUT:-$dir/logs}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv || true
    rc=0
    echo "== kernel-by-kernel differential tests and whole steps against the CPU backend"
    TITAN_CUDA_ARTIFACT="$dir/debug" TITAN_CUDA_STEP_ARTIFACT="$dir/noattn" timeout 300 \
        "$dir/cuda-test" --test-threads=1 --nocapture >"$out/tests.log" 2>&1 || rc=1
    cat "$out/tests.log"
    echo "== titan-run --backend cuda"
    timeout 120 "$dir/titan-run" "$dir/noattn" --backend cuda --steps 50 --log-every 10 2>&1 | tee "$out/run.log" || rc=1
    echo "== --resume on the GPU: 10 steps straight vs 5 steps, checkpoint, resume to 10"
    ck=$(mktemp -d)
    timeout 120 "$dir/titan-run" "$dir/debug" --backend cuda --steps 10 --metrics "$ck/straight.jsonl" --log-every 5 >"$out/resume.log" 2>&1 || rc=1
    timeout 120 "$dir/titan-run" "$dir/debug" --backend cuda --steps 5 --checkpoint-dir "$ck/ckpt" --metrics "$ck/resumed.jsonl" --log-every 5 >>"$out/resume.log" 2>&1 || rc=1
    timeout 120 "$dir/titan-run" "$dir/debug" --backend cuda --steps 10 --resume "$ck/ckpt" --metrics "$ck/resumed.jsonl" --log-every 5 >>"$out/resume.log" 2>&1 || rc=1
    python3 - "$ck/straight.jsonl" "$ck/resumed.jsonl" <<'PY' || rc=1
import json, sys
a = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1]))}
b = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2]))}
assert sorted(a) == list(range(1, 11)) and sorted(b) == list(range(1, 11)), (sorted(a), sorted(b))
worst = max(abs(a[s] - b[s]) for s in a)
bitwise = all(a[s] == b[s] for s in a)
print(f"resume on the GPU: steps 1-10 straight vs 1-5 + resume 6-10: max |dloss| {worst:.3g}, bitwise equal: {bitwise}")
sys.exit(0 if worst <= 1e-6 else 1)
PY
    rm -rf "$ck"
    if [ -d "$dir/8b4" ]; then
        echo "== kernel times (8B shape, 4 layers)"
        TITAN_CUDA_TIME_ARTIFACT="$dir/8b4" timeout 300 "$dir/cuda-test" --test-threads=1 --nocapture kernel_times >"$out/times.log" 2>&1 || rc=1
        cat "$out/times.log"
    fi
    exit $rc
    ;;
*)
    echo "usage: tools/cuda_check.sh prepare|run [DIR]" >&2
    exit 2
    ;;
esac
