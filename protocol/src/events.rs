//! KV-cache events published by worker agents, and load reports.

use serde::{Deserialize, Serialize};

use crate::ids::{BlockHash, WorkerId};

/// Where a KV block lives on its worker. Offloaded tiers still save
/// recomputation, with less benefit than device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "u8", try_from = "u8")]
pub enum Tier {
    Device = 0,
    Host = 1,
    Disk = 2,
}

impl Tier {
    pub const ALL: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

    pub fn as_str(self) -> &'static str {
        match self {
            Tier::Device => "device",
            Tier::Host => "host",
            Tier::Disk => "disk",
        }
    }
}

impl From<Tier> for u8 {
    fn from(t: Tier) -> u8 {
        t as u8
    }
}

/// A byte that is not a [`Tier`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tier {0}")]
pub struct UnknownTier(pub u8);

impl TryFrom<u8> for Tier {
    type Error = UnknownTier;

    fn try_from(v: u8) -> Result<Self, Self::Error> {
        match v {
            0 => Ok(Tier::Device),
            1 => Ok(Tier::Host),
            2 => Ok(Tier::Disk),
            other => Err(UnknownTier(other)),
        }
    }
}

/// A name that is not a [`Tier`]'s.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown tier {0:?} (device, host or disk)")]
pub struct UnknownTierName(pub String);

impl std::str::FromStr for Tier {
    type Err = UnknownTierName;

    /// `device`, `host` or `disk` ([`Tier::as_str`]).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Tier::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| UnknownTierName(s.to_owned()))
    }
}

/// A set of tiers, one bit per [`Tier`].
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct TierSet(u8);

impl TierSet {
    pub const EMPTY: TierSet = TierSet(0);

    pub fn only(tier: Tier) -> Self {
        TierSet(1 << tier as u8)
    }

    /// The set from its bits; bits beyond the known tiers are dropped.
    pub fn from_bits(bits: u8) -> Self {
        TierSet(bits & 0b111)
    }

    pub fn bits(self) -> u8 {
        self.0
    }

    pub fn contains(self, tier: Tier) -> bool {
        self.0 & (1 << tier as u8) != 0
    }

    pub fn with(self, tier: Tier) -> Self {
        TierSet(self.0 | (1 << tier as u8))
    }

    pub fn without(self, tier: Tier) -> Self {
        TierSet(self.0 & !(1 << tier as u8))
    }

    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub fn iter(self) -> impl Iterator<Item = Tier> {
        Tier::ALL.into_iter().filter(move |t| self.contains(*t))
    }
}

/// One change to a worker's KV cache.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum KvEvent {
    /// Blocks now held in `tier`. `blocks` are consecutive: each is the
    /// child of the one before it, the first the child of `parent` (`None`:
    /// the first block of a prompt).
    Stored {
        parent: Option<BlockHash>,
        blocks: Vec<BlockHash>,
        tier: Tier,
    },
    /// Blocks no longer held in `tier`.
    Removed { blocks: Vec<BlockHash>, tier: Tier },
    /// Every block of the worker is gone (engine restart, cache reset).
    Cleared,
}

/// Events of one worker, in order.
///
/// `seq` counts batches per worker and epoch, from 0, without gaps. `epoch`
/// grows whenever the worker's engine or agent restarts or resynchronises;
/// a new epoch's first batch starts with [`KvEvent::Cleared`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvEventBatch {
    pub worker: WorkerId,
    pub epoch: u64,
    pub seq: u64,
    pub events: Vec<KvEvent>,
}

impl KvEventBatch {
    /// Number of block-events (stored or removed blocks) in the batch.
    pub fn block_events(&self) -> usize {
        self.events
            .iter()
            .map(|e| match e {
                KvEvent::Stored { blocks, .. } | KvEvent::Removed { blocks, .. } => blocks.len(),
                KvEvent::Cleared => 0,
            })
            .sum()
    }
}

/// A worker's load, published at least every 100 ms and on change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoadReport {
    pub worker: WorkerId,
    /// Requests in the running batch.
    pub running: u32,
    /// Requests waiting for admission.
    pub waiting: u32,
    /// Prompt tokens admitted or waiting whose prefill has not run yet.
    pub queued_prefill_tokens: u64,
    /// KV blocks held by running decodes.
    pub active_decode_blocks: u64,
    /// KV blocks in use (running requests and cached prefixes that cannot be
    /// evicted right now).
    pub kv_blocks_used: u64,
    pub kv_blocks_total: u64,
    /// Milliseconds on the reporter's clock (virtual time in the simulator).
    pub at_ms: u64,
    /// The inter-token latency the worker's decoding requests saw lately,
    /// in microseconds: a recent mean of its decode steps' times (prefill
    /// chunks mixed into them included). 0 when unknown or when nothing
    /// decoded lately. Reports of older agents lack it (0).
    #[serde(default)]
    pub recent_itl_us: u32,
}

impl LoadReport {
    /// A report of a worker with nothing running, waiting or cached.
    pub fn idle(worker: WorkerId, kv_blocks_total: u64, at_ms: u64) -> Self {
        Self {
            worker,
            running: 0,
            waiting: 0,
            queued_prefill_tokens: 0,
            active_decode_blocks: 0,
            kv_blocks_used: 0,
            kv_blocks_total,
            at_ms,
            recent_itl_us: 0,
        }
    }

    /// Share of the KV cache in use, 0 when the total is unknown.
    pub fn kv_usage(&self) -> f64 {
        if self.kv_blocks_total == 0 {
            0.0
        } else {
            self.kv_blocks_used as f64 / self.kv_blocks_total as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tier_set_operations() {
        let s = TierSet::only(Tier::Host).with(Tier::Disk);
        assert!(s.contains(Tier::Host) && s.contains(Tier::Disk) && !s.contains(Tier::Device));
        assert_eq!(s.iter().collect::<Vec<_>>(), vec![Tier::Host, Tier::Disk]);
        assert!(s.without(Tier::Host).without(Tier::Disk).is_empty());
        assert_eq!(TierSet::from_bits(0xff).bits(), 0b111);
    }
}
