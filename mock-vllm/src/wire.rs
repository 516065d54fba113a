//! KV events as a real engine publishes them: msgpack batches in vLLM's
//! encodings (positional arrays or maps), with vLLM's u64 or SGLang's i64
//! hashes. Pure.

use protocol::Tier;
use rmp::encode;

/// How batches and events are encoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Encoding {
    /// Positional arrays, trailing defaults omitted (vLLM releases, SGLang).
    Array,
    /// Maps with a `type` tag, defaults omitted (newer vLLM builds).
    Map,
}

/// Whose hashes and envelope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Flavour {
    /// vLLM: unsigned 64-bit hashes, envelope `[ts, events, data_parallel_rank]`.
    Vllm,
    /// SGLang: signed i64 hashes, envelope `[ts, events, attn_dp_rank]`,
    /// maps with extra keys (`cache_salt`, `session_id`).
    Sglang,
}

/// One event, in engine terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EngineEvent {
    Stored {
        hashes: Vec<u64>,
        parent: Option<u64>,
        tokens: Vec<u32>,
        block_size: u32,
        tier: Tier,
    },
    Removed {
        hashes: Vec<u64>,
        tier: Tier,
    },
    AllCleared,
}

fn medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::Host => "CPU",
        Tier::Disk => "DISK",
    }
}

/// Encodes one batch.
pub fn encode_batch(
    ts: f64,
    events: &[EngineEvent],
    dp_rank: u32,
    encoding: Encoding,
    flavour: Flavour,
) -> Vec<u8> {
    let mut buf = Vec::with_capacity(64 + events.len() * 96);
    let w = &mut buf;
    // Writing to a Vec cannot fail.
    match encoding {
        Encoding::Array => {
            let _ = encode::write_array_len(w, 3);
            let _ = encode::write_f64(w, ts);
            write_events(w, events, encoding, flavour);
            let _ = encode::write_uint(w, u64::from(dp_rank));
        }
        Encoding::Map => {
            let _ = encode::write_map_len(w, 3);
            let _ = encode::write_str(w, "ts");
            let _ = encode::write_f64(w, ts);
            let _ = encode::write_str(w, "events");
            write_events(w, events, encoding, flavour);
            let _ = encode::write_str(
                w,
                match flavour {
                    Flavour::Vllm => "data_parallel_rank",
                    Flavour::Sglang => "attn_dp_rank",
                },
            );
            let _ = encode::write_uint(w, u64::from(dp_rank));
        }
    }
    buf
}

fn write_hash(w: &mut Vec<u8>, hash: u64, flavour: Flavour) {
    let _ = match flavour {
        // vLLM's low 64 bits of its digest, as msgpack uint64.
        Flavour::Vllm => encode::write_uint(w, hash),
        // SGLang's signed i64 of the first 8 digest bytes.
        Flavour::Sglang => encode::write_sint(w, hash as i64),
    };
}

fn write_hashes(w: &mut Vec<u8>, hashes: &[u64], flavour: Flavour) {
    let _ = encode::write_array_len(w, hashes.len() as u32);
    for &h in hashes {
        write_hash(w, h, flavour);
    }
}

