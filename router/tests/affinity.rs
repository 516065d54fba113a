//! Decode affinity: a conversation stays on the decode worker that holds it,
//! through bypassed turns and through a turn that is forced remote.

mod common;

use common::*;
use protocol::{DecisionId, Path, Role, Tier};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{rules, IslBased, RouterConfig};

#[test]
fn a_conversation_stays_on_the_decode_worker_that_holds_it() {
    let mut core = core_with(RouterConfig::new(contract()), Box::new(IslBased::default()));
    let mut pipeline = Pipeline::default();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    core.register(record("p0", Role::Prefill, 20_000)).unwrap();
    let decoders = ["d0", "d1", "d2", "d3"];
    for d in decoders {
        core.register(record(d, Role::Decode, 20_000)).unwrap();
        core.on_load(report(d, 100, 500, 20_000, 0), 0);
    }
    core.on_load(report("p0", 0, 0, 20_000, 0), 0);

    // Turn 0: a long cold prompt goes remote.
    let mut conversation = tokens(1, 6_000);
    let now = 1_000;
    let turn0 = core
        .route_tokens("turn-0", &conversation, 300, DecisionId(0), now, &mut rng)
        .unwrap();
    assert_eq!(turn0.path, Path::Remote, "{}", turn0.reason);
    assert_eq!(turn0.rule, rules::ISL_LONG_PREFILL);
    assert_eq!(turn0.prefill, Some(id("p0")));
    let home = turn0.decode.clone();
    let p0 = id("p0");

    // P0 prefilled the prompt; D* received it and decoded the answer.
    let hashes = core.hasher().hash_prompt(&conversation);
    pipeline.store(&mut core, &p0, &hashes, 0, Tier::Device);
    conversation.extend(tokens(1_000, 300));
    let mut held = 0;
    let hashes = core.hasher().hash_prompt(&conversation);
    pipeline.store(&mut core, &home, &hashes, held, Tier::Device);
    held = hashes.len();
    core.on_finished(turn0.id);

    for turn in 1..=11u64 {
        // D* is the most loaded decode worker: load alone would move away.
        let now = 1_000 + turn * 1_000;
        for d in decoders {
            let busy = id(d) == home;
            let (active, used) = if busy { (400, 3_000) } else { (100, 500) };
            core.on_load(report(d, active, used, 20_000, now), now);
        }
        let append = if turn == 11 { 3_000 } else { 150 };
        conversation.extend(tokens(10 + turn, append));
        let (decision, explanation) = core
            .route_tokens_explained(
                &format!("turn-{turn}"),
                &conversation,
                300,
                DecisionId(turn),
                now + 1,
                &mut rng,
            )
            .unwrap();
        assert_eq!(decision.decode, home, "turn {turn}: {}", decision.reason);
        if turn == 11 {
            assert_eq!(decision.path, Path::Remote, "{}", decision.reason);
            assert_eq!(decision.rule, rules::ISL_LONG_PREFILL);
        } else {
            assert_eq!(
                decision.path,
                Path::Bypass,
                "turn {turn}: {}",
                decision.reason
            );
            assert_eq!(decision.rule, rules::ISL_SHORT_APPEND);
            assert!(decision
                .reason
                .contains(&format!("bypass on {home} which holds")));
        }
        // Affinity, not load, explains the choice.
        let chosen = explanation
            .decode
            .iter()
            .find(|c| c.worker == home)
            .unwrap();
        let others = explanation.decode.iter().filter(|c| c.worker != home);
        for other in others {
            assert!(other.load.active_decode_blocks < chosen.load.active_decode_blocks);
            assert!(other.cost > chosen.cost, "turn {turn}: {explanation:?}");
        }
        assert!(u64::from(decision.decode_overlap_tokens) >= (held as u64) * u64::from(BLOCK));

        // The turn leaves its prompt and answer on D*.
        conversation.extend(tokens(2_000 + turn, 300));
        let hashes = core.hasher().hash_prompt(&conversation);
        pipeline.store(&mut core, &home, &hashes, held, Tier::Device);
        held = hashes.len();
        core.on_finished(decision.id);
    }
}
