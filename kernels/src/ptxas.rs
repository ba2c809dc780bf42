//! NVIDIA's `ptxas` (no GPU needed): validation of generated PTX (assemble for sm_90a and report
//! registers, spills, shared memory, stack and serialized `wgmma`s from `-v`) and assembly of
//! the sm_90a cubins that artifacts ship next to their PTX, so the driver need not JIT-compile
//! PTX at start-up.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};

use crate::KernelError;

/// What `ptxas -v` reports for one entry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PtxasReport {
    pub registers: u32,
    pub spill_stores: u64,
    pub spill_loads: u64,
    pub shared_bytes: u64,
    pub stack_bytes: u64,
    /// ptxas serialized the entry's `wgmma.mma_async` instructions (its C7512 "Potential
    /// Performance Loss" note: e.g. too few registers to keep an async chain's operands in
    /// place), which turns every asynchronous `wgmma` into issue-and-wait.
    pub wgmma_serialized: bool,
}

const INSTALL_HINT: &str = "install it with `pip install nvidia-cuda-nvcc` or point TITAN_PTXAS at a ptxas binary";

fn is_file(p: &Path) -> bool {
    p.is_file()
}

/// Temporary files unique to one call: process id, a per-process counter and the time.
fn unique_stem(entry: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos());
    let entry: String = entry.chars().map(|c| if c.is_ascii_alphanumeric() || c == '_' { c } else { '_' }).take(64).collect();
    format!("titan-{}-{n}-{nanos}-{entry}", std::process::id())
}

/// Find `ptxas`: `$TITAN_PTXAS`, then `ptxas` on `PATH`, then the one pip's `nvidia-cuda-nvcc`
/// installs (`cu13/bin/ptxas` or `cuda_nvcc/bin/ptxas` under the `nvidia` package).
pub fn find_ptxas() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("TITAN_PTXAS") {
        let p = PathBuf::from(p);
        return is_file(&p).then_some(p);
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let p = dir.join("ptxas");
            if is_file(&p) {
                return Some(p);
            }
        }
    }
    let out = Command::new("python3").args(["-c", "import nvidia, os; print(list(nvidia.__path__)[0])"]).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let root = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    ["cu13/bin/ptxas", "cuda_nvcc/bin/ptxas"].iter().map(|rel| root.join(rel)).find(|p| is_file(p))
}

/// Assemble `ptx` for sm_90a with `ptxas -v` and report on `entry`. Errors carry ptxas's output.
pub fn ptxas_check(ptx: &str, entry: &str) -> Result<PtxasReport, KernelError> {
    let ptxas = find_ptxas().ok_or_else(|| KernelError::Ptxas(format!("ptxas not found; {INSTALL_HINT}")))?;
    let dir = std::env::temp_dir();
    let unique = unique_stem(entry);
    let src = dir.join(format!("{unique}.ptx"));
    let obj = dir.join(format!("{unique}.cubin"));
    std::fs::write(&src, ptx).map_err(|e| KernelError::Ptxas(format!("cannot write `{}`: {e}", src.display())))?;
    let out = Command::new(&ptxas).arg("-arch=sm_90a").arg("-v").arg(&src).arg("-o").arg(&obj).output();
    let _ = std::fs::remove_file(&src);
    let _ = std::fs::remove_file(&obj);
    let out = out.map_err(|e| KernelError::Ptxas(format!("cannot run `{}`: {e}", ptxas.display())))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(KernelError::Ptxas(format!("ptxas rejected the PTX of `{entry}`:\n{text}")));
    }
    parse_report(&text, entry).ok_or_else(|| KernelError::Ptxas(format!("no `-v` report for entry `{entry}` in ptxas output:\n{text}")))
}

/// The flags [`assemble_cubin_with`] passes (cubin caches key on them).
pub const CUBIN_FLAGS: [&str; 3] = ["-arch=sm_90a", "-O3", "-v"];

/// A cubin and what ptxas reported on its entry while assembling it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Assembled {
    pub cubin: Vec<u8>,
    pub report: PtxasReport,
}

impl PtxasReport {
    /// The report on `entry` in ptxas's `-v` output, if it has one.
    pub fn parse(text: &str, entry: &str) -> Option<PtxasReport> {
        parse_report(text, entry)
    }

    /// Whether the kernel spills registers to local memory.
    pub fn spills(&self) -> bool {
        self.spill_stores > 0 || self.spill_loads > 0
    }

    /// What the tests refuse in a generated kernel: spills and serialized `wgmma`s, one line each.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.spills() {
            p.push(format!("{} bytes spill stores, {} bytes spill loads", self.spill_stores, self.spill_loads));
        }
        if self.wgmma_serialized {
            p.push("ptxas serialized its wgmma instructions (C7512)".to_string());
        }
        p
    }
}

/// Assemble `ptx` into an sm_90a cubin ([`CUBIN_FLAGS`]) with the `ptxas` that [`find_ptxas`]
/// finds. `entry` names the kernel in errors, which carry ptxas's output.
pub fn assemble_cubin(ptx: &str, entry: &str) -> Result<Assembled, KernelError> {
    let ptxas = find_ptxas().ok_or_else(|| KernelError::Ptxas(format!("ptxas not found; {INSTALL_HINT}")))?;
    assemble_cubin_with(&ptxas, ptx, entry)
}

