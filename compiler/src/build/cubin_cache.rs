//! A cache of assembled cubins (and ptxas's `-v` report on each) on disk, keyed by what
//! determines ptxas's output: its version banner, the flags and the PTX text. `ptxas` is most of a build's time (about 60% of the
//! debug model's; 0.87 s for the multi-tensor AdamW kernel alone at 70B) and its output is a
//! pure function of that key (`titan_kernels::ptxas`: byte-identical across runs), while a
//! rebuild with another flag (`--ac`, `--float8-filter`, a mesh) or of the same model changes
//! only some kernels' PTX. The cache returns exactly the bytes ptxas wrote for the same input, so an
//! artifact is byte-identical with or without it.
//!
//! Where: `$TITAN_CACHE_DIR/cubins`, else `$XDG_CACHE_HOME/titan/cubins`, else
//! `~/.cache/titan/cubins` (the GEMM autotuner's cache sits next to it); `TITAN_CUBIN_CACHE=off`
//! turns it off. Entries are written to a temporary name and renamed into place, so concurrent
//! builds never read a partial file; an unreadable or non-ELF entry is a miss (assembled again and
//! rewritten). Failing to write is not an error: the build just does not cache.

use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};
use titan_kernels::{Assembled, CUBIN_FLAGS, PtxasReport};

/// The cache directory, or `None` when caching is off or no home is known.
pub fn cache_dir() -> Option<PathBuf> {
    if std::env::var_os("TITAN_CUBIN_CACHE").is_some_and(|v| v == "off" || v == "0") {
        return None;
    }
    let root = if let Some(d) = std::env::var_os("TITAN_CACHE_DIR").filter(|d| !d.is_empty()) {
        PathBuf::from(d)
    } else if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        PathBuf::from(d).join("titan")
    } else {
        PathBuf::from(std::env::var_os("HOME").filter(|h| !h.is_empty())?).join(".cache").join("titan")
    };
    Some(root.join("cubins"))
}

/// A cache for one `ptxas` binary: its version banner goes into every key, so another ptxas
/// (an upgrade, `TITAN_PTXAS`) never sees this one's cubins. `None` when the banner cannot be read.
pub struct CubinCache {
    dir: PathBuf,
    version: String,
}

impl CubinCache {
    /// The cache in `dir` for `ptxas` (runs `ptxas --version` once).
    pub fn open(dir: PathBuf, ptxas: &Path) -> Option<CubinCache> {
        let out = Command::new(ptxas).arg("--version").output().ok()?;
        if !out.status.success() {
            return None;
        }
        let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (!version.is_empty()).then_some(CubinCache { dir, version })
    }

    /// The entry's files without extension: `<sha256>` of the version, the flags and the PTX.
    fn stem(&self, ptx: &str) -> PathBuf {
        let mut h = Sha256::new();
        let flags = CUBIN_FLAGS.join(" ");
        for part in [self.version.as_str(), flags.as_str(), ptx] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        self.dir.join(hex)
    }

    /// The cubin and report assembled earlier from `ptx`, if any.
    pub fn get(&self, ptx: &str) -> Option<Assembled> {
        let stem = self.stem(ptx);
        let cubin = std::fs::read(stem.with_extension("cubin")).ok().filter(|c| c.starts_with(b"\x7fELF"))?;
        let report = parse_report(&std::fs::read_to_string(stem.with_extension("report")).ok()?)?;
        Some(Assembled { cubin, report })
    }

    /// Remember what ptxas made of `ptx` (best effort). The report is written first and the cubin
    /// last, each by a rename, so a reader that finds the cubin finds its report.
    pub fn put(&self, ptx: &str, a: &Assembled) {
        let stem = self.stem(ptx);
        if std::fs::create_dir_all(&self.dir).is_err() {
            return;
        }
        let r = &a.report;
        let report = format!(
            "registers {}\nspill_stores {}\nspill_loads {}\nshared_bytes {}\nstack_bytes {}\nwgmma_serialized {}\n",
            r.registers,
            r.spill_stores,
            r.spill_loads,
            r.shared_bytes,
            r.stack_bytes,
            u8::from(r.wgmma_serialized)
        );
        let _ = write_renamed(&stem.with_extension("report"), report.as_bytes()) && write_renamed(&stem.with_extension("cubin"), &a.cubin);
    }
}

/// Write `bytes` to a temporary file beside `path` and rename it there; whether it worked.
fn write_renamed(path: &Path, bytes: &[u8]) -> bool {
    let tmp = path.with_extension(format!("tmp{}-{:?}", std::process::id(), std::thread::current().id()).replace(['(', ')'], ""));
    if std::fs::write(&tmp, bytes).is_ok() && std::fs::rename(&tmp, path).is_ok() {
        return true;
    }
    let _ = std::fs::remove_file(&tmp);
    false
}

/// The report `put` wrote: `name value` lines, every field present (a report from before a
/// field existed is no report: the kernel is assembled again).
fn parse_report(text: &str) -> Option<PtxasReport> {
    let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse::<u64>().ok());
    Some(PtxasReport {
        registers: u32::try_from(field("registers")?).ok()?,
        spill_stores: field("spill_stores")?,
        spill_loads: field("spill_loads")?,
        shared_bytes: field("shared_bytes")?,
        stack_bytes: field("stack_bytes")?,
        wgmma_serialized: field("wgmma_serialized")? != 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = ".version 8.0\n.target sm_90a\n.address_size 64\n.visible .entry tiny()\n{\n\tret;\n}\n";

    #[test]
    fn a_cached_cubin_is_the_one_ptxas_wrote_and_keys_separate_inputs() {
        let Some(ptxas) = titan_kernels::find_ptxas() else {
            eprintln!("ptxas not found; skipping the cubin cache test");
            return;
        };
        let dir = std::env::temp_dir().join(format!("titan-cubin-cache-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let cache = CubinCache::open(dir.clone(), &ptxas).expect("ptxas --version");
        assert!(cache.version.contains("ptxas") || cache.version.contains("Cuda"), "{}", cache.version);
        assert!(cache.get(TINY).is_none(), "empty cache");
        let assembled = titan_kernels::assemble_cubin_with(&ptxas, TINY, "tiny").expect("assemble");
        cache.put(TINY, &assembled);
        assert_eq!(cache.get(TINY).as_ref(), Some(&assembled), "the cubin and the report come back");
        let other = TINY.replace("tiny", "other");
        assert!(cache.get(&other).is_none(), "another PTX is another key");
        // A corrupt entry is a miss, not a cubin; so is a cubin without its report.
        cache.put(&other, &assembled);
        std::fs::write(cache.stem(&other).with_extension("cubin"), b"not an ELF").expect("write");
        assert!(cache.get(&other).is_none());
        cache.put(&other, &assembled);
        std::fs::remove_file(cache.stem(&other).with_extension("report")).expect("remove");
        assert!(cache.get(&other).is_none());
        // Another ptxas version never sees these entries.
        let newer = CubinCache { dir: dir.clone(), version: format!("{} (another)", cache.version) };
        assert!(newer.get(TINY).is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
