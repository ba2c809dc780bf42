//! The manifest verifier: every field of `manifest.json` checked at load against the others,
//! against `graph.ir` and against the artifact's files, as the IR verifier checks IR. The first
//! problem is an [`ArtifactError::Invalid`] naming the field by its JSON path
//! (`manifest.json: buffers[12].offset: ...`), so a corrupt or hand-edited artifact is refused
//! before anything runs instead of training on wrong bytes.
//!
//! What is checked (`docs/artifact.md`, "What the loader checks"): hashes and target; the mesh,
//! the model `meta` and the `dims` against each other, against `graph.ir` and against the fed
//! buffers; every buffer's id, size, arena, alignment, bounds, feed, output and state (the
//! `init` spec parsed, finite and positive, and the one `graph.ir` initializes with); the arena
//! sizes and the peak; that no two buffers of a packed arena share a byte and no two buffers of
//! the `grads` or `activations` arena that are live at the same time do (lifetimes from
//! [`titan_ir::artifact::liveness`]); every kernel's id, unique name, files (PTX and cubin
//! present at their canonical paths), kind against its code, its GEMM descriptor, its
//! `graph.ir` kernel node and body, and its byte counts; the schedule's streams, loop counts,
//! carries and collective volumes; the mesh report.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Display;
use std::path::Path;

use titan_ir::artifact::liveness::{Lifetime, buffer_lifetimes};
use titan_ir::artifact::{Arena, ArtifactError, BufRef, BufferClass, GemmDesc, KERNEL_DIR, MANIFEST_FILE, Manifest, Step};
use titan_ir::{AttrValue, DType, Graph, Init, KernelKind, Op};

use crate::artifact::{arena_name, arena_of, class_name, tensor_bytes};

/// Alignment of every buffer offset and arena size.
pub const ALIGN: u64 = 256;
/// The arenas of a memory plan, in manifest order.
const ARENAS: [Arena; 4] = [Arena::Inputs, Arena::Params, Arena::OptimizerState, Arena::Activations];
/// The mesh dims titan builds, outermost first.
const MESH_DIMS: [&str; 3] = ["dp_replicate", "dp_shard", "tp"];
/// The step outputs titan-run reads.
const OUTPUTS: [&str; 3] = ["loss", "grad_norm", "lr"];
/// Threads per block and dynamic shared memory per block an sm_90 GPU allows.
const MAX_BLOCK_THREADS: u64 = 1024;
const MAX_SHARED_BYTES: u32 = 227 * 1024;

fn fail(path: impl Display, message: impl Display) -> ArtifactError {
    ArtifactError::Invalid(format!("{MANIFEST_FILE}: {path}: {message}"))
}

type Check = Result<(), ArtifactError>;

/// Verify `m` (read from `dir`) against itself, `graph` (its `graph.ir`) and the files in `dir`.
pub fn verify_manifest(m: &Manifest, graph: &Graph, dir: &Path) -> Check {
    check_header(m)?;
    check_mesh_and_model(m, graph)?;
    check_arenas(m)?;
    check_buffers(m, graph)?;
    check_plan_totals(m)?;
    check_placement(m)?;
    check_kernels(m, graph, dir)?;
    check_schedule(m, &writes_over_last_input(m, graph))?;
    check_report(m)
}

/// Verify the eval step `m.eval` against the training plan, its `eval.ir` and the files in `dir`:
/// ids, sizes, arenas and bounds of its buffers; its `param` and `input` buffers are the training
/// plan's (same state or feed, type, arena and offset); everything else is an `activation` in
/// the `activations` arena within `eval.activation_bytes`, no two of them share a byte while both
/// are live; one f32 `loss` output; kernels with unique `eval_` names, their bodies in `eval.ir`
/// and their files present; every step names existing kernels and buffers and writes only the
/// eval step's activations (so running it leaves the training state as it was).
pub fn verify_eval(m: &Manifest, eval_graph: &Graph, dir: &Path) -> Check {
    let Some(e) = &m.eval else { return Ok(()) };
    let arena_bytes: BTreeMap<Arena, u64> = m.memory.arenas.iter().map(|a| (a.arena, a.bytes)).collect();
    let act_arena = arena_bytes.get(&Arena::Activations).copied().unwrap_or(0);
    if e.activation_bytes > act_arena {
        return Err(fail("eval.activation_bytes", format!("{}, but the activations arena has {act_arena} bytes", e.activation_bytes)));
    }
    let mut loss = None;
    for (i, b) in e.buffers.iter().enumerate() {
        let at = |field: &str| format!("eval.buffers[{i}].{field}");
        if b.id as usize != i {
            return Err(fail(at("id"), format!("{}; an eval buffer's id is its position in `eval.buffers` ({i})", b.id)));
        }
        let bytes = tensor_bytes(b.dtype, &b.shape).ok_or_else(|| fail(at("shape"), format!("{:?} overflows", b.shape)))?;
        if b.bytes != bytes {
            return Err(fail(at("bytes"), format!("{}, but {}{:?} takes {bytes}", b.bytes, b.dtype, b.shape)));
        }
        if b.arena != arena_of(b.class) {
            return Err(fail(
                at("arena"),
                format!("`{}`, but a `{}` buffer lives in `{}`", arena_name(b.arena), class_name(b.class), arena_name(arena_of(b.class))),
            ));
        }
        let shared = match b.class {
            BufferClass::Param => {
                let name = b
                    .state
                    .as_ref()
                    .map(|s| s.name.as_str())
                    .ok_or_else(|| fail(at("state"), "missing; an eval param buffer names the training state it reads"))?;
                Some(m.buffers.iter().find(|t| t.class == BufferClass::Param && t.state.as_ref().is_some_and(|s| s.name == name)).ok_or_else(|| {
                    fail(at("state.name"), format!("`{name}` is no param buffer of the training plan; the eval step reads the training masters"))
                })?)
            }
            BufferClass::Input => {
                let feed = b
                    .feed
                    .as_deref()
                    .filter(|f| *f == "tokens" || *f == "targets")
                    .ok_or_else(|| fail(at("feed"), "an eval input is fed `tokens` or `targets`"))?;
                Some(
                    m.buffers
                        .iter()
                        .find(|t| t.feed.as_deref() == Some(feed))
                        .ok_or_else(|| fail(at("feed"), format!("no training buffer is fed `{feed}`")))?,
                )
            }
            BufferClass::Activation => {
                if b.offset % ALIGN != 0 || b.offset.checked_add(b.bytes).is_none_or(|end| end > e.activation_bytes) {
                    return Err(fail(
                        at("offset"),
                        format!(
                            "bytes {}..{} are not aligned or lie outside eval.activation_bytes ({})",
                            b.offset,
                            b.offset.saturating_add(b.bytes),
                            e.activation_bytes
                        ),
                    ));
                }
                None
            }
            c => return Err(fail(at("class"), format!("`{}`: the eval step has no gradients or optimizer state", class_name(c)))),
        };
        if let Some(t) = shared
            && (t.dtype, &t.shape, t.arena, t.offset) != (b.dtype, &b.shape, b.arena, b.offset)
        {
            return Err(fail(
                at("offset"),
                format!(
                    "{}{:?} at {} of `{}`, but the training buffer `{}` it shares is {}{:?} at {}",
                    b.dtype,
                    b.shape,
                    b.offset,
                    arena_name(b.arena),
                    t.name,
                    t.dtype,
                    t.shape,
                    t.offset
                ),
            ));
        }
        match b.output.as_deref() {
            None => {}
            Some("loss") if loss.is_none() && b.dtype == DType::F32 && b.shape.iter().product::<u64>() == 1 && b.class == BufferClass::Activation => {
                loss = Some(i)
            }
            Some(o) => return Err(fail(at("output"), format!("`{o}`: the eval step has one output, `loss`, one f32 activation"))),
        }
    }
    if loss.is_none() {
        return Err(fail("eval.buffers", "no buffer holds the `loss` output"));
    }
    let train_names: BTreeSet<&str> = m.kernels.iter().map(|k| k.name.as_str()).collect();
    let mut names = BTreeSet::new();
    for (i, k) in e.kernels.iter().enumerate() {
        let at = |field: &str| format!("eval.kernels[{i}].{field}");
        if k.id as usize != i {
            return Err(fail(at("id"), format!("{}; an eval kernel's id is its position in `eval.kernels` ({i})", k.id)));
        }
        let file_safe = k.name.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
        if !k.name.starts_with("eval_") || !file_safe || train_names.contains(k.name.as_str()) || !names.insert(k.name.as_str()) {
            return Err(fail(at("name"), format!("`{}`: eval kernel names start with `eval_`, name files safely and are unique", k.name)));
        }
        if eval_graph.block_by_name(&k.body).is_none() {
            return Err(fail(at("body"), format!("`@{}` is not a block of {}", k.body, titan_ir::artifact::EVAL_GRAPH_FILE)));
        }
        for (field, file) in [("ptx", &k.ptx), ("cubin", &k.cubin)] {
            if let Some(f) = file
                && !dir.join(f).is_file()
            {
                return Err(fail(at(field), format!("`{f}` is not a file of the artifact; rebuild it with `titanc build`")));
            }
        }
    }
    check_eval_steps(e, &e.steps, "eval.steps", &[])?;
    let lifetimes = titan_ir::artifact::liveness::eval_buffer_lifetimes(m);
    let acts: Vec<usize> = (0..e.buffers.len()).filter(|&i| e.buffers[i].class == BufferClass::Activation && e.buffers[i].bytes > 0).collect();
    for (k, &i) in acts.iter().enumerate() {
        for &j in &acts[k + 1..] {
            let (a, b) = (&e.buffers[i], &e.buffers[j]);
            let bytes_overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
            if bytes_overlap
                && let (Some(l1), Some(l2)) = (lifetimes[i], lifetimes[j])
                && l1.overlaps(&l2)
            {
                return Err(fail(
                    format!("eval.buffers[{j}].offset"),
                    format!("`{}` shares bytes with eval.buffers[{i}] (`{}`) while both are live", b.name, a.name),
                ));
            }
        }
    }
    Ok(())
}

