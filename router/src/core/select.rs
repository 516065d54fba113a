//! Decode and prefill worker selection: per-candidate costs and the pick.
//!
//! Both selections score every registered candidate with a cost (lower is
//! better) and take the minimum; equal minimum costs are broken with the
//! injected RNG, so the same seed gives the same picks. With a temperature
//! `T > 0` the pick is sampled instead, with probability proportional to
//! `exp(-(cost - min) / (max - min) / T)`: costs are normalised by their
//! range so that `T` means the same whatever the cost scale.

use kv_indexer::PrefixDepth;
use rand::Rng;
use serde::{Deserialize, Serialize};

use super::workers::{EffectiveLoad, Workers};

/// How much the offloaded tiers of a cached prefix are worth, relative to a
/// block on the device (worth 1). A host block must be copied back (cheap,
/// PCIe), a disk block read (slower); both beat recomputing.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TierWeights {
    /// Weight of a block held in host memory but not on the device.
    /// Default 0.5.
    pub host: f64,
    /// Weight of a block held only on disk. Default 0.25.
    pub disk: f64,
}

impl Default for TierWeights {
    fn default() -> Self {
        Self {
            host: 0.5,
            disk: 0.25,
        }
    }
}

impl TierWeights {
    /// The weighted overlap of a prefix depth, in blocks:
    /// `device + host_weight * (host - device) + disk_weight * (disk - host)`.
    pub fn overlap_blocks(&self, depth: PrefixDepth) -> f64 {
        f64::from(depth.device)
            + self.host * f64::from(depth.host.saturating_sub(depth.device))
            + self.disk * f64::from(depth.disk.saturating_sub(depth.host))
    }
}

/// Decode-worker selection.
///
/// `cost = potential_decode_blocks - overlap_credit * overlap_blocks
///         + queue_weight * queued_prefill_tokens / block_size`
///
/// * `potential_decode_blocks` = the worker's effective active decode
///   blocks + the request's blocks (prompt and expected output): the decode
///   work the worker would carry;
/// * `overlap_blocks` = its weighted cached prefix of the prompt
///   ([`TierWeights`]): what it would not have to compute or receive;
/// * the queue term: on the bypass path the decode worker prefills too, so
///   prefill tokens already queued there delay this request's first token
///   and slow its running decodes.
///
/// Workers whose KV usage is at least `busy_kv_usage`, or with at least
/// `busy_waiting` requests waiting for admission, are skipped unless every
/// candidate is busy.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DecodeSelection {
    /// Blocks of cost removed per overlapping block. Default 1.0: a cached
    /// block is a block the worker does not have to add.
    pub overlap_credit: f64,
    /// Weights of the offloaded tiers (in the service's settings, one
    /// `tier_weights` section sets both selections').
    #[serde(skip)]
    pub tier_weights: TierWeights,
    /// Cost per block's worth of queued prefill tokens. Default 1.0.
    pub queue_weight: f64,
    /// KV usage (effective used / capacity) from which a worker is busy.
    /// Default 0.9: below the decode gate's default budget (0.95), so a
    /// worker stops being chosen before the gate must veto.
    pub busy_kv_usage: f64,
    /// Requests waiting for admission from which a worker is busy. Default
    /// 16: the engine already holds more than it can admit.
    pub busy_waiting: u32,
    /// Softmax temperature; 0 (default) takes the minimum cost.
    pub temperature: f64,
    /// Offer the policy the eligible decode worker holding more of the
    /// prompt than the pick, where a bypass may go instead
    /// ([`crate::PolicyInput::decode_holder`]; the SLA policy weighs it,
    /// the static policies keep Dynamo's semantics and never see it).
    /// Default true; a decision record made before it replays without.
    pub offer_holder: bool,
}

