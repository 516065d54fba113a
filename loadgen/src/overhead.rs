//! The router's latency overhead: the same small request sent through
//! `/v1/completions` (routed, dispatched over NATS, streamed back) and
//! straight to the workers' agents over NATS along the same path the
//! router chose (one local leg for a bypass; prefill leg, then decode leg
//! with its transfer parameters, for a remote prefill), one at a time;
//! compares the medians.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use futures::StreamExt;
use protocol::{
    subjects, Annotation, DecisionId, GenerateChunk, GenerateEvent, GenerateRequest, Message, Path,
    Stage, WorkerId,
};

use crate::stats::Samples;

#[derive(Debug, Clone)]
pub struct Overhead {
    pub router: String,
    pub nats: String,
    /// Credentials and TLS.
    pub auth: bus::AuthArgs,
    /// The router's API key.
    pub api_key: Option<String>,
    pub requests: usize,
    pub prompt_tokens: usize,
    pub max_tokens: u32,
}

/// One leg straight to a worker; returns its `Prefilled` transfer, if any.
async fn leg(
    client: &async_nats::Client,
    worker: &WorkerId,
    request: &GenerateRequest,
) -> anyhow::Result<Option<protocol::KvTransferParams>> {
    let inbox = client.new_inbox();
    let mut chunks = client.subscribe(inbox.clone()).await?;
    client
        .publish_with_reply(subjects::generate(worker), inbox, request.encode().into())
        .await?;
    let mut transfer = None;
    loop {
        let message = tokio::time::timeout(Duration::from_secs(30), chunks.next())
            .await
            .context("the worker did not answer")?
            .context("the reply subscription ended")?;
        match GenerateChunk::decode(&message.payload)?.event {
            GenerateEvent::Prefilled { transfer: t, .. } => transfer = Some(t),
            GenerateEvent::Finished { .. } => return Ok(transfer),
            GenerateEvent::Failed { error, .. } | GenerateEvent::Rejected { error, .. } => {
                bail!("{worker} failed: {error}")
            }
            GenerateEvent::Tokens(_) | GenerateEvent::Scored { .. } => {}
        }
    }
}

/// The request the router would have sent, sent directly: `prefill` is
/// `Some` for the remote path.
async fn direct(
    client: &async_nats::Client,
    decode: &WorkerId,
    prefill: Option<&WorkerId>,
    prompt: &[u32],
    max_tokens: u32,
    n: u64,
) -> anyhow::Result<()> {
    let mut request = GenerateRequest {
        request_id: format!("direct-{n}"),
        annotation: Annotation {
            decision: DecisionId(n),
            path: if prefill.is_some() {
                Path::Remote
            } else {
                Path::Bypass
            },
            decode: decode.clone(),
            prefill: prefill.cloned(),
            decode_overlap_tokens: 0,
            prefill_overlap_tokens: 0,
            fetch: None,
        },
        stage: Stage::Local,
        prompt: prompt.to_vec(),
        max_tokens,
        sampling: Default::default(),
    };
    if let Some(p) = prefill {
        request.stage = Stage::Prefill;
        let transfer = leg(client, p, &request)
            .await?
            .context("the prefill leg sent no transfer parameters")?;
        request.stage = Stage::Decode { transfer };
    }
    leg(client, decode, &request).await?;
    Ok(())
}

pub async fn run(o: Overhead) -> anyhow::Result<serde_json::Value> {
    let client = bus::Bus::connect_with(&o.nats, "loadgen-overhead", &o.auth.nats)
        .await?
        .client()
        .clone();
    let http = crate::api_key::client(o.api_key.as_deref())?.build()?;
    let (mut routed, mut straight) = (Samples::default(), Samples::default());
    let mut paths = std::collections::BTreeMap::<String, usize>::new();
    for n in 0..o.requests {
        // A fresh prompt each time, so that caches do not favour either.
        let mut prompt = Vec::with_capacity(o.prompt_tokens);
        protocol::trace::extend_block_tokens(7_000_000 + n as u64, o.prompt_tokens, &mut prompt);
        let started = Instant::now();
        let response = http
            .post(format!("{}/v1/completions", o.router))
            .json(&serde_json::json!({"prompt": prompt, "max_tokens": o.max_tokens}))
            .send()
            .await?;
        if !response.status().is_success() {
            bail!(
                "HTTP {}: {}",
                response.status(),
                response.text().await.unwrap_or_default()
            );
        }
        let body: serde_json::Value = response.json().await?;
        routed.push(started.elapsed());
        let info = &body["switchyard"];
        let worker = |key: &str| -> anyhow::Result<Option<WorkerId>> {
            info[key]
                .as_str()
                .map(|w| w.parse().map_err(|e| anyhow::anyhow!("{key} {w:?}: {e}")))
                .transpose()
        };
        let decode = worker("decode")?.context("the response names no decode worker")?;
        let prefill = worker("prefill")?;
        *paths
            .entry(info["path"].as_str().unwrap_or("?").to_owned())
            .or_default() += 1;

        // The same path, straight to the workers, with another fresh prompt.
        let mut prompt = Vec::with_capacity(o.prompt_tokens);
        protocol::trace::extend_block_tokens(8_000_000 + n as u64, o.prompt_tokens, &mut prompt);
        let started = Instant::now();
        direct(
            &client,
            &decode,
            prefill.as_ref(),
            &prompt,
            o.max_tokens,
            n as u64,
        )
        .await?;
        straight.push(started.elapsed());
    }
    let (r50, d50) = (routed.percentile_ms(0.5), straight.percentile_ms(0.5));
    Ok(serde_json::json!({
        "requests": o.requests,
        "prompt_tokens": o.prompt_tokens,
        "max_tokens": o.max_tokens,
        "via_router_ms": routed.summary(),
        "direct_ms": straight.summary(),
        "overhead_p50_ms": crate::stats::round3(r50 - d50),
        "router_paths": paths,
    }))
}
