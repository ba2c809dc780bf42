#!/usr/bin/env bash
# Install what titan needs on a fresh Debian 12 machine (idempotent): a Rust toolchain (>= 1.95),
# LLVM/MLIR 22 for the kernel code generator (melior), lld for fast links, and ptxas (PyPI
# `nvidia-cuda-nvcc`) to validate the emitted PTX. No GPU is needed.
set -euo pipefail

need_rust=1
if command -v cargo >/dev/null 2>&1; then
    ver=$(rustc --version | awk '{print $2}')
    major=${ver%%.*}; rest=${ver#*.}; minor=${rest%%.*}
    if [ "$major" -gt 1 ] || { [ "$major" -eq 1 ] && [ "$minor" -ge 95 ]; }; then
        need_rust=0
    fi
fi

apt_install() {
    local missing=()
    for p in "$@"; do dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p"); done
    [ ${#missing[@]} -eq 0 ] && return 0
    local sudo=""
    [ "$(id -u)" -ne 0 ] && sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}"
}

if command -v apt-get >/dev/null 2>&1; then
    apt_install build-essential pkg-config ca-certificates curl python3-pip \
        llvm-22-dev libmlir-22-dev mlir-22-tools libpolly-22-dev clang-22 lld-22 \
        libzstd-dev libz3-dev libxml2-dev zlib1g-dev
fi

# ptxas for sm_90a, from PyPI; runs without a GPU.
if ! python3 -c "import pathlib, nvidia; assert any(pathlib.Path(p, 'cu13/bin/ptxas').exists() or pathlib.Path(p, 'cuda_nvcc/bin/ptxas').exists() for p in nvidia.__path__)" >/dev/null 2>&1; then
    python3 -m pip install --quiet --disable-pip-version-check nvidia-cuda-nvcc \
        || python3 -m pip install --quiet --disable-pip-version-check --break-system-packages nvidia-cuda-nvcc
fi

if [ "$need_rust" -eq 1 ]; then
    if command -v rustup >/dev/null 2>&1; then
        rustup toolchain install 1.95 --profile minimal && rustup default 1.95
    else
        echo "setup: installing Rust with rustup (https://rustup.rs)" >&2
        curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95
        # shellcheck disable=SC1091
        . "$HOME/.cargo/env"
    fi
fi