impl DecodeSelection {
    /// Whether a worker at `load` is busy: skipped while another is not,
    /// and, when every one is, the router saturated (admission queues).
    ///
    /// Its KV usage here is the larger of the cache in use
    /// ([`EffectiveLoad::kv_blocks_used`], a shared prefix counted once)
    /// and the blocks routed to it ([`EffectiveLoad::active_decode_blocks`],
    /// whole contexts): selection keeps spreading whole contexts, as it
    /// did before the gate counted shared prefixes once (disaggregated
    /// deployments, which never bypass, route as before).
    pub fn is_busy(&self, load: &EffectiveLoad) -> bool {
        let routed = load.kv_blocks_used.max(load.active_decode_blocks);
        (load.kv_capacity_blocks > 0
            && routed as f64 >= self.busy_kv_usage * load.kv_capacity_blocks as f64)
            || load.waiting >= self.busy_waiting
    }
}

impl Default for DecodeSelection {
    fn default() -> Self {
        Self {
            overlap_credit: 1.0,
            tier_weights: TierWeights::default(),
            queue_weight: 1.0,
            busy_kv_usage: 0.9,
            busy_waiting: 16,
            temperature: 0.0,
            offer_holder: true,
        }
    }
}

/// Prefill-worker selection for the remote path.
///
/// `cost = uncached + queued + miss_weight * (uncached - least_uncached)
///         * mean_queued / prompt`, in blocks:
/// - `uncached`: the prompt's blocks the worker would compute (the prompt
///   less its weighted overlap);
/// - `queued`: the blocks' worth of prefill already queued ahead of it;
/// - the last term charges the blocks this worker computes beyond the
///   candidate that holds the most of the prompt (`least_uncached`) once
///   more for every request-sized queue the prefill workers hold on
///   average (`mean_queued / prompt`, tokens over tokens). Work added to a
///   busy pool delays the requests that arrive behind it, about as many
///   as wait now (Little's law), so under load a miss costs more than its
///   own blocks. On an idle pool the term is 0 and the worker with the
///   soonest start wins; it never exceeds one mean queue.
///
/// Greedy on the request's own start alone (`miss_weight = 0`), a loaded
/// pool sends each turn to whichever worker is free first and recomputes
/// the histories the others hold (Mooncake trace, 12P+4D at 3.1x:
/// 69% of requests within the SLO, 86% with the term; README).
///
/// Candidates are the workers registered with role `Prefill`. Workers with
/// role `Both` never get a remote leg: they are decode candidates whose
/// requests are aggregated (prefilled where they decode); in a deployment
/// of `Both` workers only there is no remote path.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrefillSelection {
    /// Weights of the offloaded tiers (see [`DecodeSelection::tier_weights`]).
    #[serde(skip)]
    pub tier_weights: TierWeights,
    /// Weight of the work a cache miss adds to a loaded pool (see above).
    /// Default 1.0; 0 picks by the request's own start alone.
    pub miss_weight: f64,
    /// Softmax temperature; 0 (default) takes the minimum cost.
    pub temperature: f64,
}

impl Default for PrefillSelection {
    fn default() -> Self {
        Self {
            tier_weights: TierWeights::default(),
            miss_weight: 1.0,
            temperature: 0.0,
        }
    }
}

/// The request's size, as selection sees it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Shape {
    pub(crate) isl_tokens: u32,
    pub(crate) block_size: u32,
    /// Blocks the request occupies on its decode worker at the end:
    /// `ceil((isl + expected_output) / block_size)`.
    pub(crate) request_blocks: u64,
}

impl Shape {
    pub(crate) fn new(isl_tokens: u32, expected_output_tokens: u32, block_size: u32) -> Self {
        let tokens = u64::from(isl_tokens) + u64::from(expected_output_tokens);
        Self {
            isl_tokens,
            block_size,
            request_blocks: tokens.div_ceil(u64::from(block_size.max(1))),
        }
    }
}

