//! The codec round-trips every message and turns garbage into errors.

use proptest::prelude::*;
use protocol::*;

fn worker(name: &str) -> WorkerId {
    WorkerId::new(name, 0).unwrap()
}

fn batch() -> KvEventBatch {
    KvEventBatch {
        worker: WorkerId::new("d0", 1).unwrap(),
        epoch: 7,
        seq: 3,
        events: vec![
            KvEvent::Cleared,
            KvEvent::Stored {
                parent: None,
                blocks: vec![BlockHash(1), BlockHash(u64::MAX)],
                tier: Tier::Device,
            },
            KvEvent::Removed {
                blocks: vec![BlockHash(1)],
                tier: Tier::Host,
            },
        ],
    }
}

fn decision() -> RouteDecision {
    RouteDecision {
        id: DecisionId(42),
        request_id: "req-1".into(),
        path: Path::Remote,
        decode: worker("d0"),
        prefill: Some(worker("p0")),
        isl_tokens: 8192,
        decode_overlap_tokens: 0,
        prefill_overlap_tokens: 4096,
        reserved_decode_blocks: 600,
        reserved_prefill_tokens: 4096,
        policy: "isl".into(),
        rule: "isl.long".into(),
        reason: "8192 uncached tokens >= 2048".into(),
        at_ms: 5,
        fetch: None,
    }
}

fn record() -> WorkerRecord {
    let id = worker("p0");
    WorkerRecord {
        subjects: WorkerSubjects::for_worker(&id),
        id,
        role: Role::Prefill,
        contract: HashingContract::for_model("llama", 16),
        kv_capacity_blocks: 1000,
        max_batched_tokens: 8192,
        kv_bytes_per_token: 131_072,
        gpus: 1,
        max_model_len: 0,
        capabilities: Default::default(),
    }
}

fn snapshot() -> IndexSnapshot {
    IndexSnapshot {
        delta_seq: 9,
        workers: vec![worker("a"), worker("b")],
        cursors: vec![WorkerCursor {
            worker: worker("a"),
            epoch: 1,
            last_seq: 4,
            resync_pending: false,
        }],
        runs: vec![OwnedRun {
            blocks: vec![BlockHash(5), BlockHash(6)],
            owners: vec![RunOwner {
                worker: 1,
                tiers: TierSet::only(Tier::Disk),
            }],
        }],
        digest: 77,
    }
}

fn delta() -> IndexDelta {
    IndexDelta {
        seq: 12,
        changes: vec![
            IndexChange::Stored {
                worker: worker("a"),
                parent: Some(BlockHash(3)),
                blocks: vec![BlockHash(4)],
                tier: Tier::Device,
            },
            IndexChange::WorkerRemoved {
                worker: worker("b"),
            },
            IndexChange::Evicted {
                blocks: vec![BlockHash(9)],
            },
        ],
        source: Some(WorkerCursor {
            worker: worker("a"),
            epoch: 2,
            last_seq: 3,
            resync_pending: true,
        }),
    }
}