/// Every step of the eval schedule names an existing kernel and existing buffers, and writes
/// only activation buffers (`carries`: the slot pairs of the enclosing loop).
fn check_eval_steps(e: &titan_ir::artifact::EvalStep, steps: &[Step], at: &str, carries: &[[u32; 2]]) -> Check {
    let buffers = |r: &BufRef, carries: &[[u32; 2]]| -> Result<Vec<u32>, ArtifactError> {
        match *r {
            BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => Ok(vec![buffer]),
            BufRef::Carry { carry, .. } => {
                carries.get(carry as usize).map(|c| c.to_vec()).ok_or_else(|| fail(at, format!("carry {carry} outside a loop that has it")))
            }
        }
    };
    for (i, s) in steps.iter().enumerate() {
        let here = format!("{at}[{i}]");
        if let Step::Launch { kernel, .. } = s
            && e.kernels.get(*kernel as usize).is_none()
        {
            return Err(fail(&here, format!("kernel {kernel} does not exist")));
        }
        if let Step::Loop { carries: inner, body, prefetch, .. } = s {
            for id in inner.iter().flatten() {
                if e.buffers.get(*id as usize).is_none_or(|b| b.class != BufferClass::Activation) {
                    return Err(fail(&here, format!("carry slot {id} is not an activation buffer of the eval step")));
                }
            }
            check_eval_steps(e, prefetch, &format!("{here}.prefetch"), inner)?;
            check_eval_steps(e, body, &format!("{here}.body"), inner)?;
            continue;
        }
        let written: Vec<BufRef> = match s {
            Step::Launch { outputs, .. } => outputs.clone(),
            Step::Copy { dst, .. } | Step::Memset { dst, .. } => vec![*dst],
            Step::Collective { output, .. } => vec![*output],
            Step::Loop { .. } => Vec::new(),
        };
        for r in titan_ir::artifact::liveness::step_refs(s) {
            for id in buffers(&r, carries)? {
                let b = e.buffers.get(id as usize).ok_or_else(|| fail(&here, format!("buffer {id} does not exist")))?;
                if written.contains(&r) && b.class != BufferClass::Activation {
                    return Err(fail(&here, format!("writes `{}`, a `{}` buffer; the eval step writes only its activations", b.name, class_name(b.class))));
                }
            }
        }
    }
    Ok(())
}