/// One candidate's numbers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scored {
    pub(crate) slot: u32,
    pub(crate) depth: PrefixDepth,
    pub(crate) overlap_blocks: f64,
    pub(crate) load: EffectiveLoad,
    pub(crate) busy: bool,
    pub(crate) cost: f64,
}

/// Which candidate list.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Decode,
    Prefill,
}

/// The candidate holding the longest weighted prefix, as (side, index):
/// the chosen decode worker, then the chosen prefill worker, then the
/// others in order (decode first) win ties; `None` when none holds any.
pub(crate) fn best_holder(
    decode: &[Scored],
    d_pick: usize,
    prefill: &[Scored],
    p_pick: Option<usize>,
) -> Option<(Side, usize)> {
    let order = std::iter::once((Side::Decode, d_pick))
        .chain(p_pick.map(|i| (Side::Prefill, i)))
        .chain((0..decode.len()).map(|i| (Side::Decode, i)))
        .chain((0..prefill.len()).map(|i| (Side::Prefill, i)));
    let mut best: Option<((Side, usize), f64)> = None;
    for (side, i) in order {
        let s = match side {
            Side::Decode => decode.get(i),
            Side::Prefill => prefill.get(i),
        };
        let Some(s) = s else { continue };
        if s.overlap_blocks > best.map_or(0.0, |b| b.1) {
            best = Some(((side, i), s.overlap_blocks));
        }
    }
    best.map(|b| b.0)
}

/// Scores every decode candidate into `out` (cleared first).
pub(crate) fn score_decode(
    cfg: &DecodeSelection,
    workers: &Workers,
    depths: &[PrefixDepth],
    shape: &Shape,
    out: &mut Vec<Scored>,
) {
    out.clear();
    let bs = f64::from(shape.block_size.max(1));
    for &slot in workers.decode_slots() {
        // A worker that can serve neither decode leg is no candidate.
        let caps = workers.slot(slot).capabilities();
        if !caps.local_prefill && !caps.remote_decode {
            continue;
        }
        let depth = depths.get(slot as usize).copied().unwrap_or_default();
        let load = workers.slot(slot).effective();
        let overlap_blocks = cfg.tier_weights.overlap_blocks(depth);
        let potential = load.active_decode_blocks as f64 + shape.request_blocks as f64;
        let cost = potential - cfg.overlap_credit * overlap_blocks
            + cfg.queue_weight * load.queued_prefill_tokens as f64 / bs;
        let busy = cfg.is_busy(&load);
        out.push(Scored {
            slot,
            depth,
            overlap_blocks,
            load,
            busy,
            cost,
        });
    }
}

/// Scores every prefill candidate into `out` (cleared first).
pub(crate) fn score_prefill(
    cfg: &PrefillSelection,
    workers: &Workers,
    depths: &[PrefixDepth],
    shape: &Shape,
    out: &mut Vec<Scored>,
) {
    out.clear();
    let bs = f64::from(shape.block_size.max(1));
    let prompt_blocks = f64::from(shape.isl_tokens) / bs;
    let uncached = |s: &Scored| (prompt_blocks - s.overlap_blocks).max(0.0);
    for &slot in workers.prefill_slots() {
        if !workers.slot(slot).capabilities().remote_prefill {
            continue;
        }
        let depth = depths.get(slot as usize).copied().unwrap_or_default();
        let load = workers.slot(slot).effective();
        let mut s = Scored {
            slot,
            depth,
            overlap_blocks: cfg.tier_weights.overlap_blocks(depth),
            load,
            busy: false,
            cost: 0.0,
        };
        s.cost = uncached(&s) + load.queued_prefill_tokens as f64 / bs;
        out.push(s);
    }
    if out.is_empty() || shape.isl_tokens == 0 {
        return;
    }
    let least_uncached = out.iter().map(uncached).fold(f64::INFINITY, f64::min);
    let mean_queued = out
        .iter()
        .map(|s| s.load.queued_prefill_tokens as f64)
        .sum::<f64>()
        / out.len() as f64;
    let queues_ahead = cfg.miss_weight * mean_queued / f64::from(shape.isl_tokens);
    for s in out.iter_mut() {
        s.cost += queues_ahead * (uncached(s) - least_uncached);
    }
}

