//! The decode side of vLLM's bidirectional KV transfer (the third path on
//! a real engine): the handles to finished requests' blocks that the
//! engine returned in their `kv_transfer_params`, kept until the prefill
//! worker of a later turn takes one to pull that turn's prefix. Pure: the
//! clock is a parameter.
//!
//! - A handle is found by block hash: the hash of the last whole block of
//!   the request's prompt, and of its prompt and output (when the output's
//!   ids are known). Hashes are chained, so one names its whole prefix: a
//!   later prompt whose leading blocks include it starts with exactly the
//!   tokens the handle covers up to there.
//! - A handle covering more than the blocks matched is cut to them
//!   (`remote_num_tokens`, and `remote_block_ids` when the engine has one
//!   KV cache group): vLLM pulls `min(remote_num_tokens, prompt)` tokens and
//!   reads the remote blocks' suffix past its own cache hit, which is
//!   correct only when the prompt starts with every token pulled
//!   (vllm-project/vllm#43094). A handle of several groups is not cut.
//! - Single use, as vLLM frees the blocks after the first read: taking a
//!   handle removes it. A handle older than the TTL (below the engine's
//!   `decoder_kv_blocks_ttl`, after which it declines the read) is dropped;
//!   so are the oldest while the handles kept take more than their memory
//!   bound (a handle lists a block id for every block of its conversation:
//!   about 75 KB for 200k tokens in blocks of 16).

use std::collections::{HashMap, VecDeque};

use protocol::{BlockHash, KvHandle};
use serde_json::{json, Map, Value};

/// Why no handle was given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HandleMiss {
    /// None kept for any leading part of the prefix.
    NotHeld,
    /// The one kept is past its TTL.
    Expired,
    /// It covers more than matched, in several KV cache groups.
    Uncuttable,
}

impl HandleMiss {
    pub fn as_str(self) -> &'static str {
        match self {
            HandleMiss::NotHeld => "not_held",
            HandleMiss::Expired => "expired",
            HandleMiss::Uncuttable => "uncuttable",
        }
    }
}

#[derive(Debug)]
struct Entry {
    /// The engine's `kv_transfer_params`, as JSON text.
    params: String,
    /// Its lookup keys: a block hash and the blocks up to it.
    keys: Vec<(BlockHash, u32)>,
    stored_at_ms: u64,
}

/// The handles one engine returned, by the block hashes they cover.
#[derive(Debug)]
pub struct HandleStore {
    block_size: u32,
    ttl_ms: u64,
    max_bytes: usize,
    /// The params' bytes kept.
    bytes: usize,
    entries: HashMap<u64, Entry>,
    /// Key -> (entry, blocks up to the key); the newest entry wins a key.
    by_key: HashMap<BlockHash, (u64, u32)>,
    /// Entries oldest first (some may be gone already).
    order: VecDeque<u64>,
    next: u64,
}

