//! Behaviour of one engine: prefix caching, batching, preemption, roles,
//! events and errors.

mod common;

use common::*;
use engine_sim::{ConfigError, Engine, EngineRequest, Mode, Preset, Pull, StepOutput, SubmitError};
use protocol::{KvEvent, Role, Tier};

#[test]
fn a_cached_prefix_is_not_recomputed() {
    let cfg = Preset::llama8b_h100().engine_config(16);
    let mut e = engine(Role::Both, cfg);
    let first = tokens(0, 1000);
    e.submit(req(1, &first, 4, Mode::LocalPrefill)).unwrap();
    let (outs, now) = run_to_idle(&mut e, 0, 100);
    let (ttft1, cached1) = first_token_at(&outs, 1).unwrap();
    assert_eq!(cached1, 0);
    assert_eq!(e.stats().prefill_tokens, 1000);

    // Same first 992 tokens (62 blocks), 200 new ones.
    let mut second = tokens(0, 992);
    second.extend(tokens(50_000, 200));
    assert_eq!(e.cached_prefix_tokens(&second), 992);
    e.submit(req(2, &second, 4, Mode::LocalPrefill)).unwrap();
    let (outs, _) = run_to_idle(&mut e, now, 100);
    let (t2, cached2) = first_token_at(&outs, 2).unwrap();
    assert_eq!(cached2, 992);
    assert_eq!(e.stats().prefill_tokens, 1000 + 200, "only the new tokens");
    assert!(t2 - now < ttft1, "TTFT {} vs {}", t2 - now, ttft1);
}

#[test]
fn a_fully_cached_prompt_still_computes_its_last_token() {
    let cfg = small_config(4, 64, 64, 8);
    let mut e = engine(Role::Both, cfg);
    let prompt = tokens(0, 16);
    e.submit(req(1, &prompt, 1, Mode::LocalPrefill)).unwrap();
    let (_, now) = run_to_idle(&mut e, 0, 100);
    assert_eq!(e.cached_prefix_tokens(&prompt), 16);
    e.submit(req(2, &prompt, 1, Mode::LocalPrefill)).unwrap();
    let (outs, _) = run_to_idle(&mut e, now, 100);
    // The last block is recomputed: sampling needs the last token's logits.
    assert_eq!(first_token_at(&outs, 2).unwrap().1, 12);
    assert_eq!(e.stats().prefill_tokens, 16 + 4);
}

#[test]
fn a_mixed_step_is_slower_than_the_same_decodes_alone() {
    let cfg = Preset::llama8b_h100().engine_config(16);
    let mut a = engine(Role::Both, cfg);
    for id in 0..8 {
        a.submit(req(
            id,
            &tokens(id as u32 * 10_000, 3000),
            50,
            Mode::LocalPrefill,
        ))
        .unwrap();
    }
    let mut now = 0;
    while a.stats().output_tokens < 8 * 3 {
        now = a.step(now).unwrap().end_us();
    }
    // Two identical engines from here on; one gets a local prefill.
    let mut b = engine(Role::Both, cfg);
    for id in 0..8 {
        b.submit(req(
            id,
            &tokens(id as u32 * 10_000, 3000),
            50,
            Mode::LocalPrefill,
        ))
        .unwrap();
    }
    let mut now_b = 0;
    while b.stats().output_tokens < 8 * 3 {
        now_b = b.step(now_b).unwrap().end_us();
    }
    assert_eq!(now, now_b, "the engine is deterministic");
    b.submit(req(99, &tokens(900_000, 1024), 5, Mode::LocalPrefill))
        .unwrap();
    let pure = a.step(now).unwrap();
    let mixed = b.step(now).unwrap();
    assert_eq!(pure.decode_seqs, 8);
    assert_eq!(
        mixed.decode_seqs, 8,
        "decodes are not displaced by the prefill"
    );
    assert_eq!((pure.prefill_tokens, mixed.prefill_tokens), (0, 1024));
    assert!(
        mixed.duration_us > pure.duration_us,
        "{} vs {}",
        mixed.duration_us,
        pure.duration_us
    );
}

#[test]
fn preemption_frees_blocks_and_the_preempted_request_completes() {
    // 12 blocks of 4 tokens. Each request alone peaks at 16 + 19 = 35 tokens
    // (9 blocks); together they cannot fit.
    let cfg = small_config(4, 12, 64, 8);
    let mut e = engine(Role::Both, cfg);
    e.submit(req(1, &tokens(0, 16), 20, Mode::LocalPrefill))
        .unwrap();
    e.submit(req(2, &tokens(100, 16), 20, Mode::LocalPrefill))
        .unwrap();
    let mut now = 0;
    let mut outs = Vec::new();
    let mut saw_preemption = false;
    while let Some(step) = e.step(now) {
        now = step.end_us();
        if step.outputs.contains(&StepOutput::Preempted { id: 2 }) {
            saw_preemption = true;
            // Request 2 holds nothing now; only request 1 holds blocks.
            assert_eq!(e.running(), 1);
            assert_eq!(e.waiting(), 1);
        }
        assert!(
            !step.outputs.contains(&StepOutput::Preempted { id: 1 }),
            "the most recently admitted request is preempted"
        );
        e.check_invariants().unwrap();
        outs.extend(step.outputs.into_iter().map(|o| (now, o)));
    }
    assert!(saw_preemption);
    assert!(e.stats().preemptions >= 1);
    for id in [1, 2] {
        assert_eq!(tokens_of(&outs, id), 20, "request {id}");
        let finished = outs
            .iter()
            .filter(|(_, o)| matches!(o, StepOutput::Finished { id: i, output_tokens: 20, .. } if *i == id))
            .count();
        assert_eq!(finished, 1);
    }
    assert_eq!(e.block_counts().in_use, 0);
}

