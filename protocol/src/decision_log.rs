//! The decision log's entries, written compactly.
//!
//! A [`DecisionRecord`] holds everything a decision depended on; most of it
//! repeats from one decision to the next. The log stores each repeated part
//! once:
//!
//! - the settings and the candidates' registrations (the policy and its
//!   parameters, the router's settings, the block size, each candidate's
//!   role and capacity) are a [`DecisionContext`], named by the hash of its
//!   bytes ([`ContextId`]) and written before the first decision that
//!   names it;
//! - a prompt's block hashes that an earlier entry's prompt began with are a
//!   [`PrefixRef`]: their count and last hash (a chained hash names its
//!   whole prefix). A conversation's turn k+1 starts with turn k's prompt,
//!   so it carries only the hashes after it;
//! - the candidates' depths and loads are columns of varints, a column of
//!   one repeated value written once ([`Columns`]).
//!
//! [`LogWriter`] turns records into entries, [`LogReader`] entries back
//! into records; both are pure. A reference the reader cannot resolve is an
//! error that names it, never a wrong record.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::sync::Arc;

use serde::de::{self, Deserializer, Visitor};
use serde::ser::Serializer;
use serde::{Deserialize, Serialize};

use crate::codec::Message;
use crate::decision::RouteDecision;
use crate::ids::{BlockHash, WorkerId};
use crate::registry::Role;
use crate::replay::{CandidateInput, CandidateLoad, DecisionInputs, DecisionRecord, SessionInput};

/// Names a [`DecisionContext`]: the xxh3-64 of its encoding.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ContextId(pub u64);

impl fmt::Display for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Debug for ContextId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContextId({self})")
    }
}

/// What a run of decisions shares: their settings and their candidates'
/// registrations, in the order the decisions list the candidates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecisionContext {
    /// The policy's parameters (its name is in each decision).
    pub policy_params: Vec<(String, f64)>,
    /// The router's selection and gate settings.
    pub router_params: Vec<(String, f64)>,
    pub block_size: u32,
    pub candidates: Vec<CandidateFacts>,
}

impl DecisionContext {
    /// Its name: the hash of its encoding.
    pub fn id(&self) -> ContextId {
        let mut bytes = Vec::with_capacity(64 + 32 * self.candidates.len());
        rmp_serde::encode::write(&mut bytes, self).expect("msgpack encoding of a context");
        ContextId(xxhash_rust::xxh3::xxh3_64(&bytes))
    }
}

/// A candidate's registration, as a decision saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CandidateFacts {
    pub worker: WorkerId,
    pub role: Role,
    pub kv_capacity_blocks: u64,
    pub max_batched_tokens: u32,
    pub kv_bytes_per_token: u64,
    /// The legs it could serve (entries before this field: every leg).
    #[serde(default)]
    pub capabilities: crate::Capabilities,
}

/// The leading blocks of a prompt that an earlier entry's prompt was:
/// `blocks` of them, the last one `last`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PrefixRef {
    pub blocks: u32,
    pub last: BlockHash,
}

impl fmt::Display for PrefixRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the {} blocks ending in {}", self.blocks, self.last)
    }
}

/// A prompt's block hashes: a prefix by reference, then its own.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoggedPrompt {
    pub prefix: Option<PrefixRef>,
    pub blocks: PackedHashes,
}

impl LoggedPrompt {
    /// Blocks in the whole prompt.
    pub fn len(&self) -> usize {
        self.prefix.map_or(0, |p| p.blocks as usize) + self.blocks.0.len()
    }

    /// Whether the prompt has no full block.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The whole prompt's last block hash.
    pub fn last(&self) -> Option<BlockHash> {
        self.blocks
            .0
            .last()
            .copied()
            .or(self.prefix.map(|p| p.last))
    }

    /// The whole prompt's last block hash and length, what a later prompt
    /// refers to it by.
    pub fn end(&self) -> Option<(BlockHash, u32)> {
        Some((self.last()?, u32::try_from(self.len()).ok()?))
    }
}

