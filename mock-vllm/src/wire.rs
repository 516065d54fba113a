//! KV events as a real engine publishes them: msgpack batches in vLLM's
//! encodings (positional arrays, maps, or today's array batch of tagged-map
//! events), with vLLM's u64 or 32-byte digests or SGLang's i64 hashes. Pure.

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
    /// Today's shape (vLLM 0.33, SGLang 0.5): an array batch `[ts, events,
    /// rank]` whose events are tagged maps. vLLM's carry 32-byte SHA-256
    /// digests as bytes, `group_idx` 0 of kind `full_attention` and the new
    /// optional fields (`lookahead_token_ids`, `locality`, `ownership`,
    /// `session_id`); SGLang's carry i64 hashes, one `BlockStored` per page,
    /// `CPU_PINNED` for the host tier and `session_id`.
    Tagged,
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

/// SGLang 0.5's medium names.
fn sglang_medium(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "GPU",
        Tier::Host => "CPU_PINNED",
        Tier::Disk => "DISK",
    }
}

/// vLLM 0.33's 32-byte block hash standing for the mock's 64-bit one: the
/// 64 bits, then 24 bytes drawn from them (injective, as a digest is).
pub fn digest_of(hash: u64) -> [u8; 32] {
    let mut out = [0u8; 32];
    out[..8].copy_from_slice(&hash.to_be_bytes());
    let mut x = hash;
    for chunk in out[8..].chunks_exact_mut(8) {
        // splitmix64: a fixed bijection, so the tail is a function of the hash.
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_be_bytes());
    }
    out
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
        Encoding::Array | Encoding::Tagged => {
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
    write_hash_as(w, hash, flavour, false);
}

/// A hash as `flavour` publishes it; `digest`: vLLM 0.33's 32-byte bytes.
fn write_hash_as(w: &mut Vec<u8>, hash: u64, flavour: Flavour, digest: bool) {
    if digest && flavour == Flavour::Vllm {
        let _ = encode::write_bin(w, &digest_of(hash));
        return;
    }
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
    if encoding == Encoding::Tagged {
        match flavour {
            Flavour::Vllm => {
                let _ = encode::write_array_len(w, events.len() as u32);
                for event in events {
                    write_tagged_vllm(w, event);
                }
            }
            Flavour::Sglang => {
                // One BlockStored per page.
                let pages: Vec<EngineEvent> = events.iter().flat_map(per_page).collect();
                let _ = encode::write_array_len(w, pages.len() as u32);
                for event in &pages {
                    write_tagged_sglang(w, event);
                }
            }
        }
        return;
    }
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
            (_, Encoding::Tagged) => unreachable!("tagged events are written above"),
        }
    }
}

/// A stored event split into one event per block (SGLang publishes a page
/// at a time), each chained on the one before.
fn per_page(event: &EngineEvent) -> Vec<EngineEvent> {
    match event {
        EngineEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            tier,
        } if hashes.len() > 1 => {
            let bs = *block_size as usize;
            let mut parent = *parent;
            hashes
                .iter()
                .zip(tokens.chunks(bs))
                .map(|(&h, page)| {
                    let e = EngineEvent::Stored {
                        hashes: vec![h],
                        parent,
                        tokens: page.to_vec(),
                        block_size: *block_size,
                        tier: *tier,
                    };
                    parent = Some(h);
                    e
                })
                .collect()
        }
        other => vec![other.clone()],
    }
}

fn write_key_str(w: &mut Vec<u8>, key: &str, value: &str) {
    let _ = encode::write_str(w, key);
    let _ = encode::write_str(w, value);
}

/// vLLM 0.33: a tagged map with digests, the KV-cache group and the new
/// optional fields (defaults omitted).
fn write_tagged_vllm(w: &mut Vec<u8>, event: &EngineEvent) {
    match event {
        EngineEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            tier,
        } => {
            let _ = encode::write_map_len(w, if parent.is_some() { 12 } else { 11 });
            write_key_str(w, "type", "BlockStored");
            let _ = encode::write_str(w, "block_hashes");
            let _ = encode::write_array_len(w, hashes.len() as u32);
            for &h in hashes {
                write_hash_as(w, h, Flavour::Vllm, true);
            }
            if let Some(p) = parent {
                let _ = encode::write_str(w, "parent_block_hash");
                write_hash_as(w, *p, Flavour::Vllm, true);
            }
            let _ = encode::write_str(w, "token_ids");
            write_tokens(w, tokens);
            let _ = encode::write_str(w, "block_size");
            let _ = encode::write_uint(w, u64::from(*block_size));
            write_key_str(w, "medium", medium(*tier));
            let _ = encode::write_str(w, "group_idx");
            let _ = encode::write_uint(w, 0);
            write_key_str(w, "kv_cache_spec_kind", "full_attention");
            let _ = encode::write_str(w, "lookahead_token_ids");
            let _ = encode::write_array_len(w, 0);
            write_key_str(w, "locality", "local");
            write_key_str(w, "ownership", "owned");
            write_key_str(w, "session_id", "mock-session");
        }
        EngineEvent::Removed { hashes, tier } => {
            let _ = encode::write_map_len(w, 4);
            write_key_str(w, "type", "BlockRemoved");
            let _ = encode::write_str(w, "block_hashes");
            let _ = encode::write_array_len(w, hashes.len() as u32);
            for &h in hashes {
                write_hash_as(w, h, Flavour::Vllm, true);
            }
            write_key_str(w, "medium", medium(*tier));
            let _ = encode::write_str(w, "group_idx");
            let _ = encode::write_uint(w, 0);
        }
        EngineEvent::AllCleared => {
            let _ = encode::write_map_len(w, 1);
            write_key_str(w, "type", "AllBlocksCleared");
        }
    }
}