#[test]
fn prefill_only_requests_report_done_and_leave_their_blocks_cached() {
    let cfg = small_config(16, 64, 256, 8);
    let mut e = engine(Role::Prefill, cfg);
    let prompt = tokens(0, 100);
    assert_eq!(
        e.submit(req(1, &prompt, 3, Mode::LocalPrefill)),
        Err(SubmitError::UnsupportedMode {
            role: Role::Prefill,
            mode: Mode::LocalPrefill
        })
    );
    // Outputs are ignored: a prefill-only request may carry none.
    e.submit(req(1, &prompt, 0, Mode::PrefillOnly)).unwrap();
    let (outs, _) = run_to_idle(&mut e, 0, 10);
    assert_eq!(
        outs.iter().map(|(_, o)| *o).collect::<Vec<_>>(),
        vec![StepOutput::PrefillDone {
            id: 1,
            prompt_tokens: 100,
            cached_tokens: 0
        }]
    );
    assert!(e.is_idle());
    assert_eq!(e.cached_prefix_tokens(&prompt), 96);
    assert_eq!(e.block_counts().in_use, 0);
    let mut replay = Replay::default();
    replay.sync(&mut e);
    assert_eq!(replay.blocks.len(), 6);
    assert_eq!(e.stats().prefills_done, 1);
}

#[test]
fn kv_received_requests_compute_no_prefill_and_store_their_blocks() {
    let cfg = small_config(16, 64, 256, 8);
    let mut e = engine(Role::Decode, cfg);
    let prompt = tokens(0, 100);
    assert!(matches!(
        e.submit(req(1, &prompt, 3, Mode::PrefillOnly)),
        Err(SubmitError::UnsupportedMode { .. })
    ));
    let request = req(1, &prompt, 30, Mode::KvReceived);
    let outputs = request.output_tokens.clone();
    e.submit(request).unwrap();
    let first = e.step(0).unwrap();
    assert_eq!((first.prefill_tokens, first.decode_seqs), (0, 1));
    assert_eq!(
        first.outputs,
        vec![StepOutput::FirstToken {
            id: 1,
            cached_tokens: 0
        }]
    );
    // The prompt's full blocks are stored on admission, as one chain.
    let events = e.take_kv_events();
    match &events[0] {
        KvEvent::Stored {
            parent: None,
            blocks,
            tier: Tier::Device,
        } => assert_eq!(blocks.len(), 6),
        other => panic!("expected Stored, got {other:?}"),
    }
    let (outs, _) = run_to_idle(&mut e, first.end_us(), 100);
    assert_eq!(tokens_of(&outs, 1) + 1, 30);
    assert_eq!(e.stats().prefill_tokens, 0);
    assert_eq!(e.stats().kv_received_tokens, 100);
    // The next turn (prompt + answer) hits the generated tokens' blocks too:
    // 100 + 29 tokens have KV, 8 full blocks.
    let mut next_turn = prompt.clone();
    next_turn.extend_from_slice(&outputs);
    next_turn.extend(tokens(70_000, 20));
    assert_eq!(e.cached_prefix_tokens(&next_turn), 128);
    e.submit(req(2, &next_turn, 2, Mode::LocalPrefill)).unwrap();
    let (outs, _) = run_to_idle(&mut e, 0, 100);
    assert_eq!(first_token_at(&outs, 2).unwrap().1, 128);
    assert_eq!(e.stats().prefill_tokens, 150 - 128);
}

#[test]
fn kv_received_counts_only_what_was_not_cached_as_received() {
    let cfg = small_config(16, 64, 256, 8);
    let mut e = engine(Role::Both, cfg);
    let prompt = tokens(0, 100);
    e.submit(req(1, &prompt[..64], 0, Mode::PrefillOnly))
        .unwrap();
    let (_, now) = run_to_idle(&mut e, 0, 10);
    e.submit(req(2, &prompt, 2, Mode::KvReceived)).unwrap();
    let step = e.step(now).unwrap();
    assert_eq!(
        step.outputs,
        vec![StepOutput::FirstToken {
            id: 2,
            cached_tokens: 64
        }]
    );
    assert_eq!(e.stats().kv_received_tokens, 36);
}

