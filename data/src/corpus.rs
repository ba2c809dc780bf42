//! Which files a data path names, and reading them as pieces of documents.
//!
//! A data path is a file, a directory (its files with the wanted extensions, not recursive) or a
//! glob (`shards/*.jsonl`); files are taken in sorted path order.
//!
//! **Documents.** Each non-blank line of a `.jsonl` file is one document, the string in its text
//! field (`text` unless told otherwise). A `.txt` file is one document, read in pieces of about
//! [`PIECE_BYTES`]: a piece ends after a newline that is followed by a character other than
//! whitespace, which is a boundary the pre-tokenizers of Llama 3 and GPT-2 (byte-level BPE with
//! their split pattern) never merge across, so the pieces tokenize to the tokens of the whole
//! file. A line longer than [`MAX_PIECE_BYTES`] is cut at a character boundary (the one place the
//! tokens may differ from the whole file's).
//!
//! The pieces depend only on the bytes from where reading starts, so reading from a piece's byte
//! offset gives the same pieces as reading through it: that is how a run resumes.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::{DataError, io_error};

/// The size a `.txt` piece aims at.
pub const PIECE_BYTES: usize = 1 << 20;
/// The longest piece: a longer line is cut at a character boundary.
pub const MAX_PIECE_BYTES: usize = 16 << 20;

/// How a corpus file holds its documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileKind {
    /// The whole file is one document.
    Text,
    /// One JSON object per line; its text field is the document.
    Jsonl,
}

impl FileKind {
    fn of(path: &Path) -> Option<FileKind> {
        match path.extension()?.to_str()? {
            "txt" => Some(FileKind::Text),
            "jsonl" => Some(FileKind::Jsonl),
            _ => None,
        }
    }
}

fn is_glob(spec: &str) -> bool {
    spec.contains(['*', '?', '['])
}

/// The files of a data path with one of `extensions` (without the dot), sorted. A file named
/// directly must have one of them too; `what` names the kind of data in messages.
pub fn resolve_paths(spec: &Path, extensions: &[&str], what: &str) -> Result<Vec<PathBuf>, DataError> {
    let wanted = |p: &Path| p.extension().and_then(|e| e.to_str()).is_some_and(|e| extensions.contains(&e));
    let list = extensions.iter().map(|e| format!(".{e}")).collect::<Vec<_>>().join(" or ");
    let text = spec.display().to_string();
    let mut files = if spec.is_file() {
        vec![spec.to_path_buf()]
    } else if spec.is_dir() {
        let entries = std::fs::read_dir(spec).map_err(|e| io_error(spec, e))?;
        let mut files = Vec::new();
        for entry in entries {
            let path = entry.map_err(|e| io_error(spec, e))?.path();
            if path.is_file() && wanted(&path) {
                files.push(path);
            }
        }
        if files.is_empty() {
            return Err(DataError::Source(format!("the directory `{text}` holds no {list} files of {what}")));
        }
        files
    } else if is_glob(&text) {
        let matches = glob::glob(&text).map_err(|e| DataError::Source(format!("`{text}` is not a valid glob: {e}")))?;
        let mut files = Vec::new();
        for m in matches {
            let path = m.map_err(|e| DataError::Source(format!("cannot read a match of `{text}`: {e}")))?;
            if path.is_file() {
                files.push(path);
            }
        }
        if files.is_empty() {
            return Err(DataError::Source(format!("no file matches `{text}`")));
        }
        files
    } else {
        return Err(DataError::Io { path: text, message: "no such file or directory".into() });
    };
    if let Some(bad) = files.iter().find(|p| !wanted(p)) {
        return Err(DataError::Source(format!("`{}` is not a {list} file of {what}", bad.display())));
    }
    files.sort();
    Ok(files)
}

/// The files of a text corpus and the JSONL field that holds the text.
#[derive(Clone, Debug)]
pub struct Corpus {
    pub files: Vec<(PathBuf, FileKind)>,
    pub text_field: String,
}

impl Corpus {
    /// The `.txt` and `.jsonl` files of a data path.
    pub fn open(spec: &Path, text_field: &str) -> Result<Corpus, DataError> {
        let files = resolve_paths(spec, &["txt", "jsonl"], "text")?;
        let files =
            files.into_iter().map(|p| (FileKind::of(&p).expect("invariant: resolve_paths kept .txt and .jsonl files"), p)).map(|(k, p)| (p, k)).collect();
        Ok(Corpus { files, text_field: text_field.to_string() })
    }

