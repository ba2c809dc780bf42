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
# With MESH=1 it also holds SPMD builds of the debug model for two ranks (tp 2, dp_shard 2,
# dp_replicate 2, and tp 2 with async TP's ring), which `tools/cuda_check.sh mesh DIR` runs on a
# machine with two GPUs: NCCL across GPUs against one GPU and against the CPU simulated mesh,
# and a rank killed mid-run;
# with BIG=1 also an 8B-shaped 4-layer model on one GPU, tp 2 and dp_shard 2 (losses, tok/s).
# Logs go to $OUT (or DIR/logs).
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
dir=${2:-gpu}

# The GPU machine's libraries, and $out for the logs.
gpu_env() {
    export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    # NCCL: the system's, else the one PyTorch's wheels ship (nvidia-nccl).
    nccl_dir=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
    if [ -n "$nccl_dir" ]; then export LD_LIBRARY_PATH=$LD_LIBRARY_PATH:$nccl_dir; fi
    # NVLink multicast stays off on shared hosts (launched ranks inherit this).
    export NCCL_NVLS_ENABLE=0
    out=${OUT:-$dir/logs}
    mkdir -p "$out"
}

case "$mode" in
prepare)
    mkdir -p "$dir"
    if [ -d .git ] && ! grep -qx "/$dir/" .git/info/exclude 2>/dev/null; then
        mkdir -p .git/info && echo "/$dir/" >>.git/info/exclude
    fi
    # This machine has no GPU: compile the GPU tests as runnable (runtime/build.rs).
    export TITAN_GPU_TESTS=1
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
    if [ "${BIG:-0}" = 1 ]; then
        # 8B dims, 4 layers, batch 2 x seq 4096: one GPU, tp 2, dp_shard 2 (with and without the
        # next layer's gathers prefetched).
        target/release/titanc new llama3 --preset 8b --n-layers 4 --batch-size 2 --seq-len 4096 -o "$dir/8b4s.ir"
        for cfg in "one:" "tp2:--tp 2" "dps2:--dp-shard 2" "dps2-noprefetch:--dp-shard 2 --disable-prefetch-next-layer"; do
            # shellcheck disable=SC2086
            target/release/titanc build "$dir/8b4s.ir" -o "$dir/big-${cfg%%:*}" ${cfg#*:} >/dev/null
        done
    fi
    if [ "${MESH:-0}" = 1 ]; then
        for cfg in "tp2:--tp 2" "dps2:--dp-shard 2" "dpr2:--dp-replicate 2" "tp2-nolp:--tp 2 --disable-loss-parallel" "tp2-async:--tp 2 --async-tp all"; do
            # shellcheck disable=SC2086
            target/release/titanc build examples/llama3-debug.ir -o "$dir/mesh-${cfg%%:*}" ${cfg#*:} >/dev/null
        done
    fi
    du -sh "$dir"
    echo "prepared $dir; on the GPU machine run: tools/cuda_check.sh run $dir"
    ;;
run)
    gpu_env
    nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv || true
    rc=0
    echo "== kernel-by-kernel differential tests and whole steps against the CPU backend"
    TITAN_CUDA_ARTIFACT="$dir/debug" TITAN_CUDA_STEP_ARTIFACT="$dir/noattn" timeout 300 \
        "$dir/cuda-test" --test-threads=1 --nocapture >"$out/tests.log" 2>&1 || rc=1
    cat "$out/tests.log"
    if [ -d "$dir/mesh-tp2" ]; then
        echo "== the kernels of one tp 2 rank (the vocab-parallel loss) against the CPU backend"
        TITAN_CUDA_ARTIFACT="$dir/mesh-tp2" timeout 300 "$dir/cuda-test" --test-threads=1 --nocapture every_generated_kernel \
            >"$out/tests-tp2.log" 2>&1 || rc=1
        grep -E "cross_entropy|tested|test result|FAIL|panicked" "$out/tests-tp2.log" || true
    fi
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
    echo "== validation on the GPU (--val-data): the CPU backend's validation losses, training unchanged by it"
    v=$(mktemp -d)
    val=(--steps 6 --val-data examples/data/tiny_corpus.txt --val-every 2 --val-steps 2 --log-every 2)
    timeout 120 "$dir/titan-run" "$dir/debug" --backend cuda "${val[@]}" --metrics "$v/cuda.jsonl" >"$out/val.log" 2>&1 || rc=1
    timeout 120 "$dir/titan-run" "$dir/debug" --backend cuda --steps 6 --metrics "$v/cuda-noval.jsonl" >>"$out/val.log" 2>&1 || rc=1
    timeout 300 "$dir/titan-run" "$dir/debug" --backend cpu "${val[@]}" --metrics "$v/cpu.jsonl" >>"$out/val.log" 2>&1 || rc=1
    grep -E "^validate step|eval step" "$out/val.log" || tail -20 "$out/val.log"
    python3 - "$v/cuda.jsonl" "$v/cuda-noval.jsonl" "$v/cpu.jsonl" <<'PY' || rc=1
import json, sys
def load(p):
    recs = list(map(json.loads, open(p)))
    return ({r["step"]: r["loss"] for r in recs if "loss" in r}, {r["step"]: r["validation_metrics/loss"] for r in recs if "validation_metrics/loss" in r})
(gt, gv), (nt, _), (ct, cv) = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3])
assert sorted(gv) == [1, 2, 4, 6] and sorted(gv) == sorted(cv), (sorted(gv), sorted(cv))
unchanged = all(gt[s] == nt[s] for s in nt) and sorted(gt) == sorted(nt)
worst = max(abs(gv[s] - cv[s]) / (2e-2 * max(1.0, abs(cv[s]))) for s in gv)
print(f"validation on the GPU: {[round(gv[s], 4) for s in sorted(gv)]} vs the CPU backend {[round(cv[s], 4) for s in sorted(cv)]}: worst share of the tolerance 2e-2*max(1,loss) {worst:.3f}; training losses with validation bitwise those without: {unchanged}")
sys.exit(0 if worst <= 1 and unchanged else 1)
PY
    rm -rf "$v"
    if [ -d "$dir/8b4" ]; then
        echo "== kernel times (8B shape, 4 layers)"
        TITAN_CUDA_TIME_ARTIFACT="$dir/8b4" timeout 300 "$dir/cuda-test" --test-threads=1 --nocapture kernel_times >"$out/times.log" 2>&1 || rc=1
        cat "$out/times.log"
    fi
    exit $rc
    ;;
