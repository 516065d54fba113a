//! The decode side of vLLM's bidirectional KV transfer (the third path on
//! a real engine): the handles to finished requests' blocks that the
//! engine returned in their `kv_transfer_params`, kept until the prefill
//! worker of a later turn takes one to pull that turn's prefix. Pure: the
//! clock is a parameter.
//!
//! - A handle is found by block hash: the hash of each whole block from
//!   the end of the request's prompt to the last block the engine computed
//!   (its output's too, when their ids are known). Hashes are chained, so
//!   one names its whole prefix: a later prompt whose leading blocks
//!   include it starts with exactly the tokens the handle covers up to
//!   there.
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
    /// Cut, it is larger than the bus carries.
    TooLarge,
}

impl HandleMiss {
    pub fn as_str(self) -> &'static str {
        match self {
            HandleMiss::NotHeld => "not_held",
            HandleMiss::Expired => "expired",
            HandleMiss::Uncuttable => "uncuttable",
            HandleMiss::TooLarge => "too_large",
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

impl Entry {
    /// What it takes of the store's memory bound: its params and keys.
    fn bytes(&self) -> usize {
        self.params.len() + self.keys.len() * KEY_BYTES
    }
}

/// A key's share of memory: its hash, entry and block count, in the map.
const KEY_BYTES: usize = 32;

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
    /// Handles dropped unread: past their TTL, and the oldest beyond the
    /// memory bound.
    pub expired: u64,
    pub evicted: u64,
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
            expired: 0,
            evicted: 0,
        }
    }

    /// Handles kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keeps the handle `params` of a finished request. `computed` names
    /// the whole blocks of the tokens it covers (the prompt, then the
    /// output but its last token, which the engine has not computed; the
    /// prompt alone when the output's ids are unknown), of which the first
    /// `prompt_blocks` are the prompt's. It is found by each whole block
    /// from the prompt's end to the last one computed, so that a later
    /// prompt carrying the answer re-tokenized near its end still finds it
    /// up to where they part.
    pub fn insert(
        &mut self,
        params: &Map<String, Value>,
        prompt_blocks: usize,
        computed: &[BlockHash],
        now_ms: u64,
    ) {
        self.expire(now_ms);
        let keys: Vec<(BlockHash, u32)> = (prompt_blocks.max(1)..=computed.len())
            .map(|blocks| (computed[blocks - 1], blocks as u32))
            .collect();
        if keys.is_empty() {
            return;
        }
        let params = Value::Object(params.clone()).to_string();
        let id = self.next;
        self.next += 1;
        let entry = Entry {
            params,
            keys,
            stored_at_ms: now_ms,
        };
        self.bytes += entry.bytes();
        for &(key, blocks) in &entry.keys {
            self.by_key.insert(key, (id, blocks));
        }
        self.entries.insert(id, entry);
        self.order.push_back(id);
        while self.bytes > self.max_bytes {
            match self.order.pop_front() {
                Some(oldest) => {
                    if self.remove(oldest).is_some() {
                        self.evicted += 1;
                    }
                }
                None => break,
            }
        }
    }

    /// Takes the handle to the longest leading part of a prompt one is kept
    /// for, cut to it: `prefix` holds the prompt's chained block hashes
    /// from its block `first` on. A handle whose parameters, cut, take more
    /// than `max_bytes` (what the bus carries) is not given.
    pub fn take(
        &mut self,
        first: u32,
        prefix: &[BlockHash],
        max_bytes: usize,
        now_ms: u64,
    ) -> Result<KvHandle, HandleMiss> {
        self.expire(now_ms);
        let mut miss = HandleMiss::NotHeld;
        for (i, hash) in prefix.iter().enumerate().rev() {
            let Some(&(id, blocks)) = self.by_key.get(hash) else {
                continue;
            };
            if blocks as usize != first as usize + i + 1 {
                continue;
            }
            let entry = &self.entries[&id];
            if now_ms.saturating_sub(entry.stored_at_ms) >= self.ttl_ms {
                self.remove(id);
                self.expired += 1;
                miss = HandleMiss::Expired;
                continue;
            }
            let Ok(Value::Object(params)) = serde_json::from_str(&entry.params) else {
                unreachable!("kept as a JSON object's text")
            };
            // Kept when it cannot be given: a shorter match may be.
            let Some(params) = cut(params, blocks, self.block_size) else {
                miss = HandleMiss::Uncuttable;
                continue;
            };
            let engine = Value::Object(params).to_string();
            if engine.len() > max_bytes {
                miss = HandleMiss::TooLarge;
                continue;
            }
            self.remove(id);
            return Ok(KvHandle { blocks, engine });
        }
        Err(miss)
    }

    fn expire(&mut self, now_ms: u64) {
        while let Some(&oldest) = self.order.front() {
            match self.entries.get(&oldest) {
                Some(e) if now_ms.saturating_sub(e.stored_at_ms) < self.ttl_ms => break,
                kept => {
                    let expired = kept.is_some();
                    self.order.pop_front();
                    self.remove(oldest);
                    if expired {
                        self.expired += 1;
                    }
                }
            }
        }
    }

    /// Removes entry `id` and the keys that still name it.
    fn remove(&mut self, id: u64) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        self.bytes -= entry.bytes();
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

    const ANY: usize = usize::MAX;

    #[test]
    fn a_later_prompt_extending_the_sequence_takes_the_whole_handle_once() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        // Prompt of 3 blocks; the engine computed 21 tokens of prompt and
        // output: 5 whole blocks.
        store.insert(&returned("r1", 21, 1), 3, &hashes(0..5), 0);
        let next_prompt = hashes(0..9);
        let h = store.take(0, &next_prompt, ANY, 10).unwrap();
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
            store.take(0, &next_prompt, ANY, 11),
            Err(HandleMiss::NotHeld),
            "single use"
        );
        assert!(store.is_empty());
        assert_eq!(store.bytes, 0);
    }

    #[test]
    fn an_answer_tokenized_differently_matches_up_to_where_they_part() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("r1", 21, 1), 3, &hashes(0..5), 0);
        // The next prompt shares the old prompt's 3 blocks and the
        // answer's first block, then differs.
        let mut next = hashes(0..4);
        next.extend(hashes(50..56));
        let h = store.take(0, &next, ANY, 1).unwrap();
        assert_eq!(h.blocks, 4);
        assert_eq!(params(&h)["remote_num_tokens"], 16);
        assert_eq!(
            params(&h)["remote_block_ids"],
            json!([[100, 101, 102, 103]])
        );
        // Differing within the prompt: no match at all.
        store.insert(&returned("r2", 21, 1), 3, &hashes(0..5), 2);
        let mut other = hashes(0..2);
        other.extend(hashes(60..66));
        assert_eq!(store.take(0, &other, ANY, 3), Err(HandleMiss::NotHeld));
    }

    #[test]
    fn a_query_may_start_past_the_prompts_first_block() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("r1", 21, 1), 3, &hashes(0..5), 0);
        // Blocks 2.. of the prompt only (a query cut to the bus's limit).
        assert_eq!(
            store.take(0, &hashes(2..9), ANY, 1),
            Err(HandleMiss::NotHeld)
        );
        let h = store.take(2, &hashes(2..9), ANY, 1).unwrap();
        assert_eq!(h.blocks, 5);
    }

    #[test]
    fn a_handle_within_the_match_is_passed_whole_and_flat_ids_are_cut() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        // Older vLLM: one flat list.
        let mut flat = returned("r1", 16, 1);
        flat.insert("remote_block_ids".into(), json!([100, 101, 102, 103]));
        store.insert(&flat, 2, &hashes(0..4), 0);
        let h = store.take(0, &hashes(0..3), ANY, 1).unwrap();
        assert_eq!(params(&h)["remote_block_ids"], json!([100, 101, 102]));
        // Exactly covered: unchanged, several groups too.
        store.insert(&returned("r2", 16, 2), 2, &hashes(0..4), 2);
        let h = store.take(0, &hashes(0..6), ANY, 3).unwrap();
        assert_eq!(params(&h)["remote_num_tokens"], 16);
        assert_eq!(params(&h)["remote_block_ids"].as_array().unwrap().len(), 2);
    }

    #[test]
    fn a_handle_that_cannot_be_given_is_kept_and_a_shorter_one_given() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        // Two groups, matched up to block 4 of 5: not cut, kept.
        store.insert(&returned("groups", 21, 2), 3, &hashes(0..5), 0);
        assert_eq!(
            store.take(0, &hashes(0..4), ANY, 1),
            Err(HandleMiss::Uncuttable)
        );
        assert_eq!(store.len(), 1);
        // A shorter handle of one group behind it is given instead.
        store.insert(&returned("short", 8, 1), 2, &hashes(0..2), 1);
        let h = store.take(0, &hashes(0..4), ANY, 2).unwrap();
        assert_eq!(params(&h)["remote_request_id"], "short");
        // Too large for the bus: kept, not given.
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("big", 20, 1), 3, &hashes(0..5), 0);
        assert_eq!(
            store.take(0, &hashes(0..5), 10, 1),
            Err(HandleMiss::TooLarge)
        );
        assert!(store.take(0, &hashes(0..5), ANY, 1).is_ok());
    }

    #[test]
    fn handles_expire_and_the_oldest_go_beyond_the_memory_bound() {
        let one = Value::Object(returned("a", 8, 1)).to_string().len() + KEY_BYTES;
        let mut store = HandleStore::new(BS, 100, 2 * one);
        store.insert(&returned("r1", 8, 1), 2, &hashes(0..2), 0);
        assert_eq!(
            store.take(0, &hashes(0..3), ANY, 100),
            Err(HandleMiss::NotHeld),
            "expired, and dropped"
        );
        assert_eq!(store.expired, 1);
        store.insert(&returned("a", 8, 1), 2, &hashes(10..12), 200);
        store.insert(&returned("b", 8, 1), 2, &hashes(20..22), 201);
        store.insert(&returned("c", 8, 1), 2, &hashes(30..32), 202);
        assert_eq!((store.len(), store.evicted), (2, 1));
        assert_eq!(
            store.take(0, &hashes(10..12), ANY, 203),
            Err(HandleMiss::NotHeld)
        );
        assert!(store.take(0, &hashes(20..22), ANY, 203).is_ok());
        // Expired ones leave when the next is kept.
        store.insert(&returned("d", 8, 1), 2, &hashes(40..42), 1_000);
        assert_eq!(store.len(), 1);
        assert_eq!(store.bytes, one);
    }

    #[test]
    fn the_newest_handle_wins_a_shared_key_and_the_older_keeps_its_others() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("old", 21, 1), 3, &hashes(0..5), 0);
        // The same prompt sent again, its output unknown: its prompt key
        // now names the new one.
        store.insert(&returned("new", 13, 1), 3, &hashes(0..3), 1);
        let h = store.take(0, &hashes(0..3), ANY, 2).unwrap();
        assert_eq!(params(&h)["remote_request_id"], "new");
        let h = store.take(0, &hashes(0..6), ANY, 2).unwrap();
        assert_eq!(params(&h)["remote_request_id"], "old");
    }

    #[test]
    fn a_key_at_another_position_is_no_match() {
        let mut store = HandleStore::new(BS, 1_000, 1 << 20);
        store.insert(&returned("r1", 12, 1), 3, &hashes(0..3), 0);
        // Hash 2 at position 0 of another prompt: not the same prefix.
        assert_eq!(
            store.take(0, &[BlockHash(2)], ANY, 1),
            Err(HandleMiss::NotHeld)
        );
    }
}
