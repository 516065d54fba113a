//! Registration, the in-flight ledger, determinism and bad input.

mod common;

use common::*;
use protocol::{
    BlockHash, ContractMismatch, DecisionId, HashingContract, Path, Role, RouteDecision, Tier,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{
    rules, AlwaysDisagg, IslBased, LedgerConfig, NeverDisagg, RouteError, RouteOptions,
    RouteRequest, RouterConfig, RouterCore,
};

fn rng(seed: u64) -> ChaCha8Rng {
    ChaCha8Rng::seed_from_u64(seed)
}

fn disagg(ledger: LedgerConfig) -> RouterCore {
    let config = RouterConfig {
        ledger,
        ..RouterConfig::new(contract())
    };
    let mut core = core_with(config, AlwaysDisagg);
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    core.register(record("d0", Role::Decode, 10_000)).unwrap();
    core
}

fn peer_decision(id: u64, at_ms: u64) -> RouteDecision {
    RouteDecision {
        id: DecisionId(id),
        request_id: format!("peer-{id}"),
        path: Path::Remote,
        decode: common::id("d0"),
        prefill: Some(common::id("p0")),
        isl_tokens: 1_000,
        decode_overlap_tokens: 0,
        prefill_overlap_tokens: 0,
        reserved_decode_blocks: 70,
        reserved_prefill_tokens: 1_000,
        policy: "isl".into(),
        rule: rules::ISL_LONG_PREFILL.into(),
        reason: String::new(),
        at_ms,
        fetch: None,
    }
}

#[test]
fn a_contract_mismatch_is_refused_and_the_worker_not_added() {
    let mut core = core_with(RouterConfig::new(contract()), NeverDisagg);
    let mut bad = record("d0", Role::Decode, 1_000);
    bad.contract.block_size = 32;
    assert_eq!(
        core.register(bad.clone()),
        Err(ContractMismatch::BlockSize {
            expected: 16,
            got: 32
        })
    );
    assert!(core.workers().record(&id("d0")).is_none());
    let prompt = tokens(1, 100);
    assert_eq!(
        core.route_prompt(&prompt, 10, DecisionId(1), 0, &mut rng(0)),
        Err(RouteError::NoDecodeWorker)
    );
    // A registered worker that comes back under another contract is dropped.
    core.register(record("d0", Role::Decode, 1_000)).unwrap();
    bad.contract = HashingContract::for_model("other-model", 16);
    assert!(matches!(
        core.register(bad),
        Err(ContractMismatch::Model { .. })
    ));
    assert!(core.workers().is_empty());
}

#[test]
fn ledger_entries_expire_after_their_ttl() {
    let ledger = LedgerConfig {
        ttl_ms: 1_000,
        ..LedgerConfig::default()
    };
    let mut core = disagg(ledger);
    let d = core
        .route_prompt(&tokens(1, 1_600), 400, DecisionId(1), 5_000, &mut rng(0))
        .unwrap()
        .decision;
    assert_eq!(d.path, Path::Remote);
    assert_eq!(
        (d.reserved_decode_blocks, d.reserved_prefill_tokens),
        (125, 1_600)
    );
    let d0 = core.workers().effective_load(&id("d0")).unwrap();
    let p0 = core.workers().effective_load(&id("p0")).unwrap();
    assert_eq!((d0.active_decode_blocks, d0.running), (125, 1));
    assert_eq!(p0.queued_prefill_tokens, 1_600);
    assert_eq!(core.expire(5_999), 0);
    assert_eq!(core.workers().in_flight(), 1);
    assert_eq!(core.expire(6_000), 1);
    assert_eq!(core.workers().in_flight(), 0);
    let d0 = core.workers().effective_load(&id("d0")).unwrap();
    assert_eq!(d0.active_decode_blocks, 0);
    assert_eq!(
        core.workers()
            .effective_load(&id("p0"))
            .unwrap()
            .queued_prefill_tokens,
        0
    );
}

#[test]
fn on_decision_is_idempotent_and_completions_release() {
    let mut core = disagg(LedgerConfig {
        tombstone_ttl_ms: 100,
        ..LedgerConfig::default()
    });
    let decision = peer_decision(7, 0);
    assert!(core.on_decision(&decision));
    assert!(!core.on_decision(&decision));
    let charges = |core: &RouterCore, w: &str| core.workers().ledger_charges(&id(w));
    assert_eq!(charges(&core, "p0").prefill_tokens, 1_000);
    assert_eq!(
        (
            charges(&core, "d0").decode_blocks,
            charges(&core, "d0").requests
        ),
        (70, 1)
    );

    assert!(core.on_prefill_done(decision.id));
    assert!(!core.on_prefill_done(decision.id));
    assert_eq!(charges(&core, "p0").prefill_tokens, 0);
    assert_eq!(charges(&core, "d0").decode_blocks, 70);

    assert!(core.on_finished(decision.id));
    assert!(!core.on_finished(decision.id));
    assert_eq!(charges(&core, "d0").decode_blocks, 0);
    // A late copy of the finished decision is not charged again ...
    assert!(!core.on_decision(&decision));
    assert_eq!(core.workers().in_flight(), 0);
    // ... until its tombstone is gone.
    core.expire(1_000);
    core.expire(1_100);
    assert!(core.on_decision(&decision));

    // A completion that overtakes its decision also blocks it.
    assert!(!core.on_finished(DecisionId(8)));
    assert!(!core.on_decision(&peer_decision(8, 0)));

    // An id in the ledger cannot be routed again (its charge would be lost).
    assert_eq!(
        core.route_prompt(&tokens(1, 100), 10, DecisionId(7), 0, &mut rng(0)),
        Err(RouteError::DuplicateDecision(DecisionId(7)))
    );
}

#[test]
fn a_forgotten_dry_run_releases_its_charges_and_leaves_nothing() {
    let mut core = disagg(LedgerConfig::default());
    let d = core
        .route_prompt(&tokens(1, 1_600), 400, DecisionId(1), 0, &mut rng(0))
        .unwrap()
        .decision;
    assert_eq!(core.workers().ledger_charges(&id("d0")).requests, 1);
    assert!(core.forget(d.id));
    assert!(!core.forget(d.id));
    assert_eq!(core.workers().in_flight(), 0);
    assert_eq!(core.workers().ledger_charges(&id("d0")).requests, 0);
    assert_eq!(core.workers().ledger_charges(&id("p0")).prefill_tokens, 0);
    // No tombstone: the id is free again.
    assert!(!core.workers().knows_decision(d.id));
    // A finished decision's tombstone is kept.
    assert!(!core.on_finished(DecisionId(2)));
    assert!(!core.forget(DecisionId(2)));
    assert!(core.workers().knows_decision(DecisionId(2)));
}

#[test]
fn peer_decisions_for_unknown_workers_count_once_they_register() {
    let mut core = core_with(RouterConfig::new(contract()), AlwaysDisagg);
    assert!(core.on_decision(&peer_decision(1, 0)));
    core.register(record("d0", Role::Decode, 10_000)).unwrap();
    let load = core.workers().effective_load(&id("d0")).unwrap();
    assert_eq!(load.active_decode_blocks, 70);
    // Deregistering drops its in-flight entries.
    assert!(core.deregister(&id("d0")));
    assert_eq!(core.workers().in_flight(), 0);
    assert!(!core.deregister(&id("d0")));
}

#[test]
fn effective_load_is_the_max_of_report_plus_unreported_and_ledger() {
    let mut core = disagg(LedgerConfig::default());
    // A report with 1000 blocks the ledger never saw (a peer's requests).
    core.on_load(report("d0", 1_000, 1_000, 10_000, 0), 0);
    assert!(core.on_decision(&peer_decision(1, 10)));
    let load = core.workers().effective_load(&id("d0")).unwrap();
    assert_eq!(load.active_decode_blocks, 1_070);
    // The next report includes it: not counted twice.
    core.on_load(report("d0", 1_070, 1_070, 10_000, 100), 100);
    let load = core.workers().effective_load(&id("d0")).unwrap();
    assert_eq!(load.active_decode_blocks, 1_070);
    // Reports that show less than the ledger do not hide it.
    core.on_load(report("d0", 0, 0, 10_000, 200), 200);
    let load = core.workers().effective_load(&id("d0")).unwrap();
    assert_eq!(load.active_decode_blocks, 70);
    // An older report is ignored.
    assert!(!core.on_load(report("d0", 5_000, 5_000, 10_000, 150), 300));
}

/// A fetch pins its prefix on the source (a decode worker) from the
/// decision on; the source's reports count the pinned blocks once they are
/// taken, so the pin is unreported until a report covers it, as every other
/// charge, and never counted twice.
#[test]
fn a_pinned_prefix_counts_once_on_its_source() {
    let mut core = disagg(LedgerConfig::default());
    core.register(record("d1", Role::Decode, 10_000)).unwrap();
    let used = |core: &RouterCore| {
        core.workers()
            .effective_load(&id("d1"))
            .unwrap()
            .kv_blocks_used
    };
    let fetch = |n: u64, at_ms: u64| RouteDecision {
        path: Path::RemoteFetch,
        fetch: Some(protocol::PrefixFetch {
            source: id("d1"),
            prefix_tokens: 3_200,
            pulled_tokens: 3_200,
        }),
        ..peer_decision(n, at_ms)
    };
    core.on_load(report("d1", 500, 500, 10_000, 0), 0);
    assert!(core.on_decision(&fetch(1, 10)));
    assert_eq!(used(&core), 500 + 200, "unreported: on top of the report");
    core.on_load(report("d1", 700, 700, 10_000, 100), 100);
    assert_eq!(used(&core), 700, "reported: not counted twice");
    core.on_load(report("d1", 0, 0, 10_000, 200), 200);
    assert_eq!(used(&core), 200, "a report showing less does not hide it");
    assert!(core.on_prefill_done(DecisionId(1)));
    assert_eq!(used(&core), 0);
    // Released before any report saw it: nothing is left over.
    assert!(core.on_decision(&fetch(2, 300)));
    assert_eq!(used(&core), 200);
    assert!(core.on_prefill_done(DecisionId(2)));
    assert_eq!(used(&core), 0);
    core.on_load(report("d1", 50, 50, 10_000, 400), 400);
    assert_eq!(used(&core), 50);
}

fn cluster(seed_workers: usize) -> RouterCore {
    let mut core = core_with(RouterConfig::new(contract()), IslBased::default());
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    core.register(record("p1", Role::Prefill, 10_000)).unwrap();
    for i in 0..seed_workers {
        core.register(record(&format!("d{i}"), Role::Decode, 10_000))
            .unwrap();
    }
    core
}

#[test]
fn same_seed_same_decisions_and_seeds_only_differ_among_ties() {
    let prompts: Vec<Vec<u32>> = (0..5).map(|i| tokens(i, 500 + 700 * i as usize)).collect();
    let run = |seed: u64| {
        let mut core = cluster(6);
        let mut rng = rng(seed);
        let mut out = Vec::new();
        for i in 0..60u64 {
            let prompt = &prompts[(i % 5) as usize];
            let (d, e) = explained(
                core.route_prompt(prompt, 100, DecisionId(i), i, &mut rng)
                    .unwrap(),
            );
            // The pick is always among the minimum-cost candidates.
            let min = e
                .decode
                .iter()
                .map(|c| c.cost)
                .fold(f64::INFINITY, f64::min);
            let chosen = e.decode.iter().find(|c| c.worker == d.decode).unwrap();
            assert!(chosen.cost <= min + 1e-9);
            let pmin = e
                .prefill
                .iter()
                .map(|c| c.cost)
                .fold(f64::INFINITY, f64::min);
            let p = &e.prefill[e.prefill_pick.unwrap()];
            assert!(p.cost <= pmin + 1e-9);
            if i % 3 == 0 {
                core.on_finished(d.id);
            }
            out.push((d.decode, d.prefill, d.path));
        }
        out
    };
    let a = run(1);
    assert_eq!(a, run(1));
    assert_ne!(a, run(2), "ties are broken differently by different seeds");
}

#[test]
fn bad_requests_are_refused() {
    let mut core = cluster(1);
    let mut r = rng(0);
    let empty = RouteRequest {
        request_id: "r",
        isl_tokens: 0,
        block_hashes: &[],
        expected_output_tokens: 10,
        session: None,
    };
    assert_eq!(
        core.route(&empty, RouteOptions::default(), DecisionId(1), 0, &mut r)
            .map(|r| r.decision),
        Err(RouteError::EmptyPrompt)
    );
    let hashes = [BlockHash(1), BlockHash(2)];
    let too_many = RouteRequest {
        isl_tokens: 31,
        block_hashes: &hashes,
        ..empty
    };
    assert!(matches!(
        core.route(&too_many, RouteOptions::default(), DecisionId(1), 0, &mut r)
            .map(|r| r.decision),
        Err(RouteError::TooManyBlocks {
            blocks: 2,
            max: 1,
            ..
        })
    ));
    // A prefix of the hashes is fine.
    let prefix = RouteRequest {
        isl_tokens: 64,
        ..too_many
    };
    assert!(core
        .route(&prefix, RouteOptions::default(), DecisionId(1), 0, &mut r)
        .map(|r| r.decision)
        .is_ok());
    assert_eq!(core.workers().in_flight(), 1);
}

#[test]
fn both_workers_are_aggregated_and_never_get_a_remote_leg() {
    let mut core = core_with(RouterConfig::new(contract()), AlwaysDisagg);
    core.register(record("a0", Role::Both, 10_000)).unwrap();
    core.register(record("a1", Role::Both, 10_000)).unwrap();
    let d = core
        .route_prompt(&tokens(1, 9_000), 10, DecisionId(1), 0, &mut rng(0))
        .unwrap()
        .decision;
    assert_eq!(
        (d.path, d.rule.as_str()),
        (Path::Bypass, rules::NO_PREFILL_WORKER)
    );
    assert_eq!(d.reserved_prefill_tokens, 9_000);
    // With a prefill worker, Both workers decode and p0 prefills.
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    let d = core
        .route_prompt(&tokens(1, 9_000), 10, DecisionId(2), 0, &mut rng(0))
        .unwrap()
        .decision;
    assert_eq!((d.path, d.prefill), (Path::Remote, Some(id("p0"))));
    assert!(d.decode.name().starts_with('a'));
}

#[test]
fn offloaded_tiers_count_for_less() {
    let mut core = core_with(RouterConfig::new(contract()), NeverDisagg);
    let mut pipeline = Pipeline::default();
    core.register(record("d0", Role::Decode, 10_000)).unwrap();
    core.register(record("d1", Role::Decode, 10_000)).unwrap();
    let prompt = tokens(5, 1_600);
    let hashes = core.hasher().hash_prompt(&prompt);
    // d0 holds 60 blocks on the device; d1 holds 100 in host memory only.
    pipeline.store(&mut core, &id("d0"), &hashes[..60], 0, Tier::Device);
    pipeline.store(&mut core, &id("d1"), &hashes, 0, Tier::Host);
    let (d, e) = explained(
        core.route_prompt(&prompt, 0, DecisionId(1), 0, &mut rng(0))
            .unwrap(),
    );
    let overlap: Vec<f64> = e.decode.iter().map(|c| c.overlap_blocks).collect();
    assert_eq!(overlap, [60.0, 50.0]);
    assert_eq!(d.decode, id("d0"));
    assert_eq!(d.decode_overlap_tokens, 960);
}

/// A request asking for more blocks than a worker's whole cache charges
/// the cache, not more, and releases exactly what it charged.
#[test]
fn the_ledger_never_charges_more_than_the_cache() {
    let mut core = disagg(LedgerConfig::default());
    let huge = RouteDecision {
        reserved_decode_blocks: 62_500_000,
        ..peer_decision(9, 0)
    };
    assert!(core.on_decision(&huge));
    let charges = |core: &RouterCore| core.workers().ledger_charges(&id("d0"));
    assert_eq!(charges(&core).decode_blocks, 10_000);
    assert!(core.on_finished(huge.id));
    assert_eq!(charges(&core).decode_blocks, 0);
}
