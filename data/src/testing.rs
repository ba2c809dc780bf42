//! A small Llama-3-style tokenizer trained on the spot by the `tokenizers` crate (byte-level
//! BPE with `<|begin_of_text|>` and `<|end_of_text|>`), for tests and examples: no tokenizer is
//! downloaded anywhere in titan's tests. `examples/data/tokenizer.json` was written by
//! [`train_bpe`] on the bundled corpus with a vocabulary of 512.

use std::collections::HashSet;

use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{AddedToken, Tokenizer, TokenizerBuilder, TokenizerImpl};

use crate::{DataError, TextTokenizer};

/// The pre-tokenizer split pattern of Llama 3's `tokenizer.json` (tiktoken's `cl100k`-style
/// pattern), for tests that check titan handles it.
pub const LLAMA3_SPLIT_PATTERN: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Llama 3's document separators.
pub const SPECIAL_TOKENS: [&str; 2] = ["<|begin_of_text|>", "<|end_of_text|>"];

/// Train a byte-level BPE of `vocab_size` tokens (the 256 bytes, the two special tokens and
/// merges) on `texts`, returning the `tokenizer.json` text.
pub fn train_bpe_json(texts: &[&str], vocab_size: usize) -> Result<String, DataError> {
    let err = |e: tokenizers::Error| DataError::Tokenizer { path: "trained tokenizer".into(), message: e.to_string() };
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer = BpeTrainerBuilder::new()
        .show_progress(false)
        .vocab_size(vocab_size)
        .min_frequency(2)
        .special_tokens(SPECIAL_TOKENS.iter().map(|s| AddedToken::from(s.to_string(), true)).collect())
        .initial_alphabet(alphabet)
        .build();
    let mut tokenizer: TokenizerImpl<BPE, NormalizerWrapper, ByteLevel, ByteLevel, ByteLevel> = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None)
        .with_pre_tokenizer(Some(ByteLevel::default().add_prefix_space(false)))
        .with_post_processor(Some(ByteLevel::default().add_prefix_space(false)))
        .with_decoder(Some(ByteLevel::default()))
        .build()
        .map_err(err)?;
    tokenizer.train(&mut trainer, texts.iter()).map_err(err)?;
    tokenizer.to_string(false).map_err(err)
}

/// [`train_bpe_json`] loaded as a [`TextTokenizer`].
pub fn train_bpe(texts: &[&str], vocab_size: usize) -> Result<TextTokenizer, DataError> {
    let json = train_bpe_json(texts, vocab_size)?;
    let inner = Tokenizer::from_bytes(json.as_bytes()).map_err(|e| DataError::Tokenizer { path: "trained tokenizer".into(), message: e.to_string() })?;
    TextTokenizer::new(inner, "trained tokenizer", None)
}
