//! Hand-built artifacts for the runtime's own tests (the runtime cannot depend on the compiler):
//! a bigram model that trains (gather, cross entropy, scatter-add, AdamW in four kernels) and a
//! forward pass through a reversed loop with a carry, a stacked output, a copy and a memset.
//! Each graph's `main` calls the same kernels, so graph mode is the reference.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use titan_ir::artifact::{
    Arena, ArenaPlan, BufRef, Buffer, BufferClass, FORMAT_VERSION, Kernel, Manifest, MemoryPlan, Mesh, RankSchedule, StateInfo, Step, Target, TrainingInfo,
};
use titan_ir::{DType, KernelKind};
use titan_runtime::artifact::arena_of;

pub const ALIGN: u64 = 256;

/// A scratch directory, removed when dropped.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A fresh empty directory under the target's temp dir.
pub fn temp_dir(name: &str) -> Scratch {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("runtime-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create temp dir");
    Scratch(dir)
}

/// Builds a manifest buffer by buffer, kernel by kernel, laying buffers out one after the
/// other (256-aligned) in their arenas.
pub struct Fixture {
    pub buffers: Vec<Buffer>,
    pub kernels: Vec<Kernel>,
    pub steps: Vec<Step>,
    used: BTreeMap<Arena, u64>,
    pub batch: u64,
    pub seq: u64,
    pub vocab: u64,
}

pub fn whole(id: u32) -> BufRef {
    BufRef::Buffer { buffer: id, layer: false }
}

pub fn layer(id: u32) -> BufRef {
    BufRef::Buffer { buffer: id, layer: true }
}

pub fn carry(c: u32, out: bool) -> BufRef {
    BufRef::Carry { carry: c, out }
}

pub fn launch(kernel: u32, inputs: Vec<BufRef>, outputs: Vec<BufRef>) -> Step {
    Step::Launch { kernel, inputs, outputs, stream: 0 }
}

impl Fixture {
    pub fn new(batch: u64, seq: u64, vocab: u64) -> Fixture {
        Fixture { buffers: Vec::new(), kernels: Vec::new(), steps: Vec::new(), used: BTreeMap::new(), batch, seq, vocab }
    }

    pub fn buffer(&mut self, name: &str, dtype: DType, shape: &[u64], class: BufferClass) -> u32 {
        let arena = arena_of(class);
        let bytes = shape.iter().product::<u64>() * dtype.size_bytes() as u64;
        let used = self.used.entry(arena).or_insert(0);
        let offset = *used;
        *used = (offset + bytes).div_ceil(ALIGN) * ALIGN;
        let id = self.buffers.len() as u32;
        self.buffers.push(Buffer { id, name: name.into(), dtype, shape: shape.to_vec(), bytes, class, arena, offset, state: None, feed: None, output: None });
        id
    }

    pub fn input(&mut self, feed: &str, dtype: DType, shape: &[u64]) -> u32 {
        let id = self.buffer(&format!("main.%{feed}"), dtype, shape, BufferClass::Input);
        self.buffers[id as usize].feed = Some(feed.into());
        id
    }

    pub fn state(&mut self, value: &str, name: &str, init: &str, shape: &[u64], class: BufferClass) -> u32 {
        let id = self.buffer(&format!("main.%{value}"), DType::F32, shape, class);
        self.buffers[id as usize].state = Some(StateInfo { name: name.into(), init: init.into() });
        id
    }

    pub fn kernel(&mut self, body: &str, kind: KernelKind) -> u32 {
        let id = self.kernels.len() as u32;
        self.kernels.push(Kernel {
            id,
            name: format!("main.{body}"),
            kind,
            body: body.into(),
            ptx: None,
            cubin: None,
            entry: None,
            launch: None,
            prologue: None,
            epilogue: None,
            gemm: None,
            workspace_bytes: 0,
            workspace_scratch: false,
            bytes_read: 0,
            bytes_written: 0,
        });
        id
    }

