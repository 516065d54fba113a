use proptest::prelude::*;

use super::*;
use crate::decision::Path;
use crate::ids::DecisionId;

fn worker(i: usize) -> WorkerId {
    format!("w{i}").parse().unwrap()
}

fn decision(id: u64) -> RouteDecision {
    RouteDecision {
        id: DecisionId(id),
        request_id: format!("r{id}"),
        path: Path::Bypass,
        decode: worker(0),
        prefill: None,
        isl_tokens: 1_000,
        decode_overlap_tokens: 0,
        prefill_overlap_tokens: 0,
        reserved_decode_blocks: 70,
        reserved_prefill_tokens: 1_000,
        policy: "isl".into(),
        rule: "isl.short_append".into(),
        reason: "because".into(),
        at_ms: id,
        fetch: None,
    }
}

fn record(id: u64, hashes: Vec<BlockHash>, candidates: Vec<CandidateInput>) -> DecisionRecord {
    DecisionRecord {
        decision: decision(id),
        inputs: DecisionInputs {
            block_hashes: hashes,
            block_size: 16,
            expected_output_tokens: 200,
            delta_seq: id * 3,
            seed: id ^ 0x5eed,
            avoid: Vec::new(),
            policy_params: vec![("eff_isl_tokens".into(), 2048.0)],
            router_params: vec![("gate.enabled".into(), 1.0)],
            candidates,
            calibration: if id % 2 == 0 {
                Vec::new()
            } else {
                vec![("itl".into(), 1.0 + 1.0 / id as f64)]
            },
            session: None,
        },
    }
}

fn candidate(i: usize, depth: [u32; 3], load: CandidateLoad) -> CandidateInput {
    CandidateInput {
        worker: worker(i),
        role: if i == 0 { Role::Prefill } else { Role::Decode },
        kv_capacity_blocks: 10_000,
        max_batched_tokens: 8192,
        kv_bytes_per_token: 163_840,
        depth,
        load,
        capabilities: Default::default(),
    }
}

/// Through the wire: encoded and decoded.
fn wire(entries: Vec<LogEntry>) -> Vec<LogEntry> {
    entries
        .into_iter()
        .map(|e| LogEntry::decode(&e.encode()).unwrap())
        .collect()
}

fn chain(seed: u64, n: usize) -> Vec<BlockHash> {
    (0..n as u64)
        .map(|i| BlockHash(seed.wrapping_mul(1_000_003) ^ i))
        .collect()
}

#[test]
fn a_conversation_is_written_once_and_read_back_whole() {
    let mut writer = LogWriter::default();
    let mut reader = LogReader::new();
    let cands: Vec<_> = (0..8)
        .map(|i| candidate(i, [3, 4, 4], CandidateLoad::default()))
        .collect();
    let turn1 = record(1, chain(7, 400), cands.clone());
    let mut longer = chain(7, 400);
    longer.extend(chain(8, 44));
    let turn2 = record(2, longer, cands);

    let first = wire(writer.write(&turn1, 0));
    assert_eq!(first.len(), 2, "the context, then the decision");
    assert!(matches!(first[0], LogEntry::Context { .. }));
    let second = wire(writer.write(&turn2, 10));
    assert_eq!(second.len(), 1, "the context is written once");
    let logged = second[0].decision().unwrap();
    assert_eq!(
        logged.prompt.prefix,
        Some(PrefixRef {
            blocks: 400,
            last: BlockHash(7u64.wrapping_mul(1_000_003) ^ 399)
        })
    );
    assert_eq!(logged.prompt.blocks.0.len(), 44);
    let bytes = second[0].encode().len();
    assert!(bytes < 44 * 8 + 200, "{bytes} bytes");

    let mut read = Vec::new();
    for e in first.iter().chain(&second) {
        read.extend(reader.read(e).unwrap());
    }
    assert_eq!(read, [turn1, turn2]);
}