/// Block hashes as 8-byte little-endian words in one byte string.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PackedHashes(pub Vec<BlockHash>);

impl Serialize for PackedHashes {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let bytes: Vec<u8> = self.0.iter().flat_map(|h| h.0.to_le_bytes()).collect();
        s.serialize_bytes(&bytes)
    }
}

impl<'de> Deserialize<'de> for PackedHashes {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bytes = d.deserialize_bytes(BytesVisitor)?;
        if bytes.len() % 8 != 0 {
            return Err(de::Error::custom(format!(
                "{} bytes of block hashes: not a whole number of 8-byte hashes",
                bytes.len()
            )));
        }
        Ok(PackedHashes(
            bytes
                .chunks_exact(8)
                .map(|c| BlockHash(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
                .collect(),
        ))
    }
}

/// A byte string from any of serde's byte forms.
struct BytesVisitor;

impl Visitor<'_> for BytesVisitor {
    type Value = Vec<u8>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a byte string")
    }

    fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
        Ok(v.to_vec())
    }

    fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<Vec<u8>, E> {
        Ok(v)
    }
}

/// Candidates' depths and loads, one column per number; a column is one
/// value for every candidate, or a varint each.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Columns(pub Vec<CandidateState>);

/// One candidate's depth and load at a decision.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CandidateState {
    /// Leading prompt blocks held: device, host-or-better, any tier.
    pub depth: [u32; 3],
    pub load: CandidateLoad,
}

/// The numbers of a candidate, as columns: depths as differences (they are
/// cumulative), the reported use as its difference from the effective one.
const COLUMNS: usize = 10;

/// Columns every entry has; the ones after them are absent in entries of
/// older releases (read as 0), and columns after [`COLUMNS`] (a newer
/// release's) are skipped.
const REQUIRED_COLUMNS: usize = 9;

fn column_values(s: &CandidateState) -> [u64; COLUMNS] {
    let l = &s.load;
    [
        u64::from(s.depth[0]),
        zigzag(i64::from(s.depth[1]) - i64::from(s.depth[0])),
        zigzag(i64::from(s.depth[2]) - i64::from(s.depth[1])),
        u64::from(l.running),
        u64::from(l.waiting),
        l.queued_prefill_tokens,
        l.active_decode_blocks,
        l.kv_blocks_used,
        zigzag(l.reported_kv_blocks_used.wrapping_sub(l.kv_blocks_used) as i64),
        u64::from(l.recent_itl_us),
    ]
}

fn from_columns(v: [u64; COLUMNS]) -> Result<CandidateState, String> {
    let small =
        |x: i64, what: &str| u32::try_from(x).map_err(|_| format!("{what} {x} out of range"));
    let device = small(v[0] as i64, "depth")?;
    let host = small(i64::from(device) + unzigzag(v[1]), "depth")?;
    let disk = small(i64::from(host) + unzigzag(v[2]), "depth")?;
    let count =
        |x: u64, what: &str| u32::try_from(x).map_err(|_| format!("{what} {x} out of range"));
    Ok(CandidateState {
        depth: [device, host, disk],
        load: CandidateLoad {
            running: count(v[3], "running")?,
            waiting: count(v[4], "waiting")?,
            queued_prefill_tokens: v[5],
            active_decode_blocks: v[6],
            kv_blocks_used: v[7],
            reported_kv_blocks_used: v[7].wrapping_add(unzigzag(v[8]) as u64),
            recent_itl_us: count(v[9], "recent ITL")?,
        },
    })
}

fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(bytes: &mut &[u8]) -> Result<u64, String> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let (&b, rest) = bytes.split_first().ok_or("truncated varint")?;
        *bytes = rest;
        v |= u64::from(b & 0x7f) << shift;
        if b & 0x80 == 0 {
            return Ok(v);
        }
    }
    Err("varint longer than 64 bits".into())
}

