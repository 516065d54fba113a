//! Tokenization by conversation prefix. An agent's next turn is its last
//! prompt, the answer and a new message: re-tokenizing 100k tokens of it
//! every turn makes the tokenizer the front door's bottleneck. The cache
//! keeps recent prompts' text with their token ids and start offsets; a
//! prompt that begins with one is tokenized from a safe point a little
//! before the shared prefix ends, and the ids before it are reused.
//!
//! A plain struct of text and ids: the tokenizer is an argument (a
//! closure), so its property tests compare it with full tokenization.
//!
//! Finding the longest cached prefix: every entry's text is cut into
//! [`CHUNK`]-byte chunks whose hashes are chained (a checkpoint names the
//! whole text before it, as a KV block hash names its prefix). A prompt's
//! own chain is hashed in one pass; its longest checkpoint that the table
//! knows names the entry, whose bytes are then compared (no hash collision
//! is trusted) and the common prefix extended past the checkpoint.
//!
//! The safe point: BPE never merges across a pre-token boundary, and the
//! pre-tokenizers of byte-level BPEs (GPT-2's, Llama 3's, Qwen's patterns)
//! start a pre-token at a space that follows a non-space. So the ids are
//! cut at the start of a token that begins with such a space, at least
//! [`Safety::margin`] bytes before the shared prefix ends (past the longest
//! special token and any look-ahead), and the rest is tokenized alone. A
//! tokenizer whose splits do not behave so (a normalizer or a prepended
//! `▁` that depends on the text's start) fails [`TokenCache::probe`] at
//! load, and the cache is then off.
//!
//! Memory is bounded by bytes (text, ids and offsets of the entries):
//! least recently used entries go first. An entry that a newer prompt
//! extends (its whole text the newer one's prefix) is replaced by it, so a
//! conversation holds one entry.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Bytes between checkpoints.
pub const CHUNK: usize = 512;

/// Ids and the byte offset where each token starts in its text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tokens {
    pub ids: Vec<u32>,
    pub starts: Vec<u32>,
}

/// How a prompt was tokenized.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The whole text was cached.
    Exact,
    /// A cached prefix, and the rest tokenized.
    Prefix,
    /// No cached prefix (or none with a safe point): tokenized in full.
    Miss,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Exact => "exact",
            Outcome::Prefix => "prefix",
            Outcome::Miss => "miss",
        }
    }
}

/// The result of [`TokenCache::encode`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub outcome: Outcome,
    /// Ids taken from the cache.
    pub reused: usize,
}

/// What [`TokenCache::plan`] found; [`Plan::complete`] finishes it.
#[derive(Debug)]
pub struct Plan {
    chain: Vec<u64>,
    kind: PlanKind,
}

#[derive(Debug)]
enum PlanKind {
    Exact(Arc<Tokens>),
    Prefix {
        cached: Arc<Tokens>,
        /// The first token not reused.
        cut: usize,
        /// The entry, when the text extends all of it.
        replaces: Option<u64>,
    },
    Miss,
}

/// A completed plan's tokens, for [`TokenCache::store`].
#[derive(Debug)]
pub struct Store {
    /// The text, copied outside the lock.
    text: Box<str>,
    chain: Vec<u64>,
    tokens: Arc<Tokens>,
    replaces: Option<u64>,
}