fn generate() -> GenerateRequest {
    GenerateRequest {
        request_id: "r".into(),
        annotation: decision().annotation(),
        stage: Stage::Decode {
            transfer: KvTransferParams {
                source: worker("p0"),
                prompt_tokens: 10,
                engine: Some("{}".into()),
            },
        },
        prompt: vec![1, 2, 3],
        max_tokens: 5,
        sampling: Sampling {
            temperature: Some(0.5),
            seed: Some(-7),
            stop: vec!["\n".into()],
            stop_token_ids: vec![2],
            ignore_eos: true,
            min_tokens: 1,
            logit_bias: vec![(5, -100.0)],
            response_format: Some(r#"{"type":"json_object"}"#.into()),
            cache_salt: Some("s".into()),
            lora: Some("adapter".into()),
            ..Sampling::default()
        },
    }
}

#[test]
fn every_message_round_trips() {
    assert_eq!(KvEventBatch::decode(&batch().encode()).unwrap(), batch());
    assert_eq!(
        RouteDecision::decode(&decision().encode()).unwrap(),
        decision()
    );
    assert_eq!(WorkerRecord::decode(&record().encode()).unwrap(), record());
    assert_eq!(
        IndexSnapshot::decode(&snapshot().encode()).unwrap(),
        snapshot()
    );
    assert_eq!(IndexDelta::decode(&delta().encode()).unwrap(), delta());
    let load = LoadReport::idle(worker("d0"), 100, 3);
    assert_eq!(LoadReport::decode(&load.encode()).unwrap(), load);
    assert_eq!(
        GenerateRequest::decode(&generate().encode()).unwrap(),
        generate()
    );
    for event in [
        GenerateEvent::Tokens(vec![1, 2]),
        GenerateEvent::Scored {
            tokens: vec![1, 70_000],
            logprobs: vec![
                TokenLogprob {
                    logprob: -0.25,
                    top: vec![(1, -0.25), (9, -1.5)],
                },
                TokenLogprob {
                    logprob: -3.0,
                    top: vec![],
                },
            ],
        },
        GenerateEvent::Finished {
            output_tokens: 2,
            cached_tokens: Some(1),
            reason: FinishReason::Length,
        },
        GenerateEvent::Failed {
            error: "engine down".into(),
            retryable: true,
        },
        GenerateEvent::Rejected {
            status: 400,
            param: Some("top_k".into()),
            error: "top_k is not supported".into(),
        },
    ] {
        let chunk = GenerateChunk { index: 4, event };
        assert_eq!(GenerateChunk::decode(&chunk.encode()).unwrap(), chunk);
    }
    let cancel = CancelRequest {
        decision: DecisionId(9),
        request_id: "r-9".into(),
        reason: "the client went away".into(),
    };
    assert_eq!(CancelRequest::decode(&cancel.encode()).unwrap(), cancel);
}

/// A registration written before capabilities existed (its body one
/// field shorter) reads as a worker that serves every leg its role allows.
#[test]
fn records_without_capabilities_read_as_every_leg() {
    let mut r = record();
    r.capabilities = Capabilities {
        local_prefill: true,
        remote_decode: false,
        remote_prefill: false,
    };
    let bytes = r.encode();
    // [0x92, version, 0x9a (10 fields), ..., capabilities: 0x93 c3 c2 c2]
    assert_eq!(bytes[2], 0x9a, "{bytes:02x?}");
    assert_eq!(&bytes[bytes.len() - 4..], &[0x93, 0xc3, 0xc2, 0xc2]);
    let mut old = bytes[..bytes.len() - 4].to_vec();
    old[2] = 0x99;
    let back = WorkerRecord::decode(&old).unwrap();
    assert_eq!(back.capabilities, Capabilities::default());
    assert_eq!(back.id, r.id);
    assert!(
        Capabilities::default().serves(Path::Remote)
            && Capabilities::default().serves(Path::Bypass)
    );
    assert!(!r.capabilities.serves(Path::Remote) && r.capabilities.serves(Path::Bypass));
}

#[test]
fn other_versions_are_refused_by_name() {
    let mut bytes = batch().encode();
    bytes[1] = 9; // [fixarray(2), fixint(version), ...]
    let err = KvEventBatch::decode(&bytes).unwrap_err();
    assert!(matches!(
        err,
        DecodeError::UnsupportedVersion {
            got: 9,
            supported: 1,
            ..
        }
    ));
    assert_eq!(
        err.to_string(),
        "KvEventBatch: format version 9 is not supported (this build reads version 1)"
    );
}

#[test]
fn trailing_bytes_and_truncation_are_errors() {
    let mut bytes = batch().encode();
    bytes.push(0);
    assert!(matches!(
        KvEventBatch::decode(&bytes),
        Err(DecodeError::TrailingBytes { extra: 1, .. })
    ));
    let bytes = batch().encode();
    for cut in 0..bytes.len() {
        assert!(KvEventBatch::decode(&bytes[..cut]).is_err(), "cut at {cut}");
    }
}

#[test]
fn a_message_of_another_type_is_refused() {
    assert!(KvEventBatch::decode(&decision().encode()).is_err());
    assert!(WorkerRecord::decode(&batch().encode()).is_err());
}

#[test]
fn invalid_ids_inside_a_message_are_refused() {
    let mut bytes = batch().encode();
    // The worker id "d0.1" is the first string: corrupt it into "d0 1".
    let at = bytes.windows(4).position(|w| w == b"d0.1").unwrap();
    bytes[at + 2] = b' ';
    let err = KvEventBatch::decode(&bytes).unwrap_err();
    assert!(err.to_string().contains("outside [A-Za-z0-9_-]"), "{err}");
}

#[test]
fn an_event_batch_is_compact() {
    let batch = KvEventBatch {
        worker: worker("decode-0"),
        epoch: 1,
        seq: 1,
        events: vec![KvEvent::Stored {
            parent: Some(BlockHash(u64::MAX)),
            blocks: (0..32).map(|i| BlockHash(u64::MAX - i)).collect(),
            tier: Tier::Device,
        }],
    };
    // 32 hashes of 9 bytes each dominate; the envelope and fields add little.
    let len = batch.encode().len();
    assert!(len <= 32 * 9 + 40, "{len} bytes");
}

proptest! {
    #[test]
    fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        let _ = KvEventBatch::decode(&bytes);
        let _ = IndexDelta::decode(&bytes);
        let _ = IndexSnapshot::decode(&bytes);
        let _ = WorkerRecord::decode(&bytes);
        let _ = RouteDecision::decode(&bytes);
        let _ = LoadReport::decode(&bytes);
        let _ = GenerateRequest::decode(&bytes);
        let _ = GenerateChunk::decode(&bytes);
        let _ = OverlapReply::decode(&bytes);
        let _ = CancelRequest::decode(&bytes);
    }

    #[test]
    fn corrupted_messages_never_panic(flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..8)) {
        let mut bytes = batch().encode();
        let n = bytes.len();
        for (at, value) in flips {
            bytes[at % n] = value;
        }
        let _ = KvEventBatch::decode(&bytes);
        let mut bytes = snapshot().encode();
        let n = bytes.len();
        bytes[n / 2] ^= 0xff;
        let _ = IndexSnapshot::decode(&bytes);
    }

    #[test]
    fn batches_round_trip(epoch: u64, seq: u64, hashes in proptest::collection::vec(any::<u64>(), 0..64)) {
        let b = KvEventBatch {
            worker: worker("w"),
            epoch,
            seq,
            events: vec![KvEvent::Stored {
                parent: hashes.first().map(|h| BlockHash(*h)),
                blocks: hashes.iter().map(|h| BlockHash(*h)).collect(),
                tier: Tier::Host,
            }],
        };
        prop_assert_eq!(KvEventBatch::decode(&b.encode()).unwrap(), b);
    }
}

