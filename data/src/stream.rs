//! Token streams: a text corpus tokenized on a background thread (pieces read in order,
//! encoded in groups on every core, handed over through a bounded channel), and the position of
//! every token in the stream.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};

use serde::{Deserialize, Serialize};

use crate::corpus::{Corpus, PieceReader, PieceStart};
use crate::{DataError, TextTokenizer};

/// Text encoded per group of pieces: the bytes a group aims at.
pub const GROUP_BYTES: usize = 4 << 20;
/// Groups tokenized ahead of the consumer (the read-ahead buffer is about this many groups).
pub const GROUPS_AHEAD: usize = 2;

/// Where a token lies in a stream: the `document` (counted from the start of the pass) of the
/// piece that starts at byte `offset` of file number `file` (`path`), `token` tokens into that
/// piece's encoding (its BOS included), in pass `epoch` (0 for the first pass over the data).
/// For a stream of token shards, `offset` counts tokens of the shard and `document` is 0.
/// A checkpoint records the position of the next token a run will use.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamPosition {
    pub epoch: u64,
    pub file: usize,
    pub path: String,
    pub offset: u64,
    pub document: u64,
    pub token: u64,
}

impl std::fmt::Display for StreamPosition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "`{}` byte {} (document {}, token {} of its piece, pass {})", self.path, self.offset, self.document, self.token, self.epoch + 1)
    }
}

/// Whether `path` is the file a position recorded as `recorded` (spelled the same, or the same
/// file reached by another relative path).
pub(crate) fn same_file(path: &std::path::Path, recorded: &str) -> bool {
    path.display().to_string() == recorded || matches!((std::fs::canonicalize(path), std::fs::canonicalize(recorded)), (Ok(a), Ok(b)) if a == b)
}

/// Tokens in stream order and the position of the first.
#[derive(Clone, Debug)]
pub struct Chunk {
    pub start: StreamPosition,
    pub tokens: Vec<u32>,
    /// Whether the chunk ends a document (always false for token shards, which do not know).
    pub ends_document: bool,
}

/// A source of tokens in order.
pub trait TokenSource: Send {
    /// The next chunk; `None` at the end of a source that does not wrap around.
    fn next_chunk(&mut self) -> Result<Option<Chunk>, DataError>;
    /// What the source reads, for a run's start-up line.
    fn describe(&self) -> String;
    /// Bytes of text read and tokens produced so far.
    fn counts(&self) -> (u64, u64);
}

/// Bytes read and tokens produced, shared with the tokenizing thread.
#[derive(Default)]
struct Counts {
    bytes: AtomicU64,
    tokens: AtomicU64,
}

/// A text corpus tokenized ahead on a background thread.
pub struct TextStream {
    chunks: Receiver<Result<Vec<Chunk>, DataError>>,
    ready: std::collections::VecDeque<Chunk>,
    counts: Arc<Counts>,
    described: String,
    done: bool,
}

impl TextStream {
    /// Tokenize `corpus` from `start` (the start of the data, or a recorded position: reading
    /// resumes at its piece and drops the piece's first `start.token` tokens). With `wrap`, the
    /// stream starts over at the end of the data, counting passes in `epoch`.
    pub fn new(corpus: Corpus, tokenizer: Arc<TextTokenizer>, start: &StreamPosition, wrap: bool) -> Result<TextStream, DataError> {
        TextStream::with_piece_bytes(corpus, tokenizer, start, wrap, crate::corpus::PIECE_BYTES)
    }