impl Plan {
    /// Tokenizes what the cache did not hold (no cache needed: run it
    /// without the lock). Gives the ids, and what to store unless the
    /// text was cached already.
    pub fn complete<E>(
        self,
        text: &str,
        mut tokenize: impl FnMut(&str) -> Result<Tokens, E>,
    ) -> Result<(Encoded, Option<Store>), E> {
        let Plan { chain, kind } = self;
        let (tokens, outcome, reused, replaces) = match kind {
            PlanKind::Exact(tokens) => {
                let encoded = Encoded {
                    ids: tokens.ids.clone(),
                    outcome: Outcome::Exact,
                    reused: tokens.ids.len(),
                };
                return Ok((encoded, None));
            }
            PlanKind::Prefix {
                cached,
                cut,
                replaces,
            } => {
                let at = cached.starts[cut] as usize;
                let rest = tokenize(&text[at..])?;
                // The first token after the cut must be the one the entry
                // had there: else the point was not safe after all, and
                // the text is tokenized whole.
                if rest.ids.first() == cached.ids.get(cut) {
                    let mut tokens = Tokens {
                        ids: Vec::with_capacity(cut + rest.ids.len()),
                        starts: Vec::with_capacity(cut + rest.ids.len()),
                    };
                    tokens.ids.extend_from_slice(&cached.ids[..cut]);
                    tokens.ids.extend_from_slice(&rest.ids);
                    tokens.starts.extend_from_slice(&cached.starts[..cut]);
                    let shift = at as u32;
                    tokens.starts.extend(rest.starts.iter().map(|s| s + shift));
                    (tokens, Outcome::Prefix, cut, replaces)
                } else {
                    (tokenize(text)?, Outcome::Miss, 0, None)
                }
            }
            PlanKind::Miss => (tokenize(text)?, Outcome::Miss, 0, None),
        };
        let encoded = Encoded {
            ids: tokens.ids.clone(),
            outcome,
            reused,
        };
        let store = Store {
            text: text.into(),
            chain,
            tokens: Arc::new(tokens),
            replaces,
        };
        Ok((encoded, Some(store)))
    }
}

/// Where a cut is safe for a tokenizer.
#[derive(Debug, Clone, Copy)]
pub struct Safety {
    /// Bytes kept between the cut and the end of the shared prefix: more
    /// than the longest special token and any pre-tokenizer look-ahead.
    pub margin: usize,
}

struct Entry {
    text: Box<str>,
    tokens: Arc<Tokens>,
    /// Its checkpoints' keys (to drop them with it).
    checkpoints: Vec<u64>,
    last_used: u64,
}

impl Entry {
    fn bytes(&self) -> usize {
        self.text.len() + 8 * self.tokens.ids.len() + 8 * self.checkpoints.len() + 64
    }
}

/// The cache. See the module's documentation.
pub struct TokenCache {
    max_bytes: usize,
    safety: Safety,
    used: usize,
    next_id: u64,
    tick: u64,
    entries: HashMap<u64, Entry>,
    /// Checkpoint hash → (entry, bytes of text before it).
    checkpoints: HashMap<u64, (u64, usize)>,
    /// Last use → entry (least recent first).
    lru: BTreeMap<u64, u64>,
}

impl std::fmt::Debug for TokenCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenCache")
            .field("entries", &self.entries.len())
            .field("bytes", &self.used)
            .field("max_bytes", &self.max_bytes)
            .finish()
    }
}

/// A text's chained checkpoint hashes, one per whole [`CHUNK`].
#[derive(Debug)]
pub struct Checkpoints(Vec<u64>);

impl Checkpoints {
    pub fn of(text: &str) -> Self {
        Self(chain(text.as_bytes()))
    }
}

