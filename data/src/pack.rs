//! Packing a token stream into training windows, as TorchTitan's `HuggingFaceDataset` does:
//! documents (each `[BOS] text [EOS]`) are concatenated into one stream, which is cut into
//! consecutive, non-overlapping windows of `seq + 1` tokens; a window's first `seq` tokens are
//! the inputs and its last `seq` the targets. A document longer than a window continues in the
//! next one; no token is dropped or padded.

use std::collections::VecDeque;

use crate::DataError;
use crate::stream::{Chunk, StreamPosition, TokenSource};

/// `seq + 1` tokens and the position of the first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Window {
    pub tokens: Vec<u32>,
    pub start: StreamPosition,
}

/// Cuts a token source into windows of a fixed length.
pub struct Packer {
    source: Box<dyn TokenSource>,
    window: usize,
    queue: VecDeque<Chunk>,
    /// Tokens of the front chunk already packed.
    used: usize,
}

impl Packer {
    /// Windows of `window` tokens (`seq + 1`) from `source`.
    pub fn new(source: Box<dyn TokenSource>, window: usize) -> Packer {
        Packer { source, window: window.max(1), queue: VecDeque::new(), used: 0 }
    }

    pub fn source(&self) -> &dyn TokenSource {
        self.source.as_ref()
    }

    /// Make the front chunk one with tokens left; false at the end of the source.
    fn fill_front(&mut self) -> Result<bool, DataError> {
        loop {
            match self.queue.front() {
                Some(c) if self.used < c.tokens.len() => return Ok(true),
                Some(_) => {
                    self.queue.pop_front();
                    self.used = 0;
                }
                None => match self.source.next_chunk()? {
                    Some(c) => self.queue.push_back(c),
                    None => return Ok(false),
                },
            }
        }
    }

    /// The position of the next token a window will start with (`None` at the end of a source
    /// that does not wrap around).
    pub fn position(&mut self) -> Result<Option<StreamPosition>, DataError> {
        if !self.fill_front()? {
            return Ok(None);
        }
        let front = self.queue.front().expect("invariant: fill_front left a chunk");
        Ok(Some(StreamPosition { token: front.start.token + self.used as u64, ..front.start.clone() }))
    }

    /// The next window, `None` when the source ends before it is full (its tokens are left).
    pub fn next_window(&mut self) -> Result<Option<Window>, DataError> {
        let Some(start) = self.position()? else { return Ok(None) };
        let mut tokens = Vec::with_capacity(self.window);
        while tokens.len() < self.window {
            if !self.fill_front()? {
                return Ok(None);
            }
            let front = self.queue.front().expect("invariant: fill_front left a chunk");
            let take = (self.window - tokens.len()).min(front.tokens.len() - self.used);
            tokens.extend_from_slice(&front.tokens[self.used..self.used + take]);
            self.used += take;
        }
        Ok(Some(Window { tokens, start }))
    }
}
