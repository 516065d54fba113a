//! The Mooncake trace format (one JSON object per line), shared by the
//! simulator's replay and the index benchmark.

use serde::{Deserialize, Serialize};

/// Tokens per block id in Mooncake traces.
pub const MOONCAKE_BLOCK_TOKENS: usize = 512;

/// One request of a Mooncake trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MooncakeRecord {
    /// Milliseconds since the start of the trace.
    pub timestamp: u64,
    pub input_length: u32,
    pub output_length: u32,
    /// The prompt as block ids of 512 tokens each (the last may be partial):
    /// equal ids at equal positions mean equal tokens.
    pub hash_ids: Vec<u64>,
}

/// A trace line that is not a record.
#[derive(Debug, thiserror::Error)]
#[error("trace line {line}: {source}")]
pub struct TraceError {
    pub line: usize,
    #[source]
    pub source: serde_json::Error,
}

/// Parses a whole trace; `line` numbers in errors count from 1. Blank lines
/// are skipped.
pub fn parse_mooncake(text: &str) -> Result<Vec<MooncakeRecord>, TraceError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|source| TraceError {
                line: i + 1,
                source,
            })
        })
        .collect()
}

impl MooncakeRecord {
    /// The prompt as tokens: each block id expands to 512 deterministic
    /// pseudo-tokens (the same id always gives the same tokens), the last
    /// block cut so that the prompt has `input_length` tokens.
    pub fn tokens(&self) -> Vec<u32> {
        let mut tokens = Vec::with_capacity(self.input_length as usize);
        for id in &self.hash_ids {
            let want = (self.input_length as usize - tokens.len()).min(MOONCAKE_BLOCK_TOKENS);
            extend_block_tokens(*id, want, &mut tokens);
            if tokens.len() == self.input_length as usize {
                break;
            }
        }
        tokens
    }
}

/// Appends the first `n` pseudo-tokens of block id `id`.
pub fn extend_block_tokens(id: u64, n: usize, out: &mut Vec<u32>) {
    // splitmix64 stream seeded by the id: cheap and stable.
    let mut state = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5EED;
    for _ in 0..n {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        // Token ids of a 128k vocabulary.
        out.push(((z ^ (z >> 31)) % 128_000) as u32);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_expands_records() {
        let text = r#"{"timestamp": 0, "input_length": 700, "output_length": 5, "hash_ids": [3, 4]}

{"timestamp": 10, "input_length": 512, "output_length": 1, "hash_ids": [3]}"#;
        let records = parse_mooncake(text).unwrap();
        assert_eq!(records.len(), 2);
        let a = records[0].tokens();
        let b = records[1].tokens();
        assert_eq!(a.len(), 700);
        assert_eq!(&a[..512], &b[..]);
        assert_ne!(&a[512..], &b[..188]);
    }

    #[test]
    fn errors_name_the_line() {
        let err = parse_mooncake("{\"timestamp\": 0}\n").unwrap_err();
        assert_eq!(err.line, 1);
        assert!(err.to_string().starts_with("trace line 1:"), "{err}");
    }
}