/// A 256k-token prompt of a 128k vocabulary fits NATS's default 1 MiB
/// payload as a generation request, and reads back exactly.
#[test]
fn a_long_prompt_packs_under_the_payload_limit() {
    let mut request = generate();
    request.prompt = (0..262_144u32)
        .map(|i| i.wrapping_mul(2_654_435_761) % 128_256)
        .collect();
    let bytes = request.encode();
    assert!(bytes.len() < 800 << 10, "{} bytes", bytes.len());
    assert_eq!(GenerateRequest::decode(&bytes).unwrap(), request);
}

proptest! {
    #[test]
    fn packed_tokens_round_trip(tokens in proptest::collection::vec(any::<u32>(), 0..64), small in proptest::collection::vec(0u32..300, 0..64)) {
        for t in [tokens, small] {
            prop_assert_eq!(generate::packed_tokens::unpack(&generate::packed_tokens::pack(&t)).unwrap(), t);
        }
    }

    #[test]
    fn packed_garbage_is_an_error_not_a_panic(bytes in proptest::collection::vec(any::<u8>(), 0..32)) {
        let _ = generate::packed_tokens::unpack(&bytes);
    }
}

/// A decision written before the third path (no `fetch` field: one element
/// fewer in its msgpack array) still reads, as one without a fetch; a
/// fetching decision round-trips with its source and tokens.
#[test]
fn decisions_before_the_third_path_still_read() {
    let old = decision();
    let mut bytes = rmp_serde::to_vec(&old).unwrap();
    assert_eq!(bytes[0], 0x90 | 15, "a fixarray of 15 fields");
    assert_eq!(bytes.pop(), Some(0xc0), "the last field is the nil fetch");
    bytes[0] = 0x90 | 14;
    assert_eq!(rmp_serde::from_slice::<RouteDecision>(&bytes).unwrap(), old);

    let fetching = RouteDecision {
        path: Path::RemoteFetch,
        fetch: Some(PrefixFetch {
            source: worker("d0"),
            prefix_tokens: 8000,
            pulled_tokens: 3904,
        }),
        ..decision()
    };
    let bytes = rmp_serde::to_vec(&fetching).unwrap();
    assert_eq!(
        rmp_serde::from_slice::<RouteDecision>(&bytes).unwrap(),
        fetching
    );
    let annotation = fetching.annotation();
    assert_eq!(annotation.fetch, fetching.fetch);
    let json = serde_json::to_value(&fetching).unwrap();
    assert_eq!(json["path"], "remote_fetch");
    assert_eq!(json["fetch"]["source"], "d0");
}

/// A load report of an older agent (no recent ITL: one element fewer
/// in its msgpack array) reads as one whose step time is unknown.
#[test]
fn reports_without_a_recent_itl_read_as_unknown() {
    let mut report = LoadReport::idle(worker("d0"), 100, 3);
    report.running = 2;
    report.recent_itl_us = 45;
    let bytes = report.encode();
    // [0x92, version, 0x99 (9 fields), ..., recent_itl_us: 45 (a fixint)]
    assert_eq!(bytes[2], 0x99, "{bytes:02x?}");
    assert_eq!(bytes.last(), Some(&45));
    let mut old = bytes[..bytes.len() - 1].to_vec();
    old[2] = 0x98;
    let back = LoadReport::decode(&old).unwrap();
    assert_eq!(back.recent_itl_us, 0);
    assert_eq!(back.running, 2);
    assert_eq!(LoadReport::decode(&bytes).unwrap(), report);
    // A reader refuses a report one field longer than it knows: so routers
    // are upgraded before the agents whose reports gain a field.
    let mut newer = bytes.clone();
    newer[2] = 0x9a;
    newer.push(7);
    assert!(matches!(
        LoadReport::decode(&newer),
        Err(DecodeError::Malformed { .. })
    ));
}
