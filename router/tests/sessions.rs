//! Session affinity in the core: a session's turns stay on one decode
//! worker; first turns are chosen identically by replicas whose ledgers
//! differ; the binding goes when the worker saturates or leaves; peers'
//! bindings are honoured; a recorded decision replays with its binding.

mod common;

use common::*;
use protocol::{DecisionId, Role, SessionId, Tier};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{IslBased, Replayer, RouteOptions, RouteRequest, RouterConfig, RouterCore};

fn cluster() -> RouterCore {
    let mut core = core_with(RouterConfig::new(contract()), IslBased::default());
    core.register(record("p0", Role::Prefill, 10_000)).unwrap();
    for i in 0..4 {
        core.register(record(&format!("d{i}"), Role::Decode, 10_000))
            .unwrap();
    }
    core
}

/// Routes `prompt` (64 output tokens expected) as decision `id`, seeded by
/// it.
fn route(
    core: &mut RouterCore,
    prompt: &[u32],
    session: Option<&SessionId>,
    id: u64,
    now_ms: u64,
) -> protocol::RouteDecision {
    let mut rng = ChaCha8Rng::seed_from_u64(id);
    route_session_prompt(core, prompt, session, 64, DecisionId(id), now_ms, &mut rng)
        .unwrap()
        .decision
}

fn sid(s: &str) -> SessionId {
    SessionId::new(s).unwrap()
}

#[test]
fn a_sessions_turns_stay_on_its_worker_against_load() {
    let mut core = cluster();
    let session = sid("conv-1");
    let first = route(&mut core, &tokens(1, 300), Some(&session), 1, 0);
    // Load piles on the bound worker (its own reservations, never
    // finished): KV-aware selection alone would move on.
    for turn in 2..12u64 {
        let d = route(&mut core, &tokens(turn, 300), Some(&session), turn, turn);
        assert_eq!(d.decode, first.decode, "turn {turn}: {}", d.reason);
        assert!(d.reason.contains("session conv-1 bound to"), "{}", d.reason);
    }
    // Without a session, the same load sends requests elsewhere.
    let d = route(&mut core, &tokens(99, 300), None, 99, 20);
    assert_ne!(d.decode, first.decode);
}

#[test]
fn first_turns_racing_on_two_replicas_agree_whatever_their_ledgers() {
    for n in 0..50u64 {
        let session = sid(&format!("race-{n}"));
        let prompt = tokens(1_000 + n, 400);
        // Replica a has routed other traffic (its ledger differs); b has not.
        let mut a = cluster();
        for i in 0..(n % 7) {
            route(&mut a, &tokens(5_000 + i, 300), None, 10_000 + i, 0);
        }
        let mut b = cluster();
        let da = route(&mut a, &prompt, Some(&session), 1, 5);
        let db = route(&mut b, &prompt, Some(&session), 2, 5);
        assert_eq!(da.decode, db.decode, "session {session}");
    }
}

#[test]
fn the_longest_prefix_wins_the_first_turn_and_ties_spread() {
    let mut pipeline = Pipeline::default();
    let mut core = cluster();
    let prompt = tokens(7, 640);
    let hashes = core.hasher().hash_prompt(&prompt);
    pipeline.store(&mut core, &id("d2"), &hashes[..20], 0, Tier::Device);
    let d = route(&mut core, &prompt, Some(&sid("held")), 1, 0);
    assert_eq!(d.decode, id("d2"), "{}", d.reason);
    // Cold sessions spread over the workers by rendezvous.
    let mut seen = std::collections::BTreeSet::new();
    for n in 0..40 {
        let d = route(
            &mut cluster(),
            &tokens(50 + n, 300),
            Some(&sid(&format!("s{n}"))),
            1,
            0,
        );
        seen.insert(d.decode);
    }
    assert_eq!(seen.len(), 4, "{seen:?}");
}

#[test]
fn a_saturated_or_departed_worker_releases_the_session() {
    let mut core = cluster();
    let session = sid("conv-2");
    let first = route(&mut core, &tokens(1, 300), Some(&session), 1, 0);
    // The bound worker saturates (its KV past the busy threshold).
    core.on_load(report(first.decode.name(), 9_500, 9_500, 10_000, 10), 10);
    let moved = route(&mut core, &tokens(2, 300), Some(&session), 2, 20);
    assert_ne!(moved.decode, first.decode);
    assert!(moved.reason.contains("released from"), "{}", moved.reason);
    // The new binding holds; its worker leaving releases it too.
    let again = route(&mut core, &tokens(3, 300), Some(&session), 3, 30);
    assert_eq!(again.decode, moved.decode);
    assert!(core.deregister(&moved.decode));
    assert!(core.sessions().bound(&session, 40).is_none());
    let last = route(&mut core, &tokens(4, 300), Some(&session), 4, 40);
    assert_ne!(last.decode, moved.decode);
}

#[test]
fn bindings_expire_after_the_ttl_and_peers_bind_too() {
    let mut config = RouterConfig::new(contract());
    config.session.ttl_ms = 1_000;
    let mut core = core_with(config, IslBased::default());
    for i in 0..4 {
        core.register(record(&format!("d{i}"), Role::Decode, 10_000))
            .unwrap();
    }
    let session = sid("peer");
    // A peer's decision bound it to d3 (through the decision log).
    core.bind_session(&session, &id("d3"), 0);
    let d = route(&mut core, &tokens(1, 300), Some(&session), 1, 10);
    assert_eq!(d.decode, id("d3"));
    core.expire(2_000);
    assert!(core.sessions().is_empty());
    // Disabled: a session id changes nothing.
    let mut config = RouterConfig::new(contract());
    config.session.enabled = false;
    let mut off = core_with(config, IslBased::default());
    off.register(record("d0", Role::Decode, 10_000)).unwrap();
    off.bind_session(&session, &id("d0"), 0);
    assert!(off.sessions().is_empty());
}

#[test]
fn a_recorded_session_decision_replays_with_its_binding() {
    let mut core = cluster();
    let session = sid("replayed");
    route(&mut core, &tokens(1, 300), Some(&session), 1, 0);
    // Turn 2 under load: the binding decides it, and the record says so.
    for i in 0..5 {
        route(&mut core, &tokens(100 + i, 300), None, 100 + i, 1);
    }
    let prompt = tokens(2, 300);
    let hashes = core.hasher().hash_prompt(&prompt);
    let request = RouteRequest {
        request_id: "turn-2",
        isl_tokens: prompt.len() as u32,
        block_hashes: &hashes,
        expected_output_tokens: 64,
        session: Some(&session),
    };
    let options = RouteOptions {
        avoid: &[],
        explain: true,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let routed = core
        .route(&request, options, DecisionId(2), 5, &mut rng)
        .unwrap();
    let record = core.record(
        &routed.decision,
        routed.explanation.as_ref().unwrap(),
        &request,
        9,
        &[],
    );
    let s = record.inputs.session.as_ref().unwrap();
    assert_eq!(s.id, session);
    assert_eq!(s.bound.as_ref(), Some(&routed.decision.decode));
    let mut replayer = Replayer::new();
    let replayed = replayer.replay(&record, &Default::default()).unwrap();
    assert_eq!(replayed.decision, routed.decision);
    // Without the binding, the replay would choose otherwise: the
    // record's binding is what decided.
    let mut unbound = record.clone();
    unbound.inputs.session.as_mut().unwrap().bound = None;
    let other = Replayer::new()
        .replay(&unbound, &Default::default())
        .unwrap();
    assert!(
        other.decision.reason.contains("first turn"),
        "{}",
        other.decision.reason
    );
}
