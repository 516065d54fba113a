//! Text prompts and text output through a HuggingFace `tokenizer.json`.

use std::path::Path;
use std::sync::{Arc, Mutex};

use tokenizers::PostProcessor;

use super::token_cache::{Checkpoints, Encoded, Outcome, Safety, TokenCache, Tokens};

/// Why a tokenizer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("loading the tokenizer {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizing the prompt: {0}")]
    Encode(String),
}

/// A loaded tokenizer, with its tokenization cache; cheap to clone.
#[derive(Clone)]
pub struct Text {
    tokenizer: Arc<tokenizers::Tokenizer>,
    /// Off when its size is 0 or the tokenizer failed the probe.
    cache: Option<Arc<Mutex<TokenCache>>>,
    /// Whether `encode` adds special tokens (a post-processor's BOS): then
    /// completion text prompts are not cached, chat prompts still are.
    adds_special: bool,
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Text").finish_non_exhaustive()
    }
}

impl Text {
    /// Loads a `tokenizer.json`, with a tokenization cache of at most
    /// `cache_bytes` (0: none).
    pub fn load(path: &Path, cache_bytes: u64) -> Result<Self, TextError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| TextError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self::new(tokenizer, cache_bytes))
    }

    /// A tokenizer with a cache of at most `cache_bytes` (0: none). The
    /// cache is on only when cutting this tokenizer's output at the
    /// cache's safe points gives what tokenizing whole gives
    /// ([`TokenCache::probe`]).
    pub fn new(tokenizer: tokenizers::Tokenizer, cache_bytes: u64) -> Self {
        let adds_special = tokenizer
            .get_post_processor()
            .is_some_and(|p| p.added_tokens(false) > 0);
        let longest_special = tokenizer
            .get_added_tokens_decoder()
            .values()
            .map(|t| t.content.len())
            .max()
            .unwrap_or(0);
        let safety = Safety {
            margin: longest_special + 64,
        };
        let cache = if cache_bytes == 0 {
            None
        } else if TokenCache::probe(safety, |t| tokens(&tokenizer, t)) {
            let max = usize::try_from(cache_bytes).unwrap_or(usize::MAX);
            Some(Arc::new(Mutex::new(TokenCache::new(max, safety))))
        } else {
            tracing::warn!(
                "the tokenization cache is off: this tokenizer does not tokenize a text's end alone as it does in context"
            );
            None
        };
        Self {
            tokenizer: Arc::new(tokenizer),
            cache,
            adds_special,
        }
    }

    /// Whether the tokenization cache is on.
    pub fn cached(&self) -> bool {
        self.cache.is_some()
    }

    /// Bytes the tokenization cache holds.
    pub fn cache_bytes(&self) -> usize {
        self.cache
            .as_ref()
            .map_or(0, |c| c.lock().map_or(0, |c| c.bytes()))
    }

    /// The prompt's token ids (with the tokenizer's special tokens, as
    /// engines' completion endpoints do).
    pub fn encode(&self, text: &str) -> Result<Encoded, TextError> {
        if self.adds_special {
            let ids = self
                .tokenizer
                .encode(text, true)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TextError::Encode(e.to_string()))?;
            return Ok(Encoded {
                ids,
                outcome: Outcome::Miss,
                reused: 0,
            });
        }
        self.encode_rendered(text)
    }

    /// The token ids of a rendered chat template (whose text has the
    /// special tokens it needs already), through the cache.
    pub fn encode_rendered(&self, text: &str) -> Result<Encoded, TextError> {
        let tokenize = |t: &str| tokens(&self.tokenizer, t);
        let Some(cache) = &self.cache else {
            return Ok(Encoded {
                ids: tokenize(text)?.ids,
                outcome: Outcome::Miss,
                reused: 0,
            });
        };
        // The lock is held to look up and to store, not to hash or to
        // tokenize.
        let checkpoints = Checkpoints::of(text);
        let plan = cache
            .lock()
            .map_err(|_| poisoned())?
            .plan(text, checkpoints);
        let (encoded, store) = plan.complete(text, tokenize)?;
        if let Some(store) = store {
            cache.lock().map_err(|_| poisoned())?.store(store);
        }
        Ok(encoded)
    }

    /// The text of output tokens (special tokens skipped). Undecodable ids
    /// give an empty string rather than an error: the ids are in the
    /// response anyway.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// An incremental decoder for a streamed response.
    pub fn stream(&self) -> TextStream {
        TextStream {
            text: self.clone(),
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
        }
    }
}

fn poisoned() -> TextError {
    TextError::Encode("the tokenization cache's lock is poisoned".into())
}

/// The ids and token start offsets (bytes) of `text`, no special tokens
/// added.
fn tokens(tokenizer: &tokenizers::Tokenizer, text: &str) -> Result<Tokens, TextError> {
    let encoding = tokenizer
        .encode(text, false)
        .map_err(|e| TextError::Encode(e.to_string()))?;
    Ok(Tokens {
        ids: encoding.get_ids().to_vec(),
        starts: encoding
            .get_offsets()
            .iter()
            .map(|&(start, _)| start as u32)
            .collect(),
    })
}

/// Turns streamed token ids into text pieces. Decoding tokens one at a time
/// breaks multi-token characters and word-boundary spaces; this decodes a
/// short window and emits what the new tokens added, holding back a piece
/// that ends in an incomplete character.
#[derive(Debug)]
pub struct TextStream {
    text: Text,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl TextStream {
    /// The text the new tokens add (possibly empty, when held back).
    pub fn push(&mut self, tokens: &[u32]) -> String {
        self.ids.extend_from_slice(tokens);
        let prefix = self
            .text
            .decode(&self.ids[self.prefix_offset..self.read_offset]);
        let full = self.text.decode(&self.ids[self.prefix_offset..]);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') && full.starts_with(&prefix) {
            let piece = full[prefix.len()..].to_owned();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            piece
        } else {
            String::new()
        }
    }

    /// Whatever was held back, at the end of the stream.
    pub fn finish(&mut self) -> String {
        let prefix = self
            .text
            .decode(&self.ids[self.prefix_offset..self.read_offset]);
        let full = self.text.decode(&self.ids[self.prefix_offset..]);
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_owned(),
            None => String::new(),
        }
    }
}
