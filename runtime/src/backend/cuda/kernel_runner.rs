//! [`KernelRunner`]: one kernel of an artifact at a time, on operands it allocates itself, for
//! the kernel-by-kernel differential tests against the CPU backend and per-kernel timings.

use titan_ir::DType;
use titan_ir::op::KernelKind;

use super::autotune::check_gemm_extent;
use super::bad;
use super::driver::{DeviceBuffer, Event, Gpu};
use super::module::{Loaded, LoadedCode};
use crate::RuntimeError;
use crate::artifact::Artifact;

/// The type of one kernel operand.
#[derive(Clone, Debug, PartialEq)]
pub struct Operand {
    pub dtype: DType,
    pub shape: Vec<usize>,
}

impl Operand {
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size_bytes()
    }
}

/// Device inputs, device outputs and the outputs' types of one kernel.
type Operands = (Vec<DeviceBuffer>, Vec<DeviceBuffer>, Vec<Operand>);

/// What one launch of [`KernelRunner::run`] left behind.
pub struct KernelRun {
    /// Each output's bytes.
    pub outputs: Vec<Vec<u8>>,
    /// Whether the kernel's workspace is all zero again (true when it has none or it is scratch).
    pub workspace_zeroed: bool,
}

/// Launches single kernels of an artifact on operands it allocates (each its own
/// `cuMemAlloc`, so 256-byte aligned): the kernel-by-kernel differential tests and timings.
pub struct KernelRunner<'a> {
    artifact: &'a Artifact,
    code: LoadedCode,
    gpu: Gpu,
}