    pub fn manifest(&self) -> Manifest {
        let arenas: Vec<ArenaPlan> = [Arena::Inputs, Arena::Params, Arena::OptimizerState, Arena::Activations]
            .into_iter()
            .map(|a| ArenaPlan { arena: a, bytes: self.used.get(&a).copied().unwrap_or(0) })
            .collect();
        let peak_bytes = arenas.iter().map(|a| a.bytes).sum();
        let activation_bytes_unplanned = self.buffers.iter().filter(|b| b.arena == Arena::Activations).map(|b| b.bytes.div_ceil(ALIGN) * ALIGN).sum();
        Manifest {
            format_version: FORMAT_VERSION,
            titan_version: "test".into(),
            content_hash: "0".repeat(64),
            model_hash: None,
            target: Target::sm90a(),
            model: BTreeMap::new(),
            dims: BTreeMap::from([("batch".to_string(), self.batch), ("seq".to_string(), self.seq)]),
            mesh: Mesh { world_size: 1, dims: vec![] },
            training: TrainingInfo { batch: self.batch, seq_len: self.seq, vocab_size: self.vocab, tokens_per_step: self.batch * self.seq, flops_per_token: 0 },
            buffers: self.buffers.clone(),
            memory: MemoryPlan { arenas, peak_bytes, activation_bytes_unplanned },
            kernels: self.kernels.clone(),
            ranks: vec![RankSchedule { rank: 0, steps: self.steps.clone() }],
            report: None,
            eval: None,
            build_switches: BTreeMap::new(),
        }
    }

    /// Write `manifest.json` and `graph.ir` into `dir`, with each kernel's `bytes_read` and
    /// `bytes_written` taken from its body in `graph`.
    pub fn write(&self, dir: &Path, graph: &str) {
        std::fs::create_dir_all(dir).expect("create artifact dir");
        let mut manifest = self.manifest();
        if let Ok((g, _)) = titan_ir::parse::parse(graph) {
            for k in &mut manifest.kernels {
                let Some(body) = g.block_by_name(&k.body) else { continue };
                let r = g.block(body);
                let bytes = |v: titan_ir::Value| {
                    let ty = r.ty(v);
                    ty.resolve(&g.dims).map_or(0, |s| s.iter().product::<usize>() as u64 * ty.dtype.size_bytes() as u64)
                };
                k.bytes_read = r.arg_values().map(bytes).sum();
                k.bytes_written = r.outputs.iter().map(|o| bytes(o.value)).sum();
            }
        }
        std::fs::write(dir.join("manifest.json"), manifest.to_json()).expect("write manifest");
        std::fs::write(dir.join("graph.ir"), graph).expect("write graph");
    }
}

/// The bigram model's training step, four kernels.
pub const BIGRAM_IR: &str = r#"graph @bigram_train {
  meta {vocab_size = 256}
  dims {batch = 4, seq = 16}

  block @k_fwd(%tokens: i32[batch, seq], %w: f32[256, 256]) {
    %wb = cast(%w) : bf16[256, 256]
    %logits = gather(%wb, %tokens) : bf16[batch, seq, 256]
    return %logits
  }

  block @k_loss(%logits: bf16[batch, seq, 256], %targets: i32[batch, seq]) {
    %loss = cross_entropy(%logits, %targets) : f32[]
    %one = constant() {value = 1.0} : f32[]
    %dlogits = cross_entropy_bwd(%logits, %targets, %one) : bf16[batch, seq, 256]
    return %loss, %dlogits
  }

  block @k_grad(%tokens: i32[batch, seq], %dlogits: bf16[batch, seq, 256]) {
    %dwb = scatter_add(%tokens, %dlogits) : bf16[256, 256]
    %dw = cast(%dwb) : f32[256, 256]
    %sq = square(%dw) : f32[256, 256]
    %ss = reduce_sum(%sq) {axes = [0, 1]} : f32[]
    %norm = sqrt(%ss) : f32[]
    return %dw, %norm
  }

  block @k_opt(%w: f32[256, 256], %dw: f32[256, 256], %m: f32[256, 256], %v: f32[256, 256], %step: i32[]) {
    %lr = lr_schedule(%step) {lr = 0.05, warmup_steps = 2, decay_steps = 100, decay = cosine, min_lr_ratio = 0.1} : f32[]
    %w2, %m2, %v2 = adamw(%w, %dw, %m, %v, %lr, %step) {beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.01} : f32[256, 256], f32[256, 256], f32[256, 256]
    return %w2, %m2, %v2, %lr
  }

  func @main {
    input %tokens : i32[batch, seq]
    input %targets : i32[batch, seq]
    input %step : i32[]
    state %w : f32[256, 256] {name = "w", init = normal(0.02)}
    state %m : f32[256, 256] {name = "w.exp_avg", init = zeros}
    state %v : f32[256, 256] {name = "w.exp_avg_sq", init = zeros}
    %logits = kernel(%tokens, %w) {body = @k_fwd, kind = gather} : bf16[batch, seq, 256]
    %loss, %dlogits = kernel(%logits, %targets) {body = @k_loss, kind = fused} : f32[], bf16[batch, seq, 256]
    %dw, %grad_norm = kernel(%tokens, %dlogits) {body = @k_grad, kind = scatter_add} : f32[256, 256], f32[]
    %w2, %m2, %v2, %lr = kernel(%w, %dw, %m, %v, %step) {body = @k_opt, kind = optimizer} : f32[256, 256], f32[256, 256], f32[256, 256], f32[]
    output loss = %loss
    output grad_norm = %grad_norm
    output lr = %lr
    update %w <- %w2
    update %m <- %m2
    update %v <- %v2
  }
}
"#;

