//! Protocol values and taps the crates' tests share, built one way: a
//! generation request, a worker record, the output tokens of a stream, a
//! worker's KV batches off JetStream.
//!
//! Only `protocol` types (and an `async_nats` client) cross this API, so
//! that unit tests inside a crate can use it as a dev-dependency too.

use anyhow::Result;
use async_nats::jetstream::{self, consumer};
use futures::stream::BoxStream;
use futures::StreamExt;
use protocol::{
    subjects, Annotation, BlockHash, DecisionId, GenerateEvent, GenerateRequest, HashingContract,
    IndexChange, IndexDelta, KvEventBatch, Message, Path, Role, Stage, Tier, WorkerId,
    WorkerRecord, WorkerSubjects,
};

/// The worker `name` at data-parallel rank 0.
/// Index delta `seq`: d0 stored the one block `BlockHash(seq)`.
pub fn one_block_delta(seq: u64) -> IndexDelta {
    IndexDelta {
        seq,
        changes: vec![IndexChange::Stored {
            worker: worker("d0"),
            parent: None,
            blocks: vec![BlockHash(seq)],
            tier: Tier::Device,
        }],
        source: None,
    }
}

pub fn worker(name: &str) -> WorkerId {
    WorkerId::new(name, 0).expect("a valid worker name")
}

/// A bypass annotation: decision 1, decoded on worker `w`.
pub fn annotation() -> Annotation {
    Annotation {
        decision: DecisionId(1),
        path: Path::Bypass,
        decode: worker("w"),
        prefill: None,
        decode_overlap_tokens: 0,
        prefill_overlap_tokens: 0,
        fetch: None,
    }
}

/// A generation request `id` for `stage`, with [`annotation`].
pub fn generate_request(
    id: &str,
    stage: Stage,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> GenerateRequest {
    GenerateRequest {
        request_id: id.into(),
        annotation: annotation(),
        stage,
        prompt,
        max_tokens,
        sampling: Default::default(),
    }
}

/// The output tokens in a stream's events, in order.
pub fn output_tokens(events: &[GenerateEvent]) -> Vec<u32> {
    events
        .iter()
        .filter_map(|e| match e {
            GenerateEvent::Tokens(t) => Some(t.clone()),
            _ => None,
        })
        .flatten()
        .collect()
}

/// The registration record of decode worker `name`: model `m`, 16-token
/// blocks, 1,000 blocks of KV.
pub fn worker_record(name: &str) -> WorkerRecord {
    registration(name, Role::Decode, HashingContract::for_model("m", 16))
}

/// The registration record of worker `name` (rank 0) with `role` and
/// `contract`: 1,000 blocks of KV, 8,192-token steps, 1 byte of KV per
/// token, 1 GPU. Tests change what they need with struct update syntax
/// (`WorkerRecord { kv_capacity_blocks: 10_000, ..registration(..) }`).
pub fn registration(name: &str, role: Role, contract: HashingContract) -> WorkerRecord {
    let id: WorkerId = name.parse().expect("a valid worker id");
    WorkerRecord {
        subjects: WorkerSubjects::for_worker(&id),
        id,
        role,
        contract,
        kv_capacity_blocks: 1000,
        max_batched_tokens: 8192,
        kv_bytes_per_token: 1,
        gpus: 1,
        max_model_len: 0,
        capabilities: Default::default(),
    }
}

/// The KV batches of `worker` in the KV-event stream, from the first one
/// kept (an ordered push consumer). The stream must exist.
pub async fn kv_batches(
    client: &async_nats::Client,
    worker: &WorkerId,
) -> Result<BoxStream<'static, Result<KvEventBatch>>> {
    let stream = jetstream::new(client.clone())
        .get_stream(subjects::KV_EVENTS_STREAM)
        .await?;
    let consumer = stream
        .create_consumer(consumer::push::OrderedConfig {
            deliver_subject: client.new_inbox(),
            filter_subject: subjects::kv_events(worker),
            ..Default::default()
        })
        .await?;
    let messages = consumer.messages().await?;
    Ok(messages
        .map(|m| Ok(KvEventBatch::decode(&m?.payload)?))
        .boxed())
}

/// Fills the JetStream store behind `js` as another tenant would: a
/// stream `FILLER` on subject `filler` takes 512 KiB messages until the
/// server refuses one (at most 100 MiB). Returns that refusal's text, or
/// `None` if all were taken. The caller frees the room again by deleting
/// the stream `FILLER`.
pub async fn fill_store(js: &jetstream::Context) -> Result<Option<String>> {
    js.create_stream(jetstream::stream::Config {
        name: "FILLER".into(),
        subjects: vec!["filler".into()],
        ..Default::default()
    })
    .await?;
    let chunk = vec![0u8; 512 << 10];
    for _ in 0..200 {
        let sent = async { js.publish("filler", chunk.clone().into()).await?.await }.await;
        if let Err(e) = sent {
            return Ok(Some(e.to_string()));
        }
    }
    Ok(None)
}
