//! Decision records replay exactly: the same decisions from the records
//! and the delta log, whatever the ledger and loads were; other settings
//! flip what they should.

mod common;

use common::*;
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    DecisionId, DecisionRecord, IndexDelta, KvEvent, KvEventBatch, Path, Role, Tier, WorkerId,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{
    decision_seed, difference, IslBased, Overrides, Policy, Replayer, RouteOptions, RouteRequest,
    RouterConfig, RouterCore, SlaDynamic,
};

/// Routes a few conversations, keeping every decision's record and every
/// delta.
fn history() -> (Vec<DecisionRecord>, Vec<IndexDelta>) {
    history_with(IslBased::default().into())
}

/// [`history`] with `policy`; each decision's prefill and decode are
/// observed (fed to the core's calibration) before the next one.
fn history_with(policy: Policy) -> (Vec<DecisionRecord>, Vec<IndexDelta>) {
    history_in(RouterConfig::new(contract()), policy)
}

/// [`history_with`] under another router configuration.
fn history_in(config: RouterConfig, policy: Policy) -> (Vec<DecisionRecord>, Vec<IndexDelta>) {
    let mut core = core_with(config, policy);
    let mut indexer = KvIndexer::new(OwnershipIndex::new());
    let mut deltas = Vec::new();
    let mut seqs = std::collections::HashMap::<WorkerId, u64>::new();
    let mut store = |core: &mut RouterCore,
                     deltas: &mut Vec<IndexDelta>,
                     worker: &WorkerId,
                     hashes: &[protocol::BlockHash]| {
        let seq = seqs.entry(worker.clone()).or_insert(0);
        let batch = KvEventBatch {
            worker: worker.clone(),
            epoch: 1,
            seq: *seq,
            events: vec![KvEvent::Stored {
                parent: None,
                blocks: hashes.to_vec(),
                tier: Tier::Device,
            }],
        };
        *seq += 1;
        if let Some(delta) = indexer.apply(batch).delta {
            core.apply_delta(&delta).unwrap();
            deltas.push(delta);
        }
    };
    core.register(record("p0", Role::Prefill, 20_000)).unwrap();
    for d in ["d0", "d1", "d2"] {
        core.register(record(d, Role::Decode, 20_000)).unwrap();
    }
    let mut records = Vec::new();
    let mut conversations: Vec<Vec<u32>> = (0..4)
        .map(|c| tokens(c, 3_000 + 500 * c as usize))
        .collect();
    let mut n = 0u64;
    for turn in 0..5u64 {
        for (c, conversation) in conversations.iter_mut().enumerate() {
            n += 1;
            let now = n * 100;
            for (i, d) in ["d0", "d1", "d2", "p0"].into_iter().enumerate() {
                let active = (n * 37 + i as u64 * 101) % 900;
                // Decode workers say how long their decodes took lately:
                // 30 to 69 ms a token.
                let step_us = if d.starts_with('d') {
                    30_000 + ((n * 13 + i as u64 * 29) % 40) as u32 * 1_000
                } else {
                    0
                };
                let load = protocol::LoadReport {
                    recent_itl_us: step_us,
                    ..report(d, active, active * 2, 20_000, now)
                };
                core.on_load(load, now);
            }
            let hashes = core.hasher().hash_prompt(conversation);
            let request = RouteRequest {
                request_id: &format!("c{c}-t{turn}"),
                isl_tokens: conversation.len() as u32,
                block_hashes: &hashes,
                expected_output_tokens: 200,
                session: None,
            };
            let seed = decision_seed(7, &request);
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            let options = RouteOptions {
                avoid: &[],
                explain: true,
            };
            let routed = core
                .route(&request, options, DecisionId(n), now, &mut rng)
                .unwrap();
            let (decision, explanation) = (routed.decision, routed.explanation.unwrap());
            records.push(core.record(&decision, &explanation, &request, seed, &[]));
            // Every other request is still in flight at the next decision:
            // the ledger shapes the loads the records must carry.
            core.observe_prefill_done(DecisionId(n), now + 40 + n * 7 % 90);
            if n % 2 == 0 {
                core.on_finished(DecisionId(n));
                core.observe_decoded(DecisionId(n), 8_000.0 + (n * 131 % 5_000) as f64, 200);
            }
            let decode = decision.decode.clone();
            conversation.extend(tokens(1_000 + n, 200));
            let hashes = core.hasher().hash_prompt(conversation);
            store(&mut core, &mut deltas, &decode, &hashes);
            conversation.extend(tokens(2_000 + n, if turn == 3 { 2_500 } else { 150 }));
        }
    }
    (records, deltas)
}