fn write_events(w: &mut Vec<u8>, events: &[EngineEvent], encoding: Encoding, flavour: Flavour) {
    let _ = encode::write_array_len(w, events.len() as u32);
    for event in events {
        match (event, encoding) {
            (
                EngineEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    tier,
                },
                Encoding::Array,
            ) => {
                // [tag, block_hashes, parent, token_ids, block_size,
                // lora_id, medium]: lora_name and later fields are at
                // their defaults and omitted.
                let _ = encode::write_array_len(w, 7);
                let _ = encode::write_str(w, "BlockStored");
                write_hashes(w, hashes, flavour);
                match parent {
                    Some(p) => write_hash(w, *p, flavour),
                    None => {
                        let _ = encode::write_nil(w);
                    }
                }
                write_tokens(w, tokens);
                let _ = encode::write_uint(w, u64::from(*block_size));
                let _ = encode::write_nil(w);
                let _ = encode::write_str(w, medium(*tier));
            }
            (
                EngineEvent::Stored {
                    hashes,
                    parent,
                    tokens,
                    block_size,
                    tier,
                },
                Encoding::Map,
            ) => {
                let extra = flavour == Flavour::Sglang;
                let _ = encode::write_map_len(w, if extra { 10 } else { 8 });
                let _ = encode::write_str(w, "type");
                let _ = encode::write_str(w, "BlockStored");
                let _ = encode::write_str(w, "block_hashes");
                write_hashes(w, hashes, flavour);
                let _ = encode::write_str(w, "parent_block_hash");
                match parent {
                    Some(p) => write_hash(w, *p, flavour),
                    None => {
                        let _ = encode::write_nil(w);
                    }
                }
                let _ = encode::write_str(w, "token_ids");
                write_tokens(w, tokens);
                let _ = encode::write_str(w, "block_size");
                let _ = encode::write_uint(w, u64::from(*block_size));
                let _ = encode::write_str(w, "lora_id");
                let _ = encode::write_nil(w);
                let _ = encode::write_str(w, "medium");
                let _ = encode::write_str(w, medium(*tier));
                let _ = encode::write_str(w, "lora_name");
                let _ = encode::write_nil(w);
                if extra {
                    let _ = encode::write_str(w, "cache_salt");
                    let _ = encode::write_nil(w);
                    let _ = encode::write_str(w, "session_id");
                    let _ = encode::write_str(w, "mock-session");
                }
            }
            (EngineEvent::Removed { hashes, tier }, Encoding::Array) => {
                let _ = encode::write_array_len(w, 3);
                let _ = encode::write_str(w, "BlockRemoved");
                write_hashes(w, hashes, flavour);
                let _ = encode::write_str(w, medium(*tier));
            }
            (EngineEvent::Removed { hashes, tier }, Encoding::Map) => {
                let _ = encode::write_map_len(w, 3);
                let _ = encode::write_str(w, "type");
                let _ = encode::write_str(w, "BlockRemoved");
                let _ = encode::write_str(w, "block_hashes");
                write_hashes(w, hashes, flavour);
                let _ = encode::write_str(w, "medium");
                let _ = encode::write_str(w, medium(*tier));
            }
            (EngineEvent::AllCleared, Encoding::Array) => {
                let _ = encode::write_array_len(w, 1);
                let _ = encode::write_str(w, "AllBlocksCleared");
            }
            (EngineEvent::AllCleared, Encoding::Map) => {
                let _ = encode::write_map_len(w, 1);
                let _ = encode::write_str(w, "type");
                let _ = encode::write_str(w, "AllBlocksCleared");
            }
        }
    }
}

fn write_tokens(w: &mut Vec<u8>, tokens: &[u32]) {
    let _ = encode::write_array_len(w, tokens.len() as u32);
    for &t in tokens {
        let _ = encode::write_uint(w, u64::from(t));
    }
}

#[cfg(test)]
mod tests {
    use worker_agent::vllm::wire::{decode_batch, EngineHash, WireEvent};

    use super::*;

    /// What the mock encodes, the agent's decoder reads back.
    #[test]
    fn the_agent_decodes_every_encoding_and_flavour() {
        let events = vec![
            EngineEvent::Stored {
                hashes: vec![u64::MAX - 1, 5],
                parent: Some(1 << 63),
                tokens: vec![1, 2, 3, 4],
                block_size: 2,
                tier: Tier::Device,
            },
            EngineEvent::Removed {
                hashes: vec![5],
                tier: Tier::Host,
            },
            EngineEvent::AllCleared,
        ];
        for encoding in [Encoding::Array, Encoding::Map] {
            for flavour in [Flavour::Vllm, Flavour::Sglang] {
                let bytes = encode_batch(1.25, &events, 2, encoding, flavour);
                let b = decode_batch(&bytes).unwrap();
                assert_eq!(b.dp_rank, Some(2), "{encoding:?} {flavour:?}");
                assert_eq!(b.ts, Some(1.25));
                assert!(b.skipped.is_empty());
                let WireEvent::Stored(s) = &b.events[0] else {
                    panic!("{:?}", b.events[0]);
                };
                // The same 64-bit pattern, whether sent as u64 or i64.
                assert_eq!(
                    s.block_hashes,
                    vec![EngineHash::Int(u64::MAX - 1), EngineHash::Int(5)]
                );
                assert_eq!(s.parent, Some(EngineHash::Int(1 << 63)));
                assert_eq!(s.token_ids, vec![1, 2, 3, 4]);
                assert_eq!(s.medium.as_deref(), Some("GPU"));
                assert_eq!(s.cache_salt, None);
                assert!(
                    matches!(&b.events[1], WireEvent::Removed { medium: Some(m), .. } if m == "CPU")
                );
                assert_eq!(b.events[2], WireEvent::AllCleared);
            }
        }
    }
}