fn is_hex_sha256(s: &str) -> bool {
    s.len() == 64 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn check_header(m: &Manifest) -> Check {
    if m.titan_version.trim().is_empty() {
        return Err(fail("titan_version", "is empty; rebuild the artifact with `titanc build`"));
    }
    if !is_hex_sha256(&m.content_hash) {
        return Err(fail(
            "content_hash",
            format!("`{}` is not a hex SHA-256 (64 lower-case hex digits); rebuild the artifact with `titanc build`", m.content_hash),
        ));
    }
    if let Some(h) = &m.model_hash
        && !is_hex_sha256(h)
    {
        return Err(fail("model_hash", format!("`{h}` is not a hex SHA-256 (64 lower-case hex digits); rebuild the artifact with `titanc build`")));
    }
    if m.target.arch == "sm_90a" && m.target.ptx_isa != "8.0" {
        return Err(fail(
            "target.ptx_isa",
            format!("`{}` is not the PTX ISA titanc emits for sm_90a (8.0); rebuild with `titanc build --target sm_90a`", m.target.ptx_isa),
        ));
    }
    Ok(())
}

/// A `meta` value as the manifest writes it.
fn meta_json(v: &AttrValue) -> serde_json::Value {
    match v {
        AttrValue::Bool(b) => serde_json::Value::Bool(*b),
        AttrValue::Int(i) => serde_json::Value::from(*i),
        AttrValue::Float(x) => {
            serde_json::Number::from_f64(*x).map_or_else(|| serde_json::Value::String(titan_ir::attr::fmt_float(*x)), serde_json::Value::Number)
        }
        AttrValue::Str(s) | AttrValue::Ident(s) | AttrValue::Symbol(s) => serde_json::Value::String(s.clone()),
        AttrValue::List(items) => serde_json::Value::Array(items.iter().map(meta_json).collect()),
        AttrValue::Call(..) => serde_json::Value::String(v.to_string()),
    }
}

/// The positive integer `model.key`, if present.
fn model_u64(m: &Manifest, key: &str) -> Result<Option<u64>, ArtifactError> {
    match m.model.get(key) {
        None => Ok(None),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => Ok(Some(n)),
            _ => Err(fail(format!("model.{key}"), format!("{v} is not a positive integer"))),
        },
    }
}

fn check_mesh_and_model(m: &Manifest, graph: &Graph) -> Check {
    // The mesh: known dims, outermost first, each once, of more than one rank, and the world
    // size their product.
    let mut last = None;
    let mut world: u64 = 1;
    for (i, d) in m.mesh.dims.iter().enumerate() {
        let at = format!("mesh.dims[{i}]");
        let Some(pos) = MESH_DIMS.iter().position(|n| *n == d.name) else {
            return Err(fail(format!("{at}.name"), format!("unknown mesh dim `{}`; titan builds {}", d.name, MESH_DIMS.join(", "))));
        };
        if last.is_some_and(|l| l >= pos) {
            return Err(fail(
                format!("{at}.name"),
                format!("`{}` is out of order or repeated; mesh dims are listed once, outermost first ({})", d.name, MESH_DIMS.join(", ")),
            ));
        }
        last = Some(pos);
        if d.size < 2 {
            return Err(fail(format!("{at}.size"), format!("{} ranks; the mesh lists only dims of more than one rank", d.size)));
        }
        world = world.saturating_mul(u64::from(d.size));
    }
    if u64::from(m.mesh.world_size) != world {
        return Err(fail("mesh.world_size", format!("{} but the mesh dims multiply to {world}", m.mesh.world_size)));
    }
    let mesh_size = |name: &str| m.mesh.dims.iter().find(|d| d.name == name).map_or(1, |d| u64::from(d.size));
    // The model meta names the same mesh (SPMD builds write it; single-device builds may not).
    let spmd = m.mesh.world_size > 1;
    for (key, want) in [
        ("world_size", u64::from(m.mesh.world_size)),
        ("mesh_dp_replicate", mesh_size("dp_replicate")),
        ("mesh_dp_shard", mesh_size("dp_shard")),
        ("mesh_tp", mesh_size("tp")),
    ] {
        match model_u64(m, key)? {
            Some(v) if v != want => return Err(fail(format!("model.{key}"), format!("{v}, but `mesh` has {want}; rebuild the artifact with `titanc build`"))),
            None if spmd => {
                return Err(fail("model", format!("has no `{key}` for a mesh of {} ranks; rebuild the artifact with `titanc build`", m.mesh.world_size)));
            }
            _ => {}
        }
    }
    // Every model key is the kernel graph's meta (which the lowering only adds to).
    for (key, v) in &m.model {
        let Some(g) = graph.meta.get(key) else {
            return Err(fail(
                format!("model.{key}"),
                format!("is not in the meta of {}; rebuild the artifact with `titanc build`", titan_ir::artifact::GRAPH_FILE),
            ));
        };
        let g = meta_json(g);
        if g != *v {
            return Err(fail(
                format!("model.{key}"),
                format!("{v}, but {} says {g}; rebuild the artifact with `titanc build`", titan_ir::artifact::GRAPH_FILE),
            ));
        }
    }
    for key in ["n_layers", "vocab_size", "dim", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "seq_len"] {
        model_u64(m, key)?;
    }
    if let Some(v) = model_u64(m, "vocab_size")?
        && v != m.training.vocab_size
    {
        return Err(fail("training.vocab_size", format!("{}, but model.vocab_size is {v}", m.training.vocab_size)));
    }
    // The dims are the kernel graph's.
    if m.dims != graph.dims {
        let shown = |d: &BTreeMap<String, u64>| d.iter().map(|(k, v)| format!("{k} = {v}")).collect::<Vec<_>>().join(", ");
        return Err(fail(
            "dims",
            format!(
                "{{{}}}, but {} binds {{{}}}; rebuild the artifact with `titanc build`",
                shown(&m.dims),
                titan_ir::artifact::GRAPH_FILE,
                shown(&graph.dims)
            ),
        ));
    }
    for (k, &v) in &m.dims {
        if v == 0 {
            return Err(fail(format!("dims.{k}"), "is 0; every dim must be positive"));
        }
    }
    let dim = |k: &str| m.dims.get(k).copied().ok_or_else(|| fail("dims", format!("has no `{k}`; a training step needs `batch` and `seq`")));
    let (batch, seq) = (dim("batch")?, dim("seq")?);
    let t = &m.training;
    if t.batch != batch {
        return Err(fail("training.batch", format!("{}, but dims.batch is {batch}", t.batch)));
    }
    if t.seq_len != seq {
        return Err(fail("training.seq_len", format!("{}, but dims.seq is {seq}", t.seq_len)));
    }
    if Some(t.tokens_per_step) != batch.checked_mul(seq) {
        return Err(fail("training.tokens_per_step", format!("{}, but batch x seq_len is {batch} x {seq}", t.tokens_per_step)));
    }
    Ok(())
}

fn align(x: u64) -> u64 {
    x.div_ceil(ALIGN).saturating_mul(ALIGN)
}

/// The arenas of the plan: one each, in order, aligned.
fn check_arenas(m: &Manifest) -> Check {
    let p = &m.memory;
    if p.arenas.len() != ARENAS.len() {
        return Err(fail("memory.arenas", format!("lists {} arenas; a plan has one per arena: {}", p.arenas.len(), ARENAS.map(arena_name).join(", "))));
    }
    for (i, (a, want)) in p.arenas.iter().zip(ARENAS).enumerate() {
        if a.arena != want {
            return Err(fail(
                format!("memory.arenas[{i}].arena"),
                format!("`{}`, expected `{}` (one per arena, in order)", arena_name(a.arena), arena_name(want)),
            ));
        }
        if a.bytes % ALIGN != 0 {
            return Err(fail(format!("memory.arenas[{i}].bytes"), format!("{} is not a multiple of {ALIGN}", a.bytes)));
        }
    }
    Ok(())
}