fn replay_all(
    records: &[DecisionRecord],
    deltas: &[IndexDelta],
    overrides: &Overrides,
) -> Vec<router::Replayed> {
    let mut replayer = Replayer::new();
    let mut next = deltas.iter();
    records
        .iter()
        .map(|r| {
            while replayer.replica().applied() < r.inputs.delta_seq {
                replayer.apply_delta(next.next().unwrap()).unwrap();
            }
            replayer.replay(r, overrides).unwrap()
        })
        .collect()
}

#[test]
fn every_recorded_decision_replays_exactly() {
    let (records, deltas) = history();
    assert!(records.iter().any(|r| r.decision.path == Path::Bypass));
    assert!(records.iter().any(|r| r.decision.path == Path::Remote));
    for (record, replayed) in
        records
            .iter()
            .zip(replay_all(&records, &deltas, &Overrides::default()))
    {
        assert_eq!(
            difference(&record.decision, &replayed.decision),
            None,
            "{}",
            record.decision.id
        );
        assert!(
            replayed.depth_mismatches.is_empty(),
            "{:?}",
            replayed.depth_mismatches
        );
    }
}

/// With the third path enabled, remote prefills of conversations held on a
/// decode worker fetch their prefix from it: the records carry the fetch
/// (source and tokens) and the setting, and replay reproduces both; a
/// what-if with the setting off makes them plain remote prefills again.
#[test]
fn fetching_decisions_replay_exactly() {
    let config = RouterConfig {
        fetch: router::FetchConfig {
            enabled: true,
            min_tokens: 512,
        },
        ..RouterConfig::new(contract())
    };
    let (records, deltas) = history_in(config, router::AlwaysDisagg.into());
    let fetched: Vec<_> = records
        .iter()
        .filter(|r| r.decision.path == Path::RemoteFetch)
        .collect();
    assert!(
        fetched.len() > records.len() / 2,
        "{} of {}",
        fetched.len(),
        records.len()
    );
    for r in &fetched {
        let f = r.decision.fetch.as_ref().unwrap();
        assert!(f.source.to_string().starts_with('d'), "{f:?}");
        assert_eq!(
            r.decision.reserved_prefill_tokens,
            u64::from(r.decision.isl_tokens - f.prefix_tokens)
        );
        assert!(
            r.decision.reason.contains("prefix fetched"),
            "{}",
            r.decision.reason
        );
    }
    assert!(records.iter().any(|r| r
        .inputs
        .router_params
        .iter()
        .any(|(k, v)| k == "fetch.enabled" && *v == 1.0)));
    for (record, replayed) in
        records
            .iter()
            .zip(replay_all(&records, &deltas, &Overrides::default()))
    {
        assert_eq!(difference(&record.decision, &replayed.decision), None);
        assert_eq!(record.decision.fetch, replayed.decision.fetch);
    }
    let off = Overrides {
        router_params: vec![("fetch.enabled".into(), 0.0)],
        ..Overrides::default()
    };
    for replayed in replay_all(&records, &deltas, &off) {
        assert_ne!(replayed.decision.path, Path::RemoteFetch);
        assert_eq!(replayed.decision.fetch, None);
    }
}