#[test]
fn what_the_reader_lacks_is_an_error_that_names_it() {
    let mut writer = LogWriter::default();
    let cands = vec![candidate(0, [0; 3], CandidateLoad::default())];
    let a = writer.write(&record(1, chain(1, 10), cands.clone()), 0);
    let mut longer = chain(1, 10);
    longer.push(BlockHash(99));
    let b = writer.write(&record(2, longer, cands), 0);

    // Without the context.
    let e = LogReader::new().read(&a[1]).unwrap_err();
    assert!(matches!(e, ResolveError::MissingContext { .. }), "{e}");
    assert!(e.to_string().starts_with("decision "), "{e}");
    // With the context, without the earlier prompt.
    let mut reader = LogReader::new();
    reader.read(&a[0]).unwrap();
    let e = reader.read(&b[0]).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "decision {}'s prompt begins with the 10 blocks ending in {}, which no entry read before it holds",
            DecisionId(2),
            chain(1, 10)[9]
        )
    );
    // An export that carries the prompt resolves it.
    reader.add_prompt(chain(1, 10).into());
    assert_eq!(
        reader
            .read(&b[0])
            .unwrap()
            .unwrap()
            .inputs
            .block_hashes
            .len(),
        11
    );
}

#[test]
fn a_lost_entry_is_never_referred_to() {
    let mut writer = LogWriter::default();
    let cands = vec![candidate(0, [0; 3], CandidateLoad::default())];
    let a = writer.write(&record(1, chain(1, 10), cands.clone()), 0);
    for e in &a {
        writer.lost(e);
    }
    let mut longer = chain(1, 10);
    longer.push(BlockHash(99));
    let b = writer.write(&record(2, longer, cands), 0);
    assert_eq!(b.len(), 2, "the lost context is written again");
    assert_eq!(b[1].decision().unwrap().prompt.prefix, None);
}

#[test]
fn old_prompts_are_not_referred_to() {
    let limits = WriterLimits {
        prompt_age_ms: 1_000,
        ..WriterLimits::default()
    };
    let mut writer = LogWriter::new(limits);
    let cands = vec![candidate(0, [0; 3], CandidateLoad::default())];
    writer.write(&record(1, chain(1, 10), cands.clone()), 0);
    let late = writer.write(&record(2, chain(1, 11), cands.clone()), 1_001);
    assert_eq!(late[0].decision().unwrap().prompt.prefix, None);
    let soon = writer.write(&record(3, chain(1, 12), cands), 1_500);
    assert_eq!(
        soon[0].decision().unwrap().prompt.prefix.map(|p| p.blocks),
        Some(11)
    );
}

#[test]
fn a_peers_prompt_may_be_referred_to() {
    let cands = vec![candidate(0, [0; 3], CandidateLoad::default())];
    let mut peer = LogWriter::default();
    let theirs = peer.write(&record(1, chain(1, 10), cands.clone()), 0);
    let mut ours = LogWriter::default();
    for e in &theirs {
        ours.saw(e, 0);
    }
    let mine = ours.write(&record(2, chain(1, 12), cands), 0);
    assert_eq!(
        mine[1].decision().unwrap().prompt.prefix.map(|p| p.blocks),
        Some(10)
    );
}

#[test]
fn garbage_columns_are_errors() {
    for bytes in [
        vec![],
        vec![5],
        vec![1, 9],
        vec![0xff, 0xff, 0xff, 0xff, 0x0f],
        vec![2, EACH, 1],
    ] {
        assert!(Columns::from_bytes(&bytes).is_err(), "{bytes:?}");
    }
    let three = Columns(vec![CandidateState::default(); 3]);
    let mut bytes = three.to_bytes();
    assert_eq!(Columns::from_bytes(&bytes), Ok(three));
    bytes.push(0);
    assert!(Columns::from_bytes(&bytes).is_err(), "trailing bytes");
}

