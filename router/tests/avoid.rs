//! `RouterCore::route_avoiding`: a retry elsewhere after a worker failed.

mod common;

use common::*;
use protocol::{DecisionId, Path, Role};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{
    AlwaysDisagg, NeverDisagg, RouteError, RouteRequest, RouterConfig, RouterCore, Workers,
};

fn request<'a>(hashes: &'a [protocol::BlockHash], isl: u32) -> RouteRequest<'a> {
    RouteRequest {
        request_id: "r",
        isl_tokens: isl,
        block_hashes: hashes,
        expected_output_tokens: 16,
    }
}

fn in_flight_on(workers: &Workers, name: &str) -> u32 {
    workers.ledger_charges(&id(name)).requests
}

#[test]
fn avoided_decode_workers_are_never_chosen() {
    let mut core: RouterCore = core_with(RouterConfig::new(contract()), Box::new(NeverDisagg));
    for name in ["d0", "d1", "d2"] {
        core.register(record(name, Role::Decode, 10_000)).unwrap();
    }
    let mut rng = ChaCha8Rng::seed_from_u64(3);
    let prompt = tokens(1, 256);
    let hashes = core.hasher().hash_prompt(&prompt);
    let first = core
        .route(&request(&hashes, 256), DecisionId(1), 0, &mut rng)
        .unwrap();
    for n in 2..20 {
        let avoid = [first.decode.clone()];
        let d = core
            .route_avoiding(&request(&hashes, 256), &avoid, DecisionId(n), 0, &mut rng)
            .unwrap();
        assert_ne!(d.decode, first.decode);
    }
    // Only the first decision is charged to its worker.
    assert_eq!(in_flight_on(core.workers(), &first.decode.to_string()), 1);

    let all = [id("d0"), id("d1"), id("d2")];
    assert_eq!(
        core.route_avoiding(&request(&hashes, 256), &all, DecisionId(99), 0, &mut rng),
        Err(RouteError::NoOtherDecodeWorker { avoided: 3 })
    );
    assert!(
        !core.workers().knows_decision(DecisionId(99)),
        "a refused retry charges nothing"
    );
    // Unknown ids in the avoid list are ignored.
    let d = core
        .route_avoiding(
            &request(&hashes, 256),
            &[id("zz")],
            DecisionId(100),
            0,
            &mut rng,
        )
        .unwrap();
    assert!(["d0", "d1", "d2"].contains(&d.decode.to_string().as_str()));
}

#[test]
fn an_avoided_prefill_worker_leaves_the_remote_path_to_the_others() {
    let mut core = core_with(RouterConfig::new(contract()), Box::new(AlwaysDisagg));
    for (name, role) in [
        ("p0", Role::Prefill),
        ("p1", Role::Prefill),
        ("d0", Role::Decode),
    ] {
        core.register(record(name, role, 10_000)).unwrap();
    }
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let prompt = tokens(2, 512);
    let hashes = core.hasher().hash_prompt(&prompt);
    let d = core
        .route_avoiding(
            &request(&hashes, 512),
            &[id("p0")],
            DecisionId(1),
            0,
            &mut rng,
        )
        .unwrap();
    assert_eq!((d.path, d.prefill), (Path::Remote, Some(id("p1"))));

    // With every prefill worker avoided there is no remote path: bypass.
    let d = core
        .route_avoiding(
            &request(&hashes, 512),
            &[id("p0"), id("p1")],
            DecisionId(2),
            0,
            &mut rng,
        )
        .unwrap();
    assert_eq!((d.path, d.prefill), (Path::Bypass, None));
    assert_eq!(d.rule, router::rules::NO_PREFILL_WORKER);
    assert_eq!(d.decode, id("d0"));
}
