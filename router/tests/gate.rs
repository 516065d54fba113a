//! The decode gate under a burst of bypasses decided between two load
//! reports.

mod common;

use common::*;
use protocol::{DecisionId, Path, Role, Tier};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{rules, DecodeSelection, GateConfig, NeverDisagg, RouterConfig, RouterCore};

const CAPACITY: u64 = 1_000;
const DECODERS: [&str; 4] = ["d0", "d1", "d2", "d3"];

/// p0 and d0..d3 of 1000 blocks; d0 holds a 3200-token prefix (200 blocks)
/// that every request shares and reports 400 blocks in use. The overlap
/// credit is high so that selection keeps preferring d0 and only the gate
/// can stop the burst.
fn cluster(gate: GateConfig) -> (RouterCore, Vec<u32>) {
    let config = RouterConfig {
        decode: DecodeSelection {
            overlap_credit: 10.0,
            ..DecodeSelection::default()
        },
        gate,
        ..RouterConfig::new(contract())
    };
    let mut core = core_with(config, Box::new(NeverDisagg));
    core.register(record("p0", Role::Prefill, CAPACITY))
        .unwrap();
    for d in DECODERS {
        core.register(record(d, Role::Decode, CAPACITY)).unwrap();
        let used = if d == "d0" { 400 } else { 0 };
        core.on_load(report(d, 0, used, CAPACITY, 0), 0);
    }
    let prefix = tokens(7, 3_200);
    let hashes = core.hasher().hash_prompt(&prefix);
    Pipeline::default().store(&mut core, &id("d0"), &hashes, 0, Tier::Device);
    (core, prefix)
}

/// 3200 shared + 160 own tokens, 160 expected output: 220 blocks.
fn request(prefix: &[u32], i: u64) -> Vec<u32> {
    let mut t = prefix.to_vec();
    t.extend(tokens(100 + i, 160));
    t
}

fn used(core: &RouterCore, worker: &str) -> u64 {
    core.workers()
        .effective_load(&id(worker))
        .unwrap()
        .kv_blocks_used
}

#[test]
fn concurrent_bypasses_cannot_overcommit_a_decode_worker() {
    let (mut core, prefix) = cluster(GateConfig::default());
    let budget = 0.95 * CAPACITY as f64;
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut decisions = Vec::new();
    // 14 requests, no load report in between.
    for i in 0..14u64 {
        let d = core
            .route_tokens(
                "r",
                &request(&prefix, i),
                160,
                DecisionId(i),
                10 + i,
                &mut rng,
            )
            .unwrap();
        assert_eq!(d.reserved_decode_blocks, 220);
        for w in DECODERS {
            assert!(
                used(&core, w) as f64 <= budget,
                "{w} over budget after {i}: {}",
                d.reason
            );
        }
        decisions.push(d);
    }
    // 400 + 2 × 220 = 840 <= 950; a third would make 1060.
    let bypassed: Vec<_> = decisions
        .iter()
        .filter(|d| d.path == Path::Bypass)
        .collect();
    assert_eq!(bypassed.len(), 2);
    assert!(bypassed.iter().all(|d| d.decode == id("d0")));
    assert_eq!(used(&core, "d0"), 840);
    let vetoed: Vec<_> = decisions
        .iter()
        .filter(|d| d.path == Path::Remote)
        .collect();
    assert_eq!(vetoed.len(), 12);
    for d in &vetoed {
        assert_eq!(d.rule, rules::GATE_KV_BUDGET);
        assert_eq!(d.prefill, Some(id("p0")));
        assert_ne!(d.decode, id("d0"), "moved to a worker with room");
        assert!(
            d.reason.contains("vetoed by the decode gate: d0 would use 840 + 220 = 1060 > 0.95 × 1000 = 950 KV blocks"),
            "{}",
            d.reason
        );
    }
    // 12 × 220 spread over d1..d3: four each (880 <= 950).
    for w in ["d1", "d2", "d3"] {
        assert_eq!(used(&core, w), 880, "{w}");
    }

    // When nobody has room the request still goes remote; the decode leg
    // stays on the selected worker.
    let d = core
        .route_tokens(
            "r",
            &request(&prefix, 99),
            160,
            DecisionId(99),
            30,
            &mut rng,
        )
        .unwrap();
    assert_eq!(
        (d.path, d.rule.as_str()),
        (Path::Remote, rules::GATE_KV_BUDGET)
    );
    assert!(
        d.reason.contains("no decode worker has room"),
        "{}",
        d.reason
    );
    core.on_finished(d.id);

    // Finishing releases the reservations: d0 takes bypasses again.
    for d in &decisions {
        assert!(core.on_finished(d.id));
    }
    assert_eq!(used(&core, "d0"), 400);
    let d = core
        .route_tokens(
            "r",
            &request(&prefix, 50),
            160,
            DecisionId(50),
            40,
            &mut rng,
        )
        .unwrap();
    assert_eq!(
        (d.path, &d.decode),
        (Path::Bypass, &id("d0")),
        "{}",
        d.reason
    );
}

#[test]
fn a_gate_that_reserves_nothing_lets_the_burst_through() {
    let gate = GateConfig {
        count_reservations: false,
        ..GateConfig::default()
    };
    let (mut core, prefix) = cluster(gate);
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let mut on_d0 = 0;
    for i in 0..6u64 {
        let d = core
            .route_tokens(
                "r",
                &request(&prefix, i),
                160,
                DecisionId(i),
                10 + i,
                &mut rng,
            )
            .unwrap();
        assert_eq!(d.path, Path::Bypass);
        on_d0 += u64::from(d.decode == id("d0"));
    }
    // Three bypasses on d0: 400 + 3 × 220 = 1060 blocks of 1000, past the
    // budget (950) and the capacity; only then does the busy filter (which
    // sees the ledger) move the rest away.
    assert_eq!(on_d0, 3);
    assert_eq!(used(&core, "d0"), 1_060);
}

#[test]
fn a_report_that_includes_the_burst_replaces_the_reservations() {
    let (mut core, prefix) = cluster(GateConfig::default());
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for i in 0..2u64 {
        core.route_tokens(
            "r",
            &request(&prefix, i),
            160,
            DecisionId(i),
            10 + i,
            &mut rng,
        )
        .unwrap();
    }
    assert_eq!(used(&core, "d0"), 840);
    // The report at 200 ms has admitted both (400 + 2 × 220 - their shared
    // prefix, which the engine counts once): 640. The ledger still holds
    // 440 in flight; max(640 + 0, 440) = 640, nothing counted twice.
    core.on_load(report("d0", 440, 640, CAPACITY, 200), 200);
    assert_eq!(used(&core, "d0"), 640);
    // A report received within the grace period of a decision still counts
    // the decision on top.
    core.route_tokens("r", &request(&prefix, 2), 160, DecisionId(2), 230, &mut rng)
        .unwrap();
    core.on_load(report("d0", 440, 640, CAPACITY, 250), 250);
    assert_eq!(used(&core, "d0"), 860);
}
