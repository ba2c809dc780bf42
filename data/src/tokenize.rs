//! `titanc data tokenize`: a text corpus tokenized once into llm.c shards, with a progress bar
//! (bytes, MB/s, tokens/s) and a summary. The shards hold exactly the token stream
//! `titan-run --tokenizer` packs from the same text: every document as `[BOS] text [EOS]`, in
//! file order.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::llmc::ShardWriter;
use crate::stream::{StreamPosition, TextStream, TokenSource};
use crate::{Corpus, DataError, TextTokenizer};

/// Where and how to write shards.
#[derive(Clone, Debug)]
pub struct TokenizeOptions {
    /// Tokens per shard (the last one holds the rest).
    pub shard_tokens: u64,
    /// Shard file names: `<name>_000000.bin`, ...
    pub name: String,
    /// Draw a progress bar on a terminal.
    pub progress: bool,
}

/// What a tokenization wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenizeSummary {
    pub files: usize,
    pub bytes: u64,
    pub documents: u64,
    pub tokens: u64,
    pub shards: Vec<PathBuf>,
    pub seconds: f64,
}

impl TokenizeSummary {
    pub fn tokens_per_document(&self) -> f64 {
        self.tokens as f64 / self.documents.max(1) as f64
    }

    /// The lines `titanc data tokenize` prints.
    pub fn render(&self) -> String {
        let s = self.seconds.max(1e-9);
        format!(
            "tokenized {} file(s), {:.2} MB: {} documents, {} tokens, {:.1} tokens per document\n{:.2} MB/s, {:.0} tokens/s ({:.2} s)\nwrote {} shard(s): {}\n",
            self.files,
            self.bytes as f64 / 1e6,
            self.documents,
            self.tokens,
            self.tokens_per_document(),
            self.bytes as f64 / 1e6 / s,
            self.tokens as f64 / s,
            self.seconds,
            self.shards.len(),
            self.shards.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(" ")
        )
    }
}

fn progress_bar(total_bytes: u64, show: bool) -> indicatif::ProgressBar {
    if !show {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(total_bytes);
    let style =
        indicatif::ProgressStyle::with_template("{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {msg}").expect("invariant: the progress template is valid");
    bar.set_style(style);
    bar
}

/// Tokenize `corpus` into shards in `out_dir`.
pub fn tokenize_to_shards(corpus: Corpus, tokenizer: Arc<TextTokenizer>, out_dir: &Path, opts: &TokenizeOptions) -> Result<TokenizeSummary, DataError> {
    let started = std::time::Instant::now();
    let files = corpus.files.len();
    let total = corpus.total_bytes();
    let mut writer = ShardWriter::new(out_dir, &opts.name, opts.shard_tokens, tokenizer.vocab_size())?;
    let mut stream = TextStream::new(corpus, tokenizer, &StreamPosition::default(), false)?;
    let bar = progress_bar(total, opts.progress);
    let (mut documents, mut tokens) = (0u64, 0u64);
    while let Some(chunk) = stream.next_chunk()? {
        writer.write(&chunk.tokens)?;
        documents += u64::from(chunk.ends_document);
        tokens += chunk.tokens.len() as u64;
        let (bytes, _) = stream.counts();
        bar.set_position(bytes);
        bar.set_message(format!("{tokens} tokens, {:.0} tokens/s", tokens as f64 / started.elapsed().as_secs_f64().max(1e-9)));
    }
    bar.finish_and_clear();
    let shards = writer.finish()?;
    let (bytes, _) = stream.counts();
    Ok(TokenizeSummary { files, bytes, documents, tokens, shards, seconds: started.elapsed().as_secs_f64() })
}