#[test]
fn chunked_prefill_respects_the_token_budget_and_decodes_go_first() {
    let cfg = small_config(16, 256, 64, 8);
    let mut e = engine(Role::Both, cfg);
    e.submit(req(1, &tokens(0, 10), 100, Mode::LocalPrefill))
        .unwrap();
    let s = e.step(0).unwrap();
    assert_eq!(s.prefill_tokens, 10);
    e.submit(req(2, &tokens(1000, 200), 2, Mode::LocalPrefill))
        .unwrap();
    let mut now = s.end_us();
    let mut chunks = Vec::new();
    loop {
        let s = e.step(now).unwrap();
        now = s.end_us();
        // Request 1 decodes every step, taking one budget token.
        assert_eq!(s.decode_seqs, 1);
        assert!(s.outputs.contains(&StepOutput::Token { id: 1 }));
        chunks.push(s.prefill_tokens);
        if s.outputs
            .iter()
            .any(|o| matches!(o, StepOutput::FirstToken { id: 2, .. }))
        {
            break;
        }
    }
    assert_eq!(chunks, vec![63, 63, 63, 11]);
}

#[test]
fn running_cap_and_fcfs_order_hold() {
    let cfg = small_config(16, 256, 1024, 2);
    let mut e = engine(Role::Both, cfg);
    for id in 1..=3 {
        e.submit(req(
            id,
            &tokens(id as u32 * 1000, 20),
            3,
            Mode::LocalPrefill,
        ))
        .unwrap();
    }
    let s = e.step(0).unwrap();
    assert_eq!(s.prefill_tokens, 40);
    assert_eq!((e.running(), e.waiting()), (2, 1));
    let report = e.load_report(s.end_us());
    assert_eq!((report.running, report.waiting), (2, 1));
    assert_eq!(report.queued_prefill_tokens, 20);
    let (outs, _) = run_to_idle(&mut e, s.end_us(), 100);
    let t3 = first_token_at(&outs, 3).unwrap().0;
    let finished: Vec<u64> = outs
        .iter()
        .filter_map(|(t, o)| match o {
            StepOutput::Finished { id, .. } => Some(*t).filter(|_| *id != 3),
            _ => None,
        })
        .collect();
    assert!(finished.iter().all(|&t| t <= t3), "3 waits for a slot");
}

#[test]
fn load_report_counts_blocks_and_prefill_work() {
    let cfg = small_config(16, 100, 64, 8);
    let mut e = engine(Role::Both, cfg);
    let idle = e.load_report(5_500);
    assert_eq!(idle, protocol::LoadReport::idle(worker(), 100, 5));
    e.submit(req(1, &tokens(0, 40), 10, Mode::LocalPrefill))
        .unwrap();
    e.submit(req(2, &tokens(500, 200), 10, Mode::LocalPrefill))
        .unwrap();
    assert_eq!(e.load_report(0).queued_prefill_tokens, 240);
    let s = e.step(0).unwrap();
    // Request 1 prefilled (40 tokens, now decoding with 3 blocks); request 2
    // got a 24-token chunk (2 blocks).
    let r = e.load_report(s.end_us());
    assert_eq!(r.queued_prefill_tokens, 176);
    assert_eq!(r.active_decode_blocks, 3);
    assert_eq!(r.kv_blocks_used, 5);
    assert_eq!(r.kv_blocks_total, 100);
    assert_eq!(r.at_ms, s.end_us() / 1000);
}

/// The report's `recent_itl_us` is a moving mean of the steps that
/// decoded: the first one's time, then a little of each later one's (a
/// long prefill chunk mixed in moves it only a little); 0 while nothing
/// decodes and after a restart, and a new mean once decoding starts again.
#[test]
fn load_report_says_the_recent_itl() {
    let cfg = Preset::llama8b_h100().engine_config(16);
    let mut e = engine(Role::Both, cfg);
    e.submit(req(1, &tokens(0, 1000), 50, Mode::LocalPrefill))
        .unwrap();
    let prefill = e.step(0).unwrap();
    assert_eq!(prefill.decode_seqs, 0);
    // Prefilled and decoding, no decode step yet: none to report.
    assert_eq!(e.load_report(prefill.end_us()).recent_itl_us, 0);
    let first = e.step(prefill.end_us()).unwrap();
    assert_eq!(first.decode_seqs, 1);
    let r = e.load_report(first.end_us());
    assert_eq!(u64::from(r.recent_itl_us), first.duration_us);
    // A long prefill mixed into the next step: the mean moves by a fiftieth
    // of the difference.
    e.submit(req(2, &tokens(50_000, 8000), 5, Mode::LocalPrefill))
        .unwrap();
    let mixed = e.step(first.end_us()).unwrap();
    assert!(mixed.prefill_tokens > 0 && mixed.decode_seqs == 1);
    let mean =
        first.duration_us as f64 + (mixed.duration_us as f64 - first.duration_us as f64) / 50.0;
    let r = e.load_report(mixed.end_us());
    assert_eq!(f64::from(r.recent_itl_us), mean.round());
    assert!(mixed.duration_us > 4 * first.duration_us);

    // Idle, then a new request: its decode steps start a new mean, not
    // the busy period's.
    let mut now = mixed.end_us();
    while let Some(step) = e.step(now) {
        now = step.end_us();
    }
    assert_eq!(e.load_report(now).recent_itl_us, 0);
    e.submit(req(3, &tokens(90_000, 100), 5, Mode::LocalPrefill))
        .unwrap();
    let prefill = e.step(now).unwrap();
    let alone = e.step(prefill.end_us()).unwrap();
    assert_eq!(alone.decode_seqs, 1);
    let r = e.load_report(alone.end_us());
    assert_eq!(u64::from(r.recent_itl_us), alone.duration_us);
    e.restart();
    assert_eq!(e.load_report(alone.end_us()).recent_itl_us, 0);
}

