//! Training data: the byte-level tokenizer over text, pre-tokenized token files, and
//! deterministic batching by seed that can resume mid-run.
//!
//! Token files follow two conventions: nanoGPT's raw little-endian `uint16`/`uint32` arrays, and
//! llm.c's files (a header of 256 little-endian `int32`: magic [`LLMC_MAGIC`], version 1 for
//! `uint16` tokens or 2 for `uint32`, the token count at index 2; then the tokens), recognized
//! by their magic whatever format was asked for.
//!
//! Batch `k` (0-based) is drawn from a generator seeded by `(seed, k)` alone, so a run resumed at
//! step `k` sees exactly the batches an uninterrupted run sees from step `k` on.
//!
//! Text through a tokenizer and directories of llm.c shards are not sampled but streamed and
//! packed in order (`packed.rs`, TorchTitan's way); [`DataSource`] says which a run uses.

use std::path::Path;

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

pub mod packed;

pub use packed::{PackedBatches, PackedSpec};

/// The small corpus bundled with titan, used when no data file is given.
pub const BUNDLED_CORPUS: &str = include_str!("../../examples/data/tiny_corpus.txt");

pub use titan_data::llmc::{LLMC_HEADER_BYTES, LLMC_MAGIC};

/// Byte-level tokenizer: every byte is its own token (vocab 256).
pub fn byte_tokens(text: &[u8]) -> Vec<u32> {
    text.iter().map(|&b| u32::from(b)).collect()
}

/// How a data file encodes its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DataFormat {
    /// llm.c when the file starts with its magic; otherwise text, except that a `.bin` file
    /// without the magic is refused (its token width is unknown).
    Auto,
    /// Byte-level: every byte is a token.
    Text,
    /// Raw little-endian `uint16` tokens (nanoGPT).
    U16,
    /// Raw little-endian `uint32` tokens.
    U32,
    /// llm.c's header followed by `uint16` (version 1) or `uint32` (version 2) tokens.
    Llmc,
}

impl DataFormat {
    /// Parse a `--data-format` value.
    pub fn parse(s: &str) -> Result<DataFormat, DataError> {
        match s {
            "auto" => Ok(DataFormat::Auto),
            "text" => Ok(DataFormat::Text),
            "u16" => Ok(DataFormat::U16),
            "u32" => Ok(DataFormat::U32),
            "llmc" => Ok(DataFormat::Llmc),
            other => Err(DataError::Format(format!("unknown data format `{other}`; use auto, text, u16, u32 or llmc"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Auto => "auto",
            DataFormat::Text => "text",
            DataFormat::U16 => "u16",
            DataFormat::U32 => "u32",
            DataFormat::Llmc => "llmc",
        }
    }
}

/// Why a data file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read data file `{path}`: {message}")]
    Io { path: String, message: String },
    /// An output file (`--dump-batches`) that cannot be created or written.
    #[error("cannot write `{path}`: {message}")]
    Write { path: String, message: String },
    #[error("{0}")]
    Format(String),
    #[error(
        "token id {id} at position {position} is outside the model's vocabulary of {vocab} entries; tokenize with the model's tokenizer or build the model with --vocab-size {min_vocab} or more"
    )]
    Vocab { id: u32, position: usize, vocab: usize, min_vocab: u64 },
    #[error("{0}")]
    Batch(String),
}