/// The plan's totals: the peak is the sum of the arenas, the unplanned activation bytes the sum
/// of the activation buffers.
fn check_plan_totals(m: &Manifest) -> Check {
    let p = &m.memory;
    let sum = p.arenas.iter().map(|a| a.bytes).fold(0u64, u64::saturating_add);
    if p.peak_bytes != sum {
        return Err(fail("memory.peak_bytes", format!("{}, but the arenas add up to {sum}", p.peak_bytes)));
    }
    let unplanned = m.buffers.iter().filter(|b| b.arena == Arena::Activations).map(|b| align(b.bytes)).fold(0u64, u64::saturating_add);
    if p.activation_bytes_unplanned != unplanned {
        return Err(fail(
            "memory.activation_bytes_unplanned",
            format!("{}, but the activation buffers take {unplanned} bytes unplanned", p.activation_bytes_unplanned),
        ));
    }
    Ok(())
}

/// Parse an `init` spec as `graph.ir` writes it (`zeros`, `ones`, `normal(0.02)`,
/// `trunc_normal(0.02, -2.0, 2.0)`, `trunc_normal_depth(...)`), with finite arguments, a
/// positive std and `lo < hi`.
pub fn parse_init(s: &str) -> Result<Init, String> {
    const KNOWN: &str = "zeros, ones, normal(std), trunc_normal(std, lo, hi), trunc_normal_depth(std, lo, hi) or compute_copy";
    let s = s.trim();
    let (name, args) = match s.split_once('(') {
        None => (s, None),
        Some((name, rest)) => {
            let inner = rest.strip_suffix(')').ok_or_else(|| format!("`{s}` lacks its closing parenthesis"))?;
            let xs: Result<Vec<f64>, String> =
                inner.split(',').map(|x| x.trim().parse::<f64>().map_err(|_| format!("`{}` in `{s}` is not a number", x.trim()))).collect();
            (name.trim(), Some(xs?))
        }
    };
    let init = match (name, args.as_deref()) {
        ("zeros", None) => Init::Zeros,
        ("ones", None) => Init::Ones,
        ("compute_copy", None) => Init::ComputeCopy,
        ("normal", Some(&[std])) => Init::Normal { std },
        ("trunc_normal" | "trunc_normal_depth", Some(&[std, lo, hi])) => Init::TruncNormal { std, lo, hi, depth_scaled: name == "trunc_normal_depth" },
        ("normal" | "trunc_normal" | "trunc_normal_depth" | "zeros" | "ones" | "compute_copy", _) => {
            return Err(format!("`{s}` has the wrong number of arguments; expected {KNOWN}"));
        }
        _ => return Err(format!("unknown initializer `{s}`; expected {KNOWN}")),
    };
    check_init(init).map(|()| init).map_err(|e| format!("`{s}`: {e}"))
}

/// An initializer's arguments: finite, a positive std, `lo < hi`.
fn check_init(init: Init) -> Result<(), String> {
    let (std, bounds) = match init {
        Init::Zeros | Init::Ones | Init::ComputeCopy => return Ok(()),
        Init::Normal { std } => (std, None),
        Init::TruncNormal { std, lo, hi, .. } => (std, Some((lo, hi))),
    };
    if !std.is_finite() || std <= 0.0 {
        return Err(format!("the std must be a finite number > 0, found {std}"));
    }
    if let Some((lo, hi)) = bounds
        && !(lo.is_finite() && hi.is_finite() && lo < hi)
    {
        return Err(format!("the bounds must be finite with lo < hi, found [{lo}, {hi}]"));
    }
    Ok(())
}

