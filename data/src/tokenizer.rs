//! A Hugging Face `tokenizer.json` with the document separators titan puts around every
//! document: the tokenizer's BOS and EOS special tokens.
//!
//! **Which tokens are BOS and EOS.** A `tokenizer_config.json` next to the `tokenizer.json` (as
//! Hugging Face model repositories ship it) names them in `bos_token` / `eos_token`; otherwise
//! the first of the tokenizer's added tokens among [`BOS_CANDIDATES`] is BOS and the first among
//! [`EOS_CANDIDATES`] is EOS (Llama 3: `<|begin_of_text|>` and `<|end_of_text|>`). A document is
//! encoded as `[BOS] text [EOS]`, leaving out the one that is missing; a tokenizer with neither
//! is refused, since documents would run into each other unmarked.
//!
//! The vocabulary size is the largest token id plus one (added tokens included), the number of
//! embedding rows a model needs for every id the tokenizer can produce.

use std::path::Path;

use tokenizers::Tokenizer;

use crate::DataError;

/// Added-token spellings taken as BOS, in order of preference.
pub const BOS_CANDIDATES: [&str; 5] = ["<|begin_of_text|>", "<s>", "<bos>", "<|startoftext|>", "[BOS]"];
/// Added-token spellings taken as EOS, in order of preference.
pub const EOS_CANDIDATES: [&str; 5] = ["<|end_of_text|>", "</s>", "<eos>", "<|endoftext|>", "[EOS]"];

/// A tokenizer and its document separators.
pub struct TextTokenizer {
    inner: Tokenizer,
    name: String,
    vocab_size: usize,
    bos: Option<(String, u32)>,
    eos: Option<(String, u32)>,
}

fn tokenizer_error(name: &str, e: impl std::fmt::Display) -> DataError {
    DataError::Tokenizer { path: name.to_string(), message: e.to_string() }
}

/// The `bos_token` / `eos_token` of a `tokenizer_config.json`: a string or `{"content": ...}`.
fn config_token(config: &serde_json::Value, key: &str) -> Option<String> {
    match config.get(key)? {
        serde_json::Value::String(s) => Some(s.clone()),
        v => v.get("content")?.as_str().map(str::to_string),
    }
}

impl TextTokenizer {
    /// Load `tokenizer.json`, and `tokenizer_config.json` from the same directory when present.
    pub fn from_file(path: &Path) -> Result<TextTokenizer, DataError> {
        let name = path.display().to_string();
        let bytes = std::fs::read(path).map_err(|e| crate::io_error(path, e))?;
        let inner = Tokenizer::from_bytes(&bytes).map_err(|e| tokenizer_error(&name, format!("{e}; pass a Hugging Face tokenizer.json")))?;
        let config_path = path.with_file_name("tokenizer_config.json");
        let config = match std::fs::read(&config_path) {
            Ok(b) => Some(serde_json::from_slice(&b).map_err(|e| tokenizer_error(&config_path.display().to_string(), e))?),
            Err(_) => None,
        };
        TextTokenizer::new(inner, &name, config.as_ref())
    }

    /// A tokenizer already in memory; `name` names it in messages, `config` is the content of a
    /// `tokenizer_config.json` if there is one.
    pub fn new(inner: Tokenizer, name: &str, config: Option<&serde_json::Value>) -> Result<TextTokenizer, DataError> {
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&m| m as usize + 1);
        let find = |key: &str, candidates: &[&str]| -> Result<Option<(String, u32)>, DataError> {
            if let Some(token) = config.and_then(|c| config_token(c, key)) {
                let id = inner
                    .token_to_id(&token)
                    .ok_or_else(|| tokenizer_error(name, format!("tokenizer_config.json names {key} `{token}`, which is not in the tokenizer's vocabulary")))?;
                return Ok(Some((token, id)));
            }
            let added = inner.get_added_tokens_decoder();
            Ok(candidates.iter().find_map(|c| added.iter().find(|(_, t)| t.content == *c).map(|(&id, t)| (t.content.clone(), id))))
        };
        let bos = find("bos_token", &BOS_CANDIDATES)?;
        let eos = find("eos_token", &EOS_CANDIDATES)?;
        if bos.is_none() && eos.is_none() {
            return Err(tokenizer_error(
                name,
                format!(
                    "it has no BOS or EOS special token to separate documents (looked for {} and {}); add a tokenizer_config.json next to it naming bos_token or eos_token",
                    BOS_CANDIDATES.join(" "),
                    EOS_CANDIDATES.join(" ")
                ),
            ));
        }
        Ok(TextTokenizer { inner, name: name.to_string(), vocab_size, bos, eos })
    }

    /// The file (or name) the tokenizer came from.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The largest token id plus one.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The BOS token id, if the tokenizer has one.
    pub fn bos(&self) -> Option<u32> {
        self.bos.as_ref().map(|b| b.1)
    }

    /// The EOS token id, if the tokenizer has one.
    pub fn eos(&self) -> Option<u32> {
        self.eos.as_ref().map(|e| e.1)
    }

    /// One line for a run's start-up: the vocabulary and the separators.
    pub fn describe(&self) -> String {
        let sep = |t: &Option<(String, u32)>| t.as_ref().map_or("none".to_string(), |(s, id)| format!("{s} ({id})"));
        format!("tokenizer {} ({} tokens, BOS {}, EOS {})", self.name, self.vocab_size, sep(&self.bos), sep(&self.eos))
    }

    /// Refuse a model whose vocabulary cannot hold every id of this tokenizer.
    pub fn check_model_vocab(&self, model_vocab: usize) -> Result<(), DataError> {
        if self.vocab_size > model_vocab {
            return Err(DataError::Vocab { path: self.name.clone(), tokenizer_vocab: self.vocab_size, model_vocab });
        }
        Ok(())
    }

    /// Encode pieces of documents on several threads, in order: each piece is its text, whether
    /// it starts a document (BOS first) and whether it ends one (EOS last).
    pub fn encode_pieces(&self, pieces: &[(&str, bool, bool)]) -> Result<Vec<Vec<u32>>, DataError> {
        let texts: Vec<&str> = pieces.iter().map(|p| p.0).collect();
        let encodings = self.inner.encode_batch_fast(texts, false).map_err(|e| tokenizer_error(&self.name, e))?;
        Ok(encodings
            .iter()
            .zip(pieces)
            .map(|(enc, &(_, first, last))| {
                let ids = enc.get_ids();
                let mut out = Vec::with_capacity(ids.len() + 2);
                out.extend(self.bos().filter(|_| first));
                out.extend_from_slice(ids);
                out.extend(self.eos().filter(|_| last));
                out
            })
            .collect())
    }

    /// One whole document: `[BOS] text [EOS]`.
    pub fn encode_document(&self, text: &str) -> Result<Vec<u32>, DataError> {
        Ok(self.encode_pieces(&[(text, true, true)])?.pop().unwrap_or_default())
    }

    /// Token ids back to text (`skip_special` leaves BOS, EOS and other special tokens out).
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, DataError> {
        self.inner.decode(ids, skip_special).map_err(|e| tokenizer_error(&self.name, e))
    }
}