/// SGLang 0.5: a tagged map with i64 hashes and its extra keys.
fn write_tagged_sglang(w: &mut Vec<u8>, event: &EngineEvent) {
    match event {
        EngineEvent::Stored {
            hashes,
            parent,
            tokens,
            block_size,
            tier,
        } => {
            let _ = encode::write_map_len(w, if parent.is_some() { 7 } else { 6 });
            write_key_str(w, "type", "BlockStored");
            let _ = encode::write_str(w, "block_hashes");
            write_hashes(w, hashes, Flavour::Sglang);
            if let Some(p) = parent {
                let _ = encode::write_str(w, "parent_block_hash");
                write_hash(w, *p, Flavour::Sglang);
            }
            let _ = encode::write_str(w, "token_ids");
            write_tokens(w, tokens);
            let _ = encode::write_str(w, "block_size");
            let _ = encode::write_uint(w, u64::from(*block_size));
            write_key_str(w, "medium", sglang_medium(*tier));
            write_key_str(w, "session_id", "mock-session");
        }
        EngineEvent::Removed { hashes, tier } => {
            let _ = encode::write_map_len(w, 3);
            write_key_str(w, "type", "BlockRemoved");
            let _ = encode::write_str(w, "block_hashes");
            write_hashes(w, hashes, Flavour::Sglang);
            write_key_str(w, "medium", sglang_medium(*tier));
        }
        EngineEvent::AllCleared => {
            let _ = encode::write_map_len(w, 1);
            write_key_str(w, "type", "AllBlocksCleared");
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

    /// Today's shapes: vLLM 0.33's digests and group, SGLang 0.5's pages.
    #[test]
    fn the_agent_decodes_todays_shapes() {
        let events = vec![
            EngineEvent::Stored {
                hashes: vec![7, 8],
                parent: Some(6),
                tokens: vec![1, 2, 3, 4],
                block_size: 2,
                tier: Tier::Host,
            },
            EngineEvent::Removed {
                hashes: vec![8],
                tier: Tier::Host,
            },
        ];
        let b = decode_batch(&encode_batch(
            2.0,
            &events,
            1,
            Encoding::Tagged,
            Flavour::Vllm,
        ))
        .unwrap();
        assert!(b.skipped.is_empty(), "{:?}", b.skipped);
        assert_eq!(b.dp_rank, Some(1));
        let WireEvent::Stored(s) = &b.events[0] else {
            panic!("{:?}", b.events[0]);
        };
        let d = |h: u64| EngineHash::Bytes(digest_of(h).to_vec().into_boxed_slice());
        assert_eq!(s.block_hashes, vec![d(7), d(8)]);
        assert_eq!(s.parent, Some(d(6)));
        assert_eq!(s.group_idx, Some(0));
        assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
        assert!(matches!(
            &b.events[1],
            WireEvent::Removed {
                group_idx: Some(0),
                ..
            }
        ));

        let b = decode_batch(&encode_batch(
            2.0,
            &events,
            0,
            Encoding::Tagged,
            Flavour::Sglang,
        ))
        .unwrap();
        assert!(b.skipped.is_empty(), "{:?}", b.skipped);
        // One event per page, chained.
        let stored: Vec<_> = b
            .events
            .iter()
            .filter_map(|e| match e {
                WireEvent::Stored(s) => Some((s.block_hashes.clone(), s.parent.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            stored,
            vec![
                (vec![EngineHash::Int(7)], Some(EngineHash::Int(6))),
                (vec![EngineHash::Int(8)], Some(EngineHash::Int(7))),
            ]
        );
        let WireEvent::Stored(s) = &b.events[0] else {
            panic!()
        };
        assert_eq!(s.medium.as_deref(), Some("CPU_PINNED"));
        assert_ne!(digest_of(1), digest_of(2));
    }
}