    /// As [`TextStream::new`] with another `.txt` piece size (tests use small ones).
    pub fn with_piece_bytes(
        corpus: Corpus,
        tokenizer: Arc<TextTokenizer>,
        start: &StreamPosition,
        wrap: bool,
        piece_bytes: usize,
    ) -> Result<TextStream, DataError> {
        if start.file > 0 || start.offset > 0 || start.epoch > 0 {
            match corpus.files.get(start.file) {
                Some((p, _)) if same_file(p, &start.path) => {}
                found => {
                    return Err(DataError::Position(format!(
                        "the data position is in file {} `{}`, but this data's file {} is {}; resume with the data the checkpoint was written with",
                        start.file,
                        start.path,
                        start.file,
                        found.map_or("missing (too few files)".to_string(), |(p, _)| format!("`{}`", p.display()))
                    )));
                }
            }
        }
        let described =
            format!("{} file(s) of text ({} MB), {}", corpus.files.len(), format_args!("{:.2}", corpus.total_bytes() as f64 / 1e6), tokenizer.describe());
        let counts = Arc::new(Counts::default());
        let (tx, rx) = sync_channel(GROUPS_AHEAD);
        let begin = start.clone();
        let thread_counts = Arc::clone(&counts);
        std::thread::Builder::new()
            .name("titan-tokenize".into())
            .spawn(move || tokenize_ahead(corpus, tokenizer, begin, wrap, piece_bytes, thread_counts, tx))
            .map_err(|e| DataError::Source(format!("cannot start the tokenizing thread: {e}")))?;
        Ok(TextStream { chunks: rx, ready: Default::default(), counts, described, done: false })
    }
}

impl TokenSource for TextStream {
    fn next_chunk(&mut self) -> Result<Option<Chunk>, DataError> {
        while self.ready.is_empty() && !self.done {
            match self.chunks.recv() {
                Ok(group) => self.ready.extend(group?),
                Err(_) => self.done = true,
            }
        }
        Ok(self.ready.pop_front())
    }

    fn describe(&self) -> String {
        self.described.clone()
    }

    fn counts(&self) -> (u64, u64) {
        (self.counts.bytes.load(Ordering::Relaxed), self.counts.tokens.load(Ordering::Relaxed))
    }
}

/// The tokenizing thread: read pieces in groups, encode each group on every core, send it.
/// Returns when the data ends (without `wrap`), on an error (sent first) or when the stream is
/// dropped.
fn tokenize_ahead(
    corpus: Corpus,
    tokenizer: Arc<TextTokenizer>,
    start: StreamPosition,
    wrap: bool,
    piece_bytes: usize,
    counts: Arc<Counts>,
    tx: SyncSender<Result<Vec<Chunk>, DataError>>,
) {
    let mut epoch = start.epoch;
    let mut skip = start.token as usize;
    let mut reader = PieceReader::with_piece_bytes(corpus, PieceStart { file: start.file, offset: start.offset, document: start.document }, piece_bytes);
    let mut pieces_this_pass = 0u64;
    loop {
        let mut group = Vec::new();
        let mut bytes = 0;
        let mut ended = false;
        while bytes < GROUP_BYTES {
            match reader.next_piece() {
                Ok(Some(p)) => {
                    bytes += p.text.len().max(1);
                    group.push(p);
                }
                Ok(None) => {
                    ended = true;
                    break;
                }
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            }
        }
        pieces_this_pass += group.len() as u64;
        let texts: Vec<(&str, bool, bool)> = group.iter().map(|p| (p.text.as_str(), p.first, p.last)).collect();
        let encoded = match tokenizer.encode_pieces(&texts) {
            Ok(e) => e,
            Err(e) => {
                let _ = tx.send(Err(e));
                return;
            }
        };
        let files = &reader.corpus().files;
        let mut chunks = Vec::with_capacity(group.len());
        for (p, mut tokens) in group.iter().zip(encoded) {
            let mut token = 0;
            if skip > 0 {
                token = skip.min(tokens.len());
                tokens.drain(..token);
                skip = 0;
            }
            counts.bytes.fetch_add(p.text.len() as u64, Ordering::Relaxed);
            counts.tokens.fetch_add(tokens.len() as u64, Ordering::Relaxed);
            let start = StreamPosition {
                epoch,
                file: p.start.file,
                path: files[p.start.file].0.display().to_string(),
                offset: p.start.offset,
                document: p.start.document,
                token: token as u64,
            };
            chunks.push(Chunk { start, tokens, ends_document: p.last });
        }
        if !chunks.is_empty() && tx.send(Ok(chunks)).is_err() {
            return;
        }
        if ended {
            if !wrap {
                return;
            }
            if pieces_this_pass == 0 {
                let _ = tx.send(Err(DataError::Source("the data holds no documents (every file is empty or holds only blank lines)".into())));
                return;
            }
            epoch += 1;
            pieces_this_pass = 0;
            reader = PieceReader::with_piece_bytes(reader.corpus().clone(), PieceStart { file: 0, offset: 0, document: 0 }, piece_bytes);
        }
    }
}