mesh)
    # Two ranks on two GPUs (NCCL) against one GPU and against the CPU simulated mesh.
    gpu_env
    nvidia-smi --query-gpu=index,name,memory.used --format=csv || true
    nvidia-smi topo -m || true
    rc=0
    steps=${STEPS:-20}
    m=$(mktemp -d)
    timeout 120 "$dir/titan-run" "$dir/debug" --backend cuda --steps "$steps" --metrics "$m/single.jsonl" --log-every 10 >"$out/mesh-single.log" 2>&1 || { rc=1; cat "$out/mesh-single.log"; }
    for a in "$dir"/mesh-*; do
        [ -d "$a" ] || continue
        name=$(basename "$a")
        echo "== $name: 2 GPUs (NCCL) vs the CPU simulated mesh vs one GPU"
        timeout 180 "$dir/titan-run" "$a" --backend cuda --nproc-per-node 2 --steps "$steps" --metrics "$m/$name.gpu.jsonl" --log-every 10 >"$out/$name.gpu.log" 2>&1 || { rc=1; tail -30 "$out/$name.gpu.log"; }
        timeout 180 "$dir/titan-run" "$a" --backend cpu --steps "$steps" --metrics "$m/$name.cpu.jsonl" --log-every 10 >"$out/$name.cpu.log" 2>&1 || { rc=1; tail -30 "$out/$name.cpu.log"; }
        grep -h "titan-run: artifact" "$out/$name.gpu.log" | head -1 || true
        python3 - "$m/$name.gpu.jsonl" "$m/$name.cpu.jsonl" "$m/single.jsonl" "$steps" <<'PY' || rc=1
import json, os, sys
def load(p):
    return {r["step"]: r["loss"] for r in map(json.loads, open(p))} if os.path.exists(p) else {}
