//! End-to-end tests across crates, in ONE test binary: every test binary that reaches the
//! compiler links LLVM statically, so they are modules of this crate rather than files of
//! their own.

mod activation_checkpoint;
mod artifact_cpu;
mod artifact_mesh;
mod async_tp;
mod block_gradcheck;
mod checkpoint_e2e;
mod common;
mod compute_copies;
mod distributed;
mod example_files;
mod filetests;
mod float8;
mod fusion;
mod initial_loss;
mod job_config;
mod launch;
mod manifest_mutation;
mod mesh_checkpoint;
mod nonfinite;
mod ptx_presets;
mod readme;
mod text_data;
mod train_debug;
mod train_graph;
mod validation;