/// [`assemble_cubin`] with a given `ptxas` binary (callers assembling many kernels find it once).
/// The cubin is an ELF image that `cuModuleLoadData` loads as it loads PTX; for the same PTX and
/// ptxas it is byte-identical across runs (ptxas embeds no paths or timestamps). The report
/// (registers, spills, shared memory) comes from the same run (`-v`), so a build learns about
/// spills without assembling twice.
pub fn assemble_cubin_with(ptxas: &Path, ptx: &str, entry: &str) -> Result<Assembled, KernelError> {
    let dir = std::env::temp_dir();
    let unique = unique_stem(entry);
    let src = dir.join(format!("{unique}.ptx"));
    let obj = dir.join(format!("{unique}.cubin"));
    std::fs::write(&src, ptx).map_err(|e| KernelError::Ptxas(format!("cannot write `{}`: {e}", src.display())))?;
    let out = Command::new(ptxas).args(CUBIN_FLAGS).arg(&src).arg("-o").arg(&obj).output();
    let _ = std::fs::remove_file(&src);
    let cubin = std::fs::read(&obj);
    let _ = std::fs::remove_file(&obj);
    let out = out.map_err(|e| KernelError::Ptxas(format!("cannot run `{}`: {e}", ptxas.display())))?;
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if !out.status.success() {
        return Err(KernelError::Ptxas(format!("ptxas rejected the PTX of `{entry}`:\n{text}")));
    }
    let cubin = cubin.map_err(|e| KernelError::Ptxas(format!("ptxas wrote no cubin for `{entry}` ({e}):\n{text}")))?;
    if !cubin.starts_with(b"\x7fELF") {
        return Err(KernelError::Ptxas(format!("ptxas wrote a cubin for `{entry}` that is not an ELF image:\n{text}")));
    }
    let report = parse_report(&text, entry).ok_or_else(|| KernelError::Ptxas(format!("no `-v` report for entry `{entry}` in ptxas output:\n{text}")))?;
    Ok(Assembled { cubin, report })
}

/// The first number before `what` in `line` (`"0 bytes spill stores"` -> 0).
fn number_before(line: &str, what: &str) -> Option<u64> {
    let pos = line.find(what)?;
    line[..pos].split(|c: char| !c.is_ascii_digit()).rfind(|s| !s.is_empty())?.parse().ok()
}

/// Read the `Function properties for <entry>` and `Used N registers` lines, and a C7512 note
/// (`wgmma.mma_async instructions are serialized ... function '<entry>'`) wherever it is.
fn parse_report(text: &str, entry: &str) -> Option<PtxasReport> {
    let (quoted, for_entry) = (format!("'{entry}'"), format!("for {entry}"));
    let mut in_entry = false;
    let mut r = PtxasReport::default();
    let mut seen = false;
    for line in text.lines() {
        if line.contains("instructions are serialized") && line.contains(&quoted) {
            r.wgmma_serialized = true;
        }
        if line.contains("Function properties for") || line.contains("Compiling entry function") {
            in_entry = line.trim_end().ends_with(&for_entry) || line.contains(&quoted);
            continue;
        }
        if !in_entry {
            continue;
        }
        if line.contains("bytes stack frame") {
            r.stack_bytes = number_before(line, "bytes stack frame")?;
            r.spill_stores = number_before(line, "bytes spill stores")?;
            r.spill_loads = number_before(line, "bytes spill loads")?;
        }
        if line.contains("Used") && line.contains("registers") {
            r.registers = u32::try_from(number_before(line, "registers")?).ok()?;
            r.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            seen = true;
        }
    }
    seen.then_some(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_parsed() {
        let text = "ptxas info    : 32 bytes gmem\n\
ptxas info    : Compiling entry function 'k' for 'sm_90a'\n\
ptxas info    : Function properties for k\n\
    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n\
ptxas info    : Used 14 registers, used 1 barriers, 256 bytes smem\n";
        let r = parse_report(text, "k").expect("report");
        assert_eq!(r, PtxasReport { registers: 14, spill_stores: 4, spill_loads: 12, shared_bytes: 256, stack_bytes: 8, wgmma_serialized: false });
        assert!(parse_report(text, "other").is_none());
        // ptxas 13's note when an async wgmma chain cannot keep its registers (seen on the
        // pipelined attention forward with Q in registers at head_dim 128): for that entry only.
        let note = "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'k'\n";
        let r = parse_report(&format!("{note}{text}"), "k").expect("report");
        assert!(r.wgmma_serialized);
        let other = text.replace("'k'", "'k2'").replace("for k", "for k2");
        assert!(!parse_report(&format!("{note}{other}"), "k2").expect("report").wgmma_serialized);
    }

    const TINY: &str = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry tiny()\n{\n\tret;\n}\n";

    #[test]
    fn cubins_are_elf_and_deterministic() {
        let Some(ptxas) = find_ptxas() else {
            eprintln!("ptxas not found; skipping cubin assembly");
            return;
        };
        let a = assemble_cubin_with(&ptxas, TINY, "tiny").unwrap_or_else(|e| panic!("{e}"));
        let b = assemble_cubin_with(&ptxas, TINY, "tiny").unwrap_or_else(|e| panic!("{e}"));
        assert!(a.cubin.starts_with(b"\x7fELF"));
        assert_eq!(a, b, "ptxas output differs between two runs");
        assert_eq!(Ok(&a.report), ptxas_check(TINY, "tiny").as_ref().map_err(ToString::to_string), "the same report as a separate check");
        let err = assemble_cubin_with(&ptxas, "not ptx", "broken").expect_err("bad PTX is rejected");
        assert!(err.to_string().contains("`broken`"), "{err}");
        let missing = assemble_cubin_with(Path::new("/nonexistent/ptxas"), TINY, "tiny").expect_err("no such ptxas");
        assert!(missing.to_string().contains("cannot run"), "{missing}");
    }
}
