//! Writing an artifact directory atomically: every file goes into a fresh temporary directory
//! next to the destination, which is then renamed into place. A failed build therefore never
//! leaves a half-written artifact, and a previous artifact at the destination is replaced only
//! once the new one is complete. A destination that exists but is not an artifact (no
//! `manifest.json`, not empty) is never touched.

use std::fs;
use std::path::{Path, PathBuf};

use titan_ir::artifact::{EVAL_GRAPH_FILE, GRAPH_FILE, KERNEL_DIR, MANIFEST_FILE};

use super::{Artifact, BuildError};

fn io(path: &Path, e: std::io::Error) -> BuildError {
    BuildError::Io { path: path.display().to_string(), message: e.to_string() }
}

/// A sibling of `dir` named `.<name>.<tag>-<pid>`.
fn sibling(parent: &Path, name: &str, tag: &str) -> PathBuf {
    parent.join(format!(".{name}.{tag}-{}", std::process::id()))
}

fn write_files(dir: &Path, a: &Artifact) -> Result<(), BuildError> {
    fs::create_dir_all(dir.join(KERNEL_DIR)).map_err(|e| io(dir, e))?;
    let manifest = a.manifest.to_json();
    let mut files: Vec<(&str, &str)> = vec![(MANIFEST_FILE, manifest.as_str()), (GRAPH_FILE, a.graph_text.as_str())];
    if let Some(text) = &a.eval_graph_text {
        files.push((EVAL_GRAPH_FILE, text.as_str()));
    }
    files.extend(a.ptx.iter().map(|(p, t)| (p.as_str(), t.as_str())));
    let cubins = a.cubins.iter().map(|(p, c)| (p.as_str(), c.as_slice()));
    for (rel, bytes) in files.into_iter().map(|(p, t)| (p, t.as_bytes())).chain(cubins) {
        let path = dir.join(rel);
        fs::write(&path, bytes).map_err(|e| io(&path, e))?;
    }
    Ok(())
}

/// Write `a` to `out_dir`, replacing a previous artifact there.
pub fn write_artifact(out_dir: &Path, a: &Artifact) -> Result<(), BuildError> {
    let name = out_dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| BuildError::Invalid(format!("`{}` does not name a directory; give `-o` a directory such as build/debug", out_dir.display())))?;
    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let existing = match fs::symlink_metadata(out_dir) {
        Ok(m) if m.is_dir() => {
            let empty = fs::read_dir(out_dir).map_err(|e| io(out_dir, e))?.next().is_none();
            if !empty && !out_dir.join(MANIFEST_FILE).is_file() {
                return Err(BuildError::NotArtifact { path: out_dir.display().to_string() });
            }
            true
        }
        Ok(_) => return Err(BuildError::NotArtifact { path: out_dir.display().to_string() }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
        Err(e) => return Err(io(out_dir, e)),
    };
    fs::create_dir_all(&parent).map_err(|e| io(&parent, e))?;
    let tmp = sibling(&parent, name, "tmp");
    if tmp.exists() {
        fs::remove_dir_all(&tmp).map_err(|e| io(&tmp, e))?;
    }
    if let Err(e) = write_files(&tmp, a) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(e);
    }
    if existing {
        let old = sibling(&parent, name, "old");
        if old.exists() {
            fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
        }
        if let Err(e) = fs::rename(out_dir, &old) {
            let _ = fs::remove_dir_all(&tmp);
            return Err(io(out_dir, e));
        }
        if let Err(e) = fs::rename(&tmp, out_dir) {
            let _ = fs::rename(&old, out_dir);
            let _ = fs::remove_dir_all(&tmp);
            return Err(io(out_dir, e));
        }
        fs::remove_dir_all(&old).map_err(|e| io(&old, e))?;
    } else if let Err(e) = fs::rename(&tmp, out_dir) {
        let _ = fs::remove_dir_all(&tmp);
        return Err(io(out_dir, e));
    }
    Ok(())
}
