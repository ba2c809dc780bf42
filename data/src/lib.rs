//! Training text for titan: a corpus of `.txt` and `.jsonl` files (a file, a directory or a glob
//! of shards) read as a stream of documents, tokenized by a Hugging Face `tokenizer.json` on
//! several threads, each document between the tokenizer's BOS and EOS, and packed into
//! `seq + 1`-token windows as TorchTitan packs them; llm.c `.bin` token shards written from the
//! same stream (`titanc data tokenize`) and read back as the same token stream.
//!
//! Memory is bounded by the read-ahead buffer, never by the corpus: a `.txt` file is read in
//! chunks cut at line boundaries, a `.jsonl` file one line (one document) at a time.
//!
//! Every place in the stream has a [`StreamPosition`] (file, byte offset of the chunk, document,
//! token within the chunk, pass over the data), which a checkpoint records so that a resumed run
//! continues with exactly the tokens an uninterrupted run would have seen.
//!
//! `titan-runtime` (`titan-run --tokenizer`) and `titan-compiler` (`titanc data tokenize`) both
//! use this crate; it knows nothing about graphs, artifacts or devices.

pub mod corpus;
pub mod llmc;
pub mod pack;
pub mod stream;
pub mod testing;
pub mod tokenize;
pub mod tokenizer;

pub use corpus::{Corpus, FileKind};
pub use pack::{Packer, Window};
pub use stream::{StreamPosition, TextStream, TokenSource};
pub use tokenizer::TextTokenizer;

/// Why a corpus, a tokenizer or a token shard cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("cannot read `{path}`: {message}")]
    Io { path: String, message: String },
    #[error("cannot write `{path}`: {message}")]
    Write { path: String, message: String },
    /// A corpus file whose contents are malformed at a byte offset.
    #[error("`{path}`, byte offset {offset}: {message}")]
    At { path: String, offset: u64, message: String },
    /// A data path that names nothing usable.
    #[error("{0}")]
    Source(String),
    #[error("cannot use the tokenizer `{path}`: {message}")]
    Tokenizer { path: String, message: String },
    #[error(
        "the tokenizer `{path}` has {tokenizer_vocab} tokens but the model's vocabulary has {model_vocab}; build the model with --vocab-size {tokenizer_vocab} (or more), or use the model's own tokenizer"
    )]
    Vocab { path: String, tokenizer_vocab: usize, model_vocab: usize },
    /// A checkpoint's data position that does not fit this data.
    #[error("{0}")]
    Position(String),
}

pub(crate) fn io_error(path: &std::path::Path, e: impl std::fmt::Display) -> DataError {
    DataError::Io { path: path.display().to_string(), message: e.to_string() }
}
