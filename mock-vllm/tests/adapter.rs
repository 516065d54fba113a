//! The agent's vLLM adapter against mock-vllm, in process: every stage of
//! generation, kv_transfer_params passed through, the KV stream in
//! canonical hashes, the load, data-parallel ranks, failures, and vLLM's
//! bidirectional transfer (a prefix exported on the decode side, pulled
//! with on the prefill side).

use std::time::Duration;

use anyhow::{bail, ensure, Context, Result};
use engine_sim::Preset;
use futures::stream::BoxStream;
use futures::StreamExt;
use protocol::{
    BlockHash, BlockHasher, FinishReason, GenerateEvent, HashSalt, KvEvent, KvHandleQuery,
    KvTransferParams, PrefixFetch, Role, Stage, WorkerId,
};
use serde_json::Value;
use tests::fixtures::{generate_request as request, output_tokens as tokens};
use tests::free_port;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use worker_agent::vllm::{EngineKind, ReplayLimits, VllmConfig, VllmEngine};
use worker_agent::{BlockMirror, Engine, KvUpdate};

const SERVED: &str = "served-model";
const WAIT: Duration = Duration::from_secs(10);

struct Mock {
    http: u16,
    events: u16,
    replay: u16,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<Result<(), mock_vllm::Error>>,
}

impl Mock {
    async fn start(extra: &[&str]) -> Result<Self> {
        let (http, events, replay) = (free_port()?, free_port()?, free_port()?);
        let mut args = vec![
            "mock-vllm".to_owned(),
            format!("--port={http}"),
            "--host=127.0.0.1".into(),
            format!("--model={SERVED}"),
            "--preset=llama8b_h100".into(),
            "--block-size=16".into(),
            "--speedup=50".into(),
            format!("--kv-events-endpoint=tcp://*:{events}"),
            format!("--kv-replay-endpoint=tcp://*:{replay}"),
            "--engine-id=engine-under-test".into(),
        ];
        args.extend(extra.iter().map(|a| (*a).to_owned()));
        let args = mock_vllm::Args::try_parse_from(
            mock_vllm::config::command(),
            &mock_vllm::config::flags(),
            &mock_vllm::Options::default(),
            args,
        )
        .expect("valid flags");
        let config = mock_vllm::Config::from_args(&args).expect("a valid configuration");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(mock_vllm::run(config, async {
            let _ = stopped.await;
        }));
        let mock = Self {
            http,
            events,
            replay,
            stop: Some(stop),
            task,
        };
        let client = reqwest::Client::new();
        let deadline = tokio::time::Instant::now() + WAIT;
        while client
            .get(format!("{}/health", mock.url()))
            .send()
            .await
            .is_err()
        {
            if mock.task.is_finished() {
                return match mock.task.await? {
                    Err(e) => Err(e.into()),
                    Ok(()) => bail!("mock-vllm stopped"),
                };
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "mock-vllm did not start"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(mock)
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http)
    }

    async fn debug(&self) -> Result<Value> {
        Ok(reqwest::get(format!("{}/switchyard/debug", self.url()))
            .await?
            .json()
            .await?)
    }

    async fn stop(mut self) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        tokio::time::timeout(WAIT, self.task).await???;
        Ok(())
    }

    fn adapter(&self, rank: u32, dp_size: u32) -> VllmConfig {
        VllmConfig {
            kind: EngineKind::Vllm,
            worker: WorkerId::new("w", rank).unwrap(),
            role: Role::Both,
            model: SERVED.into(),
            block_size: 16,
            api_url: self.url(),
            kv_events: format!("tcp://127.0.0.1:{}", self.events),
            kv_replay: Some(format!("tcp://127.0.0.1:{}", self.replay)),
            topic: String::new(),
            dp_size,
            preset: Preset::llama8b_h100(),
            kv_capacity_blocks: None,
            startup_timeout: WAIT,
            request_timeout: Duration::from_secs(5),
            metrics_interval: Duration::from_millis(50),
            return_token_ids: true,
            bidirectional_kv: false,
            do_local_prefill: false,
            replay: ReplayLimits {
                connect: Duration::from_secs(1),
                idle: Duration::from_secs(1),
                total: Duration::from_secs(3),
            },
            idle_check: Some(Duration::from_millis(200)),
        }
    }
}

