//! Whether this machine runs the GPU tests (`tests/cuda.rs`, `tests/cuda_startup.rs`). libtest
//! cannot skip a test at run time, so without a CUDA device the build sets `cfg(titan_no_cuda)`
//! and those tests are compiled as ignored ("skipped: no CUDA device"): the summary counts them
//! as ignored instead of reporting a silent `ok`.
//!
//! `TITAN_GPU_TESTS=1` turns them on (a build machine preparing the test binary for a GPU
//! machine, `tools/cuda_check.sh prepare`), `TITAN_GPU_TESTS=0` off; unset, they are on when the
//! NVIDIA driver's device node `/dev/nvidia0` exists. The choice is made when this script runs
//! (the first build, or when `TITAN_GPU_TESTS` changes); `cargo test -p titan-runtime --
//! --ignored` runs ignored tests anyway.

fn main() {
    println!("cargo::rustc-check-cfg=cfg(titan_no_cuda)");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=TITAN_GPU_TESTS");
    let gpu = match std::env::var("TITAN_GPU_TESTS").as_deref() {
        Ok("1") => true,
        Ok("0") => false,
        Ok(other) => {
            println!("cargo::warning=TITAN_GPU_TESTS={other} is neither 0 nor 1; looking for /dev/nvidia0 instead");
            std::path::Path::new("/dev/nvidia0").exists()
        }
        Err(_) => std::path::Path::new("/dev/nvidia0").exists(),
    };
    if !gpu {
        println!("cargo::rustc-cfg=titan_no_cuda");
    }
}