impl HandleStore {
    pub fn new(block_size: u32, ttl_ms: u64, max_bytes: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            ttl_ms,
            max_bytes,
            bytes: 0,
            entries: HashMap::new(),
            by_key: HashMap::new(),
            order: VecDeque::new(),
            next: 0,
        }
    }

    /// Handles kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keeps the handle `params` of a finished request whose blocks are
    /// `prompt` (hashes of its prompt's whole blocks) and `sequence`
    /// (of its prompt and output; empty when the output's ids are
    /// unknown).
    pub fn insert(
        &mut self,
        params: &Map<String, Value>,
        prompt: &[BlockHash],
        sequence: &[BlockHash],
        now_ms: u64,
    ) {
        self.expire(now_ms);
        let keys: Vec<(BlockHash, u32)> = [prompt, sequence]
            .into_iter()
            .filter_map(|hashes| Some((*hashes.last()?, hashes.len() as u32)))
            .collect();
        if keys.is_empty() {
            return;
        }
        let params = Value::Object(params.clone()).to_string();
        let id = self.next;
        self.next += 1;
        self.bytes += params.len();
        for &(key, blocks) in &keys {
            self.by_key.insert(key, (id, blocks));
        }
        self.entries.insert(
            id,
            Entry {
                params,
                keys,
                stored_at_ms: now_ms,
            },
        );
        self.order.push_back(id);
        while self.bytes > self.max_bytes {
            match self.order.pop_front() {
                Some(oldest) => {
                    self.remove(oldest);
                }
                None => break,
            }
        }
    }

    /// Takes the handle to the longest leading part of `prefix` (a
    /// prompt's chained block hashes) one is kept for, cut to it.
    pub fn take(&mut self, prefix: &[BlockHash], now_ms: u64) -> Result<KvHandle, HandleMiss> {
        let found = prefix.iter().enumerate().rev().find_map(|(i, hash)| {
            let &(id, blocks) = self.by_key.get(hash)?;
            (blocks as usize == i + 1).then_some((id, blocks))
        });
        let Some((id, blocks)) = found else {
            return Err(HandleMiss::NotHeld);
        };
        let entry = self.remove(id).expect("a key names a kept entry");
        if now_ms.saturating_sub(entry.stored_at_ms) >= self.ttl_ms {
            return Err(HandleMiss::Expired);
        }
        let Ok(Value::Object(params)) = serde_json::from_str(&entry.params) else {
            unreachable!("kept as a JSON object's text")
        };
        let params = cut(params, blocks, self.block_size).ok_or(HandleMiss::Uncuttable)?;
        Ok(KvHandle {
            blocks,
            engine: Value::Object(params).to_string(),
        })
    }

    fn expire(&mut self, now_ms: u64) {
        while let Some(&oldest) = self.order.front() {
            match self.entries.get(&oldest) {
                Some(e) if now_ms.saturating_sub(e.stored_at_ms) < self.ttl_ms => break,
                _ => {
                    self.order.pop_front();
                    self.remove(oldest);
                }
            }
        }
    }

    /// Removes entry `id` and the keys that still name it.
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.bytes -= entry.params.len();
        for (key, _) in &entry.keys {
            if self.by_key.get(key).is_some_and(|&(owner, _)| owner == id) {
                self.by_key.remove(key);
            }
        }
        Some(entry)
    }
}