async fn collect(events: BoxStream<'static, GenerateEvent>) -> Result<Vec<GenerateEvent>> {
    let events: Vec<GenerateEvent> = tokio::time::timeout(WAIT, events.collect())
        .await
        .context("the stream did not end")?;
    ensure!(
        events.last().is_some_and(GenerateEvent::is_last),
        "{events:?}"
    );
    Ok(events)
}

fn prompt(seed: u32, n: u32) -> Vec<u32> {
    (0..n).map(|i| seed * 100_000 + i).collect()
}

/// The canonical hashes the router computes for a prompt.
fn canonical(prompt: &[u32]) -> Vec<BlockHash> {
    BlockHasher::new(16, HashSalt::new(SERVED, None, None))
        .unwrap()
        .hash_prompt(prompt)
}

/// Reads the KV stream until every hash of `want` is held.
async fn until_holding(
    kv: &mut BoxStream<'static, KvUpdate>,
    mirror: &mut BlockMirror,
    want: &[BlockHash],
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !want.iter().all(|h| mirror.contains(*h)) {
        let update = tokio::time::timeout_at(deadline, kv.next())
            .await
            .context("waiting for KV events")?
            .context("the KV stream ended")?;
        match update {
            KvUpdate::Events(events) => mirror.apply(&events),
            KvUpdate::BlockSet(set) => {
                *mirror = BlockMirror::new();
                mirror.apply(&set);
            }
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_stage_through_the_adapter() -> Result<()> {
    let mock = Mock::start(&[]).await?;
    let engine = VllmEngine::connect(mock.adapter(0, 1)).await?;
    let facts = engine.facts();
    ensure!(facts.contract.model == SERVED && facts.contract.block_size == 16);
    let mut kv = engine.take_kv_updates().context("the KV stream")?;
    let mut mirror = BlockMirror::new();

    // Local: the engine's token ids come back, its blocks in canonical
    // hashes (prompt and output).
    let p = prompt(1, 70);
    let events = collect(engine.generate(request("local", Stage::Local, p.clone(), 10))).await?;
    let out = tokens(&events);
    ensure!(
        out == worker_agent::sim_engine::output_tokens("local", 10).to_vec(),
        "{events:?}"
    );
    ensure!(
        matches!(
            events.last(),
            Some(GenerateEvent::Finished {
                output_tokens: 10,
                reason: FinishReason::Length,
                ..
            })
        ),
        "{events:?}"
    );
    // (The last output token has no KV yet.)
    let mut whole = p.clone();
    whole.extend(&out[..out.len() - 1]);
    until_holding(&mut kv, &mut mirror, &canonical(&whole)).await?;

    // Prefill: the engine's kv_transfer_params travel in the transfer.
    let p2 = prompt(2, 100);
    let events = collect(engine.generate(request("pre", Stage::Prefill, p2.clone(), 8))).await?;
    let transfer = match &events[..] {
        [GenerateEvent::Prefilled { transfer, .. }, GenerateEvent::Finished {
            reason: FinishReason::Prefilled,
            ..
        }] => transfer.clone(),
        other => bail!("{other:?}"),
    };
    ensure!(transfer.prompt_tokens == 100 && transfer.source == WorkerId::new("w", 0)?);
    let params: Value = serde_json::from_str(transfer.engine.as_deref().context("engine params")?)?;
    ensure!(
        params["remote_engine_id"] == "engine-under-test",
        "{params}"
    );

    // Decode with them: the engine receives them, with do_remote_prefill.
    let events = collect(engine.generate(request(
        "dec",
        Stage::Decode {
            transfer: transfer.clone(),
        },
        p2.clone(),
        4,
    )))
    .await?;
    ensure!(tokens(&events).len() == 4, "{events:?}");
    let debug = mock.debug().await?;
    ensure!(debug["kv_transfer_params_received"] == 1, "{debug}");
    ensure!(
        debug["last_kv_transfer_params"]["do_remote_prefill"] == true
            && debug["last_kv_transfer_params"]["remote_engine_id"] == "engine-under-test",
        "{debug}"
    );

    // Parameters the engine refuses: a 400, not retryable.
    let mut bad = transfer.clone();
    bad.engine = Some(r#"{"remote_block_ids": [1]}"#.into());
    let events = collect(engine.generate(request(
        "bad",
        Stage::Decode { transfer: bad },
        p2.clone(),
        4,
    )))
    .await?;
    ensure!(
        matches!(&events[..], [GenerateEvent::Failed { retryable: false, error }] if error.contains("HTTP 400") && error.contains("remote_engine_id")),
        "{events:?}"
    );
    // Without engine parameters (a simulated prefill worker): served as a
    // local prefill.
    let plain = KvTransferParams {
        engine: None,
        ..transfer
    };
    let events =
        collect(engine.generate(request("plain", Stage::Decode { transfer: plain }, p2, 2)))
            .await?;
    ensure!(tokens(&events).len() == 2, "{events:?}");

    // The load: capacity from the engine; running requests, usage and the
    // recent inter-token latency from its metrics while a long request
    // decodes.
    let capacity = facts.kv_capacity_blocks;
    let long = engine.generate(request("long", Stage::Local, prompt(4, 3000), 3000));
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let load = engine.load();
        if load.kv_blocks_total == capacity
            && load.running >= 1
            && load.kv_blocks_used > 0
            && load.recent_itl_us > 0
        {
            // The engine's steps are well under a millisecond at this
            // speed-up: a second would be a unit gone wrong.
            ensure!(load.recent_itl_us < 1_000_000, "{load:?}");
            break;
        }
        ensure!(tokio::time::Instant::now() < deadline, "{load:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let events = collect(long).await?;
    ensure!(tokens(&events).len() == 3000);
    // Its metrics are valid Prometheus text (vLLM's names have colons).
    let metrics = reqwest::get(format!("{}/metrics", mock.url()))
        .await?
        .text()
        .await?;
    ensure!(
        metrics.contains("vllm:inter_token_latency_seconds_count{engine=\"0\""),
        "{metrics}"
    );
    tests::promtool::check_metrics(&metrics, &["metric names should not contain ':'"])?;

    // A block set asked for comes in order in the KV stream.
    engine.request_block_set();
    let set = loop {
        match tokio::time::timeout(WAIT, kv.next())
            .await?
            .context("KV stream")?
        {
            KvUpdate::Events(events) => mirror.apply(&events),
            KvUpdate::BlockSet(set) => break set,
        }
    };
    ensure!(set == mirror.stored_events());
    ensure!(set.iter().all(|e| matches!(e, KvEvent::Stored { .. })));

    // The engine goes away: a clear, retryable failure.
    mock.stop().await?;
    let events = collect(engine.generate(request("gone", Stage::Local, prompt(3, 20), 2))).await?;
    ensure!(
        matches!(&events[..], [GenerateEvent::Failed { retryable: true, error }] if error.contains("the engine at") && error.contains("/v1/completions")),
        "{events:?}"
    );
    engine.stop();
    Ok(())
}

/// Two ranks behind one API: each agent is its own worker with its own
/// publisher (port offset by the rank) and its requests pinned to it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn data_parallel_ranks_are_separate_workers() -> Result<()> {
    let mock = Mock::start(&[
        "--data-parallel-size=2",
        "--encoding=map",
        "--hash-flavour=sglang",
    ])
    .await?;
    let rank0 = VllmEngine::connect(mock.adapter(0, 2)).await?;
    let rank1 = VllmEngine::connect(mock.adapter(1, 2)).await?;
    let mut kv0 = rank0.take_kv_updates().context("kv0")?;
    let mut kv1 = rank1.take_kv_updates().context("kv1")?;
    let p = prompt(9, 64);
    let events = collect(rank1.generate(request("on-1", Stage::Local, p.clone(), 1))).await?;
    ensure!(tokens(&events).len() == 1, "{events:?}");
    let mut m1 = BlockMirror::new();
    until_holding(&mut kv1, &mut m1, &canonical(&p)).await?;
    // Rank 0 heard nothing of it.
    ensure!(
        tokio::time::timeout(Duration::from_millis(300), kv0.next())
            .await
            .is_err(),
        "rank 0 got rank 1's events"
    );
    rank0.stop();
    rank1.stop();
    mock.stop().await
}

/// vLLM's bidirectional transfer through the adapter: a bypass asks the
/// decode engine for nothing; when a prefill worker needs a prefix the
/// decode engine holds, the adapter has the engine export it (a one-token
/// request of it) and returns the handle; a prefill engine sent it pulls
/// exactly that prefix from the decode engine. Each export is its own. A
/// handle to other tokens fails the prefill (mock-vllm checks what vLLM
/// would not), a prefill without one prefills whole, and an adapter
/// without bidirectional transfer exports nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_exported_on_the_decode_side_is_pulled_with_on_the_prefill_side() -> Result<()> {
    let flags = ["--bidirectional-kv-xfer=true"];
    let (d_mock, p_mock) = (Mock::start(&flags).await?, Mock::start(&flags).await?);
    let bidirectional = |mock: &Mock, role: Role| VllmConfig {
        role,
        bidirectional_kv: true,
        ..mock.adapter(0, 1)
    };
    let d = VllmEngine::connect(bidirectional(&d_mock, Role::Decode)).await?;
    let p = VllmEngine::connect(bidirectional(&p_mock, Role::Prefill)).await?;
    ensure!(d.wants_kv_handles() && p.wants_kv_handles());
    // What the decode engine holds, as the router (and its agent) hear it.
    let mut d_kv = d.take_kv_updates().context("the KV stream")?;
    let mut d_blocks = BlockMirror::new();

    // Turn 1 on the decode engine: a bypass of 300 tokens, 40 out; it
    // exports nothing.
    let turn1 = prompt(7, 300);
    let events = collect(d.generate(request("turn1", Stage::Local, turn1.clone(), 40))).await?;
    ensure!(d_mock.debug().await?["handles_exported"] == 0);
    let mut turn2 = turn1.clone();
    turn2.extend(tokens(&events));
    turn2.extend(prompt(8, 500));
    // Turn 1's prompt and output but its last token, 339 computed tokens:
    // 21 whole blocks, as the router would see them.
    let fetch = PrefixFetch {
        source: WorkerId::new("d", 0).unwrap(),
        prefix_tokens: 336,
        pulled_tokens: 336,
    };
    until_holding(&mut d_kv, &mut d_blocks, &canonical(&turn2[..336])).await?;
    let query_of = |id: &str, tokens: &[u32]| KvHandleQuery {
        request_id: id.into(),
        tokens: tokens.to_vec(),
        lora: None,
        cache_salt: None,
    };
    let query = |id: &str, prompt: &[u32]| query_of(id, &prompt[..336]);
    const ANY: usize = usize::MAX;
    // Asked for two blocks more than the engine holds (turn 2's new
    // message): it exports only the 21 it holds, computing none of them.
    let handle = d
        .export_kv(query_of("turn2", &turn2[..368]), ANY)
        .await
        .context("the handle to turn 2's prefix")?;
    ensure!(handle.blocks == 21, "{handle:?}");
    let params: Value = serde_json::from_str(&handle.engine)?;
    ensure!(
        params["remote_num_tokens"] == 336 && params["remote_engine_id"] == "engine-under-test",
        "{params}"
    );
    let d_debug = d_mock.debug().await?;
    ensure!(d_debug["handles_exported"] == 1, "{d_debug}");
    ensure!(
        d.export_kv(query("small", &turn2), 16).await.is_none(),
        "a handle larger than the bus carries is not given"
    );

    // Turn 2's prefill pulls it: the prefix comes cached.
    let mut leg = request("turn2", Stage::Prefill, turn2.clone(), 1);
    leg.annotation.fetch = Some(fetch.clone());
    let events = collect(p.generate_pulling(leg, Some(handle))).await?;
    let cached = events.iter().find_map(|e| match e {
        GenerateEvent::Prefilled { cached_tokens, .. } => *cached_tokens,
        _ => None,
    });
    ensure!(cached.is_some_and(|c| c >= 336), "{events:?}");
    let p_debug = p_mock.debug().await?;
    ensure!(
        p_debug["prefix_pulls_received"] == 1 && p_debug["pull_mismatches"] == 0,
        "{p_debug}"
    );
    ensure!(d_mock.debug().await?["handles_read"] == 1);

    // A prefix the engine does not hold is not exported: the export would
    // compute it on the decode worker.
    let other = prompt(5, 400);
    let exported = || async { anyhow::Ok(d_mock.debug().await?["handles_exported"].clone()) };
    let before = exported().await?;
    ensure!(d.export_kv(query("unheld", &other), ANY).await.is_none());
    ensure!(exported().await? == before, "no request to the engine");

    // A handle to another prompt's blocks, sent with a prompt it is no
    // prefix of, fails the prefill loudly (vLLM would use the wrong KV
    // silently).
    collect(d.generate(request("other", Stage::Local, other.clone(), 1))).await?;
    until_holding(&mut d_kv, &mut d_blocks, &canonical(&other[..336])).await?;
    let handle = d
        .export_kv(query("other", &other), ANY)
        .await
        .context("the handle to another prefix")?;
    let mut wrong = request("wrong", Stage::Prefill, turn2.clone(), 1);
    wrong.annotation.fetch = Some(fetch.clone());
    let events = collect(p.generate_pulling(wrong, Some(handle))).await?;
    ensure!(
        matches!(events.last(), Some(GenerateEvent::Failed { error, .. }) if error.contains("not this prompt's prefix")),
        "{events:?}"
    );

    // Without bidirectional transfer nothing is exported.
    let plain_d = VllmEngine::connect(d_mock.adapter(0, 1)).await?;
    ensure!(!plain_d.wants_kv_handles());
    ensure!(plain_d.export_kv(query("off", &turn2), ANY).await.is_none());
    plain_d.stop();

    // No handle: a plain prefill, nothing pulled.
    let mut plain = request("plain", Stage::Prefill, turn2, 1);
    plain.annotation.fetch = Some(fetch);
    let events = collect(p.generate_pulling(plain, None)).await?;
    ensure!(
        matches!(events.last(), Some(GenerateEvent::Finished { .. })),
        "{events:?}"
    );
    ensure!(p_mock.debug().await?["prefix_pulls_received"] == 2);
    d.stop();
    p.stop();
    d_mock.stop().await?;
    p_mock.stop().await
}

/// vLLM's reader declines a handle that expires within 5 s, and then
/// fails the request (`kv_load_failure_policy: fail`, its default: an HTTP
/// 500, which the adapter reports as a retryable failure that says what to
/// set) or computes the prefix (`recompute`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_declined_near_its_ttl_fails_or_is_recomputed_as_the_policy_says() -> Result<()> {
    let d_mock =
        Mock::start(&["--bidirectional-kv-xfer=true", "--decoder-kv-blocks-ttl=4s"]).await?;
    let p_fail = Mock::start(&["--bidirectional-kv-xfer=true"]).await?;
    let p_recompute = Mock::start(&[
        "--bidirectional-kv-xfer=true",
        "--kv-load-failure-policy=recompute",
    ])
    .await?;
    let bidirectional = |mock: &Mock, role: Role| VllmConfig {
        role,
        bidirectional_kv: true,
        ..mock.adapter(0, 1)
    };
    let d = VllmEngine::connect(bidirectional(&d_mock, Role::Decode)).await?;
    let mut d_kv = d.take_kv_updates().context("the KV stream")?;
    let turn1 = prompt(9, 300);
    collect(d.generate(request("turn1", Stage::Local, turn1.clone(), 1))).await?;
    until_holding(
        &mut d_kv,
        &mut BlockMirror::new(),
        &canonical(&turn1[..288]),
    )
    .await?;
    let mut turn2 = turn1.clone();
    turn2.extend(prompt(10, 200));
    let fetch = PrefixFetch {
        source: WorkerId::new("d", 0).unwrap(),
        prefix_tokens: 288,
        pulled_tokens: 288,
    };
    let mut outcomes = Vec::new();
    for (name, p_mock) in [("fail", &p_fail), ("recompute", &p_recompute)] {
        let query = KvHandleQuery {
            request_id: format!("turn2-{name}"),
            tokens: turn2[..288].to_vec(),
            lora: None,
            cache_salt: None,
        };
        let handle = d.export_kv(query, usize::MAX).await.context("a handle")?;
        let p = VllmEngine::connect(bidirectional(p_mock, Role::Prefill)).await?;
        let mut leg = request(&format!("turn2-{name}"), Stage::Prefill, turn2.clone(), 1);
        leg.annotation.fetch = Some(fetch.clone());
        let events = collect(p.generate_pulling(leg, Some(handle))).await?;
        outcomes.push((events, p_mock.debug().await?));
        p.stop();
    }
    let [(failed, fail_debug), (recomputed, recompute_debug)] = &outcomes[..] else {
        bail!("two outcomes");
    };
    ensure!(
        matches!(failed.last(), Some(GenerateEvent::Failed { retryable: true, error }) if error.contains("HTTP 500") && error.contains("kv_load_failure_policy")),
        "{failed:?}"
    );
    ensure!(
        matches!(recomputed.last(), Some(GenerateEvent::Finished { .. })),
        "{recomputed:?}"
    );
    for debug in [fail_debug, recompute_debug] {
        ensure!(debug["pulls_declined"] == 1, "{debug}");
    }
    ensure!(
        d_mock.debug().await?["handles_read"] == 0,
        "declined without a read"
    );
    d.stop();
    for mock in [d_mock, p_fail, p_recompute] {
        mock.stop().await?;
    }
    Ok(())
}