fn int32_at(bytes: &[u8], i: usize) -> Option<i32> {
    let b = bytes.get(4 * i..4 * i + 4)?;
    Some(i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Whether `bytes` starts with an llm.c header (magic and a known version).
pub fn is_llmc(bytes: &[u8]) -> bool {
    int32_at(bytes, 0) == Some(LLMC_MAGIC) && matches!(int32_at(bytes, 1), Some(1 | 2))
}

fn raw_tokens(bytes: &[u8], width: usize, what: &str) -> Result<Vec<u32>, DataError> {
    if bytes.is_empty() {
        return Err(DataError::Format(format!("{what} holds no tokens; the file is too short")));
    }
    if !bytes.len().is_multiple_of(width) {
        return Err(DataError::Format(format!(
            "{what} has {} bytes, not a multiple of the {width}-byte token width; the file is too short or truncated, or pass the right --data-format",
            bytes.len()
        )));
    }
    Ok(match width {
        2 => bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
        _ => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
    })
}

fn llmc_tokens(bytes: &[u8], name: &str) -> Result<Vec<u32>, DataError> {
    if bytes.len() < LLMC_HEADER_BYTES {
        return Err(DataError::Format(format!("`{name}` has {} bytes, too short for the {LLMC_HEADER_BYTES}-byte llm.c header", bytes.len())));
    }
    if int32_at(bytes, 0) != Some(LLMC_MAGIC) {
        return Err(DataError::Format(format!("`{name}` does not start with the llm.c magic {LLMC_MAGIC}; pass --data-format u16, u32 or text")));
    }
    let width = match int32_at(bytes, 1) {
        Some(1) => 2,
        Some(2) => 4,
        v => {
            return Err(DataError::Format(format!("`{name}` is llm.c version {}, expected 1 (uint16 tokens) or 2 (uint32 tokens)", v.unwrap_or_default())));
        }
    };
    let count = int32_at(bytes, 2).unwrap_or_default();
    let count = usize::try_from(count).map_err(|_| DataError::Format(format!("`{name}` declares a negative token count {count}")))?;
    let body = &bytes[LLMC_HEADER_BYTES..];
    let held = body.len() / width;
    if count > held {
        return Err(DataError::Format(format!(
            "`{name}` is truncated: its llm.c header declares {count} tokens but the file holds only {held}; regenerate or re-download it"
        )));
    }
    raw_tokens(&body[..count * width], width, &format!("`{name}`"))
}

/// Decode the tokens of a data file's bytes in `format`; `name` names the file in errors.
pub fn decode_tokens(bytes: &[u8], format: DataFormat, name: &str) -> Result<Vec<u32>, DataError> {
    if format != DataFormat::Text && is_llmc(bytes) {
        return llmc_tokens(bytes, name);
    }
    match format {
        DataFormat::Text => Ok(byte_tokens(bytes)),
        DataFormat::U16 => raw_tokens(bytes, 2, &format!("`{name}`")),
        DataFormat::U32 => raw_tokens(bytes, 4, &format!("`{name}`")),
        DataFormat::Llmc => llmc_tokens(bytes, name),
        DataFormat::Auto if name.ends_with(".bin") => {
            Err(DataError::Format(format!("`{name}` has no llm.c header; pass --data-format u16 or u32 for a raw token array, or text")))
        }
        DataFormat::Auto => Ok(byte_tokens(bytes)),
    }
}

/// Read and decode a data file.
pub fn load_tokens(path: &Path, format: DataFormat) -> Result<Vec<u32>, DataError> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| DataError::Io { path: name.clone(), message: e.to_string() })?;
    decode_tokens(&bytes, format, &name)
}

/// Check every token id is below `vocab`; the error names the first offending id and position.
pub fn check_vocab(tokens: &[u32], vocab: usize) -> Result<(), DataError> {
    match tokens.iter().position(|&t| t as usize >= vocab) {
        Some(position) => {
            let max = tokens.iter().copied().max().unwrap_or(0);
            Err(DataError::Vocab { id: tokens[position], position, vocab, min_vocab: u64::from(max) + 1 })
        }
        None => Ok(()),
    }
}

/// One batch: `tokens` and next-token `targets`, both `[batch, seq]` row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<i64>,
    pub targets: Vec<i64>,
}

/// Samples windows of `seq + 1` tokens at positions drawn from a generator seeded by
/// `(seed, k)` for batch `k`: the same seed gives the same batches in every run, and a run can
/// start at any batch ([`Batcher::seek`]).
pub struct Batcher {
    tokens: Vec<u32>,
    batch: usize,
    seq: usize,
    seed: u64,
    /// The index of the next batch [`Batcher::next_batch`] returns.
    position: u64,
}