fn chain(text: &[u8]) -> Vec<u64> {
    let mut seed = 0x5717_C4A7_u64;
    text.chunks_exact(CHUNK)
        .map(|chunk| {
            seed = xxh3_64_with_seed(chunk, seed);
            seed
        })
        .collect()
}

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    // Word-wise first: compare 8 bytes at a time.
    let mut i = 0;
    while i + 8 <= n && a[i..i + 8] == b[i..i + 8] {
        i += 8;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

impl TokenCache {
    /// A cache of at most `max_bytes`.
    pub fn new(max_bytes: usize, safety: Safety) -> Self {
        Self {
            max_bytes,
            safety,
            used: 0,
            next_id: 0,
            tick: 0,
            entries: HashMap::new(),
            checkpoints: HashMap::new(),
            lru: BTreeMap::new(),
        }
    }

    /// Bytes the entries hold.
    pub fn bytes(&self) -> usize {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Whether cutting `tokenize`'s output as this cache does gives what
    /// tokenizing in one piece gives, on texts made to catch the usual
    /// ways it does not (a prepended `▁`, a normalizer, merges across
    /// spaces). Run once when a tokenizer is loaded.
    pub fn probe<E>(safety: Safety, mut tokenize: impl FnMut(&str) -> Result<Tokens, E>) -> bool {
        let turn = "<|im_start|>user\nWhat is   the  cost of 12345 apples, café and naïve \"quotes\"?\n\tThanks!<|im_end|>\n<|im_start|>assistant\n";
        let mut history = String::new();
        for i in 0..24 {
            history.push_str(turn);
            history.push_str(&format!(" Answer {i}: it's fine. \n\n"));
        }
        let longer = format!("{history}{turn} and then some more words");
        let mut cache = TokenCache::new(usize::MAX, safety);
        let (Ok(_), Ok(full)) = (
            cache.encode(&history, &mut tokenize),
            tokenize(&longer).map(|t| t.ids),
        ) else {
            return false;
        };
        matches!(cache.encode(&longer, &mut tokenize), Ok(e) if e.ids == full && e.outcome == Outcome::Prefix)
    }

    /// The ids of `text`: a cached prefix's and `tokenize` of the rest.
    /// `tokenize` returns ids and byte offsets of token starts (in the text
    /// it is given), with no special tokens added. One call holding the
    /// cache throughout; a shared cache calls [`TokenCache::plan`], then
    /// [`Plan::complete`] unlocked, then [`TokenCache::store`].
    pub fn encode<E>(
        &mut self,
        text: &str,
        tokenize: impl FnMut(&str) -> Result<Tokens, E>,
    ) -> Result<Encoded, E> {
        let plan = self.plan(text, Checkpoints::of(text));
        let (encoded, store) = plan.complete(text, tokenize)?;
        if let Some(store) = store {
            self.store(store);
        }
        Ok(encoded)
    }

    /// What the cache holds of `text`, whose checkpoints are given
    /// (hashed before taking a shared cache's lock).
    pub fn plan(&mut self, text: &str, checkpoints: Checkpoints) -> Plan {
        let chain = checkpoints.0;
        let kind = match self.longest(text, &chain) {
            Some((id, common)) => {
                let entry = &self.entries[&id];
                if common == text.len() && entry.text.len() == text.len() {
                    let tokens = entry.tokens.clone();
                    self.touch(id);
                    PlanKind::Exact(tokens)
                } else {
                    match self.cut(id, text, common) {
                        Some(cut) => {
                            let entry = &self.entries[&id];
                            let kind = PlanKind::Prefix {
                                cached: entry.tokens.clone(),
                                cut,
                                replaces: (common == entry.text.len()).then_some(id),
                            };
                            self.touch(id);
                            kind
                        }
                        None => PlanKind::Miss,
                    }
                }
            }
            None => PlanKind::Miss,
        };
        Plan { chain, kind }
    }

    /// Keeps a completed plan's text and tokens (the entry it extends
    /// replaced).
    pub fn store(&mut self, store: Store) {
        if let Some(id) = store.replaces {
            self.remove(id);
        }
        self.insert(store.text, store.tokens, store.chain);
    }

    /// The entry with the longest prefix of `text`, and that prefix's
    /// length in bytes.
    fn longest(&self, text: &str, chain: &[u64]) -> Option<(u64, usize)> {
        for (k, key) in chain.iter().enumerate().rev() {
            let Some(&(id, at)) = self.checkpoints.get(key) else {
                continue;
            };
            let entry = &self.entries[&id];
            let checked = (k + 1) * CHUNK;
            if at != checked || entry.text.as_bytes()[..checked] != text.as_bytes()[..checked] {
                continue; // a hash collision: not this one
            }
            let common = checked
                + common_prefix(
                    &entry.text.as_bytes()[checked..],
                    &text.as_bytes()[checked..],
                );
            return Some((id, common));
        }
        // Texts shorter than a chunk have no checkpoint: not worth caching.
        None
    }

    /// The index of the entry's token to cut before: the last token that
    /// starts with a space after a non-space, at least the margin before
    /// `common`.
    fn cut(&self, id: u64, text: &str, common: usize) -> Option<usize> {
        let entry = &self.entries[&id];
        let limit = common.checked_sub(self.safety.margin)?;
        let starts = &entry.tokens.starts;
        let bytes = text.as_bytes();
        let mut j = starts.partition_point(|&s| (s as usize) <= limit);
        // Look back a little way for a safe start.
        for _ in 0..256 {
            j = j.checked_sub(1)?;
            let at = starts[j] as usize;
            // A token that begins where the previous one begins (bytes of
            // one character) is no start.
            let unique = j == 0 || starts[j - 1] as usize != at;
            if at > 0 && unique && bytes[at] == b' ' && !bytes[at - 1].is_ascii_whitespace() {
                return (j > 0).then_some(j);
            }
        }
        None
    }

    fn insert(&mut self, text: Box<str>, tokens: Arc<Tokens>, chain: Vec<u64>) {
        if chain.is_empty() {
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        let last_used = self.bump();
        let entry = Entry {
            text,
            tokens,
            checkpoints: chain,
            last_used,
        };
        let bytes = entry.bytes();
        if bytes > self.max_bytes {
            return;
        }
        for (k, key) in entry.checkpoints.iter().enumerate() {
            self.checkpoints.insert(*key, (id, (k + 1) * CHUNK));
        }
        self.lru.insert(last_used, id);
        self.used += bytes;
        self.entries.insert(id, entry);
        while self.used > self.max_bytes {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            self.remove(oldest);
        }
    }

    /// A new last-use stamp: each use its own (a store after another
    /// thread's lookups must not share its stamp).
    fn bump(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn touch(&mut self, id: u64) {
        let tick = self.bump();
        let entry = self.entries.get_mut(&id).expect("entry");
        self.lru.remove(&entry.last_used);
        entry.last_used = tick;
        self.lru.insert(tick, id);
    }

    fn remove(&mut self, id: u64) {
        let Some(entry) = self.entries.remove(&id) else {
            return;
        };
        self.lru.remove(&entry.last_used);
        self.used -= entry.bytes();
        // A checkpoint now pointing at a newer entry (sharing the prefix)
        // stays.
        for key in &entry.checkpoints {
            if self.checkpoints.get(key).is_some_and(|&(e, _)| e == id) {
                self.checkpoints.remove(key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy tokenizer: each byte a token (its value), starts at each byte.
    fn bytes(text: &str) -> Result<Tokens, ()> {
        Ok(Tokens {
            ids: text.bytes().map(u32::from).collect(),
            starts: (0..text.len() as u32).collect(),
        })
    }

    fn conversation(turns: usize) -> Vec<String> {
        let mut text = String::new();
        (0..turns)
            .map(|i| {
                text.push_str(&format!("turn {i}: some words of the turn, "));
                text.push_str(&"and more words ".repeat(100));
                text.clone()
            })
            .collect()
    }

    #[test]
    fn a_conversation_keeps_one_entry_and_reuses_its_prefix() {
        let mut cache = TokenCache::new(usize::MAX, Safety { margin: 16 });
        let turns = conversation(5);
        let first = cache.encode(&turns[0], bytes).unwrap();
        assert_eq!(first.outcome, Outcome::Miss);
        for pair in turns.windows(2) {
            let (before, turn) = (&pair[0], &pair[1]);
            let e = cache.encode(turn, bytes).unwrap();
            assert_eq!(e.ids, bytes(turn).unwrap().ids);
            assert_eq!(e.outcome, Outcome::Prefix);
            // Cut at the last space at least the margin before the end
            // of the earlier turn.
            assert!(
                e.reused + 16 + 8 >= before.len(),
                "{} of {}",
                e.reused,
                before.len()
            );
            assert_eq!(cache.len(), 1);
        }
        let again = cache.encode(&turns[4], bytes).unwrap();
        assert_eq!(
            (again.outcome, again.reused),
            (Outcome::Exact, turns[4].len())
        );
        // A branch off turn 2 shares its prefix and keeps its own entry.
        let branch = format!("{} a different ending", &turns[2]);
        let e = cache.encode(&branch, bytes).unwrap();
        assert_eq!(
            (e.outcome, e.ids.clone()),
            (Outcome::Prefix, bytes(&branch).unwrap().ids)
        );
        assert_eq!(cache.len(), 2);
        // Short texts have no checkpoint and are not kept.
        assert_eq!(cache.encode("short", bytes).unwrap().outcome, Outcome::Miss);
        assert_eq!(cache.len(), 2);
    }

    #[test]
    fn memory_stays_under_its_bound_least_recent_first() {
        let texts: Vec<String> = (0..20)
            .map(|i| format!("conversation {i} ") + &"word ".repeat(400))
            .collect();
        let one = {
            let mut c = TokenCache::new(usize::MAX, Safety { margin: 16 });
            c.encode(&texts[0], bytes).unwrap();
            c.bytes()
        };
        let mut cache = TokenCache::new(one * 5 + one / 2, Safety { margin: 16 });
        for t in &texts {
            cache.encode(t, bytes).unwrap();
            assert!(cache.bytes() <= one * 5 + one / 2);
        }
        assert_eq!(cache.len(), 5);
        // The most recent are kept, the oldest evicted.
        let recent = format!("{} more", texts[19]);
        assert_eq!(
            cache.encode(&recent, bytes).unwrap().outcome,
            Outcome::Prefix
        );
        let old = format!("{} more", texts[0]);
        assert_eq!(cache.encode(&old, bytes).unwrap().outcome, Outcome::Miss);
        // An entry larger than the whole cache is not kept.
        let mut tiny = TokenCache::new(100, Safety { margin: 16 });
        tiny.encode(&texts[0], bytes).unwrap();
        assert!(tiny.is_empty());
    }

    /// Two requests interleaved as two threads do (look up, look up, store,
    /// store): every entry keeps its place in the LRU order, and the bound
    /// holds.
    #[test]
    fn interleaved_lookups_and_stores_keep_the_bound() {
        let texts: Vec<String> = (0..40)
            .map(|i| format!("conversation {} ", i % 2) + &"word ".repeat(300 + i))
            .collect();
        let one = {
            let mut c = TokenCache::new(usize::MAX, Safety { margin: 16 });
            c.encode(&texts[0], bytes).unwrap();
            c.bytes()
        };
        let max = one * 6;
        let mut cache = TokenCache::new(max, Safety { margin: 16 });
        for pair in texts.chunks(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let plan_a = cache.plan(a, Checkpoints::of(a));
            let plan_b = cache.plan(b, Checkpoints::of(b));
            let (ea, store_a) = plan_a.complete(a, bytes).unwrap();
            let (eb, store_b) = plan_b.complete(b, bytes).unwrap();
            assert_eq!(
                (ea.ids, eb.ids),
                (bytes(a).unwrap().ids, bytes(b).unwrap().ids)
            );
            cache.store(store_b.unwrap());
            cache.store(store_a.unwrap());
            assert!(cache.bytes() <= max);
            assert_eq!(cache.lru.len(), cache.entries.len());
        }
        // Both conversations' latest turns are still found.
        for t in &texts[38..] {
            let next = format!("{t} more");
            assert_eq!(cache.encode(&next, bytes).unwrap().outcome, Outcome::Prefix);
        }
    }

    /// A tokenizer whose tokens depend on where the text starts (pairs of
    /// bytes from the start): a cut at an odd offset gives other tokens.
    /// The check of the first token after the cut catches it, and the
    /// text is tokenized whole: never wrong ids.
    fn pairs(text: &str) -> Result<Tokens, ()> {
        let b = text.as_bytes();
        Ok(Tokens {
            ids: b
                .chunks(2)
                .map(|p| (u32::from(p[0]) << 8) | p.get(1).map_or(0, |&x| u32::from(x)))
                .collect(),
            starts: (0..b.len() as u32).step_by(2).collect(),
        })
    }

    #[test]
    fn a_cut_that_changes_the_tokens_falls_back_to_the_whole_text() {
        let mut cache = TokenCache::new(usize::MAX, Safety { margin: 16 });
        let turns = conversation(6);
        let mut outcomes = Vec::new();
        for turn in &turns {
            let e = cache.encode(turn, pairs).unwrap();
            assert_eq!(e.ids, pairs(turn).unwrap().ids);
            outcomes.push(e.outcome);
        }
        // Cuts land at even or odd spaces: some prefixes are reused
        // (even), the others fall back.
        assert!(outcomes.contains(&Outcome::Miss));
    }

    #[test]
    fn a_tokenizer_that_depends_on_the_texts_start_fails_the_probe() {
        let safety = Safety { margin: 16 };
        assert!(TokenCache::probe(safety, bytes));
        // A SentencePiece-like tokenizer prepending a marker to every text.
        let prepending = |t: &str| {
            let mut tokens = bytes(t)?;
            tokens.ids.insert(0, 0x2581);
            tokens.starts.insert(0, 0);
            Ok::<_, ()>(tokens)
        };
        assert!(!TokenCache::probe(safety, prepending));
    }
}