fn check_buffers(m: &Manifest, graph: &Graph) -> Check {
    let arena_bytes: BTreeMap<Arena, u64> = m.memory.arenas.iter().map(|a| (a.arena, a.bytes)).collect();
    let mut feeds = BTreeMap::new();
    let mut outputs = BTreeSet::new();
    let mut states = BTreeSet::new();
    let n_layers = model_u64(m, "n_layers")?;
    for (i, b) in m.buffers.iter().enumerate() {
        let at = |field: &str| format!("buffers[{i}].{field}");
        if b.id as usize != i {
            return Err(fail(at("id"), format!("{}; a buffer's id is its position in `buffers` ({i})", b.id)));
        }
        if b.name.trim().is_empty() {
            return Err(fail(at("name"), "is empty"));
        }
        let bytes = tensor_bytes(b.dtype, &b.shape).ok_or_else(|| fail(at("shape"), format!("{:?} overflows", b.shape)))?;
        if b.bytes != bytes {
            return Err(fail(at("bytes"), format!("{}, but {}{:?} takes {bytes}", b.bytes, b.dtype, b.shape)));
        }
        let want = arena_of(b.class);
        if b.arena != want {
            return Err(fail(at("arena"), format!("`{}`, but a `{}` buffer lives in `{}`", arena_name(b.arena), class_name(b.class), arena_name(want))));
        }
        if b.offset % ALIGN != 0 {
            return Err(fail(at("offset"), format!("{} is not a multiple of {ALIGN}", b.offset)));
        }
        let size = arena_bytes.get(&b.arena).copied().unwrap_or(0);
        if b.offset.checked_add(b.bytes).is_none_or(|end| end > size) {
            return Err(fail(
                at("offset"),
                format!("bytes {}..{} lie outside its arena (`{}`, {size} bytes)", b.offset, b.offset.saturating_add(b.bytes), arena_name(b.arena)),
            ));
        }
        match (&b.feed, b.class) {
            (Some(f), BufferClass::Input) => {
                if !crate::artifact::FEEDS.contains(&f.as_str()) {
                    return Err(fail(at("feed"), format!("`{f}` is not one titan-run provides (tokens, targets, step)")));
                }
                if feeds.insert(f.clone(), i).is_some() {
                    return Err(fail(at("feed"), format!("a second input buffer fed `{f}`")));
                }
            }
            (None, BufferClass::Input) => return Err(fail(at("feed"), "missing; an input buffer names its feed (tokens, targets or step)")),
            (Some(_), c) => return Err(fail(at("feed"), format!("only input buffers are fed, this one is `{}`", class_name(c)))),
            (None, _) => {}
        }
        if let Some(o) = &b.output {
            if !OUTPUTS.contains(&o.as_str()) {
                return Err(fail(at("output"), format!("`{o}` is not a step output titan-run reads ({})", OUTPUTS.join(", "))));
            }
            if !outputs.insert(o.clone()) {
                return Err(fail(at("output"), format!("a second buffer holds `{o}`")));
            }
            if b.dtype != DType::F32 || b.shape.iter().product::<u64>() != 1 {
                return Err(fail(at("output"), format!("`{o}` is read as one f32, the buffer is {}{:?}", b.dtype, b.shape)));
            }
        }
        let persistent = matches!(b.class, BufferClass::Param | BufferClass::OptimizerState | BufferClass::ComputeCopy);
        match (&b.state, persistent) {
            (None, true) => return Err(fail(at("state"), format!("missing; a `{}` buffer carries its checkpoint name and init", class_name(b.class)))),
            (Some(_), false) => {
                return Err(fail(at("state"), format!("only param, optimizer_state and compute_copy buffers have one, this one is `{}`", class_name(b.class))));
            }
            (None, false) => {}
            (Some(s), true) => {
                if s.name.trim().is_empty() {
                    return Err(fail(at("state.name"), "is empty"));
                }
                if !states.insert(s.name.clone()) {
                    return Err(fail(at("state.name"), format!("`{}` names a second state buffer", s.name)));
                }
                if !b.dtype.is_float() {
                    return Err(fail(at("dtype"), format!("{}, but state `{}` must be a float type", b.dtype, s.name)));
                }
                let init = parse_init(&s.init).map_err(|e| fail(at("state.init"), e))?;
                if b.class == BufferClass::OptimizerState && init != Init::Zeros {
                    return Err(fail(at("state.init"), format!("`{}`, but AdamW moments start at `zeros`", s.init)));
                }
                if (b.class == BufferClass::ComputeCopy) != (init == Init::ComputeCopy) {
                    return Err(fail(
                        at("state.init"),
                        format!("`{}` on a `{}` buffer; `compute_copy` initializes exactly the compute_copy buffers", s.init, class_name(b.class)),
                    ));
                }
                if b.class == BufferClass::ComputeCopy {
                    let master = s
                        .name
                        .strip_suffix(titan_ir::COMPUTE_COPY_SUFFIX)
                        .and_then(|name| m.buffers.iter().find(|t| t.class == BufferClass::Param && t.state.as_ref().is_some_and(|ts| ts.name == name)));
                    match master {
                        None => {
                            return Err(fail(
                                at("state.name"),
                                format!("`{}` names no param buffer's compute copy (`<master>{}`)", s.name, titan_ir::COMPUTE_COPY_SUFFIX),
                            ));
                        }
                        Some(t) if t.shape != b.shape || t.dtype != DType::F32 || b.dtype == DType::F32 => {
                            return Err(fail(
                                at("dtype"),
                                format!(
                                    "{}{:?}, but a compute copy narrows its f32 master of the same shape, found {}{:?}",
                                    b.dtype, b.shape, t.dtype, t.shape
                                ),
                            ));
                        }
                        Some(_) => {}
                    }
                }
                let arg = graph.main.args.iter().find_map(|a| a.kind.param_info().filter(|p| p.name == s.name).map(|p| (a, p)));
                let Some((_, info)) = arg else {
                    return Err(fail(at("state.name"), format!("`{}` is no state argument of {}", s.name, titan_ir::artifact::GRAPH_FILE)));
                };
                if info.init != init {
                    return Err(fail(
                        at("state.init"),
                        format!("`{}`, but {} initializes `{}` with `{}`", s.init, titan_ir::artifact::GRAPH_FILE, s.name, info.init.to_attr()),
                    ));
                }
                if s.name.contains("{i}") {
                    match (b.shape.first(), n_layers) {
                        (None, _) => return Err(fail(at("shape"), format!("[], but the stacked state `{}` needs a leading layer dim", s.name))),
                        (Some(&l), Some(n)) if l != n => {
                            return Err(fail(at("shape"), format!("{:?}: the stacked state `{}` has {l} layers, model.n_layers is {n}", b.shape, s.name)));
                        }
                        _ => {}
                    }
                }
            }
        }
    }
    for f in crate::artifact::FEEDS {
        if !feeds.contains_key(f) {
            return Err(fail("buffers", format!("no input buffer is fed `{f}`; is this a training-step artifact?")));
        }
    }
    if !outputs.contains("loss") {
        return Err(fail("buffers", "no buffer holds the `loss` output; is this a training-step artifact?"));
    }
    // The fed buffers against the dims: targets are [batch, seq]; tokens too, or this rank's
    // slice of `seq` with sequence parallelism.
    let (batch, seq) = (m.dims.get("batch").copied().unwrap_or(0), m.dims.get("seq").copied().unwrap_or(0));
    let tp = m.mesh.dims.iter().find(|d| d.name == "tp").map_or(1, |d| u64::from(d.size));
    for feed in crate::artifact::FEEDS {
        let i = feeds[feed];
        let b = &m.buffers[i];
        let ok = match (feed, b.shape.as_slice()) {
            ("step", s) => s.is_empty(),
            ("targets", s) => s == [batch, seq],
            // Sequence parallelism: a rank may hold its slice of the tokens, or all of them.
            (_, &[b0, s]) => b0 == batch && (s == seq || (tp > 1 && (s.saturating_mul(tp) == seq || s == seq.saturating_mul(tp)))),
            _ => false,
        };
        if !b.dtype.is_int() || !ok {
            return Err(fail(
                format!("buffers[{i}].shape"),
                format!(
                    "the `{feed}` input is {}{:?}; with dims batch = {batch}, seq = {seq} it must be i32{}",
                    b.dtype,
                    b.shape,
                    if feed == "step" { "[]" } else { "[batch, seq]" }
                ),
            ));
        }
    }
    Ok(())
}

/// No two buffers of a packed arena share a byte; no two buffers of `activations` live at the
/// same time do.
fn check_placement(m: &Manifest) -> Check {
    let lifetimes = buffer_lifetimes(m, 0);
    for a in ARENAS {
        let planned = a == Arena::Activations;
        let mut ids: Vec<usize> = (0..m.buffers.len()).filter(|&i| m.buffers[i].arena == a && m.buffers[i].bytes > 0).collect();
        ids.sort_by_key(|&i| (m.buffers[i].offset, i));
        for (k, &i) in ids.iter().enumerate() {
            let bi = &m.buffers[i];
            let end = bi.offset.saturating_add(bi.bytes);
            for &j in &ids[k + 1..] {
                let bj = &m.buffers[j];
                if bj.offset >= end {
                    break;
                }
                let (first, second) = if i < j { (i, j) } else { (j, i) };
                let (b1, b2) = (&m.buffers[first], &m.buffers[second]);
                let overlap = format!(
                    "bytes {}..{} of `{}` overlap buffers[{first}] (`{}`, bytes {}..{})",
                    b2.offset,
                    b2.offset + b2.bytes,
                    arena_name(a),
                    b1.name,
                    b1.offset,
                    b1.offset + b1.bytes
                );
                if !planned {
                    return Err(fail(format!("buffers[{second}].offset"), format!("{overlap}; `{}` buffers are packed, never shared", arena_name(a))));
                }
                if let (Some(l1), Some(l2)) = (lifetimes[first], lifetimes[second])
                    && l1.overlaps(&l2)
                {
                    let span = |l: Lifetime| format!("{}..={}", l.start, l.end);
                    return Err(fail(
                        format!("buffers[{second}].offset"),
                        format!("{overlap} while both are live (schedule positions {} and {}); rebuild the artifact with `titanc build`", span(l2), span(l1)),
                    ));
                }
            }
        }
    }
    Ok(())
}