/// More candidates than any deployment has: a bound on what a reader
/// allocates for bytes it was given.
const MAX_CANDIDATES: usize = 1 << 16;

/// A column written as one value for all.
const CONSTANT: u8 = 0;
/// A column written as a value each.
const EACH: u8 = 1;

impl Columns {
    fn to_bytes(&self) -> Vec<u8> {
        let rows: Vec<[u64; COLUMNS]> = self.0.iter().map(column_values).collect();
        let mut out = Vec::with_capacity(2 + rows.len() * 6);
        put_varint(&mut out, rows.len() as u64);
        for c in 0..COLUMNS {
            let first = rows.first().map_or(0, |r| r[c]);
            if rows.iter().all(|r| r[c] == first) {
                out.push(CONSTANT);
                put_varint(&mut out, first);
            } else {
                out.push(EACH);
                for r in &rows {
                    put_varint(&mut out, r[c]);
                }
            }
        }
        out
    }

    fn from_bytes(mut bytes: &[u8]) -> Result<Self, String> {
        let n = get_varint(&mut bytes)?;
        if n > MAX_CANDIDATES as u64 {
            return Err(format!("{n} candidates (at most {MAX_CANDIDATES})"));
        }
        let n = n as usize;
        let mut rows = vec![[0u64; COLUMNS]; n];
        let mut c = 0;
        while c < REQUIRED_COLUMNS || !bytes.is_empty() {
            let (&kind, rest) = bytes.split_first().ok_or("truncated column")?;
            bytes = rest;
            // Columns past the ones this release knows (a newer writer's)
            // are read and left out.
            let known = c < COLUMNS;
            match kind {
                CONSTANT => {
                    let v = get_varint(&mut bytes)?;
                    if known {
                        rows.iter_mut().for_each(|r| r[c] = v);
                    }
                }
                EACH => {
                    for r in &mut rows {
                        let v = get_varint(&mut bytes)?;
                        if known {
                            r[c] = v;
                        }
                    }
                }
                other => return Err(format!("unknown column kind {other}")),
            }
            c += 1;
        }
        rows.into_iter()
            .map(from_columns)
            .collect::<Result<_, _>>()
            .map(Columns)
    }
}

impl Serialize for Columns {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.to_bytes())
    }
}

impl<'de> Deserialize<'de> for Columns {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let bytes = d.deserialize_bytes(BytesVisitor)?;
        Columns::from_bytes(&bytes).map_err(de::Error::custom)
    }
}

/// A decision as the log holds it (see the module documentation).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoggedDecision {
    pub decision: RouteDecision,
    pub context: ContextId,
    pub prompt: LoggedPrompt,
    pub expected_output_tokens: u32,
    pub delta_seq: u64,
    pub seed: u64,
    pub avoid: Vec<WorkerId>,
    /// The context's candidates' depths and loads, in its order.
    pub candidates: Columns,
    /// The policy's calibration factors at the decision (see
    /// [`DecisionInputs::calibration`]; absent in older entries).
    #[serde(default)]
    pub calibration: Vec<(String, f64)>,
    /// The request's session (see [`DecisionInputs::session`]): peers
    /// bind it to the decision's decode worker.
    #[serde(default)]
    pub session: Option<SessionInput>,
}

/// One entry of the decision log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum LogEntry {
    /// A context, written before the first decision that names it.
    Context {
        id: ContextId,
        context: DecisionContext,
    },
    Decision(LoggedDecision),
}

impl LogEntry {
    /// The decision, if this entry is one.
    pub fn decision(&self) -> Option<&LoggedDecision> {
        match self {
            LogEntry::Decision(d) => Some(d),
            LogEntry::Context { .. } => None,
        }
    }
}