impl Batcher {
    pub fn new(tokens: Vec<u32>, batch: usize, seq: usize, seed: u64) -> Result<Batcher, String> {
        if tokens.len() < seq + 2 {
            return Err(format!("the data has {} tokens, fewer than seq_len + 2 = {}; use a larger data file or a shorter --seq-len", tokens.len(), seq + 2));
        }
        Ok(Batcher { tokens, batch, seq, seed, position: 0 })
    }

    /// The largest token id in the data (to check it fits the vocabulary).
    pub fn max_token(&self) -> u32 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    /// The index of the next batch.
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Continue from batch `k` (a resumed run at step `k` draws batch `k` next).
    pub fn seek(&mut self, k: u64) {
        self.position = k;
    }

    /// Batch `k`, the same whatever was drawn before.
    pub fn batch_at(&self, k: u64) -> Batch {
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&self.seed.to_le_bytes());
        key[8..16].copy_from_slice(&k.to_le_bytes());
        key[16..24].copy_from_slice(b"titanbat");
        let mut rng = ChaCha8Rng::from_seed(key);
        let mut tokens = Vec::with_capacity(self.batch * self.seq);
        let mut targets = Vec::with_capacity(self.batch * self.seq);
        let last_start = self.tokens.len() - self.seq - 1;
        for _ in 0..self.batch {
            let start = rng.random_range(0..=last_start);
            let w = &self.tokens[start..start + self.seq + 1];
            tokens.extend(w[..self.seq].iter().map(|&t| i64::from(t)));
            targets.extend(w[1..].iter().map(|&t| i64::from(t)));
        }
        Batch { tokens, targets }
    }

    pub fn next_batch(&mut self) -> Batch {
        let b = self.batch_at(self.position);
        self.position += 1;
        b
    }
}

/// Where a run's batches come from.
pub enum DataSource {
    /// Tokens held in memory, batches sampled by seed ([`Batcher`]): byte-level text or one
    /// token file.
    Sampled(Vec<u32>),
    /// A stream packed in order ([`PackedBatches`]).
    Packed(PackedSpec),
}

/// A run's batches, by the source's rule.
pub enum Batches {
    Sampled(Batcher),
    Packed(Box<PackedBatches>),
}

impl Batches {
    pub fn next_batch(&mut self) -> Result<Batch, DataError> {
        match self {
            Batches::Sampled(b) => Ok(b.next_batch()),
            Batches::Packed(p) => p.next_batch(),
        }
    }
}

/// `--dump-batches FILE`: every step's batch as it was fed, for a reference run (the PyTorch
/// parity check, `tools/torch_parity.py`) to train on exactly titan's batches.
///
/// Format: no header; for each step in order, the `tokens` then the `targets` of its batch,
/// each `batch * seq` little-endian `int32` in row-major `[batch, seq]` order. A file of
/// `steps` steps is `int32[steps, 2, batch, seq]` (`batch` and `seq` are the model's `dims`).
pub struct BatchDump {
    path: String,
    out: std::io::BufWriter<std::fs::File>,
}

impl BatchDump {
    /// Create (or truncate) `path`.
    pub fn create(path: &Path) -> Result<BatchDump, DataError> {
        let name = path.display().to_string();
        let file =
            std::fs::File::create(path).map_err(|e| DataError::Write { path: name.clone(), message: format!("{e}; pass a writable --dump-batches path") })?;
        Ok(BatchDump { path: name, out: std::io::BufWriter::new(file) })
    }

