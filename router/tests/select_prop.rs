//! Properties of selection with temperature 0: the selected decode worker
//! has the minimum cost among the candidates the busy filter keeps; the
//! selected prefill worker has the minimum cost, and with equal queues it
//! holds the longest prefix.

mod common;

use common::*;
use proptest::prelude::*;
use protocol::{DecisionId, IndexChange, IndexDelta, LoadReport, Role, Tier};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{AlwaysDisagg, DecodeSelection, NeverDisagg, PrefillSelection, RouterConfig};

const CAPACITY: u64 = 4_000;

#[derive(Debug, Clone)]
struct Worker {
    device: usize,
    host_extra: usize,
    disk_extra: usize,
    active: u64,
    used_extra: u64,
    queued: u64,
    waiting: u32,
}

fn worker() -> impl Strategy<Value = Worker> {
    (
        0..=40usize,
        0..=8usize,
        0..=8usize,
        0..3_000u64,
        0..2_000u64,
        0..20_000u64,
        0..24u32,
    )
        .prop_map(
            |(device, host_extra, disk_extra, active, used_extra, queued, waiting)| Worker {
                device,
                host_extra,
                disk_extra,
                active,
                used_extra,
                queued,
                waiting,
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn selected_decode_worker_has_the_minimum_cost(
        workers in prop::collection::vec(worker(), 1..8),
        isl_extra in 0..800u32,
        output in 0..2_000u32,
        seed in any::<u64>(),
        credit in 0.0..3.0f64,
        queue_weight in 0.0..2.0f64,
    ) {
        let selection = DecodeSelection { overlap_credit: credit, queue_weight, ..DecodeSelection::default() };
        let config = RouterConfig { decode: selection, ..RouterConfig::new(contract()) };
        let mut core = core_with(config, NeverDisagg);
        let prompt = tokens(seed, 56 * BLOCK as usize + isl_extra as usize);
        let hashes = core.hasher().hash_prompt(&prompt);
        let mut changes = Vec::new();
        for (i, w) in workers.iter().enumerate() {
            let name = format!("d{i}");
            core.register(record(&name, Role::Decode, CAPACITY)).unwrap();
            let host = w.device + w.host_extra;
            let disk = host + w.disk_extra;
            for (tier, n) in [(Tier::Device, w.device), (Tier::Host, host), (Tier::Disk, disk)] {
                if n > 0 {
                    changes.push(IndexChange::Stored { worker: id(&name), parent: None, blocks: hashes[..n].to_vec(), tier });
                }
            }
            core.on_load(LoadReport {
                worker: id(&name),
                running: 0,
                waiting: w.waiting,
                queued_prefill_tokens: w.queued,
                active_decode_blocks: w.active,
                kv_blocks_used: w.active + w.used_extra,
                kv_blocks_total: CAPACITY,
                at_ms: 0,
                recent_itl_us: 0,
            }, 0);
        }
        core.apply_delta(&IndexDelta {
            seq: 1,
            changes,
            source: None,
        })
        .unwrap();

        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let decision = core
            .route_prompt(&prompt, output, DecisionId(1), 1_000, &mut rng)
            .unwrap()
            .decision;

        // The cost, computed here from the inputs alone.
        let bs = f64::from(BLOCK);
        let request_blocks = (f64::from(prompt.len() as u32 + output) / bs).ceil();
        let expected: Vec<(f64, bool)> = workers.iter().map(|w| {
            let overlap = w.device as f64 + 0.5 * w.host_extra as f64 + 0.25 * w.disk_extra as f64;
            let cost = w.active as f64 + request_blocks - credit * overlap + queue_weight * w.queued as f64 / bs;
            let usage = (w.active + w.used_extra) as f64 / CAPACITY as f64;
            (cost, usage >= 0.9 || w.waiting >= 16)
        }).collect();
        let any_free = expected.iter().any(|(_, busy)| !busy);
        let min = expected.iter().filter(|(_, busy)| !any_free || !busy).map(|(c, _)| *c).fold(f64::INFINITY, f64::min);
        let chosen: usize = decision.decode.name()[1..].parse().unwrap();
        let (cost, busy) = expected[chosen];
        prop_assert!(!any_free || !busy, "picked a busy worker");
        prop_assert!((cost - min).abs() <= 1e-6 * min.abs().max(1.0), "cost {} > min {}", cost, min);
    }

    #[test]
    fn selected_prefill_worker_has_the_minimum_cost(
        prefill in prop::collection::vec((0..=60usize, 0..40_000u64), 1..8),
        equal_queues in any::<bool>(),
        isl_extra in 0..800u32,
        seed in any::<u64>(),
        miss_weight in 0.0..3.0f64,
    ) {
        let selection = PrefillSelection { miss_weight, ..PrefillSelection::default() };
        let config = RouterConfig { prefill: selection, ..RouterConfig::new(contract()) };
        let mut core = core_with(config, AlwaysDisagg);
        let prompt = tokens(seed, 60 * BLOCK as usize + isl_extra as usize);
        let hashes = core.hasher().hash_prompt(&prompt);
        core.register(record("d0", Role::Decode, CAPACITY)).unwrap();
        core.on_load(report("d0", 0, 0, CAPACITY, 0), 0);
        let queued = |q: u64| if equal_queues { prefill[0].1 } else { q };
        let mut changes = Vec::new();
        for (i, &(held, q)) in prefill.iter().enumerate() {
            let name = format!("p{i}");
            core.register(record(&name, Role::Prefill, CAPACITY)).unwrap();
            if held > 0 {
                changes.push(IndexChange::Stored { worker: id(&name), parent: None, blocks: hashes[..held].to_vec(), tier: Tier::Device });
            }
            core.on_load(LoadReport { queued_prefill_tokens: queued(q), ..report(&name, 0, 0, CAPACITY, 0) }, 0);
        }
        core.apply_delta(&IndexDelta { seq: 1, changes, source: None }).unwrap();

        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let decision = core
            .route_prompt(&prompt, 16, DecisionId(1), 1_000, &mut rng)
            .unwrap()
            .decision;

        // The cost, computed here from the inputs alone.
        let bs = f64::from(BLOCK);
        let prompt_blocks = prompt.len() as f64 / bs;
        let uncached: Vec<f64> = prefill.iter().map(|&(held, _)| (prompt_blocks - held as f64).max(0.0)).collect();
        let least = uncached.iter().copied().fold(f64::INFINITY, f64::min);
        let mean_queued = prefill.iter().map(|&(_, q)| queued(q) as f64).sum::<f64>() / prefill.len() as f64;
        let cost: Vec<f64> = prefill.iter().zip(&uncached).map(|(&(_, q), &u)| {
            u + queued(q) as f64 / bs + miss_weight * mean_queued / prompt.len() as f64 * (u - least)
        }).collect();
        let min = cost.iter().copied().fold(f64::INFINITY, f64::min);
        let chosen: usize = decision.prefill.expect("a remote decision").name()[1..].parse().unwrap();
        prop_assert!((cost[chosen] - min).abs() <= 1e-6 * min.max(1.0), "cost {} > min {}", cost[chosen], min);
        if equal_queues {
            let longest = prefill.iter().map(|&(held, _)| held).max().unwrap();
            prop_assert_eq!(prefill[chosen].0, longest, "equal queues: the longest holder wins");
        }
    }
}