/// The bigram artifact's manifest: the optimizer updates `w`, `m`, `v` in place.
pub fn bigram() -> Fixture {
    let (b, s, v) = (4, 16, 256);
    let mut f = Fixture::new(b, s, v);
    let tokens = f.input("tokens", DType::I32, &[b, s]);
    let targets = f.input("targets", DType::I32, &[b, s]);
    let step = f.input("step", DType::I32, &[]);
    let w = f.state("w", "w", "normal(0.02)", &[v, v], BufferClass::Param);
    let m = f.state("m", "w.exp_avg", "zeros", &[v, v], BufferClass::OptimizerState);
    let vv = f.state("v", "w.exp_avg_sq", "zeros", &[v, v], BufferClass::OptimizerState);
    let logits = f.buffer("main.%logits", DType::BF16, &[b, s, v], BufferClass::Activation);
    let loss = f.buffer("main.%loss", DType::F32, &[], BufferClass::Activation);
    let dlogits = f.buffer("main.%dlogits", DType::BF16, &[b, s, v], BufferClass::Activation);
    let dw = f.buffer("main.%dw", DType::F32, &[v, v], BufferClass::Grad);
    let norm = f.buffer("main.%grad_norm", DType::F32, &[], BufferClass::Activation);
    let lr = f.buffer("main.%lr", DType::F32, &[], BufferClass::Activation);
    f.buffers[loss as usize].output = Some("loss".into());
    f.buffers[norm as usize].output = Some("grad_norm".into());
    f.buffers[lr as usize].output = Some("lr".into());
    let (k_fwd, k_loss, k_grad, k_opt) = (
        f.kernel("k_fwd", KernelKind::Gather),
        f.kernel("k_loss", KernelKind::Fused),
        f.kernel("k_grad", KernelKind::ScatterAdd),
        f.kernel("k_opt", KernelKind::Optimizer),
    );
    f.steps = vec![
        launch(k_fwd, vec![whole(tokens), whole(w)], vec![whole(logits)]),
        launch(k_loss, vec![whole(logits), whole(targets)], vec![whole(loss), whole(dlogits)]),
        launch(k_grad, vec![whole(tokens), whole(dlogits)], vec![whole(dw), whole(norm)]),
        launch(k_opt, vec![whole(w), whole(dw), whole(m), whole(vv), whole(step)], vec![whole(w), whole(m), whole(vv), whole(lr)]),
    ];
    f
}