/// A waiting request's queued prefill is what it will compute: its prompt
/// less the prefix cached when it came (the router's ledger counts the
/// same), not its whole prompt.
#[test]
fn a_waiting_requests_cached_prefix_is_not_queued_work() {
    let cfg = small_config(16, 100, 64, 1);
    let mut e = engine(Role::Both, cfg);
    e.submit(req(1, &tokens(0, 48), 2, Mode::LocalPrefill))
        .unwrap();
    let (_, now) = run_to_idle(&mut e, 0, 100);
    // Request 2 extends request 1's prompt (3 blocks cached) by 20 tokens;
    // request 3 shares nothing. One running slot: both wait behind 4.
    e.submit(req(4, &tokens(900, 8), 50, Mode::LocalPrefill))
        .unwrap();
    let s = e.step(now).unwrap();
    let mut extended = tokens(0, 48);
    extended.extend(tokens(300, 20));
    e.submit(req(2, &extended, 2, Mode::LocalPrefill)).unwrap();
    e.submit(req(3, &tokens(600, 68), 2, Mode::LocalPrefill))
        .unwrap();
    assert_eq!(e.waiting(), 2);
    let report = e.load_report(s.end_us());
    assert_eq!(report.queued_prefill_tokens, 20 + 68);
    e.check_invariants().unwrap();
    let (outs, _) = run_to_idle(&mut e, s.end_us(), 1_000);
    // The expected hits were the hits.
    assert_eq!(first_token_at(&outs, 2).map(|(_, c)| c), Some(48));
    assert_eq!(first_token_at(&outs, 3).map(|(_, c)| c), Some(0));
    assert_eq!(e.load_report(0).queued_prefill_tokens, 0);
}

#[test]
fn a_restart_empties_the_cache_and_its_events_start_cleared() {
    let cfg = small_config(4, 32, 64, 8);
    let mut e = Engine::new(worker(), Role::Both, cfg).unwrap();
    assert!(e.take_kv_events().is_empty(), "a new engine lost nothing");

    let mut replay = Replay::default();
    e.submit(req(1, &tokens(0, 20), 5, Mode::LocalPrefill))
        .unwrap();
    e.submit(req(2, &tokens(100, 40), 50, Mode::LocalPrefill))
        .unwrap();
    let mut now = 0;
    for _ in 0..10 {
        now = e.step(now).unwrap().end_us();
        replay.sync(&mut e);
    }
    assert!(!replay.blocks.is_empty());

    let dropped = e.restart();
    assert_eq!(dropped.iter().map(|r| r.id).collect::<Vec<_>>(), vec![2]);
    assert_eq!(dropped[0].mode, Mode::LocalPrefill);
    assert!(e.is_idle());
    assert_eq!(e.cached_blocks().count(), 0);
    assert_eq!(e.block_counts().free, 32);
    let events = e.take_kv_events();
    assert_eq!(events, vec![KvEvent::Cleared]);
    replay.apply(&events);
    // The dropped request can come back.
    e.submit(dropped[0].clone()).unwrap();
    run_to_idle(&mut e, now, 1000);
    replay.sync(&mut e);
    assert!(e.take_kv_events().is_empty());
}

#[test]
fn a_step_asked_for_early_starts_when_the_previous_one_ends() {
    let cfg = small_config(16, 64, 64, 8);
    let mut e = engine(Role::Both, cfg);
    e.submit(req(1, &tokens(0, 10), 5, Mode::LocalPrefill))
        .unwrap();
    let a = e.step(1_000).unwrap();
    assert_eq!(a.start_us, 1_000);
    let b = e.step(1_001).unwrap();
    assert_eq!(b.start_us, a.end_us());
    assert_eq!(e.busy_until_us(), b.end_us());
    let c = e.step(b.end_us() + 500).unwrap();
    assert_eq!(c.start_us, b.end_us() + 500);
}