#[test]
fn columns_of_older_and_newer_entries_read() {
    let state = CandidateState {
        depth: [4, 5, 5],
        load: CandidateLoad {
            running: 3,
            recent_itl_us: 41_000,
            ..CandidateLoad::default()
        },
    };
    let two = Columns(vec![state; 2]);
    let bytes = two.to_bytes();
    // The last column, the recent ITL, written once for both: its kind
    // and a 3-byte varint. An older release wrote none.
    let older = &bytes[..bytes.len() - 4];
    let read = Columns::from_bytes(older).expect("an older entry");
    let mut expected = state;
    expected.load.recent_itl_us = 0;
    assert_eq!(read, Columns(vec![expected; 2]));
    assert_eq!(Columns::from_bytes(&bytes), Ok(two.clone()));
    // Eight columns are not an entry of any release.
    let eight = &older[..older.len() - 2];
    assert_eq!(eight[eight.len() - 2..], [CONSTANT, 0], "the ninth column");
    let eight = &eight[..eight.len() - 2];
    assert!(Columns::from_bytes(eight).is_err());
    // A newer release's columns after the ones known are skipped.
    let mut newer = bytes.clone();
    newer.extend([EACH, 7, 0x80, 0x01, CONSTANT, 5]);
    assert_eq!(Columns::from_bytes(&newer), Ok(two));
    newer.push(EACH);
    assert!(Columns::from_bytes(&newer).is_err(), "a truncated column");
}

fn load() -> impl Strategy<Value = CandidateLoad> {
    (
        0u32..64,
        prop_oneof![Just(0u32), 0u32..u32::MAX],
        any::<u64>(),
        0u64..100_000,
        prop_oneof![0u64..100_000, Just(u64::MAX)],
        any::<u64>(),
        prop_oneof![Just(0u32), any::<u32>()],
    )
        .prop_map(
            |(running, waiting, queued, active, used, reported, step)| CandidateLoad {
                running,
                waiting,
                queued_prefill_tokens: queued,
                active_decode_blocks: active,
                kv_blocks_used: used,
                reported_kv_blocks_used: reported,
                recent_itl_us: step,
            },
        )
}

proptest! {
    /// Whatever the records, writing them and reading the entries back
    /// (through the wire, in log order) gives the records.
    #[test]
    fn written_records_read_back_exactly(
        turns in proptest::collection::vec(
            (0usize..3, 0usize..40, proptest::collection::vec(([any::<u32>(), any::<u32>(), any::<u32>()], load()), 1..6), any::<bool>()),
            1..24,
        )
    ) {
        let mut writer = LogWriter::new(WriterLimits { prompts: 8, ..WriterLimits::default() });
        let mut reader = LogReader::new();
        let mut conversations: Vec<Vec<BlockHash>> = vec![Vec::new(); 3];
        for (n, (c, append, states, avoid)) in turns.into_iter().enumerate() {
            let n = n as u64;
            conversations[c].extend(chain(n * 31 + c as u64, append));
            let candidates = states
                .iter()
                .enumerate()
                .map(|(i, (depth, load))| candidate(i, *depth, *load))
                .collect();
            let mut r = record(n, conversations[c].clone(), candidates);
            if avoid {
                r.inputs.avoid = vec![worker(9)];
            }
            let mut read = Vec::new();
            for entry in wire(writer.write(&r, n)) {
                read.extend(reader.read(&entry).unwrap());
            }
            prop_assert_eq!(read, vec![r]);
        }
    }

    #[test]
    fn garbage_entries_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = LogEntry::decode(&bytes);
        let _ = Columns::from_bytes(&bytes);
    }
}

#[test]
fn awaiting_acks_only_what_the_log_confirmed_is_referred_to() {
    let mut writer = LogWriter::awaiting_acks(WriterLimits::default());
    let cands = vec![candidate(0, [0; 3], CandidateLoad::default())];
    let first = writer.write(&record(1, chain(1, 10), cands.clone()), 0);
    assert_eq!(first.len(), 2, "a context, then the decision");
    // Not confirmed yet: the context again, and the whole prompt.
    let second = writer.write(&record(2, chain(1, 11), cands.clone()), 0);
    assert_eq!(second.len(), 2, "the unconfirmed context is written again");
    assert_eq!(second[1].decision().unwrap().prompt.prefix, None);
    // The first decision is confirmed, the second lost: only the first's
    // prompt may be referred to.
    for e in &first {
        writer.acked(e, 0);
    }
    for e in &second {
        match e {
            LogEntry::Context { .. } => writer.acked(e, 0),
            LogEntry::Decision(_) => writer.lost(e),
        }
    }
    let third = writer.write(&record(3, chain(1, 12), cands), 0);
    assert_eq!(third.len(), 1, "the confirmed context is not written again");
    assert_eq!(
        third[0].decision().unwrap().prompt.prefix.map(|p| p.blocks),
        Some(10)
    );
}
