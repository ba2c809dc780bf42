//! `titanc opt`: run named passes on a graph given as text and print the result, like
//! `mlir-opt` or `clif-util test`. This is the library side, shared by the `titanc opt`
//! command and the per-pass filetests (`tests/filetests/passes/<pass>/*.ir`).

use titan_ir::diag::SourceError;
use titan_ir::print::print_graph;
use titan_ir::{Mesh, MeshDim};

use crate::pipeline::{PipelineOptions, PipelineReport, lookup_passes, run_pipeline};
use crate::{PassError, TrainOptions};

/// What to run: pass names in order, the mesh to give the graph, verification and the
/// training options the optimizer pass bakes in.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptRequest {
    pub passes: Vec<String>,
    /// Written into the graph's `meta` before the passes run (replacing any mesh it names).
    pub mesh: Option<Mesh>,
    /// Verify the input and the graph after every pass, naming the pass that broke it.
    pub verify_each: bool,
    pub train: TrainOptions,
    /// Written into the graph's `meta` before the passes run (`--ac`; see
    /// [`crate::activation_checkpoint`]).
    pub ac: Option<crate::activation_checkpoint::AcPolicy>,
    /// Written into the graph's `meta` before the passes run (`--async-tp`; see
    /// [`crate::async_tp`]).
    pub async_tp: Option<crate::async_tp::AsyncTpMode>,
}

/// The graph after the passes, as text, and what each pass reported.
#[derive(Clone, Debug)]
pub struct OptOutput {
    pub text: String,
    pub report: PipelineReport,
}

/// Why `opt` produced no graph.
#[derive(Debug, thiserror::Error)]
pub enum OptError {
    /// The input does not parse or verify, or a pass refused it; rendered against the source
    /// (`file:line:col` and a caret where the error has a location).
    #[error(transparent)]
    Source(#[from] SourceError),
    /// A pass error without a usable source location, or a pass-manager error.
    #[error("{0}")]
    Pass(PassError),
    /// A bad `--passes` or `--mesh` value.
    #[error("{0}")]
    Usage(String),
}

/// Split `cse,dce` into pass names (spaces around names allowed, empty names refused).
pub fn parse_pass_list(list: &str) -> Result<Vec<String>, OptError> {
    let names: Vec<String> = list.split(',').map(|s| s.trim().to_string()).collect();
    if names.iter().any(String::is_empty) {
        return Err(OptError::Usage(format!("`--passes {list}`: give pass names separated by commas, e.g. `--passes cse,dce` (`titanc passes` lists them)")));
    }
    Ok(names)
}

/// Parse `tp=2,dp_shard=2` (any of `dp_replicate`, `dp_shard`, `tp`; the others are 1).
pub fn parse_mesh_spec(spec: &str) -> Result<Mesh, OptError> {
    let mut sizes = [1u32; 3];
    let mut seen = [false; 3];
    for part in spec.split(',') {
        let usage = |why: String| OptError::Usage(format!("`--mesh {spec}`: {why}; write it as `tp=2,dp_shard=2` with dims dp_replicate, dp_shard and tp"));
        let (key, value) = part.split_once('=').ok_or_else(|| usage(format!("`{part}` is not `dim=size`")))?;
        let dim = MeshDim::ALL.into_iter().find(|m| m.name() == key.trim()).ok_or_else(|| usage(format!("unknown mesh dim `{}`", key.trim())))?;
        let size: u32 = value.trim().parse().ok().filter(|&n| n >= 1).ok_or_else(|| usage(format!("`{}` must be a size >= 1", value.trim())))?;
        if std::mem::replace(&mut seen[dim.index()], true) {
            return Err(usage(format!("`{key}` is given twice")));
        }
        sizes[dim.index()] = size;
    }
    Ok(Mesh::new(sizes[0], sizes[1], sizes[2]))
}

/// Parse and verify `src` (named `file` in messages), give it `req.mesh`, run `req.passes` and
/// print the result. Errors point into `src` where they can.
pub fn run_opt(file: &str, src: &str, req: &OptRequest) -> Result<OptOutput, OptError> {
    let (mut g, map) = titan_ir::parse_and_verify_with_map(file, src)?;
    let names: Vec<&str> = req.passes.iter().map(String::as_str).collect();
    let passes = lookup_passes(&names).map_err(OptError::Pass)?;
    if let Some(mesh) = &req.mesh {
        mesh.write_meta(&mut g);
    }
    if let Some(policy) = req.ac {
        policy.write_meta(&mut g);
    }
    if let Some(mode) = req.async_tp {
        crate::async_tp::enable_async_tp(&mut g, mode);
    }
    let popts = PipelineOptions { verify_each: req.verify_each, ..PipelineOptions::default() };
    let report = run_pipeline(&mut g, &passes, &req.train, &popts).map_err(|e| match e.source_diagnostic(Some(&map)) {
        Some(diag) => OptError::Source(SourceError { file: file.to_string(), source_text: src.to_string(), diagnostics: vec![diag] }),
        None => OptError::Pass(e),
    })?;
    Ok(OptOutput { text: print_graph(&g), report })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mesh_specs_name_every_dim_and_refuse_the_rest() {
        assert_eq!(parse_mesh_spec("tp=2,dp_shard=4").expect("valid").sizes, [1, 4, 2]);
        assert_eq!(parse_mesh_spec(" dp_replicate = 2 ").expect("valid").sizes, [2, 1, 1]);
        for (bad, why) in [("tp", "is not `dim=size`"), ("pp=2", "unknown mesh dim `pp`"), ("tp=0", "must be a size >= 1"), ("tp=2,tp=4", "given twice")] {
            let e = parse_mesh_spec(bad).expect_err(bad).to_string();
            assert!(e.contains(why), "{bad}: {e}");
        }
        assert!(parse_pass_list("cse,,dce").is_err());
        assert_eq!(parse_pass_list("cse, dce").expect("valid"), ["cse", "dce"]);
    }
}
