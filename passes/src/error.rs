//! Typed pass errors: what kind of failure ([`PassErrorKind`]), the message, and the node,
//! argument or output it is about ([`Loc`]), so a driver can point at the source line when the
//! graph came from text. Passes build a [`PassDiag`]; the pass manager turns it into a
//! [`PassError`](crate::PassError) naming the pass.

use std::fmt;

use titan_ir::Graph;
use titan_ir::diag::Diagnostic;
use titan_ir::parse::SourceMap;
use titan_ir::verify::{Loc, VerifyError, to_diagnostics};

/// Why a pass refused a graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PassErrorKind {
    /// The graph uses something titan does not implement yet (a VJP, a sharding pattern).
    Unsupported,
    /// The graph is not in the state the pass needs: an earlier pass has not run (no gradients
    /// for `adamw`), or the graph lacks what the pass works on (no mesh for `shard-tp`).
    Precondition,
    /// The graph is malformed for this pass, or the pass produced an ill-typed node (a bug).
    Invalid,
}

impl PassErrorKind {
    pub fn name(self) -> &'static str {
        match self {
            PassErrorKind::Unsupported => "unsupported",
            PassErrorKind::Precondition => "precondition",
            PassErrorKind::Invalid => "invalid",
        }
    }
}

impl fmt::Display for PassErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A problem a pass found: its kind, the message (a whole sentence saying what to change) and,
/// when it is about one part of the graph, where.
#[derive(Clone, Debug, PartialEq)]
pub struct PassDiag {
    pub kind: PassErrorKind,
    pub message: String,
    pub at: Option<Loc>,
}

impl PassDiag {
    pub fn new(kind: PassErrorKind, message: impl Into<String>) -> PassDiag {
        PassDiag { kind, message: message.into(), at: None }
    }

    pub fn unsupported(message: impl Into<String>) -> PassDiag {
        PassDiag::new(PassErrorKind::Unsupported, message)
    }

    pub fn precondition(message: impl Into<String>) -> PassDiag {
        PassDiag::new(PassErrorKind::Precondition, message)
    }

    pub fn invalid(message: impl Into<String>) -> PassDiag {
        PassDiag::new(PassErrorKind::Invalid, message)
    }

    /// Locate the problem at `loc`, unless a more precise location is already known.
    pub fn at(mut self, loc: Loc) -> PassDiag {
        self.at.get_or_insert(loc);
        self
    }

    /// Prefix the message (`backward of node n3 (`linear`): ...`), keeping kind and location.
    pub fn context(mut self, prefix: impl fmt::Display) -> PassDiag {
        self.message = format!("{prefix}: {}", self.message);
        self
    }
}

/// Errors of the builder and type inference are strings: a pass that produced them built an
/// ill-typed node or was handed an ill-typed graph.
impl From<String> for PassDiag {
    fn from(message: String) -> PassDiag {
        PassDiag::invalid(message)
    }
}

impl From<&str> for PassDiag {
    fn from(message: &str) -> PassDiag {
        PassDiag::invalid(message)
    }
}

impl fmt::Display for PassDiag {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Where a pass error points, with the location in words for output without source text.
#[derive(Clone, Debug, PartialEq)]
pub struct PassLoc {
    pub loc: Loc,
    /// `in @layer, node n3 (`linear`)`, described on the graph the pass failed on.
    pub place: String,
    /// The location's ids still name the parts of the pipeline's input graph (no pass before
    /// the failing one renumbered nodes), so a source map of that input can point at its line.
    pub input_ids: bool,
}

impl PassLoc {
    pub fn new(g: &Graph, loc: Loc, input_ids: bool) -> PassLoc {
        PassLoc { loc, place: VerifyError::new(g, loc, "").place, input_ids }
    }
}

/// `message` about `at` as a diagnostic of the parsed source (`file:line:col` and a caret when
/// rendered), `map` being the source map of the pipeline's input.
pub fn pass_diagnostic(message: &str, at: &PassLoc, map: &SourceMap) -> Diagnostic {
    let e = VerifyError { loc: at.loc, message: message.to_string(), place: at.place.clone() };
    to_diagnostics(&[e], Some(map)).pop().unwrap_or_else(|| Diagnostic::new(message, None))
}

/// A pass that partitions or synchronizes over the mesh was given a graph without one.
pub(crate) fn no_mesh() -> PassDiag {
    PassDiag::precondition(
        "the graph's meta names no device mesh; give one (`titanc opt --mesh tp=2,dp_shard=2`, `titanc lower --tp 2`, or meta `world_size`, `mesh_dp_replicate`, `mesh_dp_shard` and `mesh_tp`)",
    )
}