g, c, s, n = load(sys.argv[1]), load(sys.argv[2]), load(sys.argv[3]), int(sys.argv[4])
if sorted(g) != list(range(1, n + 1)):
    print(f"  2-GPU run logged steps {sorted(g)[:5]}..., want 1..{n}"); sys.exit(1)
tol = lambda l: 2e-2 * max(1.0, abs(l))
vs_cpu = max(abs(g[k] - c[k]) for k in g) if c else float("nan")
vs_one = max(abs(g[k] - s[k]) for k in g) if s else float("nan")
worst = max(max(abs(g[k] - c.get(k, 1e9)), abs(g[k] - s.get(k, 1e9))) / tol(g[k]) for k in g)
print(f"  loss {g[1]:.4f} -> {g[n]:.4f}; max |dloss| vs CPU simulated mesh {vs_cpu:.3g}, vs one GPU {vs_one:.3g}; worst share of the tolerance 2e-2*max(1,loss): {worst:.3f}")
sys.exit(0 if worst <= 1 else 1)
PY
    done
    echo "== checkpoint and --resume on 2 GPUs (tp 2): 10 steps straight vs 5, checkpoint, resume to 10"
    ck=$(mktemp -d)
    a="$dir/mesh-tp2"
    timeout 120 "$dir/titan-run" "$a" --backend cuda --nproc-per-node 2 --steps 10 --metrics "$ck/straight.jsonl" >"$out/mesh-resume.log" 2>&1 || rc=1
    timeout 120 "$dir/titan-run" "$a" --backend cuda --nproc-per-node 2 --steps 5 --checkpoint-dir "$ck/ckpt" --metrics "$ck/resumed.jsonl" >>"$out/mesh-resume.log" 2>&1 || rc=1
    timeout 120 "$dir/titan-run" "$a" --backend cuda --nproc-per-node 2 --steps 10 --resume "$ck/ckpt" --metrics "$ck/resumed.jsonl" >>"$out/mesh-resume.log" 2>&1 || rc=1
    python3 - "$ck/straight.jsonl" "$ck/resumed.jsonl" <<'PY' || { rc=1; tail -20 "$out/mesh-resume.log"; }
import json, sys
a = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[1]))}
b = {r["step"]: r["loss"] for r in map(json.loads, open(sys.argv[2]))}
assert sorted(a) == list(range(1, 11)) and sorted(b) == list(range(1, 11)), (sorted(a), sorted(b))
worst = max(abs(a[s] - b[s]) for s in a)
print(f"  max |dloss| {worst:.3g}, bitwise equal: {all(a[s] == b[s] for s in a)}")
sys.exit(0 if worst <= 1e-6 else 1)
PY
    rm -rf "$ck"
    if [ -d "$dir/big-one" ]; then
        # A model of real size (built with BIG=1): 2 GPUs against one, losses and throughput.
        echo "== $(basename "$dir")/big-*: one GPU vs 2 GPUs"
        timeout 300 "$dir/titan-run" "$dir/big-one" --backend cuda --steps 12 --metrics "$m/big-one.jsonl" --log-every 4 >"$out/big-one.log" 2>&1 || { rc=1; tail -20 "$out/big-one.log"; }
        grep -E "^step: *12 " "$out/big-one.log" | sed 's/^/  one GPU: /' || true
        for a in "$dir"/big-*; do
            name=$(basename "$a")
            [ "$name" = big-one ] && continue
            timeout 300 "$dir/titan-run" "$a" --backend cuda --nproc-per-node 2 --steps 12 --metrics "$m/$name.jsonl" --log-every 4 >"$out/$name.log" 2>&1 || { rc=1; tail -20 "$out/$name.log"; }
            grep -E "^step: *12 " "$out/$name.log" | sed "s/^/  $name: /" || true
            python3 - "$m/$name.jsonl" "$m/big-one.jsonl" <<'PY' || rc=1
import json, os, sys
load = lambda p: {r["step"]: r["loss"] for r in map(json.loads, open(p))} if os.path.exists(p) else {}
g, s = load(sys.argv[1]), load(sys.argv[2])
if not g or sorted(g) != sorted(s):
    print(f"  steps {sorted(g)} vs {sorted(s)}"); sys.exit(1)