/// Whether any scored candidate is not busy.
pub(crate) fn any_free(scored: &[Scored]) -> bool {
    scored.iter().any(|s| !s.busy)
}

/// Picks among the eligible candidates: the minimum cost (ties broken by
/// `rng`), or with `temperature > 0` a softmax sample over the
/// range-normalised costs. `None` when no candidate is eligible.
pub(crate) fn pick<R: Rng + ?Sized>(
    scored: &[Scored],
    eligible: impl Fn(&Scored) -> bool,
    temperature: f64,
    rng: &mut R,
) -> Option<usize> {
    let mut min = f64::INFINITY;
    let mut max = f64::NEG_INFINITY;
    let mut n = 0usize;
    for s in scored.iter().filter(|s| eligible(s)) {
        min = min.min(s.cost);
        max = max.max(s.cost);
        n += 1;
    }
    if n == 0 {
        return None;
    }
    let candidates = || scored.iter().enumerate().filter(|(_, s)| eligible(s));
    if temperature > 0.0 && max > min {
        let scale = 1.0 / ((max - min) * temperature);
        let weight = |s: &Scored| (-(s.cost - min) * scale).exp();
        let total: f64 = candidates().map(|(_, s)| weight(s)).sum();
        let mut u = rng.random::<f64>() * total;
        let mut last = None;
        for (i, s) in candidates() {
            let w = weight(s);
            if u < w {
                return Some(i);
            }
            u -= w;
            last = Some(i);
        }
        return last; // rounding left u just above the total
    }
    let tolerance = 1e-9 * min.abs().max(1.0);
    let tied = |s: &Scored| s.cost <= min + tolerance;
    let ties = candidates().filter(|(_, s)| tied(s)).count();
    let k = if ties > 1 {
        rng.random_range(0..ties)
    } else {
        0
    };
    candidates().filter(|(_, s)| tied(s)).nth(k).map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn scored(costs: &[f64]) -> Vec<Scored> {
        costs
            .iter()
            .enumerate()
            .map(|(i, &cost)| Scored {
                slot: i as u32,
                depth: PrefixDepth::default(),
                overlap_blocks: 0.0,
                load: EffectiveLoad::default(),
                busy: false,
                cost,
            })
            .collect()
    }

    #[test]
    fn overlap_weighs_each_tier() {
        let w = TierWeights::default();
        let d = PrefixDepth {
            device: 10,
            host: 14,
            disk: 22,
        };
        assert_eq!(w.overlap_blocks(d), 10.0 + 0.5 * 4.0 + 0.25 * 8.0);
    }

    #[test]
    fn minimum_wins_and_ties_are_spread_by_the_rng() {
        let s = scored(&[5.0, 3.0, 3.0, 9.0]);
        let mut seen = [0usize; 4];
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..200 {
            seen[pick(&s, |_| true, 0.0, &mut rng).unwrap()] += 1;
        }
        assert_eq!(seen[0] + seen[3], 0);
        assert!(seen[1] > 50 && seen[2] > 50, "{seen:?}");
        assert_eq!(pick(&s, |c| c.slot == 3, 0.0, &mut rng), Some(3));
        assert_eq!(pick(&s, |_| false, 0.0, &mut rng), None);
    }

    #[test]
    fn temperature_samples_cheaper_more_often() {
        let s = scored(&[0.0, 10.0]);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let mut cheap = 0;
        for _ in 0..1000 {
            if pick(&s, |_| true, 0.5, &mut rng) == Some(0) {
                cheap += 1;
            }
        }
        // p(cheap) = 1 / (1 + e^-2) = 0.88
        assert!((830..930).contains(&cheap), "{cheap}");
    }
}