/// The SLA policy's decisions depend on its calibration, learnt from
/// observations the records do not carry: each record carries the factors
/// its decision used, and replay reproduces every decision (its reason
/// names the predicted numbers and the factors); without them it does not.
#[test]
fn sla_decisions_replay_with_their_calibration() {
    let (records, deltas) = history_with(SlaDynamic::default().into());
    let calibrated = records
        .iter()
        .filter(|r| r.inputs.calibration.iter().any(|(_, v)| *v != 1.0))
        .count();
    assert!(
        calibrated > records.len() / 2,
        "{calibrated} of {}",
        records.len()
    );
    for (record, replayed) in
        records
            .iter()
            .zip(replay_all(&records, &deltas, &Overrides::default()))
    {
        assert!(
            record.decision.rule.starts_with("sla."),
            "{}",
            record.decision.rule
        );
        assert_eq!(
            difference(&record.decision, &replayed.decision),
            None,
            "{}",
            record.decision.id
        );
    }
    let differ = differ_without(&records, &deltas, |r| r.inputs.calibration.clear());
    assert!(differ >= calibrated, "{differ} of {calibrated}");

    // Some bypasses went to the decode worker holding the conversation,
    // not to the one the selection picked, and replayed so.
    let on_holder = records
        .iter()
        .filter(|r| {
            r.decision.path == Path::Bypass
                && r.decision
                    .reason
                    .contains(&format!("local weighed on {}, which", r.decision.decode))
        })
        .count();
    assert!(on_holder > 0, "none of {}", records.len());
    // A record made before the router offered the holder replays without
    // it (`UNRECORDED_PARAMS`), as it was decided.
    let differ = differ_without(&records, &deltas, |r| {
        r.inputs
            .router_params
            .retain(|(name, _)| name != "decode.offer_holder")
    });
    assert!(differ >= on_holder, "{differ} of {on_holder}");

    // The decode workers' reported ITL is recorded and replayed: without
    // it some decisions differ.
    let reported = records
        .iter()
        .filter(|r| r.inputs.candidates.iter().any(|c| c.load.recent_itl_us > 0))
        .count();
    assert_eq!(reported, records.len());
    let differ = differ_without(&records, &deltas, |r| {
        r.inputs
            .candidates
            .iter_mut()
            .for_each(|c| c.load.recent_itl_us = 0)
    });
    assert!(differ > 0, "{differ} of {}", records.len());
}

/// How many of `records` replay to another decision once `strip` took
/// something out of each.
fn differ_without(
    records: &[DecisionRecord],
    deltas: &[IndexDelta],
    strip: impl Fn(&mut DecisionRecord),
) -> usize {
    let stripped: Vec<DecisionRecord> = records
        .iter()
        .cloned()
        .map(|mut r| {
            strip(&mut r);
            r
        })
        .collect();
    stripped
        .iter()
        .zip(replay_all(&stripped, deltas, &Overrides::default()))
        .filter(|(r, replayed)| difference(&r.decision, &replayed.decision).is_some())
        .count()
}

#[test]
fn a_lower_threshold_flips_bypasses_to_remote() {
    let (records, deltas) = history();
    let overrides = Overrides {
        policy_params: vec![("eff_isl_tokens".into(), 100.0)],
        ..Overrides::default()
    };
    let mut flipped = 0;
    for (record, replayed) in records
        .iter()
        .zip(replay_all(&records, &deltas, &overrides))
    {
        if record.decision.path == Path::Bypass {
            assert_eq!(
                replayed.decision.path,
                Path::Remote,
                "{}",
                replayed.decision.reason
            );
            flipped += 1;
        } else {
            assert_eq!(replayed.decision.path, Path::Remote);
        }
    }
    assert!(flipped > 0);
}

#[test]
fn a_record_at_another_index_position_is_refused() {
    let (records, _) = history();
    let late = records.iter().find(|r| r.inputs.delta_seq > 0).unwrap();
    assert!(matches!(
        Replayer::new().replay(late, &Overrides::default()),
        Err(router::ReplayError::IndexPosition { .. })
    ));
}

#[test]
fn unknown_policies_and_parameters_are_named() {
    let (records, deltas) = history();
    let mut replayer = Replayer::new();
    for d in &deltas {
        if d.seq > records[0].inputs.delta_seq {
            break;
        }
        replayer.apply_delta(d).unwrap();
    }
    let bad = Overrides {
        policy_params: vec![("eff_isl_tokenz".into(), 1.0)],
        ..Overrides::default()
    };
    let error = replayer.replay(&records[0], &bad).unwrap_err().to_string();
    assert!(
        error.contains("eff_isl_tokenz") && error.contains("eff_isl_tokens"),
        "{error}"
    );
}