/// How much a [`LogWriter`] remembers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterLimits {
    /// Prompts it may refer back to (the most recent ones).
    pub prompts: usize,
    /// It refers back to prompts logged at most this long ago (ms): older
    /// entries may have left the log.
    pub prompt_age_ms: u64,
    /// Contexts it remembers having written.
    pub contexts: usize,
}

impl Default for WriterLimits {
    fn default() -> Self {
        Self {
            prompts: 100_000,
            prompt_age_ms: 3_600_000,
            contexts: 1_024,
        }
    }
}

/// Turns decision records into log entries, each repeated part written
/// once. Pure: time comes in as an argument.
///
/// Made with [`LogWriter::awaiting_acks`], it refers only to what the log
/// confirmed ([`LogWriter::acked`]): an entry sent but unconfirmed may be
/// lost (a NATS node dies with it), and every entry referring to it would
/// then be unreadable. Until its confirmation a context is written again
/// with each decision that names it, and a prompt is not referred to.
#[derive(Debug, Default)]
pub struct LogWriter {
    limits: WriterLimits,
    /// Prompts on the log: last hash -> (blocks, when).
    prompts: HashMap<BlockHash, (u32, u64)>,
    prompt_order: VecDeque<BlockHash>,
    contexts: HashSet<ContextId>,
    context_order: VecDeque<ContextId>,
    /// Whether its own entries wait for [`LogWriter::acked`].
    await_acks: bool,
}

impl LogWriter {
    /// A writer whose entries are on the log once written (a file, a
    /// test).
    pub fn new(limits: WriterLimits) -> Self {
        Self {
            limits,
            ..Self::default()
        }
    }

    /// A writer whose entries are on the log only once confirmed
    /// ([`LogWriter::acked`]).
    pub fn awaiting_acks(limits: WriterLimits) -> Self {
        Self {
            limits,
            await_acks: true,
            ..Self::default()
        }
    }

    /// The log confirmed `entry` (see [`LogWriter::awaiting_acks`]): it may
    /// be referred to from now on.
    pub fn acked(&mut self, entry: &LogEntry, now_ms: u64) {
        match entry {
            LogEntry::Context { id, .. } => {
                self.remember_context(*id);
            }
            LogEntry::Decision(d) => self.saw_prompt(&d.prompt, now_ms),
        }
    }

    /// The entries of `record`, in order: its context when not written
    /// yet, then the decision, its prompt's longest prefix that an earlier
    /// entry's prompt was replaced by a reference.
    pub fn write(&mut self, record: &DecisionRecord, now_ms: u64) -> Vec<LogEntry> {
        let inputs = &record.inputs;
        let context = DecisionContext {
            policy_params: inputs.policy_params.clone(),
            router_params: inputs.router_params.clone(),
            block_size: inputs.block_size,
            candidates: inputs
                .candidates
                .iter()
                .map(|c| CandidateFacts {
                    worker: c.worker.clone(),
                    role: c.role,
                    kv_capacity_blocks: c.kv_capacity_blocks,
                    max_batched_tokens: c.max_batched_tokens,
                    kv_bytes_per_token: c.kv_bytes_per_token,
                    capabilities: c.capabilities,
                })
                .collect(),
        };
        let id = context.id();
        let mut entries = Vec::with_capacity(2);
        let written = if self.await_acks {
            self.contexts.contains(&id)
        } else {
            !self.remember_context(id)
        };
        if !written {
            entries.push(LogEntry::Context { id, context });
        }
        let hashes = &inputs.block_hashes;
        let prefix = self.longest_prefix(hashes, now_ms);
        let skip = prefix.map_or(0, |p| p.blocks as usize);
        let prompt = LoggedPrompt {
            prefix,
            blocks: PackedHashes(hashes[skip..].to_vec()),
        };
        if !self.await_acks {
            self.saw_prompt(&prompt, now_ms);
        }
        entries.push(LogEntry::Decision(LoggedDecision {
            decision: record.decision.clone(),
            context: id,
            prompt,
            expected_output_tokens: inputs.expected_output_tokens,
            delta_seq: inputs.delta_seq,
            seed: inputs.seed,
            avoid: inputs.avoid.clone(),
            calibration: inputs.calibration.clone(),
            session: inputs.session.clone(),
            candidates: Columns(
                inputs
                    .candidates
                    .iter()
                    .map(|c| CandidateState {
                        depth: c.depth,
                        load: c.load,
                    })
                    .collect(),
            ),
        }));
        entries
    }

