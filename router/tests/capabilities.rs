//! Registered capabilities are honoured by selection: a decode worker that
//! cannot take a remote decode (an SGLang decode server without the
//! bootstrap handshake) never gets one, nor a bypass without local
//! prefill; a worker that serves no leg is no candidate.

mod common;

use common::*;
use protocol::{Capabilities, DecisionId, Path, Role, WorkerRecord};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{rules, AlwaysDisagg, IslBased, NeverDisagg, RouteError, RouterConfig};

fn with(mut r: WorkerRecord, local_prefill: bool, remote_decode: bool) -> WorkerRecord {
    r.capabilities = Capabilities {
        local_prefill,
        remote_decode,
        remote_prefill: false,
    };
    r
}

/// SGLang-like decode workers: `bypass_only` prefills locally but takes no
/// remote decode; `nothing` serves no leg.
fn sglang(name: &str, local_prefill: bool) -> WorkerRecord {
    with(record(name, Role::Decode, 10_000), local_prefill, false)
}

#[test]
fn remote_decodes_go_only_to_workers_that_take_them() {
    let mut core = core_with(RouterConfig::new(contract()), AlwaysDisagg);
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    core.register(sglang("d0", true)).unwrap();
    core.register(record("d1", Role::Decode, 10_000)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    for i in 0..40u64 {
        let prompt = tokens(i, 2_000);
        let (d, _) = explained(
            core.route_prompt(&prompt, 64, DecisionId(i), i, &mut rng)
                .unwrap(),
        );
        assert_eq!(d.path, Path::Remote, "{d:?}");
        assert_eq!(d.decode, id("d1"), "decision {i}: {}", d.reason);
    }
}

#[test]
fn without_a_capable_worker_the_other_path_is_taken() {
    // Only the SGLang decode server (bypass only): a remote verdict turns
    // into a bypass on it, with its own rule.
    let mut core = core_with(RouterConfig::new(contract()), AlwaysDisagg);
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    core.register(sglang("d0", true)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let (d, _) = explained(
        core.route_prompt(&tokens(1, 2_000), 64, DecisionId(1), 0, &mut rng)
            .unwrap(),
    );
    assert_eq!((d.path, d.decode.clone()), (Path::Bypass, id("d0")));
    assert_eq!(d.rule, rules::CAPABILITY_OTHER_PATH);
    assert!(
        d.reason
            .contains("no decode worker can serve a remote decode"),
        "{}",
        d.reason
    );

    // A worker that only takes remote decodes, under a bypass verdict.
    let mut core = core_with(RouterConfig::new(contract()), NeverDisagg);
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    core.register(with(record("d0", Role::Decode, 10_000), false, true))
        .unwrap();
    let (d, _) = explained(
        core.route_prompt(&tokens(2, 2_000), 64, DecisionId(2), 0, &mut rng)
            .unwrap(),
    );
    assert_eq!((d.path, d.prefill.clone()), (Path::Remote, Some(id("p0"))));
    assert_eq!(d.rule, rules::CAPABILITY_OTHER_PATH);
}

#[test]
fn a_worker_that_serves_no_leg_is_no_candidate() {
    let mut core = core_with(RouterConfig::new(contract()), IslBased::default());
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    core.register(sglang("d0", false)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let err = core
        .route_prompt(&tokens(1, 200), 64, DecisionId(1), 0, &mut rng)
        .unwrap_err();
    assert_eq!(err, RouteError::NoDecodeWorker);
    core.register(record("d1", Role::Decode, 10_000)).unwrap();
    for i in 0..20u64 {
        let (d, e) = explained(
            core.route_prompt(
                &tokens(i, 200 + 100 * i as usize),
                64,
                DecisionId(10 + i),
                0,
                &mut rng,
            )
            .unwrap(),
        );
        assert_eq!(d.decode, id("d1"));
        assert!(e.decode.iter().all(|c| c.worker != id("d0")));
    }
}

#[test]
fn a_prefill_worker_without_remote_prefill_gets_no_prefill_leg() {
    let mut core = core_with(RouterConfig::new(contract()), AlwaysDisagg);
    let mut p0 = record("p0", Role::Prefill, 10_000);
    p0.capabilities.remote_prefill = false;
    core.register(p0).unwrap();
    core.register(record("p1", Role::Prefill, 10_000)).unwrap();
    core.register(record("d0", Role::Decode, 10_000)).unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    for i in 0..20u64 {
        let (d, _) = explained(
            core.route_prompt(&tokens(i, 1_000), 64, DecisionId(i), 0, &mut rng)
                .unwrap(),
        );
        assert_eq!(d.prefill, Some(id("p1")));
    }
}