#[test]
fn caller_mistakes_are_typed_errors() {
    let cfg = small_config(4, 8, 64, 8);
    let mut e = engine(Role::Both, cfg);
    assert_eq!(
        e.submit(req(1, &[], 3, Mode::LocalPrefill)),
        Err(SubmitError::EmptyPrompt(1))
    );
    assert_eq!(
        e.submit(req(1, &[1, 2], 0, Mode::KvReceived)),
        Err(SubmitError::NoOutputTokens(1))
    );
    // 30 + 3 - 1 = 32 tokens = 8 blocks fit; one more token does not.
    e.submit(req(1, &tokens(0, 30), 3, Mode::LocalPrefill))
        .unwrap();
    assert_eq!(
        e.submit(req(1, &tokens(0, 3), 3, Mode::LocalPrefill)),
        Err(SubmitError::DuplicateId(1))
    );
    assert_eq!(
        e.submit(req(2, &tokens(0, 31), 3, Mode::LocalPrefill)),
        Err(SubmitError::ExceedsKvCapacity {
            id: 2,
            needed_blocks: 9,
            capacity_blocks: 8
        })
    );
    // A finished id may be reused.
    run_to_idle(&mut e, 0, 100);
    e.submit(req(1, &tokens(0, 3), 3, Mode::LocalPrefill))
        .unwrap();

    let bad = |f: fn(&mut engine_sim::EngineConfig)| {
        let mut cfg = small_config(4, 8, 64, 8);
        f(&mut cfg);
        Engine::new(worker(), Role::Both, cfg).unwrap_err()
    };
    assert_eq!(bad(|c| c.block_size = 0), ConfigError::ZeroBlockSize);
    assert_eq!(bad(|c| c.kv_capacity_blocks = 0), ConfigError::ZeroCapacity);
    assert_eq!(
        bad(|c| c.kv_capacity_blocks = u32::MAX),
        ConfigError::CapacityTooLarge(u32::MAX)
    );
    assert_eq!(
        bad(|c| c.max_batched_tokens = 0),
        ConfigError::ZeroMaxBatchedTokens
    );
    assert_eq!(bad(|c| c.max_running = 0), ConfigError::ZeroMaxRunning);
    assert!(matches!(
        bad(|c| c.cost.decode_fixed_ms = f64::INFINITY),
        ConfigError::InvalidCost { .. }
    ));
}

#[test]
fn concurrent_identical_prompts_share_blocks_once_computed() {
    let cfg = small_config(4, 64, 64, 8);
    let mut e = engine(Role::Both, cfg);
    let prompt = tokens(0, 20);
    e.submit(req(1, &prompt, 8, Mode::LocalPrefill)).unwrap();
    e.submit(req(2, &prompt, 8, Mode::LocalPrefill)).unwrap();
    let mut replay = Replay::default();
    let mut now = 0;
    while let Some(s) = e.step(now) {
        now = s.end_us();
        e.check_invariants().unwrap();
        replay.sync(&mut e);
    }
    // Both computed the prompt in the same step; its 5 blocks are stored
    // once and the duplicates went back to the free list.
    assert_eq!(e.stats().prefill_tokens, 40);
    assert_eq!(e.block_counts().in_use, 0);
}

#[test]
fn requests_round_trip_through_restart_unchanged() {
    let cfg = small_config(4, 64, 64, 8);
    let mut e = engine(Role::Decode, cfg);
    let original: EngineRequest = req(9, &tokens(0, 10), 4, Mode::KvReceived);
    e.submit(original.clone()).unwrap();
    e.step(0).unwrap();
    assert_eq!(e.restart(), vec![original]);
}

#[test]
fn an_aborted_request_leaves_at_once_and_its_full_blocks_stay_cached() {
    let cfg = small_config(16, 100, 64, 1);
    let mut e = engine(Role::Both, cfg);
    // Request 1 runs (the running cap is 1); request 2 waits behind it.
    e.submit(req(1, &tokens(0, 40), 50, Mode::LocalPrefill))
        .unwrap();
    e.submit(req(2, &tokens(500, 200), 10, Mode::LocalPrefill))
        .unwrap();
    let s = e.step(0).unwrap();
    assert_eq!((e.running(), e.waiting()), (1, 1));
    assert!(e.block_counts().in_use > 0);

    // The waiting one: its queued prefill goes with it.
    assert!(e.abort(2));
    assert_eq!(e.waiting(), 0);
    assert_eq!(e.load_report(s.end_us()).queued_prefill_tokens, 0);
    // The running one: its blocks are released, the full ones stay cached.
    assert!(e.abort(1));
    assert!(!e.abort(1));
    assert!(e.is_idle());
    assert_eq!(e.block_counts().in_use, 0);
    assert_eq!(e.cached_prefix_tokens(&tokens(0, 40)), 32);
    assert_eq!(e.stats().aborted, 2);
    e.check_invariants().unwrap();
    assert!(e.step(s.end_us()).is_none());
    // The id is free again.
    e.submit(req(1, &tokens(0, 40), 5, Mode::LocalPrefill))
        .unwrap();
    let (outs, _) = run_to_idle(&mut e, s.end_us(), 1_000);
    assert_eq!(tokens_of(&outs, 1), 5);
}

/// A prefill worker of 16-token blocks that computed the first 160 tokens
/// (10 blocks) of a 500-token prompt; the prompt, and when it is idle.
fn prefill_worker_holding_ten_blocks() -> (Engine, Vec<u32>, u64) {
    let mut p = engine(Role::Prefill, small_config(16, 64, 256, 8));
    let prompt = tokens(0, 500);
    p.submit(req(9, &prompt[..160], 0, Mode::PrefillOnly))
        .unwrap();
    let (_, now) = run_to_idle(&mut p, 0, 10);
    (p, prompt, now)
}

