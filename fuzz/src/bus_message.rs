//! Every message a service reads off the bus or the registry: the first
//! byte picks the type, the rest is the message. Garbage must give a
//! `DecodeError`; what decodes must survive re-encoding (decode ∘ encode is
//! the identity on what a decoder accepted). The one text body, a request
//! to announce KV batches again (`"EPOCH SEQ"`), likewise.

use protocol::decision_log::LogEntry;
use protocol::generate::{
    CancelRequest, GenerateChunk, GenerateEvent, GenerateRequest, LegProbe, LegProbeReply,
    OverlapQuery, OverlapReply, RequestProgress, ResyncReply, Stage,
};
use protocol::{
    BlockHash, DecisionId, IndexDelta, IndexSnapshot, IndexStatus, KvEvent, KvEventBatch,
    LoadReport, Message, RequestFragment, RouteDecision, Tier, WorkerRecord,
};

/// Decodes `bytes` as `M`; what decodes re-encodes and decodes to the same
/// bytes.
fn check<M: Message>(bytes: &[u8]) {
    let Ok(message) = M::decode(bytes) else {
        return;
    };
    let encoded = message.encode();
    let again = M::decode(&encoded)
        .unwrap_or_else(|e| panic!("{}: its own encoding does not decode: {e}", M::NAME));
    assert_eq!(
        again.encode(),
        encoded,
        "{}: re-encoding changed it",
        M::NAME
    );
}

/// A request to announce KV batches again: what parses re-encodes to a
/// body that parses to the same position.
fn check_reannounce_body(bytes: &[u8]) {
    let Some((epoch, seq)) = protocol::subjects::parse_kv_reannounce_body(bytes) else {
        return;
    };
    let again = protocol::subjects::kv_reannounce_body(epoch, seq);
    assert_eq!(
        protocol::subjects::parse_kv_reannounce_body(again.as_bytes()),
        Some((epoch, seq)),
        "kv_reannounce_body: its own encoding does not parse back"
    );
}

/// The selector of the reannounce body (after the messages).
const REANNOUNCE_BODY: &str = "kv_reannounce_body";

/// A message type's name and its check.
type Check = (&'static str, fn(&[u8]));

/// The types, in the order of the selector byte.
const CHECKS: &[Check] = &[
    (KvEventBatch::NAME, check::<KvEventBatch>),
    (LoadReport::NAME, check::<LoadReport>),
    (WorkerRecord::NAME, check::<WorkerRecord>),
    (RouteDecision::NAME, check::<RouteDecision>),
    (IndexDelta::NAME, check::<IndexDelta>),
    (IndexSnapshot::NAME, check::<IndexSnapshot>),
    (GenerateRequest::NAME, check::<GenerateRequest>),
    (GenerateChunk::NAME, check::<GenerateChunk>),
    (CancelRequest::NAME, check::<CancelRequest>),
    (ResyncReply::NAME, check::<ResyncReply>),
    (OverlapQuery::NAME, check::<OverlapQuery>),
    (OverlapReply::NAME, check::<OverlapReply>),
    (RequestProgress::NAME, check::<RequestProgress>),
    (IndexStatus::NAME, check::<IndexStatus>),
    (LogEntry::NAME, check::<LogEntry>),
    (RequestFragment::NAME, check::<RequestFragment>),
    (LegProbe::NAME, check::<LegProbe>),
    (LegProbeReply::NAME, check::<LegProbeReply>),
    (REANNOUNCE_BODY, check_reannounce_body),
];

pub fn run(data: &[u8]) {
    let Some((&kind, body)) = data.split_first() else {
        return;
    };
    (CHECKS[usize::from(kind) % CHECKS.len()].1)(body);
}

fn seed<M: Message>(message: &M) -> Vec<u8> {
    let kind = CHECKS
        .iter()
        .position(|(name, _)| *name == M::NAME)
        .expect("the seed's type is checked");
    let mut out = vec![kind as u8];
    out.extend(message.encode());
    out
}

pub fn seeds() -> Vec<Vec<u8>> {
    let w = tests::fixtures::worker("d0");
    let batch = KvEventBatch {
        worker: w.clone(),
        epoch: 7,
        seq: 3,
        events: vec![
            KvEvent::Cleared,
            KvEvent::Stored {
                parent: None,
                blocks: vec![BlockHash(1), BlockHash(2), BlockHash(3)],
                tier: Tier::Device,
            },
            KvEvent::Removed {
                blocks: vec![BlockHash(3)],
                tier: Tier::Host,
            },
        ],
    };
    let load = LoadReport {
        worker: w.clone(),
        running: 3,
        waiting: 1,
        queued_prefill_tokens: 4096,
        active_decode_blocks: 80,
        kv_blocks_used: 120,
        kv_blocks_total: 1000,
        at_ms: 1_700_000_000_000,
        recent_itl_us: 41_250,
    };
    let request = tests::fixtures::generate_request("r-1", Stage::Local, vec![1, 2, 3, 4], 16);
    let chunk = GenerateChunk {
        index: 2,
        event: GenerateEvent::Tokens(vec![9, 8, 7]),
    };
    let scored = GenerateChunk {
        index: 3,
        event: GenerateEvent::Scored {
            tokens: vec![9, 70_000],
            logprobs: vec![
                protocol::TokenLogprob {
                    logprob: -0.5,
                    top: vec![(9, -0.5), (10, -1.0)],
                },
                protocol::TokenLogprob {
                    logprob: -2.0,
                    top: vec![],
                },
            ],
        },
    };
    let cancel = CancelRequest {
        decision: DecisionId(42),
        request_id: "r-1".into(),
        reason: "client left".into(),
    };
    vec![
        seed(&batch),
        seed(&load),
        seed(&tests::fixtures::worker_record("d0")),
        seed(&request),
        seed(&chunk),
        seed(&scored),
        seed(&protocol::fragment::split(&request.encode(), 16).remove(1)),
        seed(&cancel),
        seed(&LegProbe {
            decision: DecisionId(42),
        }),
        seed(&LegProbeReply {
            decision: DecisionId(42),
            in_flight: true,
        }),
        reannounce_seed(),
    ]
}

fn reannounce_seed() -> Vec<u8> {
    let kind = CHECKS
        .iter()
        .position(|(name, _)| *name == REANNOUNCE_BODY)
        .expect("the reannounce body is checked");
    let mut out = vec![kind as u8];
    out.extend(protocol::subjects::kv_reannounce_body(1_796_532_255_513, 42).into_bytes());
    out
}