    /// Append one step's tokens then targets (flushed, so a failed run keeps the steps it ran).
    pub fn write(&mut self, batch: &Batch) -> Result<(), DataError> {
        use std::io::Write;
        let mut bytes = Vec::with_capacity(4 * (batch.tokens.len() + batch.targets.len()));
        for &t in batch.tokens.iter().chain(&batch.targets) {
            let t = i32::try_from(t).map_err(|_| DataError::Batch(format!("token id {t} does not fit the int32 of --dump-batches")))?;
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let io = |e: std::io::Error| DataError::Write { path: self.path.clone(), message: e.to_string() };
        self.out.write_all(&bytes).map_err(io)?;
        self.out.flush().map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn llmc(version: i32, count: i32, tokens: &[u8]) -> Vec<u8> {
        let mut h = vec![0i32; 256];
        (h[0], h[1], h[2]) = (LLMC_MAGIC, version, count);
        let mut out: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        out.extend_from_slice(tokens);
        out
    }

    #[test]
    fn every_format_decodes() {
        let u16s: Vec<u8> = [1u16, 300, 65535].iter().flat_map(|x| x.to_le_bytes()).collect();
        let u32s: Vec<u8> = [1u32, 300, 70000].iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(decode_tokens(&u16s, DataFormat::U16, "a").unwrap(), vec![1, 300, 65535]);
        assert_eq!(decode_tokens(&u32s, DataFormat::U32, "a").unwrap(), vec![1, 300, 70000]);
        assert_eq!(decode_tokens(b"hi", DataFormat::Text, "a").unwrap(), vec![104, 105]);
        assert_eq!(decode_tokens(b"hi", DataFormat::Auto, "a.txt").unwrap(), vec![104, 105]);
        let f = llmc(1, 3, &u16s);
        for fmt in [DataFormat::Auto, DataFormat::U16, DataFormat::U32, DataFormat::Llmc] {
            assert_eq!(decode_tokens(&f, fmt, "a.bin").unwrap(), vec![1, 300, 65535], "{fmt:?}");
        }
        assert_eq!(decode_tokens(&llmc(2, 3, &u32s), DataFormat::Auto, "a").unwrap(), vec![1, 300, 70000]);
    }

    #[test]
    fn bad_files_say_what_is_wrong() {
        let e = |b: &[u8], f| decode_tokens(b, f, "d.bin").unwrap_err().to_string();
        assert!(e(&[], DataFormat::U16).contains("too short"));
        assert!(e(&[1, 2, 3], DataFormat::U16).contains("not a multiple of the 2-byte"));
        assert!(e(&[0; 10], DataFormat::Llmc).contains("too short for the 1024-byte llm.c header"));
        assert!(e(&llmc(1, 5, &[0; 6]), DataFormat::Auto).contains("declares 5 tokens but the file holds only 3"));
        assert!(e(&[0; 8], DataFormat::Auto).contains("no llm.c header"));
        let v = check_vocab(&[1, 2, 300, 7], 256).unwrap_err().to_string();
        assert!(v.contains("token id 300 at position 2") && v.contains("vocabulary of 256"), "{v}");
        assert!(DataFormat::parse("u8").is_err());
    }

    #[test]
    fn dumped_batches_are_int32_tokens_then_targets() {
        let path = std::env::temp_dir().join(format!("titan-dump-{}.bin", std::process::id()));
        let b = Batch { tokens: vec![1, 2, 3, 4], targets: vec![2, 3, 4, 5] };
        let mut d = BatchDump::create(&path).unwrap();
        d.write(&b).unwrap();
        d.write(&b).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let ints: Vec<i32> = bytes.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(ints, [1, 2, 3, 4, 2, 3, 4, 5, 1, 2, 3, 4, 2, 3, 4, 5]);
    }

    #[test]
    fn an_unwritable_dump_path_is_named_as_an_output() {
        let path = std::env::temp_dir().join(format!("titan-no-such-dir-{}", std::process::id())).join("dump.bin");
        let e = BatchDump::create(&path).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(e.starts_with(&format!("cannot write `{}`: ", path.display())) && e.ends_with("pass a writable --dump-batches path"), "{e}");
    }

    #[test]
    fn batches_depend_on_seed_and_index_only() {
        let toks = byte_tokens(BUNDLED_CORPUS.as_bytes());
        let mut a = Batcher::new(toks.clone(), 2, 8, 7).unwrap();
        let all: Vec<Batch> = (0..5).map(|_| a.next_batch()).collect();
        let mut b = Batcher::new(toks.clone(), 2, 8, 7).unwrap();
        b.seek(3);
        assert_eq!(b.next_batch(), all[3]);
        assert_eq!(b.position(), 4);
        assert_ne!(all[0], all[1]);
        assert_ne!(Batcher::new(toks, 2, 8, 8).unwrap().batch_at(0), all[0]);
    }
}