    /// The bytes of every file (for progress and throughput).
    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|(p, _)| std::fs::metadata(p).map_or(0, |m| m.len())).sum()
    }

    /// The file list with sizes, for the identity every rank of a run must share.
    pub fn fingerprint(&self) -> String {
        let files: Vec<String> = self.files.iter().map(|(p, _)| format!("{}:{}", p.display(), std::fs::metadata(p).map_or(0, |m| m.len()))).collect();
        format!("{} field {}", files.join(","), self.text_field)
    }
}

/// Where a piece starts: its file, byte offset in the file, and document (counted over the
/// whole corpus from the start of a pass).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceStart {
    pub file: usize,
    pub offset: u64,
    pub document: u64,
}

/// A piece of a document: its text and whether it starts or ends its document.
#[derive(Clone, Debug)]
pub struct Piece {
    pub start: PieceStart,
    pub text: String,
    pub first: bool,
    pub last: bool,
}

/// Reads a corpus as pieces from a start position to the end of its last file.
pub struct PieceReader {
    corpus: Corpus,
    next: PieceStart,
    open: Option<BufReader<File>>,
    /// `.txt`: bytes read from `next.offset` on, not yet handed out.
    pending: Vec<u8>,
    eof: bool,
    piece_bytes: usize,
}

fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r' | 0x0b | 0x0c)
}

/// Where a `.txt` piece of `bytes` ends: after the last newline before a non-space within the
/// first `window` bytes, looking further when there is none (None: read more first).
fn text_cut(bytes: &[u8], piece_bytes: usize, eof: bool) -> Option<usize> {
    let mut window = piece_bytes;
    loop {
        if bytes.len() <= window {
            return eof.then_some(bytes.len());
        }
        if let Some(p) = (1..=window).rev().find(|&p| bytes[p - 1] == b'\n' && !is_space(bytes[p])) {
            return Some(p);
        }
        if window >= MAX_PIECE_BYTES {
            // A line too long to keep whole: cut at a character boundary.
            return Some((1..=window).rev().find(|&p| bytes[p] & 0xc0 != 0x80).unwrap_or(window));
        }
        window = (window * 2).min(MAX_PIECE_BYTES);
    }
}

impl PieceReader {
    /// Read from `start` (a piece boundary: the start of the corpus or a recorded position).
    pub fn new(corpus: Corpus, start: PieceStart) -> PieceReader {
        PieceReader::with_piece_bytes(corpus, start, PIECE_BYTES)
    }

    /// As [`PieceReader::new`] with another `.txt` piece size (tests use small ones).
    pub fn with_piece_bytes(corpus: Corpus, start: PieceStart, piece_bytes: usize) -> PieceReader {
        PieceReader { corpus, next: start, open: None, pending: Vec::new(), eof: false, piece_bytes: piece_bytes.clamp(1, MAX_PIECE_BYTES) }
    }

    pub fn corpus(&self) -> &Corpus {
        &self.corpus
    }

    fn path(&self) -> &Path {
        &self.corpus.files[self.next.file].0
    }

    fn at(&self, offset: u64, message: String) -> DataError {
        DataError::At { path: self.path().display().to_string(), offset, message }
    }

    /// The next piece, `None` after the last file.
    pub fn next_piece(&mut self) -> Result<Option<Piece>, DataError> {
        loop {
            if self.next.file >= self.corpus.files.len() {
                return Ok(None);
            }
            if self.open.is_none() {
                let path = self.path().to_path_buf();
                let mut f = File::open(&path).map_err(|e| io_error(&path, e))?;
                let len = f.metadata().map_err(|e| io_error(&path, e))?.len();
                if self.next.offset > len {
                    return Err(DataError::Position(format!(
                        "`{}` has {len} bytes, fewer than the recorded data position {}; the file changed since the checkpoint",
                        path.display(),
                        self.next.offset
                    )));
                }
                f.seek(SeekFrom::Start(self.next.offset)).map_err(|e| io_error(&path, e))?;
                self.open = Some(BufReader::with_capacity(1 << 16, f));
                self.pending.clear();
                self.eof = false;
            }
            let piece = match self.corpus.files[self.next.file].1 {
                FileKind::Text => self.text_piece()?,
                FileKind::Jsonl => self.jsonl_piece()?,
            };
            match piece {
                Some(p) => return Ok(Some(p)),
                None => {
                    self.open = None;
                    self.next = PieceStart { file: self.next.file + 1, offset: 0, document: self.next.document };
                }
            }
        }
    }