/// The third path's prefill worker pulls a supplied prefix when the request
/// reaches the head of its queue, not before: it takes blocks for what it
/// lacks of it (held, so not evicted while the pull runs, and stored in the
/// prefix cache only when the KV arrived), asks its caller to move them,
/// lets other requests be admitted meanwhile, and computes only the rest
/// once they arrived. A waiting request's supplied prefix is no queued
/// work.
#[test]
fn a_supplied_prefix_is_pulled_at_admission_and_held_until_used() {
    // Holds 10 of the 25 supplied blocks already.
    let (mut p, prompt, now) = prefill_worker_holding_ten_blocks();
    let computed = p.stats().prefill_tokens;
    let mut pulling = req(1, &prompt, 0, Mode::PrefillOnly);
    pulling.pull_tokens = 400;
    p.submit(pulling).unwrap();
    assert_eq!(p.load_report(now).queued_prefill_tokens, 100);
    let other = tokens(10_000, 300);
    p.submit(req(2, &other, 0, Mode::PrefillOnly)).unwrap();
    let step = p.step(now).unwrap();
    assert_eq!(
        step.pulls,
        vec![Pull { id: 1, tokens: 240 }],
        "what it lacks"
    );
    assert_eq!(p.stats().pulled_prefix_tokens, 240);
    assert_eq!(p.load_report(now).waiting, 1);
    p.check_invariants().unwrap();
    // The next request is admitted meanwhile; the pulled blocks are held
    // while a third prompt fills the cache.
    let (outs, now) = run_to_idle(&mut p, step.end_us(), 20);
    assert!(outs
        .iter()
        .any(|(_, o)| matches!(o, StepOutput::PrefillDone { id: 2, .. })));
    assert!(!p.is_idle(), "request 1 waits for its pull");
    p.submit(req(3, &tokens(20_000, 600), 0, Mode::PrefillOnly))
        .unwrap();
    let (_, now) = run_to_idle(&mut p, now, 20);
    assert_eq!(
        p.cached_prefix_tokens(&prompt),
        160,
        "blocks still filling are not hit by others"
    );
    assert_eq!(p.load_report(now).queued_prefill_tokens, 100);
    p.check_invariants().unwrap();
    assert!(p.pull_done(1));
    assert!(!p.pull_done(1), "once");
    assert_eq!(p.cached_prefix_tokens(&prompt), 400, "stored when arrived");
    p.check_invariants().unwrap();
    let before = p.stats().prefill_tokens;
    let (outs, _) = run_to_idle(&mut p, now, 10);
    assert!(outs.iter().any(|(_, o)| matches!(
        o,
        StepOutput::PrefillDone {
            id: 1,
            cached_tokens: 400,
            ..
        }
    )));
    assert_eq!(
        p.stats().prefill_tokens - before,
        100,
        "only the rest computed"
    );
    assert!(computed > 0);
    p.check_invariants().unwrap();

    // Nothing lacking: no pull, admitted at once. Aborted while pulling:
    // its blocks go.
    let mut held = req(4, &prompt, 0, Mode::PrefillOnly);
    held.pull_tokens = 400;
    p.submit(held).unwrap();
    assert!(p.step(now).unwrap().pulls.is_empty());
    let (_, now) = run_to_idle(&mut p, now, 10);
    let mut fresh = req(5, &tokens(30_000, 500), 0, Mode::PrefillOnly);
    fresh.pull_tokens = 400;
    p.submit(fresh).unwrap();
    assert_eq!(p.step(now).unwrap().pulls.len(), 1);
    assert!(p.abort(5));
    assert_eq!(p.block_counts().in_use, 0);
    assert!(p.is_idle());
    p.check_invariants().unwrap();
}

/// A pull its source declined (the blocks were let go there, e.g. its
/// export expired): the blocks set aside for it go back unstored, the
/// request's queued work counts what it lacks again, and it computes all
/// but its own device hit, once.
#[test]
fn a_declined_pull_is_computed_instead() {
    let (mut p, prompt, now) = prefill_worker_holding_ten_blocks();
    let mut pulling = req(1, &prompt, 0, Mode::PrefillOnly);
    pulling.pull_tokens = 400;
    p.submit(pulling).unwrap();
    assert_eq!(
        p.step(now).unwrap().pulls,
        vec![Pull { id: 1, tokens: 240 }]
    );
    assert_eq!(p.block_counts().in_use, 25, "its hit and the pull's blocks");
    let before = p.stats().prefill_tokens;
    assert!(p.pull_declined(1));
    assert!(!p.pull_declined(1) && !p.pull_done(1), "once");
    assert_eq!(p.block_counts().in_use, 0);
    assert_eq!(p.cached_prefix_tokens(&prompt), 160, "nothing stored");
    assert_eq!(p.load_report(now).queued_prefill_tokens, 340);
    p.check_invariants().unwrap();
    let (outs, _) = run_to_idle(&mut p, now, 20);
    assert!(outs.iter().any(|(_, o)| matches!(
        o,
        StepOutput::PrefillDone {
            id: 1,
            cached_tokens: 160,
            ..
        }
    )));
    assert_eq!(p.stats().prefill_tokens - before, 340, "the rest computed");
    assert_eq!(p.stats().pulled_prefix_tokens, 240, "asked for, once");
    p.check_invariants().unwrap();
}

