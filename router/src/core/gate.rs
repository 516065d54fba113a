//! The decode gate: vetoes a bypass that would push the decode worker past
//! its KV budget.
//!
//! The check is `effective KV used + request blocks > budget_fraction ×
//! capacity`, where the effective KV used already holds every reservation
//! made since the worker's last report (see
//! [`super::workers::EffectiveLoad::kv_blocks_used`]): each routed
//! request's blocks beyond the prefix the worker held for it are reserved
//! in the in-flight ledger the moment it is decided, so a burst of bypasses
//! decided between two load reports cannot together overcommit one worker,
//! while a prefix they share is counted once. The request's own blocks are
//! counted whole: its prefix may be cached without being in use. (A gate
//! that reserves nothing — `count_reservations: false` — compares against
//! the last report only and lets such a burst through.)
//!
//! Without its signal — the worker's KV capacity unknown (registered as 0
//! and never reported) — an enabled gate vetoes, as Dynamo's does: it
//! cannot tell that the bypass fits.
//!
//! A vetoed bypass goes remote; its decode leg moves to the cheapest decode
//! worker that has room, if any (remote or not, the request's KV lands on
//! its decode worker). Without a prefill worker there is no remote path and
//! nothing to veto.

use serde::{Deserialize, Serialize};

use super::workers::EffectiveLoad;

/// Decode gate settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GateConfig {
    /// Whether bypasses are checked at all. Default true.
    pub enabled: bool,
    /// Share of the KV capacity a bypass may fill. Default 0.95: engines
    /// preempt running requests when the cache is full; the remaining 5%
    /// absorbs the error of `expected_output_tokens`.
    pub budget_fraction: f64,
    /// Count the ledger's reservations (true, default) or only the last
    /// report (false: the behaviour of gates that reserve nothing, kept
    /// for comparisons).
    pub count_reservations: bool,
}

impl Default for GateConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            budget_fraction: 0.95,
            count_reservations: true,
        }
    }
}

/// The gate's numbers for one worker and request.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GateCheck {
    /// KV blocks counted as used (with or without reservations).
    pub used_blocks: u64,
    /// Blocks the request would add.
    pub request_blocks: u64,
    /// `budget_fraction × capacity`.
    pub budget_blocks: f64,
    /// Whether the worker's KV capacity is known (the gate's signal).
    pub known: bool,
    /// Whether `used + request <= budget` (always true when the gate is
    /// off; false when the capacity is unknown: no signal, veto).
    pub fits: bool,
}

impl GateConfig {
    /// Checks whether `request_blocks` more fit in a worker's budget.
    pub fn check(&self, load: &EffectiveLoad, request_blocks: u64) -> GateCheck {
        let used_blocks = if self.count_reservations {
            load.kv_blocks_used
        } else {
            load.reported_kv_blocks_used
        };
        let budget_blocks = self.budget_fraction * load.kv_capacity_blocks as f64;
        let known = load.kv_capacity_blocks > 0;
        let fits = !self.enabled
            || (known && used_blocks.saturating_add(request_blocks) as f64 <= budget_blocks);
        GateCheck {
            used_blocks,
            request_blocks,
            budget_blocks,
            known,
            fits,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn budget_at_and_around() {
        let gate = GateConfig::default();
        let load = |used| EffectiveLoad {
            kv_blocks_used: used,
            reported_kv_blocks_used: 0,
            kv_capacity_blocks: 1_000,
            ..EffectiveLoad::default()
        };
        assert!(gate.check(&load(849), 100).fits);
        assert!(gate.check(&load(850), 100).fits); // exactly 950
        assert!(!gate.check(&load(851), 100).fits);
        let blind = GateConfig {
            count_reservations: false,
            ..gate
        };
        assert!(blind.check(&load(900), 100).fits);
        // No signal (capacity unknown): an enabled gate vetoes, as
        // Dynamo's; a disabled one lets everything through.
        let unknown = EffectiveLoad::default();
        let check = gate.check(&unknown, 1);
        assert!(!check.known && !check.fits);
        let off = GateConfig {
            enabled: false,
            ..gate
        };
        assert!(off.check(&unknown, 1 << 40).fits);
    }
}
