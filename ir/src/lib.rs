//! titan's graph IR: types, ops, graphs, the text format, the verifier and the reference
//! interpreter (the executable spec every backend is compared against).

pub mod artifact;
pub mod attr;
pub mod diag;
pub mod dtype;
pub mod flags;
pub mod float8;
pub mod fp8;
pub mod graph;
pub mod identity;
pub mod infer;
pub mod interp;
pub mod job_config;
pub mod op;
pub mod parse;
pub mod placement;
pub mod prefetch;
pub mod print;
pub mod shape;
pub mod verify;

pub use attr::{AttrValue, Attrs};
pub use dtype::DType;
pub use graph::{
    Arg, ArgKind, BlockId, Builder, COMPUTE_COPY_SUFFIX, Graph, Init, Node, NodeId, Output, ParamInfo, Region, Update, Value, ValueData, ValueDef,
};
pub use op::{
    AdamWConfig, BinaryOp, CollectiveReduce, DecayKind, Float8Recipe, KernelKind, LrSchedule, Op, ReduceKind, RopeConfig, RopeLayout, RopeScaling, UnaryOp,
};
pub use parse::{RegionSpans, SourceMap, parse, parse_and_verify, parse_and_verify_with_map, parse_file};
pub use placement::{Mesh, MeshDim, Placement};
pub use shape::{Dim, DimTable, TensorType};
pub use verify::{Loc, RegionRef, VerifyError, to_diagnostics, verify};