/// A bypass the gate vetoed for want of its signal (the decode worker's KV
/// capacity unknown) replays as the same veto.
#[test]
fn a_veto_without_the_gates_signal_replays() {
    let mut core = core_with(RouterConfig::new(contract()), router::NeverDisagg);
    core.register(record("p0", Role::Prefill, 20_000)).unwrap();
    core.register(record("d0", Role::Decode, 0)).unwrap();
    core.on_load(report("p0", 0, 0, 20_000, 10), 10);
    core.on_load(report("d0", 0, 0, 0, 10), 10);
    let prompt = tokens(5, 400);
    let record = decide_one(&mut core, &prompt);
    assert_eq!(
        (record.decision.path, record.decision.rule.as_str()),
        (Path::Remote, router::rules::GATE_NO_SIGNAL)
    );
    let replayed = replay_all(std::slice::from_ref(&record), &[], &Overrides::default());
    assert_eq!(difference(&record.decision, &replayed[0].decision), None);
}

/// A record made before a setting existed does not name it, and replays
/// with the value that decided as the router did then: prefill selection
/// greedy on the request's own start (`prefill.miss_weight` 0), not today's
/// default, which here picks the other prefill worker.
#[test]
fn a_record_older_than_a_setting_replays_as_it_was_decided() {
    let config = RouterConfig {
        prefill: router::PrefillSelection {
            miss_weight: 0.0,
            ..router::PrefillSelection::default()
        },
        ..RouterConfig::new(contract())
    };
    let mut core = core_with(config, router::AlwaysDisagg);
    for (name, role) in [
        ("p0", Role::Prefill),
        ("p1", Role::Prefill),
        ("d0", Role::Decode),
    ] {
        core.register(record(name, role, 20_000)).unwrap();
    }
    let history = tokens(9, 3_200);
    let mut prompt = history.clone();
    prompt.extend(tokens(10, 800));
    let held = core.hasher().hash_prompt(&history);
    let delta = IndexDelta {
        seq: 1,
        changes: vec![protocol::IndexChange::Stored {
            worker: id("p0"),
            parent: None,
            blocks: held,
            tier: Tier::Device,
        }],
        source: None,
    };
    core.apply_delta(&delta).unwrap();
    // p0 holds the history behind a queue; p1 is idle and holds nothing.
    for (name, queued) in [("p0", 4_000), ("p1", 0), ("d0", 0)] {
        let load = protocol::LoadReport {
            queued_prefill_tokens: queued,
            ..report(name, 0, 0, 20_000, 10)
        };
        core.on_load(load, 10);
    }
    let mut old = decide_one(&mut core, &prompt);
    assert_eq!(old.decision.prefill, Some(id("p1")));
    old.inputs
        .router_params
        .retain(|(name, _)| name != "prefill.miss_weight");

    let replayed = replay_all(
        std::slice::from_ref(&old),
        std::slice::from_ref(&delta),
        &Overrides::default(),
    );
    assert_eq!(difference(&old.decision, &replayed[0].decision), None);
    let today = Overrides {
        router_params: vec![("prefill.miss_weight".into(), 1.0)],
        ..Overrides::default()
    };
    let what_if = replay_all(
        std::slice::from_ref(&old),
        std::slice::from_ref(&delta),
        &today,
    );
    assert_eq!(what_if[0].decision.prefill, Some(id("p0")));
}

/// Routes one request (`r`, decision 1, at 20 ms) with its explanation and
/// returns its record.
fn decide_one(core: &mut RouterCore, prompt: &[u32]) -> DecisionRecord {
    let hashes = core.hasher().hash_prompt(prompt);
    let request = RouteRequest {
        request_id: "r",
        isl_tokens: prompt.len() as u32,
        block_hashes: &hashes,
        expected_output_tokens: 50,
        session: None,
    };
    let seed = decision_seed(7, &request);
    let options = RouteOptions {
        avoid: &[],
        explain: true,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let routed = core
        .route(&request, options, DecisionId(1), 20, &mut rng)
        .unwrap();
    core.record(
        &routed.decision,
        &routed.explanation.unwrap(),
        &request,
        seed,
        &[],
    )
}