/// The kernels that may write their output over their last input: a `scatter_add` with its add
/// (fusion rule 12) whose body adds the table to its last argument. The memory plan writes the
/// sum over that tensor when nothing reads it after, and the kernel then stores only hit rows.
fn writes_over_last_input(m: &Manifest, graph: &Graph) -> BTreeSet<u32> {
    m.kernels
        .iter()
        .filter(|k| k.kind == KernelKind::ScatterAdd)
        .filter(|k| {
            let Some(body) = graph.block_by_name(&k.body) else { return false };
            let r = graph.block(body);
            let nodes: Vec<&titan_ir::Node> = r.order.iter().map(|&n| r.node(n)).collect();
            let ([scatter, add], Some(last)) = (nodes.as_slice(), r.args.last()) else { return false };
            let table = scatter.results.first();
            matches!(add.op, Op::Binary(titan_ir::BinaryOp::Add))
                && add.inputs.contains(&last.value)
                && add.inputs.iter().any(|v| Some(v) == table)
                && !scatter.inputs.contains(&last.value)
        })
        .map(|k| k.id)
        .collect()
}

/// The `graph.ir` kernel node that calls body `body`, with its kind.
fn graph_kernel_kind(graph: &Graph, body: titan_ir::BlockId) -> Option<KernelKind> {
    std::iter::once(&graph.main).chain(&graph.blocks).flat_map(|r| &r.nodes).find_map(|n| match n.op {
        Op::Kernel { body: b, kind } if b == body => Some(kind),
        _ => None,
    })
}

fn check_kernels(m: &Manifest, graph: &Graph, dir: &Path) -> Check {
    let mut names = BTreeMap::new();
    for (i, k) in m.kernels.iter().enumerate() {
        let at = |field: &str| format!("kernels[{i}].{field}");
        if k.id as usize != i {
            return Err(fail(at("id"), format!("{}; a kernel's id is its position in `kernels` ({i})", k.id)));
        }
        let file_safe = !k.name.is_empty() && !k.name.starts_with('.') && k.name.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c));
        if !file_safe {
            return Err(fail(at("name"), format!("`{}` is not a kernel name (letters, digits, `.`, `_`, `-`; it names the kernel's files)", k.name)));
        }
        if let Some(j) = names.insert(k.name.clone(), i) {
            return Err(fail(at("name"), format!("`{}` is also the name of kernels[{j}]; kernel names are unique", k.name)));
        }
        let kind = k.kind.name();
        // The code a kind has: GEMMs run on cuBLASLt (a descriptor, no PTX); every other kind
        // is generated code (PTX, entry and launch together, or none when it has no generator).
        match (k.kind == KernelKind::Gemm, &k.gemm) {
            (true, None) => return Err(fail(at("gemm"), "missing; a `gemm` kernel carries its cuBLASLt descriptor")),
            (false, Some(_)) => return Err(fail(at("gemm"), format!("a `{kind}` kernel has a GEMM descriptor; only `gemm` kernels run on cuBLASLt"))),
            _ => {}
        }
        if k.kind == KernelKind::Gemm {
            for (field, present) in [
                ("ptx", k.ptx.is_some()),
                ("cubin", k.cubin.is_some()),
                ("entry", k.entry.is_some()),
                ("launch", k.launch.is_some()),
                ("prologue", k.prologue.is_some()),
                ("epilogue", k.epilogue.is_some()),
            ] {
                if present {
                    return Err(fail(at(field), "a `gemm` kernel runs on cuBLASLt and has no generated code"));
                }
            }
            if k.workspace_bytes > 0 {
                return Err(fail(at("workspace_bytes"), "a `gemm` kernel uses the cuBLASLt workspace, not one of its own"));
            }
        }
        let has_code = k.ptx.is_some();
        for (field, present) in [("entry", k.entry.is_some()), ("launch", k.launch.is_some())] {
            if present != has_code {
                return Err(fail(at(field), if has_code { "missing; a kernel with PTX names its entry and launch" } else { "present without `ptx`" }));
            }
        }
        if !has_code {
            for (field, present) in [("prologue", k.prologue.is_some()), ("epilogue", k.epilogue.is_some()), ("workspace_bytes", k.workspace_bytes > 0)] {
                if present {
                    return Err(fail(at(field), "present without `ptx`"));
                }
            }
        }
        if k.workspace_scratch && k.workspace_bytes == 0 {
            return Err(fail(at("workspace_scratch"), "set on a kernel without a workspace"));
        }
        for (field, file, ext) in [("ptx", &k.ptx, "ptx"), ("cubin", &k.cubin, "cubin")] {
            let Some(file) = file else { continue };
            let want = format!("{KERNEL_DIR}/{}.{ext}", k.name);
            if *file != want {
                return Err(fail(at(field), format!("`{file}`; the kernel's {ext} file is `{want}`")));
            }
            if !dir.join(file).is_file() {
                return Err(fail(at(field), format!("`{file}` is not in the artifact; it is incomplete, rebuild it with `titanc build`")));
            }
        }
        if let Some(e) = &k.entry
            && e.trim().is_empty()
        {
            return Err(fail(at("entry"), "is empty"));
        }
        let launches = k
            .launch
            .iter()
            .map(|l| (at("launch"), l))
            .chain(k.prologue.iter().map(|p| (at("prologue.launch"), &p.launch)))
            .chain(k.epilogue.iter().map(|p| (at("epilogue.launch"), &p.launch)));
        for (path, l) in launches {
            let threads = l.block.iter().map(|&x| u64::from(x)).product::<u64>();
            if l.grid.contains(&0) || l.block.contains(&0) || threads > MAX_BLOCK_THREADS || l.grid[1] > 65535 || l.grid[2] > 65535 || l.block[2] > 64 {
                return Err(fail(
                    path,
                    format!(
                        "grid {:?} x block {:?} is not a launch an sm_90 GPU runs (every size > 0, at most {MAX_BLOCK_THREADS} threads a block)",
                        l.grid, l.block
                    ),
                ));
            }
            if l.shared_bytes > MAX_SHARED_BYTES {
                return Err(fail(
                    format!("{path}.shared_bytes"),
                    format!("{} exceeds the {MAX_SHARED_BYTES} bytes of shared memory a block can have", l.shared_bytes),
                ));
            }
        }
        if let Some(g) = &k.gemm {
            check_gemm(&at("gemm"), g)?;
        }
        // The kind is the one of `graph.ir`'s kernel node, and the body's ops are that kind's.
        let Some(body) = graph.block_by_name(&k.body) else {
            return Err(fail(at("body"), format!("`@{}` is not a block of {}", k.body, titan_ir::artifact::GRAPH_FILE)));
        };
        match graph_kernel_kind(graph, body) {
            None => return Err(fail(at("body"), format!("`@{}` is not the body of any kernel node of {}", k.body, titan_ir::artifact::GRAPH_FILE))),
            Some(g) if g != k.kind => {
                return Err(fail(at("kind"), format!("`{kind}`, but {} calls `@{}` as a `{}` kernel", titan_ir::artifact::GRAPH_FILE, k.body, g.name())));
            }
            Some(_) => {}
        }
        let region = graph.block(body);
        let ops: Vec<&Op> = region.order.iter().filter_map(|n| region.nodes.get(n.index())).map(|n| &n.op).collect();
        // cuBLASLt and the attention kernels run their one op and nothing else; a gather or
        // scatter-add kernel is built around one such op; the optimizer runs AdamW. (A `fused`
        // body may hold anything the interpreter runs: without a generator it has no PTX.)
        let count = |f: fn(&Op) -> bool| ops.iter().filter(|o| f(o)).count();
        let fits = match k.kind {
            // With the residual-add epilogue (`epilogue = "add"`) the add follows the product.
            KernelKind::Gemm => match (ops.as_slice(), k.gemm.as_ref().map(|g| g.epilogue.as_str())) {
                ([Op::Linear | Op::Matmul { .. }, Op::Binary(titan_ir::BinaryOp::Add)], Some(GemmDesc::ADD)) => region.args.len() == 3,
                ([Op::Linear | Op::Matmul { .. } | Op::ScaledMatmul { .. }], Some("none")) => true,
                _ => false,
            },
            KernelKind::Attention => matches!(ops.as_slice(), [Op::Attention { .. }]),
            KernelKind::AttentionBwd => matches!(ops.as_slice(), [Op::AttentionBwd { .. }]),
            KernelKind::Gather => count(|o| matches!(o, Op::Embedding | Op::Gather | Op::GatherShard)) == 1,
            KernelKind::ScatterAdd => count(|o| matches!(o, Op::ScatterAdd | Op::ScatterAddShard)) == 1,
            KernelKind::Optimizer => count(|o| matches!(o, Op::AdamW(_))) > 0,
            KernelKind::Fused => true,
        };
        if !fits {
            let names: Vec<&str> = ops.iter().map(|o| o.name()).collect();
            return Err(fail(at("kind"), format!("`{kind}`, but its body `@{}` holds {}", k.body, names.join(", "))));
        }
        let size = |vs: &mut dyn Iterator<Item = titan_ir::Value>| -> Option<u64> {
            let mut total = 0u64;
            for v in vs {
                let ty = region.ty(v);
                let shape: Vec<u64> = ty.resolve(&graph.dims).ok()?.into_iter().map(|d| d as u64).collect();
                total = total.checked_add(tensor_bytes(ty.dtype, &shape)?)?;
            }
            Some(total)
        };
        for (field, declared, real) in [
            ("bytes_read", k.bytes_read, size(&mut region.arg_values())),
            ("bytes_written", k.bytes_written, size(&mut region.outputs.iter().map(|o| o.value))),
        ] {
            if Some(declared) != real {
                return Err(fail(
                    at(field),
                    format!("{declared}, but the body `@{}` moves {}", k.body, real.map_or("an unresolvable number of".into(), |r| r.to_string())),
                ));
            }
        }
    }
    Ok(())
}

