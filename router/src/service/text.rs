//! Text prompts and text output through a HuggingFace `tokenizer.json`.

use std::path::Path;
use std::sync::Arc;

/// Why a tokenizer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    #[error("loading the tokenizer {path}: {message}")]
    Load { path: String, message: String },
    #[error("tokenizing the prompt: {0}")]
    Encode(String),
}

/// A loaded tokenizer; cheap to clone.
#[derive(Clone)]
pub struct Text {
    tokenizer: Arc<tokenizers::Tokenizer>,
}

impl std::fmt::Debug for Text {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Text").finish_non_exhaustive()
    }
}

impl Text {
    /// Loads a `tokenizer.json`.
    pub fn load(path: &Path) -> Result<Self, TextError> {
        let tokenizer = tokenizers::Tokenizer::from_file(path).map_err(|e| TextError::Load {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Ok(Self {
            tokenizer: Arc::new(tokenizer),
        })
    }

    /// The prompt's token ids (with the tokenizer's special tokens, as
    /// engines' completion endpoints do).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.tokenizer
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Encode(e.to_string()))
    }

    /// The token ids of a rendered chat template (whose text has the
    /// special tokens it needs already).
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>, TextError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TextError::Encode(e.to_string()))
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
