//! Lowering of fused kernel groups to MLIR (melior) and PTX for sm_90a.
//!
//! Nothing lives here yet: kernel codegen arrives with the compile-pipeline issue. The crate
//! exists so the workspace has its final shape and `runtime` can be checked never to depend on it.
