//! llm.c token shards: a header of 256 little-endian `int32` (magic [`LLMC_MAGIC`], version 1
//! for `uint16` tokens or 2 for `uint32` ones, the token count at index 2), then the tokens.
//! [`ShardWriter`] writes a token stream as shards of a given size; [`ShardStream`] reads shards
//! back, in order and in bounded blocks, as the same token stream.

use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::stream::{Chunk, StreamPosition, TokenSource};
use crate::{DataError, io_error};

/// The first `int32` of an llm.c token file.
pub const LLMC_MAGIC: i32 = 20240520;
/// Bytes of an llm.c header: 256 `int32`.
pub const LLMC_HEADER_BYTES: usize = 256 * 4;
/// Tokens a [`ShardStream`] reads at a time.
pub const READ_BLOCK_TOKENS: usize = 1 << 16;

/// The llm.c version for a vocabulary: 1 (`uint16` tokens) when every id fits, else 2.
pub fn version_for_vocab(vocab: usize) -> i32 {
    if vocab <= 1 << 16 { 1 } else { 2 }
}

fn header(version: i32, count: i32) -> Vec<u8> {
    let mut h = [0i32; 256];
    (h[0], h[1], h[2]) = (LLMC_MAGIC, version, count);
    h.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Writes tokens into `DIR/<name>_000000.bin`, `_000001.bin`, ... of at most `shard_tokens`
/// tokens each; a shard's header gets its count when the shard is closed.
pub struct ShardWriter {
    dir: PathBuf,
    name: String,
    shard_tokens: u64,
    version: i32,
    open: Option<(PathBuf, BufWriter<File>, u64)>,
    written: Vec<PathBuf>,
}

impl ShardWriter {
    /// `vocab` picks the token width; the directory is created if needed.
    pub fn new(dir: &Path, name: &str, shard_tokens: u64, vocab: usize) -> Result<ShardWriter, DataError> {
        if shard_tokens == 0 || shard_tokens > i32::MAX as u64 {
            return Err(DataError::Source(format!("a shard of {shard_tokens} tokens cannot be written; llm.c shards hold 1 to {} tokens", i32::MAX)));
        }
        std::fs::create_dir_all(dir).map_err(|e| DataError::Write { path: dir.display().to_string(), message: e.to_string() })?;
        Ok(ShardWriter { dir: dir.to_path_buf(), name: name.to_string(), shard_tokens, version: version_for_vocab(vocab), open: None, written: Vec::new() })
    }

    fn write_error(path: &Path, e: impl std::fmt::Display) -> DataError {
        DataError::Write { path: path.display().to_string(), message: e.to_string() }
    }

    /// Append tokens, starting new shards as they fill.
    pub fn write(&mut self, mut tokens: &[u32]) -> Result<(), DataError> {
        while !tokens.is_empty() {
            if self.open.is_none() {
                let path = self.dir.join(format!("{}_{:06}.bin", self.name, self.written.len()));
                let file = File::create(&path).map_err(|e| Self::write_error(&path, e))?;
                let mut out = BufWriter::with_capacity(1 << 20, file);
                out.write_all(&header(self.version, 0)).map_err(|e| Self::write_error(&path, e))?;
                self.written.push(path.clone());
                self.open = Some((path, out, 0));
            }
            let (path, out, count) = self.open.as_mut().expect("invariant: a shard is open");
            let take = ((self.shard_tokens - *count) as usize).min(tokens.len());
            let mut bytes = Vec::with_capacity(take * 4);
            for &t in &tokens[..take] {
                if self.version == 1 {
                    bytes.extend_from_slice(&(t as u16).to_le_bytes());
                } else {
                    bytes.extend_from_slice(&t.to_le_bytes());
                }
            }
            out.write_all(&bytes).map_err(|e| Self::write_error(path, e))?;
            *count += take as u64;
            tokens = &tokens[take..];
            if *count == self.shard_tokens {
                self.close_shard()?;
            }
        }
        Ok(())
    }

    fn close_shard(&mut self) -> Result<(), DataError> {
        let Some((path, out, count)) = self.open.take() else { return Ok(()) };
        let mut file = out.into_inner().map_err(|e| Self::write_error(&path, e.error()))?;
        file.seek(SeekFrom::Start(8)).map_err(|e| Self::write_error(&path, e))?;
        file.write_all(&(count as i32).to_le_bytes()).map_err(|e| Self::write_error(&path, e))?;
        Ok(())
    }

    /// Close the last shard; the shards written, in order.
    pub fn finish(mut self) -> Result<Vec<PathBuf>, DataError> {
        self.close_shard()?;
        Ok(std::mem::take(&mut self.written))
    }
}

/// A shard's token width and count, from its header (checked against the file's length).
fn read_header(path: &Path, file: &mut File) -> Result<(usize, u64), DataError> {
    let name = path.display().to_string();
    let len = file.metadata().map_err(|e| io_error(path, e))?.len();
    let mut h = vec![0u8; LLMC_HEADER_BYTES];
    if len < LLMC_HEADER_BYTES as u64 {
        return Err(DataError::At { path: name, offset: 0, message: format!("{len} bytes, too short for the {LLMC_HEADER_BYTES}-byte llm.c header") });
    }
    file.read_exact(&mut h).map_err(|e| io_error(path, e))?;
    let int = |i: usize| i32::from_le_bytes([h[4 * i], h[4 * i + 1], h[4 * i + 2], h[4 * i + 3]]);
    if int(0) != LLMC_MAGIC {
        return Err(DataError::At { path: name, offset: 0, message: format!("not an llm.c token shard (no magic {LLMC_MAGIC})") });
    }
    let width = match int(1) {
        1 => 2,
        2 => 4,
        v => return Err(DataError::At { path: name, offset: 4, message: format!("llm.c version {v}, expected 1 (uint16 tokens) or 2 (uint32 tokens)") }),
    };
    let count = u64::try_from(int(2)).map_err(|_| DataError::At { path: name.clone(), offset: 8, message: format!("negative token count {}", int(2)) })?;
    let held = (len - LLMC_HEADER_BYTES as u64) / width as u64;
    if count > held {
        return Err(DataError::At {
            path: name,
            offset: 8,
            message: format!("truncated: the header declares {count} tokens but the file holds only {held}; regenerate it"),
        });
    }
    Ok((width, count))
}

/// The `.bin` shards of a data path (a file, a directory or a glob), in order, as one token
/// stream; with `wrap`, it starts over at the end (counting passes in `epoch`).
pub struct ShardStream {
    files: Vec<PathBuf>,
    wrap: bool,
    next: StreamPosition,
    open: Option<(File, usize, u64)>,
    read: (u64, u64),
}

impl ShardStream {
    /// Read `spec`'s shards from `start` (`offset` counts tokens of the shard; its first
    /// `start.token` tokens after it are dropped, as a text stream drops a piece's).
    pub fn open(spec: &Path, start: &StreamPosition, wrap: bool) -> Result<ShardStream, DataError> {
        let files = crate::corpus::resolve_paths(spec, &["bin"], "llm.c token shards")?;
        if start.file > 0 || start.offset > 0 || start.epoch > 0 {
            match files.get(start.file) {
                Some(p) if crate::stream::same_file(p, &start.path) => {}
                _ => {
                    return Err(DataError::Position(format!(
                        "the data position is in shard {} `{}`, which is not this data's shard {}; resume with the shards the checkpoint was written with",
                        start.file, start.path, start.file
                    )));
                }
            }
        }
        let next = StreamPosition { offset: start.offset + start.token, token: 0, ..start.clone() };
        Ok(ShardStream { files, wrap, next, open: None, read: (0, 0) })
    }

    pub fn files(&self) -> &[PathBuf] {
        &self.files
    }
}

impl TokenSource for ShardStream {
    fn next_chunk(&mut self) -> Result<Option<Chunk>, DataError> {
        let mut empty_files = 0;
        loop {
            if self.next.file >= self.files.len() {
                if !self.wrap || empty_files >= self.files.len() {
                    if self.wrap {
                        return Err(DataError::Source("the token shards hold no tokens".into()));
                    }
                    return Ok(None);
                }
                self.next = StreamPosition { epoch: self.next.epoch + 1, ..StreamPosition::default() };
            }
            let path = self.files[self.next.file].clone();
            if self.open.is_none() {
                let mut f = File::open(&path).map_err(|e| io_error(&path, e))?;
                let (width, count) = read_header(&path, &mut f)?;
                if self.next.offset > count {
                    return Err(DataError::Position(format!("`{}` holds {count} tokens, fewer than the data position {}", path.display(), self.next.offset)));
                }
                f.seek(SeekFrom::Start(LLMC_HEADER_BYTES as u64 + self.next.offset * width as u64)).map_err(|e| io_error(&path, e))?;
                self.open = Some((f, width, count));
            }
            let (f, width, count) = self.open.as_mut().expect("invariant: the shard is open");
            let n = (*count - self.next.offset).min(READ_BLOCK_TOKENS as u64) as usize;
            if n == 0 {
                empty_files += usize::from(*count == 0);
                self.open = None;
                self.next = StreamPosition { epoch: self.next.epoch, file: self.next.file + 1, ..StreamPosition::default() };
                continue;
            }
            let mut bytes = vec![0u8; n * *width];
            f.read_exact(&mut bytes).map_err(|e| io_error(&path, e))?;
            let tokens: Vec<u32> = match width {
                2 => bytes.chunks_exact(2).map(|c| u32::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
                _ => bytes.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            };
            let start = StreamPosition { path: path.display().to_string(), ..self.next.clone() };
            self.next.offset += n as u64;
            self.read.0 += bytes.len() as u64;
            self.read.1 += n as u64;
            return Ok(Some(Chunk { start, tokens, ends_document: false }));
        }
    }

    fn describe(&self) -> String {
        format!("{} llm.c token shard(s)", self.files.len())
    }

    fn counts(&self) -> (u64, u64) {
        self.read
    }
}