worst = max(abs(g[k] - s[k]) for k in g)
share = max(abs(g[k] - s[k]) / (2e-2 * max(1.0, abs(s[k]))) for k in g)
print(f"  loss {g[1]:.4f} -> {g[max(g)]:.4f}; max |dloss| vs one GPU {worst:.3g} ({share:.3f} of the tolerance 2e-2*max(1,loss))")
sys.exit(0 if share <= 1 else 1)
PY
        done
    fi
    if [ -d "$dir/big-dps2" ]; then
        echo "== --profile on 2 GPUs (big-dps2): kernels, collectives and the compute stream's waits"
        timeout 300 "$dir/titan-run" "$dir/big-dps2" --backend cuda --nproc-per-node 2 --steps 4 --profile >"$out/big-profile.log" 2>&1 || rc=1
        grep -A 14 "collectives, mean of" "$out/big-profile.log" || tail -20 "$out/big-profile.log"
        grep "\[rank 1\] titan-run: --profile" "$out/big-profile.log" || true
    fi
    echo "== validation on 2 GPUs (mesh-tp2, --val-data): the CPU simulated mesh's validation losses"
    v=$(mktemp -d)
    val=(--steps 4 --val-data examples/data/tiny_corpus.txt --val-every 2 --val-steps 2)
    timeout 180 "$dir/titan-run" "$dir/mesh-tp2" --backend cuda --nproc-per-node 2 "${val[@]}" --metrics "$v/gpu.jsonl" >"$out/mesh-val.log" 2>&1 || rc=1
    timeout 180 "$dir/titan-run" "$dir/mesh-tp2" --backend cpu "${val[@]}" --metrics "$v/cpu.jsonl" >>"$out/mesh-val.log" 2>&1 || rc=1
    python3 - "$v/gpu.jsonl" "$v/cpu.jsonl" <<'PY' || { rc=1; tail -20 "$out/mesh-val.log"; }
import json, sys
load = lambda p: {r["step"]: r["validation_metrics/loss"] for r in map(json.loads, open(p)) if "validation_metrics/loss" in r}
g, c = load(sys.argv[1]), load(sys.argv[2])
assert sorted(g) == [1, 2, 4] and sorted(g) == sorted(c), (sorted(g), sorted(c))
worst = max(abs(g[s] - c[s]) / (2e-2 * max(1.0, abs(c[s]))) for s in g)
print(f"  validation {[round(g[s], 4) for s in sorted(g)]} vs the CPU simulated mesh {[round(c[s], 4) for s in sorted(c)]}: worst share of the tolerance {worst:.3f}")
sys.exit(0 if worst <= 1 else 1)
PY
    rm -rf "$v"
    echo "== a rank killed mid-run: the other rank must exit with an error, not hang"
    a="$dir/mesh-dps2"
    for victim in 1 0; do
        port=$((29500 + RANDOM % 1000))
        survivor=$((1 - victim))
        # The victim runs bare (a `timeout` wrapper would take the SIGKILL and leave it running).
        for r in 0 1; do
            if [ "$r" = "$victim" ]; then
                RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port \
                    "$dir/titan-run" "$a" --backend cuda --steps 1000000 --log-every 1000 >"$out/kill$victim.rank$r.log" 2>&1 &
                vpid=$!
            else
                RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r MASTER_ADDR=127.0.0.1 MASTER_PORT=$port timeout 100 \
                    "$dir/titan-run" "$a" --backend cuda --steps 1000000 --log-every 1000 >"$out/kill$victim.rank$r.log" 2>&1 &
                spid=$!
            fi
        done
        sleep 8
        kill -9 "$vpid" 2>/dev/null || true
        t0=$(date +%s)
        set +e
        wait "$spid"
        code=$?
        wait "$vpid" 2>/dev/null
        set -e
        t1=$(date +%s)
        echo "  rank $victim killed: rank $survivor exited with status $code $((t1 - t0)) s later:"
        tail -2 "$out/kill$victim.rank$survivor.log" | sed 's/^/    /'
        if [ "$code" = 0 ] || [ "$code" = 124 ]; then rc=1; echo "  FAILED: rank $survivor should exit with an error on its own"; fi
    done
    rm -rf "$m"
    exit $rc
    ;;
*)
    echo "usage: tools/cuda_check.sh prepare|run|mesh [DIR]" >&2
    exit 2
    ;;
esac