    /// An entry another writer put on the log: its prompt may be referred
    /// back to.
    pub fn saw(&mut self, entry: &LogEntry, now_ms: u64) {
        if let LogEntry::Decision(d) = entry {
            self.saw_prompt(&d.prompt, now_ms);
        }
    }

    /// A prompt of `blocks` blocks ending in `last` is on the log (another
    /// writer's, as [`LoggedPrompt::end`] names it).
    pub fn saw_prompt_end(&mut self, last: BlockHash, blocks: u32, now_ms: u64) {
        if self.prompts.insert(last, (blocks, now_ms)).is_none() {
            self.prompt_order.push_back(last);
        }
        while self.prompt_order.len() > self.limits.prompts {
            if let Some(old) = self.prompt_order.pop_front() {
                self.prompts.remove(&old);
            }
        }
    }

    /// An entry that did not reach the log: nothing refers to it from now
    /// on (a context is written again with its next decision).
    pub fn lost(&mut self, entry: &LogEntry) {
        match entry {
            LogEntry::Context { id, .. } => {
                self.contexts.remove(id);
            }
            LogEntry::Decision(d) => {
                if let Some(last) = d.prompt.last() {
                    self.prompts.remove(&last);
                }
            }
        }
    }

    fn remember_context(&mut self, id: ContextId) -> bool {
        if !self.contexts.insert(id) {
            return false;
        }
        self.context_order.push_back(id);
        while self.context_order.len() > self.limits.contexts {
            if let Some(old) = self.context_order.pop_front() {
                self.contexts.remove(&old);
            }
        }
        true
    }

    fn saw_prompt(&mut self, prompt: &LoggedPrompt, now_ms: u64) {
        if let Some((last, blocks)) = prompt.end() {
            self.saw_prompt_end(last, blocks, now_ms);
        }
    }

    /// The longest leading run of `hashes` that is a recent prompt on the
    /// log (a hash names its prefix, so its last hash and length suffice).
    fn longest_prefix(&self, hashes: &[BlockHash], now_ms: u64) -> Option<PrefixRef> {
        (1..=hashes.len()).rev().find_map(|n| {
            let last = hashes[n - 1];
            let (blocks, at) = *self.prompts.get(&last)?;
            let recent = now_ms.saturating_sub(at) <= self.limits.prompt_age_ms;
            (blocks as usize == n && recent).then_some(PrefixRef { blocks, last })
        })
    }
}

/// Why an entry cannot be read back into a record.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    #[error("decision {decision} names context {context}, which is not in the log read")]
    MissingContext {
        decision: String,
        context: ContextId,
    },
    #[error(
        "decision {decision}'s prompt begins with {prefix}, which no entry read before it holds"
    )]
    MissingPrefix { decision: String, prefix: PrefixRef },
    #[error("decision {decision} has {got} candidates' loads for the {expected} candidates of context {context}")]
    Candidates {
        decision: String,
        context: ContextId,
        expected: usize,
        got: usize,
    },
}

/// Reads log entries back into records, in log order. Pure.
#[derive(Debug, Default)]
pub struct LogReader {
    contexts: HashMap<ContextId, Arc<DecisionContext>>,
    /// Every prompt read: last hash -> its hashes.
    prompts: HashMap<BlockHash, Arc<[BlockHash]>>,
}

impl LogReader {
    pub fn new() -> Self {
        Self::default()
    }

    /// A context (from the log, or from an export).
    pub fn add_context(&mut self, id: ContextId, context: DecisionContext) {
        self.contexts.insert(id, Arc::new(context));
    }