/// A GEMM descriptor against `docs/artifact.md`'s rules.
fn check_gemm(at: &str, g: &GemmDesc) -> Check {
    for (field, v) in [("m", g.m), ("n", g.n), ("k", g.k), ("batch", g.batch)] {
        if v == 0 {
            return Err(fail(format!("{at}.{field}"), "is 0"));
        }
    }
    let lda = if g.transpose_a { g.m } else { g.k };
    let ldb = if g.transpose_b { g.k } else { g.n };
    for (field, v, want) in [("lda", g.lda, lda), ("ldb", g.ldb, ldb), ("ldc", g.ldc, g.n)] {
        if v != want {
            return Err(fail(format!("{at}.{field}"), format!("{v}, but a row-major {}x{}x{} GEMM has {want}", g.m, g.n, g.k)));
        }
    }
    if g.batch > 1 {
        for (field, v, want) in [("stride_a", g.stride_a, g.m * g.k), ("stride_c", g.stride_c, g.m * g.n)] {
            if v != want {
                return Err(fail(
                    format!("{at}.{field}"),
                    format!("{v}, but consecutive {}x{} matrices are {want} elements apart", g.m, if field == "stride_a" { g.k } else { g.n }),
                ));
            }
        }
        if g.stride_b != 0 && g.stride_b != g.k * g.n {
            return Err(fail(format!("{at}.stride_b"), format!("{}; it is 0 (one B for every batch) or {}", g.stride_b, g.k * g.n)));
        }
    }
    if g.compute != DType::F32 {
        return Err(fail(format!("{at}.compute"), format!("`{}`; titan GEMMs accumulate in f32", g.compute)));
    }
    match g.epilogue.as_str() {
        "none" => {}
        GemmDesc::ADD if g.scale_a.is_none() && g.scale_b.is_none() => {}
        GemmDesc::ADD => return Err(fail(format!("{at}.epilogue"), "`add` on a scaled fp8 GEMM is not supported")),
        other => return Err(fail(format!("{at}.epilogue"), format!("`{other}`; `none` or `add` (D = A B + C, C the body's argument 2)"))),
    }
    Ok(())
}

/// `over`: the kernels that may write their output over their last input
/// ([`writes_over_last_input`]).
fn check_schedule(m: &Manifest, over: &BTreeSet<u32>) -> Check {
    if m.ranks.len() != 1 {
        return Err(fail("ranks", format!("{} schedules; an artifact has one (rank 0) that every rank of its mesh runs", m.ranks.len())));
    }
    if m.ranks[0].rank != 0 {
        return Err(fail("ranks[0].rank", format!("{}; the one schedule is rank 0's", m.ranks[0].rank)));
    }
    let n_layers = model_u64(m, "n_layers")?;
    check_steps(m, &m.ranks[0].steps, "ranks[0].steps", n_layers, over, 0)
}