/// A forward pass through three layers walked in reverse, with `DT` activations: an embedding
/// kernel, a copy into the loop's carry, a memset bias, a loop whose kernel reads and writes the
/// carry and a layer slice of a stacked output, and a loss kernel reading both.
pub fn looped_ir(dt: &str) -> String {
    format!(
        r#"graph @looped {{
  meta {{vocab_size = 256}}
  dims {{batch = 2, seq = 8}}

  block @k_embed(%tokens: i32[batch, seq], %emb: f32[256, 4]) {{
    %e = cast(%emb) : {dt}[256, 4]
    %h = gather(%e, %tokens) : {dt}[batch, seq, 4]
    return %h
  }}

  block @k_layer(%h: {dt}[batch, seq, 4], %w: f32[4]) {{
    %wc = cast(%w) : {dt}[4]
    %wb = broadcast(%wc) {{dims = [2]}} : {dt}[batch, seq, 4]
    %t = tanh(%h) : {dt}[batch, seq, 4]
    %u = mul(%t, %wb) : {dt}[batch, seq, 4]
    %o = add(%u, %h) : {dt}[batch, seq, 4]
    return %o, %t
  }}

  block @layer(%h: {dt}[batch, seq, 4], %w: f32[4]) {{
    %o, %t = kernel(%h, %w) {{body = @k_layer, kind = fused}} : {dt}[batch, seq, 4], {dt}[batch, seq, 4]
    return %o, %t
  }}

  block @k_loss(%h: {dt}[batch, seq, 4], %saved: {dt}[3, batch, seq, 4], %out: f32[256, 4], %bias: f32[256], %targets: i32[batch, seq]) {{
    %oc = cast(%out) : {dt}[256, 4]
    %logits = linear(%h, %oc) : {dt}[batch, seq, 256]
    %lf = cast(%logits) : f32[batch, seq, 256]
    %bb = broadcast(%bias) {{dims = [2]}} : f32[batch, seq, 256]
    %z = add(%lf, %bb) : f32[batch, seq, 256]
    %ce = cross_entropy(%z, %targets) : f32[]
    %sf = cast(%saved) : f32[3, batch, seq, 4]
    %sm = reduce_mean(%sf) {{axes = [0, 1, 2, 3]}} : f32[]
    %loss = add(%ce, %sm) : f32[]
    return %loss
  }}

  func @main {{
    input %tokens : i32[batch, seq]
    input %targets : i32[batch, seq]
    input %step : i32[]
    state %emb : f32[256, 4] {{name = "emb", init = normal(1.0)}}
    state %ws : f32[3, 4] {{name = "layers.{{i}}.w", init = normal(1.0)}}
    state %out : f32[256, 4] {{name = "out", init = normal(0.5)}}
    %h0 = kernel(%tokens, %emb) {{body = @k_embed, kind = gather}} : {dt}[batch, seq, 4]
    %h, %saved = repeat(%h0, %ws) {{block = @layer, count = 3, carry = 1, stacked = 1, reverse = true}} : {dt}[batch, seq, 4], {dt}[3, batch, seq, 4]
    %bias = constant() {{value = 0.0}} : f32[256]
    %loss = kernel(%h, %saved, %out, %bias, %targets) {{body = @k_loss, kind = fused}} : f32[]
    output loss = %loss
  }}
}}
"#
    )
}

/// Buffer ids of the looped fixture that tests break on purpose.
pub struct Looped {
    pub fixture: Fixture,
    pub carry_a: u32,
    pub carry_b: u32,
    pub saved: u32,
    pub bias: u32,
}

pub fn looped(dtype: DType) -> Looped {
    let (b, s, v) = (2, 8, 256);
    let mut f = Fixture::new(b, s, v);
    let tokens = f.input("tokens", DType::I32, &[b, s]);
    let targets = f.input("targets", DType::I32, &[b, s]);
    f.input("step", DType::I32, &[]);
    let emb = f.state("emb", "emb", "normal(1.0)", &[v, 4], BufferClass::Param);
    let ws = f.state("ws", "layers.{i}.w", "normal(1.0)", &[3, 4], BufferClass::Param);
    let out = f.state("out", "out", "normal(0.5)", &[v, 4], BufferClass::Param);
    let h0 = f.buffer("main.%h0", dtype, &[b, s, 4], BufferClass::Activation);
    let carry_a = f.buffer("layer.%h.0", dtype, &[b, s, 4], BufferClass::Activation);
    let carry_b = f.buffer("layer.%h.1", dtype, &[b, s, 4], BufferClass::Activation);
    let saved = f.buffer("main.%saved", dtype, &[3, b, s, 4], BufferClass::Activation);
    let bias = f.buffer("main.%bias", DType::F32, &[v], BufferClass::Activation);
    let loss = f.buffer("main.%loss", DType::F32, &[], BufferClass::Activation);
    f.buffers[loss as usize].output = Some("loss".into());
    let (k_embed, k_layer, k_loss) = (f.kernel("k_embed", KernelKind::Gather), f.kernel("k_layer", KernelKind::Fused), f.kernel("k_loss", KernelKind::Fused));
    let h_bytes = b * s * 4 * dtype.size_bytes() as u64;
    f.steps = vec![
        launch(k_embed, vec![whole(tokens), whole(emb)], vec![whole(h0)]),
        Step::Copy { src: whole(h0), dst: whole(carry_a), bytes: h_bytes, stream: 0 },
        Step::Memset { dst: whole(bias), bytes: v * 4, stream: 0 },
        Step::Loop {
            count: 3,
            reverse: true,
            carries: vec![[carry_a, carry_b]],
            body: vec![launch(k_layer, vec![carry(0, false), layer(ws)], vec![carry(0, true), layer(saved)])],
            prefetch: vec![],
        },
        // Three iterations end in carries[0][3 % 2].
        launch(k_loss, vec![whole(carry_b), whole(saved), whole(out), whole(bias), whole(targets)], vec![whole(loss)]),
    ];
    Looped { fixture: f, carry_a, carry_b, saved, bias }
}
