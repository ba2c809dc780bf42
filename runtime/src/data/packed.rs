//! Batches packed in order from a token stream (`titan_data`): text and JSONL through a Hugging
//! Face tokenizer (`titan-run --tokenizer`), or llm.c shards (`titanc data tokenize`'s output,
//! a directory or glob of `.bin`). Row `r` of a batch is the `r`-th next window of `seq + 1`
//! tokens; the stream's position is what a checkpoint records.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use titan_data::llmc::ShardStream;
use titan_data::stream::{StreamPosition, TextStream, TokenSource};
use titan_data::{Corpus, Packer, TextTokenizer};

use super::{Batch, DataError};

/// Where packed batches come from.
#[derive(Clone)]
pub enum PackedSpec {
    /// Text files through a tokenizer.
    Text { corpus: Corpus, tokenizer: Arc<TextTokenizer> },
    /// llm.c token shards.
    Shards { path: PathBuf },
}

impl PackedSpec {
    /// `--data PATH --tokenizer FILE [--text-field NAME]`.
    pub fn text(data: &Path, tokenizer: &Path, text_field: &str) -> Result<PackedSpec, DataError> {
        let tokenizer = Arc::new(TextTokenizer::from_file(tokenizer).map_err(from_data)?);
        let corpus = Corpus::open(data, text_field).map_err(from_data)?;
        Ok(PackedSpec::Text { corpus, tokenizer })
    }

    /// What every rank of a multi-process run must agree on.
    pub fn fingerprint(&self) -> String {
        match self {
            PackedSpec::Text { corpus, tokenizer } => format!("text {} tokenizer {} vocab {}", corpus.fingerprint(), tokenizer.name(), tokenizer.vocab_size()),
            PackedSpec::Shards { path } => format!("shards {}", path.display()),
        }
    }

    /// Refuse a model whose vocabulary cannot hold the tokenizer's ids (shards are checked
    /// batch by batch, their vocabulary being unknown).
    pub fn check_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        match self {
            PackedSpec::Text { tokenizer, .. } => tokenizer.check_model_vocab(model_vocab).map_err(from_data),
            PackedSpec::Shards { .. } => Ok(()),
        }
    }
}

pub(crate) fn from_data(e: titan_data::DataError) -> DataError {
    DataError::Format(e.to_string())
}

/// Batches of consecutive windows from a packed stream.
pub struct PackedBatches {
    packer: Packer,
    batch: usize,
    seq: usize,
    vocab: usize,
}

impl PackedBatches {
    /// Batches of `batch` rows of `seq` tokens from `start` (the stream's beginning, or the
    /// position a checkpoint recorded); every token must be below `vocab`.
    pub fn open(spec: &PackedSpec, batch: usize, seq: usize, vocab: usize, start: &StreamPosition) -> Result<PackedBatches, DataError> {
        PackedBatches::open_with(spec, batch, seq, vocab, start, true)
    }

    /// Batches of the stream read once from its start: [`PackedBatches::try_next_batch`] ends
    /// where the data does (`--val-steps -1`).
    pub fn open_once(spec: &PackedSpec, batch: usize, seq: usize, vocab: usize) -> Result<PackedBatches, DataError> {
        PackedBatches::open_with(spec, batch, seq, vocab, &StreamPosition::default(), false)
    }

    fn open_with(spec: &PackedSpec, batch: usize, seq: usize, vocab: usize, start: &StreamPosition, wrap: bool) -> Result<PackedBatches, DataError> {
        spec.check_vocab(vocab)?;
        let source: Box<dyn TokenSource> = match spec {
            PackedSpec::Text { corpus, tokenizer } => Box::new(TextStream::new(corpus.clone(), Arc::clone(tokenizer), start, wrap).map_err(from_data)?),
            PackedSpec::Shards { path } => Box::new(ShardStream::open(path, start, wrap).map_err(from_data)?),
        };
        Ok(PackedBatches { packer: Packer::new(source, seq + 1), batch, seq, vocab })
    }

    /// One line on what is read.
    pub fn describe(&self) -> String {
        format!("{}, packed in order into windows of seq + 1 = {} tokens", self.packer.source().describe(), self.seq + 1)
    }

    /// Bytes of text read and tokens produced so far (ahead of the batches handed out).
    pub fn counts(&self) -> (u64, u64) {
        self.packer.source().counts()
    }

    /// The position of the next batch's first token.
    pub fn position(&mut self) -> Result<StreamPosition, DataError> {
        self.packer.position().map_err(from_data)?.ok_or_else(|| DataError::Batch("invariant: a wrapping stream never ends".into()))
    }

    pub fn next_batch(&mut self) -> Result<Batch, DataError> {
        self.try_next_batch()?.ok_or_else(|| DataError::Batch("invariant: a wrapping stream never ends".into()))
    }

    /// The next whole batch; `None` when a stream opened with [`PackedBatches::open_once`] has
    /// fewer windows left than a batch has rows (they are dropped, as TorchTitan's validation
    /// loader drops its last partial batch).
    pub fn try_next_batch(&mut self) -> Result<Option<Batch>, DataError> {
        let mut tokens = Vec::with_capacity(self.batch * self.seq);
        let mut targets = Vec::with_capacity(self.batch * self.seq);
        for _ in 0..self.batch {
            let Some(w) = self.packer.next_window().map_err(from_data)? else { return Ok(None) };
            if let Some(i) = w.tokens.iter().position(|&t| t as usize >= self.vocab) {
                return Err(DataError::Format(format!(
                    "token id {} at {} (token {} of the window) is outside the model's vocabulary of {} entries; tokenize with the model's tokenizer or build the model with a larger --vocab-size",
                    w.tokens[i], w.start, i, self.vocab
                )));
            }
            tokens.extend(w.tokens[..self.seq].iter().map(|&t| i64::from(t)));
            targets.extend(w.tokens[1..].iter().map(|&t| i64::from(t)));
        }
        Ok(Some(Batch { tokens, targets }))
    }
}