impl<'a> KernelRunner<'a> {
    /// Open the GPU and load every kernel that has GPU code (the others are reported by
    /// [`KernelRunner::has_gpu_code`]).
    pub fn new(artifact: &'a Artifact) -> Result<KernelRunner<'a>, RuntimeError> {
        let gpu = Gpu::open()?;
        let code = LoadedCode::load(&gpu, artifact, &artifact.manifest.kernels, &|_| [256; 3], true)?;
        Ok(KernelRunner { artifact, code, gpu })
    }

    pub fn device_name(&self) -> &str {
        &self.gpu.name
    }

    /// Compute capability of the GPU.
    pub fn capability(&self) -> Result<(i32, i32), RuntimeError> {
        Ok(self.gpu.capability()?)
    }

    /// Whether kernel `pos` (index in `manifest.kernels`) runs on the GPU.
    pub fn has_gpu_code(&self, pos: usize) -> bool {
        !matches!(self.code.kernels.get(pos), Some(Loaded::Missing) | None)
    }

    /// The argument and result types of kernel `pos`'s body.
    pub fn operands(&self, pos: usize) -> Result<(Vec<Operand>, Vec<Operand>), RuntimeError> {
        let k = self.artifact.manifest.kernels.get(pos).ok_or_else(|| bad(format!("kernel {pos} does not exist")))?;
        let (_, body) = self.artifact.kernel(k.id).ok_or_else(|| bad(format!("kernel `{}` has no body", k.name)))?;
        let dims = &self.artifact.graph.dims;
        let spec = |v| {
            let ty = body.ty(v);
            ty.resolve(dims).map(|shape| Operand { dtype: ty.dtype, shape }).map_err(|e| bad(format!("kernel `{}`: {e}", k.name)))
        };
        let ins = body.args.iter().map(|a| spec(a.value)).collect::<Result<Vec<_>, _>>()?;
        let outs = body.outputs.iter().map(|o| spec(o.value)).collect::<Result<Vec<_>, _>>()?;
        Ok((ins, outs))
    }

    fn alloc_operands(
        &self,
        pos: usize,
        out_fill: u8,
        fill_in: &mut dyn FnMut(usize, &Operand, u64) -> Result<(), RuntimeError>,
    ) -> Result<Operands, RuntimeError> {
        let name = &self.artifact.manifest.kernels[pos].name;
        let (ins, outs) = self.operands(pos)?;
        let mut din = Vec::new();
        for (i, o) in ins.iter().enumerate() {
            let b = self.gpu.alloc(o.bytes() as u64, 0, &format!("input {i} of kernel `{name}`"))?;
            fill_in(i, o, b.ptr)?;
            din.push(b);
        }
        let mut dout = Vec::new();
        for (i, o) in outs.iter().enumerate() {
            dout.push(self.gpu.alloc(o.bytes() as u64, out_fill, &format!("output {i} of kernel `{name}`"))?);
        }
        Ok((din, dout, outs))
    }

    /// For a GEMM, check that its operands hold what the description addresses.
    fn check_extent(&self, pos: usize, din: &[DeviceBuffer], dout: &[DeviceBuffer]) -> Result<(), RuntimeError> {
        let k = &self.artifact.manifest.kernels[pos];
        if let (KernelKind::Gemm, Some(g)) = (k.kind, &k.gemm) {
            let (Some(a), Some(c)) = (din.first(), dout.first()) else { return Err(bad(format!("GEMM `{}` needs two inputs and one output", k.name))) };
            let b = din.get(1).unwrap_or(a);
            check_gemm_extent(k, g, [a.bytes, b.bytes, c.bytes])?;
            if g.adds_input() {
                let Some(c_in) = din.get(2) else { return Err(bad(format!("GEMM `{}` adds its input 2, which it does not have", k.name))) };
                check_gemm_extent(k, g, [a.bytes, b.bytes, c_in.bytes])?;
            }
        }
        Ok(())
    }

    /// Launch kernel `pos` once on `inputs` (bytes in each argument's dtype), every output byte
    /// set to `fill` first (`0xff`, NaN, to catch unwritten elements; 0 for a `scatter_add`,
    /// which sums into the table the schedule zeroes), and read back the outputs and the
    /// workspace.
    pub fn run(&self, pos: usize, inputs: &[Vec<u8>], fill: u8) -> Result<KernelRun, RuntimeError> {
        self.gpu.bind()?;
        let name = self.artifact.manifest.kernels.get(pos).map(|k| k.name.clone()).unwrap_or_default();
        let (ins, _) = self.operands(pos)?;
        if inputs.len() != ins.len() || inputs.iter().zip(&ins).any(|(b, o)| b.len() != o.bytes()) {
            return Err(bad(format!("kernel `{name}`: the inputs do not match its {} arguments", ins.len())));
        }
        let (din, dout, outs) = self.alloc_operands(pos, fill, &mut |i, _, ptr| {
            self.gpu.upload(ptr, &inputs[i], || format!("copying input {i} of kernel `{name}`"))?;
            Ok(self.gpu.sync(|| format!("copying input {i} of kernel `{name}`"))?)
        })?;
        self.check_extent(pos, &din, &dout)?;
        let ip: Vec<u64> = din.iter().map(|b| b.ptr).collect();
        let op: Vec<u64> = dout.iter().map(|b| b.ptr).collect();
        let scratch = self.artifact.manifest.kernels[pos].workspace_scratch;
        if let (true, Loaded::Ptx { workspace: Some(w), .. }) = (scratch, &self.code.kernels[pos]) {
            // A scratch workspace may hold anything: poison it so a read before write shows.
            self.gpu.memset(w.ptr, fill, w.bytes as usize, || format!("poisoning the workspace of kernel `{name}`"))?;
        }
        self.code.launch(&self.gpu, &self.artifact.manifest.kernels, pos, &ip, &op, &|| "differential test".into())?;
        self.gpu.sync(|| format!("running kernel `{name}`"))?;
        let mut outputs = Vec::new();
        for (i, (b, o)) in dout.iter().zip(&outs).enumerate() {
            let mut host = vec![0u8; o.bytes()];
            self.gpu.download(&mut host, b.ptr, || format!("reading output {i} of kernel `{name}`"))?;
            outputs.push(host);
        }
        let workspace_zeroed = match &self.code.kernels[pos] {
            Loaded::Ptx { workspace: Some(w), .. } if !scratch => {
                let mut host = vec![0u8; w.bytes as usize];
                self.gpu.download(&mut host, w.ptr, || format!("reading the workspace of kernel `{name}`"))?;
                host.iter().all(|&b| b == 0)
            }
            _ => true,
        };
        Ok(KernelRun { outputs, workspace_zeroed })
    }

    /// Median milliseconds of one launch of kernel `pos` over `iters` launches (after a
    /// warm-up launch), on inputs tiled from `block(operand)` (a few KiB of valid values per
    /// operand, repeated over the whole buffer by device copies).
    pub fn time(&self, pos: usize, iters: usize, block: &mut dyn FnMut(&Operand) -> Vec<u8>) -> Result<f64, RuntimeError> {
        self.gpu.bind()?;
        let name = self.artifact.manifest.kernels.get(pos).map(|k| k.name.clone()).unwrap_or_default();
        let (din, dout, _) = self.alloc_operands(pos, 0, &mut |i, o, ptr| {
            let total = o.bytes();
            let mut b = block(o);
            let unit = o.dtype.size_bytes().max(1);
            b.truncate(total.min(b.len()) / unit * unit);
            if b.is_empty() {
                return Ok(());
            }
            self.gpu.upload(ptr, &b, || format!("filling input {i} of kernel `{name}`"))?;
            self.gpu.sync(|| format!("filling input {i} of kernel `{name}`"))?;
            // Double the filled prefix until the buffer is full.
            let mut filled = b.len();
            while filled < total {
                let n = filled.min(total - filled);
                self.gpu.copy(ptr + filled as u64, ptr, n, || format!("filling input {i} of kernel `{name}`"))?;
                filled += n;
            }
            Ok(self.gpu.sync(|| format!("filling input {i} of kernel `{name}`"))?)
        })?;
        self.check_extent(pos, &din, &dout)?;
        let ip: Vec<u64> = din.iter().map(|b| b.ptr).collect();
        let op: Vec<u64> = dout.iter().map(|b| b.ptr).collect();
        let at = || "timing".to_string();
        self.code.launch(&self.gpu, &self.artifact.manifest.kernels, pos, &ip, &op, &at)?;
        self.gpu.sync(|| format!("warming up kernel `{name}`"))?;
        let (e0, e1) = (Event::new()?, Event::new()?);
        let mut ms = Vec::with_capacity(iters.max(1));
        for _ in 0..iters.max(1) {
            self.gpu.record(&e0)?;
            self.code.launch(&self.gpu, &self.artifact.manifest.kernels, pos, &ip, &op, &at)?;
            self.gpu.record(&e1)?;
            ms.push(f64::from(e0.elapsed_ms(&e1)?));
        }
        ms.sort_by(f64::total_cmp);
        Ok(ms[ms.len() / 2])
    }
}