fn check_steps(m: &Manifest, steps: &[Step], at: &str, n_layers: Option<u64>, over: &BTreeSet<u32>, depth: usize) -> Check {
    for (i, s) in steps.iter().enumerate() {
        let at = format!("{at}[{i}]");
        match s {
            Step::Launch { stream, .. } | Step::Copy { stream, .. } | Step::Memset { stream, .. } | Step::Collective { stream, .. } if *stream != 0 => {
                return Err(fail(format!("{at}.stream"), format!("{stream}; every step runs on stream 0")));
            }
            Step::Launch { kernel, inputs, outputs, .. } => {
                // A launch writes an operand it also reads only to update state in place, or a
                // `scatter_add` its sum over the tensor it adds to (fusion rule 12: its last input).
                let persistent = |r: &BufRef| match r {
                    BufRef::Buffer { buffer, .. } | BufRef::View { buffer, .. } => m
                        .buffers
                        .get(*buffer as usize)
                        .is_some_and(|b| matches!(b.class, BufferClass::Param | BufferClass::OptimizerState | BufferClass::ComputeCopy)),
                    BufRef::Carry { .. } => false,
                };
                for (j, o) in outputs.iter().enumerate() {
                    let over_added = over.contains(kernel) && inputs.last() == Some(o) && inputs.iter().filter(|&i| i == o).count() == 1;
                    if inputs.contains(o) && !persistent(o) && !over_added {
                        return Err(fail(
                            format!("{at}.outputs[{j}]"),
                            "is also an input; a kernel updates only state buffers in place (and a scatter_add the tensor it adds to)",
                        ));
                    }
                    if outputs[..j].contains(o) {
                        return Err(fail(format!("{at}.outputs[{j}]"), "is written twice by one launch"));
                    }
                }
            }
            Step::Copy { src, dst, bytes, .. } => {
                if src == dst {
                    return Err(fail(format!("{at}.dst"), "is its source"));
                }
                if *bytes == 0 {
                    return Err(fail(format!("{at}.bytes"), "is 0"));
                }
            }
            Step::Memset { bytes, .. } => {
                if *bytes == 0 {
                    return Err(fail(format!("{at}.bytes"), "is 0"));
                }
            }
            Step::Collective { collective, mesh_dim, group, dtype, in_shape, out_shape, input, output, more_inputs, send_bytes, .. } => {
                let size = m.mesh.dims.iter().find(|d| d.name == *mesh_dim).map_or(1, |d| d.size);
                if size != *group || m.mesh.world_size < 2 {
                    return Err(fail(
                        format!("{at}.group"),
                        format!(
                            "a collective over {group} ranks of `{mesh_dim}`, but the artifact's mesh (world size {}) has {size} there; rebuild the artifact with `titanc build`",
                            m.mesh.world_size
                        ),
                    ));
                }
                if input == output || more_inputs.contains(output) {
                    return Err(fail(format!("{at}.output"), "is its input; a collective's input and output never share bytes"));
                }
                let bytes = |shape: &[u64]| tensor_bytes(*dtype, shape).unwrap_or(u64::MAX);
                let want = collective.ring_send_bytes(*group, bytes(in_shape), bytes(out_shape));
                if *send_bytes != want {
                    return Err(fail(
                        format!("{at}.send_bytes"),
                        format!("{send_bytes}, but a ring `{}` of these shapes over {group} ranks sends {want}", collective.name()),
                    ));
                }
            }
            Step::Loop { count, carries, body, prefetch, .. } => {
                if depth > 0 {
                    return Err(fail(&at, "a loop inside a loop; titan schedules only top-level loops"));
                }
                if *count == 0 {
                    return Err(fail(format!("{at}.count"), "is 0"));
                }
                // Once per layer, or once per group of N layers (every-N-th layer checkpointing:
                // a loop over the groups and one over the `L % N` layers after them).
                if let Some(n) = n_layers
                    && u64::from(*count) > n
                {
                    return Err(fail(
                        format!("{at}.count"),
                        format!("{count}, but model.n_layers is {n}; a loop runs once per layer or per group of layers, at most n_layers times"),
                    ));
                }
                for (c, [a, b]) in carries.iter().enumerate() {
                    if a == b {
                        return Err(fail(format!("{at}.carries[{c}]"), format!("[{a}, {b}]: the two slots of a carry are different buffers")));
                    }
                }
                if body.is_empty() {
                    return Err(fail(format!("{at}.body"), "is empty"));
                }
                check_steps(m, prefetch, &format!("{at}.prefetch"), n_layers, over, depth + 1)?;
                check_steps(m, body, &format!("{at}.body"), n_layers, over, depth + 1)?;
            }
        }
    }
    Ok(())
}

/// The mesh report of an SPMD artifact against its memory plan and mesh.
fn check_report(m: &Manifest) -> Check {
    let spmd = m.mesh.world_size > 1;
    let Some(r) = &m.report else {
        return if spmd { Err(fail("report", format!("missing; an artifact for a mesh of {} ranks carries its report", m.mesh.world_size))) } else { Ok(()) };
    };
    if !spmd {
        return Err(fail("report", "present on a single-device artifact; only mesh artifacts have one"));
    }
    let arena = |a: Arena| m.memory.arenas.iter().find(|p| p.arena == a).map_or(0, |p| p.bytes);
    let mem = &r.memory;
    for (field, v, want) in [
        ("params", mem.params, arena(Arena::Params)),
        ("optimizer_state", mem.optimizer_state, arena(Arena::OptimizerState)),
        ("activations", mem.activations, arena(Arena::Activations)),
        ("inputs", mem.inputs, arena(Arena::Inputs)),
        ("peak", mem.peak, m.memory.peak_bytes),
    ] {
        if v != want {
            return Err(fail(format!("report.memory.{field}"), format!("{v}, but the memory plan has {want}")));
        }
    }
    if mem.gathered_weights_saved > mem.gathered_weights || mem.gathered_weights > mem.activations {
        return Err(fail(
            "report.memory.gathered_weights",
            format!("{} (of which {} saved) does not fit in the activations' {}", mem.gathered_weights, mem.gathered_weights_saved, mem.activations),
        ));
    }
    if r.comm.len() != m.mesh.dims.len() {
        return Err(fail("report.comm", format!("{} entries for a mesh of {} dims; one per mesh dim", r.comm.len(), m.mesh.dims.len())));
    }
    for (i, (c, d)) in r.comm.iter().zip(&m.mesh.dims).enumerate() {
        if c.mesh_dim != d.name || c.group != d.size {
            return Err(fail(
                format!("report.comm[{i}]"),
                format!("`{}` over {} ranks, but mesh.dims[{i}] is `{}` of {}", c.mesh_dim, c.group, d.name, d.size),
            ));
        }
    }
    Ok(())
}