    fn text_piece(&mut self) -> Result<Option<Piece>, DataError> {
        if self.eof && self.pending.is_empty() {
            return Ok(None);
        }
        let cut = loop {
            if let Some(cut) = text_cut(&self.pending, self.piece_bytes, self.eof) {
                break cut;
            }
            let mut block = vec![0u8; 1 << 16];
            let path = self.path().to_path_buf();
            let n = self.open.as_mut().expect("invariant: the file is open").read(&mut block).map_err(|e| io_error(&path, e))?;
            self.pending.extend_from_slice(&block[..n]);
            self.eof = n == 0;
        };
        let start = self.next;
        let rest = self.pending.split_off(cut);
        let bytes = std::mem::replace(&mut self.pending, rest);
        let text = String::from_utf8(bytes).map_err(|e| {
            let offset = start.offset + e.utf8_error().valid_up_to() as u64;
            self.at(offset, "the text is not valid UTF-8; convert the file to UTF-8 (e.g. `iconv -t UTF-8`)".into())
        })?;
        let last = self.eof && self.pending.is_empty();
        self.next.offset += cut as u64;
        if last {
            self.next.document += 1;
        }
        Ok(Some(Piece { start, text, first: start.offset == 0, last }))
    }

    fn jsonl_piece(&mut self) -> Result<Option<Piece>, DataError> {
        loop {
            let mut line = Vec::new();
            let path = self.path().to_path_buf();
            let n = self.open.as_mut().expect("invariant: the file is open").read_until(b'\n', &mut line).map_err(|e| io_error(&path, e))?;
            if n == 0 {
                return Ok(None);
            }
            let start = self.next;
            self.next.offset += n as u64;
            let complete = line.last() == Some(&b'\n');
            let text = std::str::from_utf8(&line)
                .map_err(|e| self.at(start.offset + e.valid_up_to() as u64, "the line is not valid UTF-8; JSON Lines files are UTF-8 text".into()))?;
            if text.trim().is_empty() {
                continue;
            }
            let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                if !complete && e.is_eof() {
                    let why = format!(
                        "the file ends in the middle of the JSON line that starts at byte {}; it is truncated (re-download or regenerate it)",
                        start.offset
                    );
                    return self.at(start.offset + n as u64, why);
                }
                self.at(start.offset + line_byte_offset(text, e.line(), e.column()), format!("the line is not valid JSON: {e}"))
            })?;
            let field = &self.corpus.text_field;
            let Some(doc) = value.get(field).and_then(|v| v.as_str()) else {
                let fields = value.as_object().map(|o| o.keys().map(String::as_str).collect::<Vec<_>>().join(", ")).unwrap_or_default();
                let has = if value.is_object() { format!("its fields: {fields}") } else { "it is not a JSON object".to_string() };
                return Err(
                    self.at(start.offset, format!("the line has no string field `{field}` ({has}); pass --text-field with the field that holds the text"))
                );
            };
            self.next.document += 1;
            return Ok(Some(Piece { start, text: doc.to_string(), first: true, last: true }));
        }
    }
}

/// The byte offset in `text` of serde_json's 1-based `line` and `column` (a column counts bytes).
fn line_byte_offset(text: &str, line: usize, column: usize) -> u64 {
    let line_start: usize = text.split_inclusive('\n').take(line.saturating_sub(1)).map(str::len).sum();
    (line_start + column.saturating_sub(1)).min(text.len()) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_pieces_end_after_a_newline_before_text() {
        let t = b"ab\ncd\n\n  ef\ngh";
        assert_eq!(text_cut(t, 4, false), Some(3));
        assert_eq!(text_cut(t, 8, false), Some(3), "\\n\\n  ef: no boundary before the spaces");
        assert_eq!(text_cut(t, 12, false), Some(12));
        assert_eq!(text_cut(t, 20, false), None, "more bytes may extend the last line");
        assert_eq!(text_cut(t, 20, true), Some(t.len()));
        assert_eq!(text_cut(b"abcdef", 2, false), None);
    }
}
