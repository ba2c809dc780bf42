//! Training data: the byte-level tokenizer over text, and deterministic batching by seed.

use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// The small corpus bundled with titan, used when no data file is given.
pub const BUNDLED_CORPUS: &str = include_str!("../../examples/data/tiny_corpus.txt");

/// Byte-level tokenizer: every byte is its own token (vocab 256).
pub fn byte_tokens(text: &[u8]) -> Vec<u32> {
    text.iter().map(|&b| u32::from(b)).collect()
}

/// One batch: `tokens` and next-token `targets`, both `[batch, seq]` row-major.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Batch {
    pub tokens: Vec<i64>,
    pub targets: Vec<i64>,
}

/// Samples windows of `seq + 1` tokens at positions drawn from a seeded generator, so the same
/// seed gives the same batches in every run.
pub struct Batcher {
    tokens: Vec<u32>,
    batch: usize,
    seq: usize,
    rng: ChaCha8Rng,
}

impl Batcher {
    pub fn new(tokens: Vec<u32>, batch: usize, seq: usize, seed: u64) -> Result<Batcher, String> {
        if tokens.len() < seq + 2 {
            return Err(format!("the data has {} tokens, fewer than seq_len + 2 = {}; use a larger data file or a shorter --seq-len", tokens.len(), seq + 2));
        }
        Ok(Batcher { tokens, batch, seq, rng: ChaCha8Rng::seed_from_u64(seed) })
    }

    /// The largest token id in the data (to check it fits the vocabulary).
    pub fn max_token(&self) -> u32 {
        self.tokens.iter().copied().max().unwrap_or(0)
    }

    pub fn next_batch(&mut self) -> Batch {
        let mut tokens = Vec::with_capacity(self.batch * self.seq);
        let mut targets = Vec::with_capacity(self.batch * self.seq);
        let last_start = self.tokens.len() - self.seq - 1;
        for _ in 0..self.batch {
            let start = self.rng.random_range(0..=last_start);
            let w = &self.tokens[start..start + self.seq + 1];
            tokens.extend(w[..self.seq].iter().map(|&t| i64::from(t)));
            targets.extend(w[1..].iter().map(|&t| i64::from(t)));
        }
        Batch { tokens, targets }
    }
}
