//! safetensors files: the byte layout titan writes (the one `safetensors::serialize` would
//! write, computed without the data), a file opened for reading boxes of its tensors, and
//! reading every tensor of a file as f32.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::{Dtype, SafeTensors};

use super::shard::for_each_run;
use super::{CheckpointError, io};

/// A tensor of a checkpoint file: its name, shape and values as f32.
#[derive(Clone, Debug, PartialEq)]
pub struct NamedTensor {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// The metadata every checkpoint file carries. One entry only: safetensors writes the map in
/// its iteration order, and the files of two identical runs must be byte-identical.
pub(super) fn file_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// The layout of an f32 safetensors file.
pub(super) struct FileLayout {
    /// The bytes before the data: length prefix and JSON header.
    pub(super) prefix: Vec<u8>,
    /// The file offset of every tensor's data.
    pub(super) offsets: HashMap<String, u64>,
    /// The file's length.
    pub(super) len: u64,
}

/// The layout of an f32 safetensors file of `tensors` (names, shapes), exactly as
/// `safetensors::serialize` writes it: tensors in name order, the header padded with spaces to 8
/// bytes.
pub(super) fn f32_file_layout(tensors: &[(String, Vec<usize>)], path: &Path) -> Result<FileLayout, CheckpointError> {
    let mut sorted: Vec<&(String, Vec<usize>)> = tensors.iter().collect();
    sorted.sort_by(|a, b| a.0.cmp(&b.0));
    let mut infos = Vec::with_capacity(sorted.len());
    let mut at = 0usize;
    for (name, shape) in sorted {
        let n = shape.iter().product::<usize>() * 4;
        infos.push((name.clone(), TensorInfo { dtype: Dtype::F32, shape: shape.clone(), data_offsets: (at, at + n) }));
        at += n;
    }
    let fmt = |e: &dyn std::fmt::Display| CheckpointError::Format { path: path.display().to_string(), message: e.to_string() };
    let starts: Vec<(String, usize)> = infos.iter().map(|(n, i)| (n.clone(), i.data_offsets.0)).collect();
    let metadata = Metadata::new(Some(file_metadata()), infos).map_err(|e| fmt(&e))?;
    let mut header = serde_json::to_string(&metadata).map_err(|e| fmt(&e))?.into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');
    let data_start = 8 + header.len() as u64;
    let mut prefix = (header.len() as u64).to_le_bytes().to_vec();
    prefix.extend_from_slice(&header);
    let offsets = starts.into_iter().map(|(n, s)| (n, data_start + s as u64)).collect();
    Ok(FileLayout { prefix, offsets, len: data_start + at as u64 })
}

/// A safetensors file opened for reading slices of its tensors (its header parsed and checked;
/// no tensor data read).
pub(super) struct TensorFile {
    pub(super) path: PathBuf,
    file: File,
    /// Every tensor: dtype, shape and the file offset of its data.
    pub(super) tensors: BTreeMap<String, (Dtype, Vec<usize>, u64)>,
}

impl TensorFile {
    pub(super) fn open(path: &Path) -> Result<TensorFile, CheckpointError> {
        let p = path.display().to_string();
        let bad = |message: String| CheckpointError::Format { path: p.clone(), message };
        let file = File::open(path).map_err(|e| io("read", path, e))?;
        let len = file.metadata().map_err(|e| io("read", path, e))?.len();
        let mut n = [0u8; 8];
        file.read_exact_at(&mut n, 0).map_err(|_| bad("shorter than a safetensors header".into()))?;
        let n = u64::from_le_bytes(n);
        if n > 100_000_000 || 8 + n > len {
            return Err(bad(format!("its header length {n} does not fit the file of {len} bytes")));
        }
        let mut header = vec![0u8; n as usize];
        file.read_exact_at(&mut header, 8).map_err(|e| io("read", path, e))?;
        let metadata: Metadata = serde_json::from_slice(&header).map_err(|e| bad(e.to_string()))?;
        let mut tensors = BTreeMap::new();
        for (name, info) in metadata.tensors() {
            let width = match info.dtype {
                Dtype::F32 => 4,
                Dtype::BF16 | Dtype::F16 => 2,
                other => return Err(bad(format!("tensor `{name}` is {other:?}; titan loads F32, BF16 and F16 tensors, convert it to one of those"))),
            };
            let (s, e) = info.data_offsets;
            let numel: usize = info.shape.iter().product();
            if e < s || e - s != numel * width || 8 + n + e as u64 > len {
                return Err(bad(format!("tensor `{name}` has data offsets {s}..{e}, which do not fit its shape {:?} or the file", info.shape)));
            }
            tensors.insert(name, (info.dtype, info.shape.clone(), 8 + n + s as u64));
        }
        Ok(TensorFile { path: path.to_path_buf(), file, tensors })
    }

    /// Read the box (`offset`, `shape`) of tensor `name` (of shape `full`) into `out` as f32.
    pub(super) fn read_box(&self, name: &str, full: &[usize], offset: &[usize], shape: &[usize], out: &mut [f32]) -> Result<(), CheckpointError> {
        let (dtype, _, base) = self.tensors.get(name).ok_or_else(|| CheckpointError::Mismatch(format!("`{}` has no tensor `{name}`", self.path.display())))?;
        let width = if *dtype == Dtype::F32 { 4 } else { 2 };
        let mut buf = Vec::new();
        for_each_run(full, offset, shape, &mut |src, dst, len| {
            buf.resize(len * width, 0);
            self.file.read_exact_at(&mut buf, base + (src * width) as u64).map_err(|e| io("read", &self.path, e))?;
            let out = &mut out[dst..dst + len];
            match dtype {
                Dtype::F32 => out.iter_mut().zip(buf.chunks_exact(4)).for_each(|(o, c)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]])),
                Dtype::BF16 => out.iter_mut().zip(buf.chunks_exact(2)).for_each(|(o, c)| *o = half::bf16::from_le_bytes([c[0], c[1]]).to_f32()),
                _ => out.iter_mut().zip(buf.chunks_exact(2)).for_each(|(o, c)| *o = half::f16::from_le_bytes([c[0], c[1]]).to_f32()),
            }
            Ok(())
        })
    }
}

/// Read every tensor of a safetensors file, converting bf16, f16 and f32 to f32.
pub fn read_safetensors(path: &Path) -> Result<BTreeMap<String, NamedTensor>, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|e| io("read", path, e))?;
    let p = path.display().to_string();
    let st = SafeTensors::deserialize(&bytes).map_err(|e| CheckpointError::Format { path: p.clone(), message: e.to_string() })?;
    let mut out = BTreeMap::new();
    for (name, view) in st.iter() {
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => data.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => data.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => {
                return Err(CheckpointError::Format {
                    path: p,
                    message: format!("tensor `{name}` is {other:?}; titan loads F32, BF16 and F16 tensors, convert it to one of those"),
                });
            }
        };
        out.insert(name.to_string(), NamedTensor { name: name.to_string(), shape: view.shape().to_vec(), values });
    }
    Ok(out)
}