    /// A prompt later entries may begin with (an export carries those its
    /// window refers back to).
    pub fn add_prompt(&mut self, hashes: Arc<[BlockHash]>) {
        if let Some(&last) = hashes.last() {
            self.prompts.insert(last, hashes);
        }
    }

    /// The whole prompt that ends in `prefix.last`, if read.
    pub fn prompt(&self, prefix: &PrefixRef) -> Option<&Arc<[BlockHash]>> {
        self.prompts
            .get(&prefix.last)
            .filter(|p| p.len() == prefix.blocks as usize)
    }

    /// Reads one entry: a context is kept, a decision read back (`None`
    /// for a context).
    pub fn read(&mut self, entry: &LogEntry) -> Result<Option<DecisionRecord>, ResolveError> {
        match entry {
            LogEntry::Context { id, context } => {
                self.add_context(*id, context.clone());
                Ok(None)
            }
            LogEntry::Decision(d) => self.decision(d).map(Some),
        }
    }

    /// Reads a decision back into its record.
    pub fn decision(&mut self, d: &LoggedDecision) -> Result<DecisionRecord, ResolveError> {
        let decision = || d.decision.id.to_string();
        let context = self
            .contexts
            .get(&d.context)
            .ok_or_else(|| ResolveError::MissingContext {
                decision: decision(),
                context: d.context,
            })?
            .clone();
        if context.candidates.len() != d.candidates.0.len() {
            return Err(ResolveError::Candidates {
                decision: decision(),
                context: d.context,
                expected: context.candidates.len(),
                got: d.candidates.0.len(),
            });
        }
        let mut hashes = Vec::with_capacity(d.prompt.len());
        if let Some(prefix) = &d.prompt.prefix {
            let earlier = self
                .prompt(prefix)
                .ok_or_else(|| ResolveError::MissingPrefix {
                    decision: decision(),
                    prefix: *prefix,
                })?;
            hashes.extend_from_slice(earlier);
        }
        hashes.extend_from_slice(&d.prompt.blocks.0);
        let hashes: Arc<[BlockHash]> = hashes.into();
        self.add_prompt(hashes.clone());
        let candidates = context
            .candidates
            .iter()
            .zip(&d.candidates.0)
            .map(|(facts, state)| CandidateInput {
                worker: facts.worker.clone(),
                role: facts.role,
                kv_capacity_blocks: facts.kv_capacity_blocks,
                max_batched_tokens: facts.max_batched_tokens,
                kv_bytes_per_token: facts.kv_bytes_per_token,
                depth: state.depth,
                load: state.load,
                capabilities: facts.capabilities,
            })
            .collect();
        Ok(DecisionRecord {
            decision: d.decision.clone(),
            inputs: DecisionInputs {
                block_hashes: hashes.to_vec(),
                block_size: context.block_size,
                expected_output_tokens: d.expected_output_tokens,
                delta_seq: d.delta_seq,
                seed: d.seed,
                avoid: d.avoid.clone(),
                policy_params: context.policy_params.clone(),
                router_params: context.router_params.clone(),
                candidates,
                calibration: d.calibration.clone(),
                session: d.session.clone(),
            },
        })
    }
}

/// A prompt's block hashes, as an export carries those that its window's
/// decisions refer back to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptRecord {
    pub blocks: PackedHashes,
}

impl Message for PromptRecord {
    const NAME: &'static str = "PromptRecord";
    const VERSION: u16 = 1;
}

impl Message for LogEntry {
    const NAME: &'static str = "LogEntry";
    const VERSION: u16 = 2;
}

impl Message for DecisionContext {
    const NAME: &'static str = "DecisionContext";
    const VERSION: u16 = 1;
}

impl Message for LoggedDecision {
    const NAME: &'static str = "LoggedDecision";
    const VERSION: u16 = 1;
}

#[cfg(test)]
mod tests;