/// The third path's source: it pins the blocks of a prefix (not evicted
/// meanwhile, counted in use), and its steps are longer while the read runs.
#[test]
fn a_pinned_prefix_is_held_and_its_read_slows_the_steps() {
    let cfg = small_config(16, 64, 256, 8);
    let prompt = tokens(0, 500);
    // The source: its blocks are pinned while read.
    let mut d = engine(Role::Both, cfg);
    d.submit(req(1, &prompt, 2, Mode::LocalPrefill)).unwrap();
    let (_, now) = run_to_idle(&mut d, 0, 20);
    let mut pin = d.pin_prefix(&prompt, 400);
    assert_eq!(pin.tokens(), 400);
    d.start_read(&mut pin);
    assert_eq!(d.block_counts().in_use, 25);
    d.check_invariants().unwrap();
    // Filling the cache with other prompts evicts everything but the pin.
    let other = tokens(10_000, 600);
    d.submit(req(2, &other, 1, Mode::LocalPrefill)).unwrap();
    let pinned_step = d.step(now).unwrap().duration_us;
    let (_, now) = run_to_idle(&mut d, now, 50);
    assert!(d.cached_prefix_tokens(&prompt) >= 400);
    // The read done, the blocks stay held for the reader until the unpin.
    d.end_read(&mut pin);
    assert_eq!(d.block_counts().in_use, 25);
    d.unpin(pin);
    assert_eq!(d.block_counts().in_use, 0);
    d.check_invariants().unwrap();
    // The same step unpinned is shorter by the read overhead.
    let mut fresh = engine(Role::Both, cfg);
    fresh.submit(req(2, &other, 1, Mode::LocalPrefill)).unwrap();
    let plain_step = fresh.step(now).unwrap().duration_us;
    let want = (plain_step as f64 * (1.0 + cfg.read_step_overhead)).ceil() as u64;
    assert_eq!(pinned_step, want, "{plain_step} -> {pinned_step}");
    // A pin whose read has not started or is done slows no step.
    let mut held = engine(Role::Both, cfg);
    held.submit(req(1, &prompt, 2, Mode::LocalPrefill)).unwrap();
    let (_, now) = run_to_idle(&mut held, 0, 20);
    let mut pin = held.pin_prefix(&prompt, 400);
    held.end_read(&mut pin);
    held.submit(req(2, &other, 1, Mode::LocalPrefill)).unwrap();
    assert_eq!(held.step(now).unwrap().duration_us, plain_step);
    held.unpin(pin);

    // A pin from before a restart holds nothing: releasing it leaves the
    // blocks of a pin taken since (the same block ids, reused) held, and
    // the read that one runs.
    let mut old_pin = held.pin_prefix(&prompt, 400);
    held.end_read(&mut old_pin);
    let mut old_pin_2 = held.pin_prefix(&prompt, 400);
    held.start_read(&mut old_pin_2);
    assert_eq!(held.restart().len(), 1, "request 2 dropped");
    held.submit(req(3, &prompt, 2, Mode::LocalPrefill)).unwrap();
    let (_, now) = run_to_idle(&mut held, now, 20);
    let mut new_pin = held.pin_prefix(&prompt, 400);
    held.start_read(&mut new_pin);
    assert_eq!(held.block_counts().in_use, 25);
    held.unpin(old_pin);
    held.unpin(old_pin_2);
    assert_eq!(held.block_counts().in_use, 25, "the new pin still holds");
    held.check_invariants().unwrap();
    held.submit(req(4, &other, 1, Mode::LocalPrefill)).unwrap();
    let read_step = held.step(now).unwrap().duration_us;
    assert!(read_step > plain_step, "the new pin's read still runs");
    held.unpin(new_pin);
    run_to_idle(&mut held, now, 50);
    assert_eq!(held.block_counts().in_use, 0);
    held.check_invariants().unwrap();
}