/// `params` for a pull of at most `blocks` whole blocks, as the pulling
/// prefill engine takes them (`do_remote_decode`: it is the prefill of a
/// remote decode, whose remote is the engine holding the prefix). `None`
/// when they cover more and cannot be cut (several KV cache groups, or no
/// token count).
pub fn cut(
    mut params: Map<String, Value>,
    blocks: u32,
    block_size: u32,
) -> Option<Map<String, Value>> {
    let held = params.get("remote_num_tokens").and_then(Value::as_u64)?;
    let matched = u64::from(blocks) * u64::from(block_size);
    if held > matched {
        let ids = params.get_mut("remote_block_ids")?.as_array_mut()?;
        // One group: a list of ids, or (newer vLLM) a list of one list.
        let ids = match ids.as_slice() {
            [Value::Array(_)] => ids[0].as_array_mut()?,
            list if list.iter().all(Value::is_u64) => ids,
            _ => return None,
        };
        ids.truncate(blocks as usize);
        params.insert("remote_num_tokens".into(), json!(matched));
    }
    params.insert("do_remote_decode".into(), json!(true));
    params.insert("do_remote_prefill".into(), json!(false));
    Some(params)
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u32 = 4;

    fn hashes(range: std::ops::Range<u64>) -> Vec<BlockHash> {
        range.map(BlockHash).collect()
    }

    /// What a vLLM decode engine returns for a request of `tokens`
    /// computed tokens in `blocks` blocks.
    fn returned(request: &str, tokens: u64, groups: usize) -> Map<String, Value> {
        let blocks = tokens.div_ceil(u64::from(BS));
        let ids: Vec<u64> = (100..100 + blocks).collect();
        let Value::Object(m) = json!({
            "do_remote_prefill": false,
            "do_remote_decode": true,
            "remote_block_ids": vec![ids; groups],
            "remote_engine_id": "engine-d",
            "remote_request_id": request,
            "remote_host": "10.0.0.7",
            "remote_port": 5600,
            "tp_size": 1,
            "remote_num_tokens": tokens,
            "remote_blocks_expiry_time": 1234.5,
            "transfer_mode": "pull",
        }) else {
            unreachable!()
        };
        m
    }

    fn params(handle: &KvHandle) -> Value {
        serde_json::from_str(&handle.engine).unwrap()
    }

    #[test]
    fn a_later_prompt_extending_the_sequence_takes_the_whole_handle_once() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        // Prompt of 3 blocks, prompt and output 5 blocks and 2 tokens:
        // the engine computed 21 tokens.
        store.insert(&returned("r1", 21, 1), &hashes(0..3), &hashes(0..5), 0);
        let next_prompt = hashes(0..9);
        let h = store.take(&next_prompt, 10).unwrap();
        assert_eq!(h.blocks, 5);
        let p = params(&h);
        // Cut to the 5 whole blocks matched: the 21st token is not known
        // to be the prompt's.
        assert_eq!(p["remote_num_tokens"], 20);
        assert_eq!(p["remote_block_ids"], json!([[100, 101, 102, 103, 104]]));
        assert_eq!(p["remote_request_id"], "r1");
        assert_eq!(p["remote_blocks_expiry_time"], 1234.5);
        assert_eq!(
            (
                p["do_remote_decode"].clone(),
                p["do_remote_prefill"].clone()
            ),
            (json!(true), json!(false))
        );
        assert_eq!(
            store.take(&next_prompt, 11),
            Err(HandleMiss::NotHeld),
            "single use"
        );
        assert!(store.is_empty());
    }

    #[test]
    fn an_answer_tokenized_differently_matches_up_to_the_prompt() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("r1", 21, 1), &hashes(0..3), &hashes(0..5), 0);
        // The next prompt shares the old prompt's 3 blocks, then differs.
        let mut next = hashes(0..3);
        next.extend(hashes(50..56));
        let h = store.take(&next, 1).unwrap();
        assert_eq!(h.blocks, 3);
        assert_eq!(params(&h)["remote_num_tokens"], 12);
        assert_eq!(params(&h)["remote_block_ids"], json!([[100, 101, 102]]));
    }

    #[test]
    fn a_handle_within_the_match_is_passed_whole_and_flat_ids_are_cut() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        // Older vLLM: one flat list.
        let mut flat = returned("r1", 16, 1);
        flat.insert("remote_block_ids".into(), json!([100, 101, 102, 103]));
        store.insert(&flat, &hashes(0..2), &hashes(0..4), 0);
        let h = store.take(&hashes(0..3), 1).unwrap();
        assert_eq!(params(&h)["remote_block_ids"], json!([100, 101]));
        // Exactly covered: unchanged.
        store.insert(&returned("r2", 16, 2), &hashes(0..2), &hashes(0..4), 2);
        let h = store.take(&hashes(0..6), 3).unwrap();
        assert_eq!(params(&h)["remote_num_tokens"], 16);
        assert_eq!(params(&h)["remote_block_ids"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn several_groups_are_not_cut() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("r1", 21, 2), &hashes(0..3), &hashes(0..5), 0);
        assert_eq!(store.take(&hashes(0..4), 1), Err(HandleMiss::Uncuttable));
    }

    #[test]
    fn handles_expire_and_the_oldest_go_beyond_the_memory_bound() {
        let one = Value::Object(returned("a", 8, 1)).to_string().len();
        let mut store = HandleStore::new(BS, 100, 2 * one);
        store.insert(&returned("r1", 8, 1), &hashes(0..2), &[], 0);
        assert_eq!(store.take(&hashes(0..3), 100), Err(HandleMiss::Expired));
        store.insert(&returned("a", 8, 1), &hashes(10..12), &[], 200);
        store.insert(&returned("b", 8, 1), &hashes(20..22), &[], 201);
        store.insert(&returned("c", 8, 1), &hashes(30..32), &[], 202);
        assert_eq!(store.len(), 2);
        assert_eq!(store.take(&hashes(10..12), 203), Err(HandleMiss::NotHeld));
        assert!(store.take(&hashes(20..22), 203).is_ok());
        // Expired ones leave when the next is kept.
        store.insert(&returned("d", 8, 1), &hashes(40..42), &[], 1_000);
        assert_eq!(store.len(), 1);
        assert_eq!(store.bytes, one);
    }

    #[test]
    fn the_newest_handle_wins_a_shared_key_and_the_older_keeps_its_other() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("old", 21, 1), &hashes(0..3), &hashes(0..5), 0);
        // The same prompt sent again: its prompt key now names the new one.
        store.insert(&returned("new", 13, 1), &hashes(0..3), &[], 1);
        let h = store.take(&hashes(0..3), 2).unwrap();
        assert_eq!(params(&h)["remote_request_id"], "new");
        let h = store.take(&hashes(0..6), 2).unwrap();
        assert_eq!(params(&h)["remote_request_id"], "old");
    }

    #[test]
    fn a_key_at_another_position_is_no_match() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("r1", 12, 1), &hashes(0..3), &[], 0);
        // Hash 2 at position 0 of another prompt: not the same prefix.
        assert_eq!(store.take(&[BlockHash(2)], 1), Err(HandleMiss::NotHeld));
    }
}