/// The host tier (G2): an evicted prefix is written to host (Removed from
/// the device, Stored on host), and a later request whose prefix is on
/// host reads it back (latency + bytes / bandwidth) instead of recomputing
/// it: fewer prefill tokens, a sooner first token than the same request on
/// an engine without the tier, and the read-back's Stored on the device.
#[test]
fn a_prefix_evicted_to_host_is_read_back_not_recomputed() {
    let base = {
        let mut cfg = Preset::llama70b_fp8_tp2_h100().engine_config(16);
        cfg.kv_capacity_blocks = 400; // 6,400 tokens: one 6k prompt at a time
        cfg
    };
    let mut with_host = base;
    with_host.host.capacity_blocks = 1_000;
    let first = tokens(0, 6_000);
    let other = tokens(100_000, 6_000);
    let mut again = first.clone();
    again.extend(tokens(200_000, 100));

    let run = |cfg: engine_sim::EngineConfig| {
        let mut e = engine(Role::Both, cfg);
        e.submit(req(1, &first, 2, Mode::LocalPrefill)).unwrap();
        let (_, now) = run_to_idle(&mut e, 0, 100);
        // Evicts most of the first prompt.
        e.submit(req(2, &other, 2, Mode::LocalPrefill)).unwrap();
        let (_, now) = run_to_idle(&mut e, now, 100);
        let events = e.take_kv_events();
        e.check_invariants().unwrap();
        let before = *e.stats();
        e.submit(req(3, &again, 2, Mode::LocalPrefill)).unwrap();
        let (outs, _) = run_to_idle(&mut e, now, 100);
        e.check_invariants().unwrap();
        let (t, cached) = first_token_at(&outs, 3).unwrap();
        (e, events, before, t - now, cached)
    };

    let (plain, _, plain_before, plain_ttft, plain_cached) = run(base);
    assert_eq!(plain.host_block_count(), 0);
    let (e, events, before, ttft, cached) = run(with_host);

    // The eviction's events: device Removed, host Stored, both present.
    let host_stored: usize = events
        .iter()
        .map(|ev| match ev {
            KvEvent::Stored {
                blocks,
                tier: Tier::Host,
                ..
            } => blocks.len(),
            _ => 0,
        })
        .sum();
    let device_removed: usize = events
        .iter()
        .map(|ev| match ev {
            KvEvent::Removed {
                blocks,
                tier: Tier::Device,
            } => blocks.len(),
            _ => 0,
        })
        .sum();
    assert!(host_stored > 200, "{host_stored} blocks written to host");
    assert_eq!(
        host_stored, device_removed,
        "every evicted block reaches host"
    );
    assert_eq!(before.host_blocks_written as usize, host_stored);

    // Read back: the whole first prompt is a hit (375 blocks, 6,000 tokens).
    assert_eq!(cached, 6_000);
    let read = e.stats().host_read_tokens;
    assert_eq!(read, u64::from(cached) - u64::from(plain_cached));
    assert_eq!(e.stats().prefill_tokens - before.prefill_tokens, 100);
    assert!(plain.stats().prefill_tokens - plain_before.prefill_tokens >= 100 + read);
    // Its time: 50 µs + bytes at 2 x 50 GB/s (TP2), on the link alone.
    let bytes = read * with_host.kv_bytes_per_token;
    let want_read = with_host.host.link.duration_us(bytes);
    assert_eq!(e.stats().host_read_us, want_read);
    assert!(
        ttft + 1 < plain_ttft,
        "read back {ttft} µs vs recomputed {plain_ttft} µs"
    );
    assert!(ttft >= want_read, "the request waited for its read");
}

#[test]
fn a_host_tier_with_no_bandwidth_is_refused() {
    let mut cfg = Preset::llama8b_h100().engine_config(16);
    cfg.host.capacity_blocks = 10;
    cfg.host.link.bytes_per_s = 0.0;
    assert!(matches!(
        Engine::new(worker(), Role::Both, cfg),
        Err(ConfigError::HostLinkBandwidth(_))
    ));
}

/// A request reading its prefix back from host waits without holding up
/// the queue: alone, the engine's next step is a wait of exactly the read;
/// with another request behind it, that one is admitted meanwhile.
#[test]
fn a_read_back_waits_beside_the_batch() {
    let mut cfg = Preset::llama70b_fp8_tp2_h100().engine_config(16);
    cfg.kv_capacity_blocks = 400;
    cfg.host.capacity_blocks = 1_000;
    let first = tokens(0, 6_000);
    let mut again = first.clone();
    again.extend(tokens(200_000, 100));
    let setup = || {
        let mut e = engine(Role::Both, cfg);
        e.submit(req(1, &first, 2, Mode::LocalPrefill)).unwrap();
        let (_, now) = run_to_idle(&mut e, 0, 100);
        e.submit(req(2, &tokens(100_000, 6_000), 2, Mode::LocalPrefill))
            .unwrap();
        let (_, now) = run_to_idle(&mut e, now, 100);
        (e, now)
    };

    let (mut alone, now) = setup();
    let on_host = 6_000 - alone.cached_prefix_tokens(&again);
    alone.submit(req(3, &again, 2, Mode::LocalPrefill)).unwrap();
    let wait = alone.step(now).unwrap();
    let read = cfg
        .host
        .link
        .duration_us(u64::from(on_host) * cfg.kv_bytes_per_token);
    assert_eq!((wait.start_us, wait.duration_us), (now, read));
    assert!(wait.outputs.is_empty() && wait.prefill_tokens + wait.decode_seqs == 0);
    assert_eq!((alone.running(), alone.waiting()), (0, 1));
    alone.check_invariants().unwrap();
    let next = alone.step(wait.end_us()).unwrap();
    assert_eq!(next.prefill_tokens, 100, "only the new tokens are computed");

    let (mut busy, now) = setup();
    busy.submit(req(3, &again, 2, Mode::LocalPrefill)).unwrap();
    busy.submit(req(4, &tokens(300_000, 50), 2, Mode::LocalPrefill))
        .unwrap();
    let step = busy.step(now).unwrap();
    assert_eq!(step.prefill_tokens, 50, "the request behind the read runs");
    assert_eq!((busy.running(), busy.waiting()), (1, 1));
    busy.check_invariants().unwrap();
    let (outs, _) = run_to_idle(&mut busy, step.end_us(), 100);
    assert_eq!(first_token_at(&outs, 3).unwrap().1, 6_000);
}
