//! End-to-end on mock-vllm engines: the router, the indexer and agents
//! with `--engine vllm` (the adapter a real vLLM gets: ZMQ KV events with
//! engine-private hashes, OpenAI HTTP, kv_transfer_params) as processes.

mod cluster;

use anyhow::{ensure, Context, Result};
use cluster::{
    conversation, decode, output, path, Cluster, Engine, Wire, ANSWER, BLOCK_SIZE, COLD_PROMPT,
};

const VLLM_ARRAYS: Engine = Engine::MockVllm(Wire {
    encoding: "array",
    hash_flavour: "vllm",
    replay_topic_frame: false,
});
const MAPS_SGLANG_HASHES: Engine = Engine::MockVllm(Wire {
    encoding: "map",
    hash_flavour: "sglang",
    replay_topic_frame: true,
});

#[tokio::test(flavor = "multi_thread")]
async fn a_conversation_on_mock_vllm_engines() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            ("d0", "decode", VLLM_ARRAYS),
            ("d1", "decode", MAPS_SGLANG_HASHES),
        ],
        1,
    )
    .await?;
    let result = async {
        // Each turn waits until the router sees the previous turn's blocks
        // (published by its engine with private hashes, translated by its
        // agent) before it is sent.
        let turns = conversation(&cluster, 0, 7, 3).await?;
        for (turn, response) in turns.iter().enumerate() {
            ensure!(
                output(response).len() == ANSWER as usize,
                "turn {turn}: {} token ids came back: {response}",
                output(response).len()
            );
        }

        // Turn 0, cold and long: prefilled on p0, decoded on a decode
        // worker with p0's kv_transfer_params.
        ensure!(
            path(&turns[0]) == "remote",
            "turn 0: {}",
            turns[0]["switchyard"]
        );
        let home = decode(&turns[0]).to_owned();
        let debug = cluster.engine_debug(&home).await?;
        ensure!(
            debug["kv_transfer_params_received"].as_u64() == Some(1),
            "{home}'s engine: {debug}"
        );
        let params = &debug["last_kv_transfer_params"];
        let p0_id = cluster.worker("p0")?.engine_id.as_str();
        ensure!(
            params["remote_engine_id"] == p0_id
                && params["do_remote_prefill"] == true
                && params["remote_block_ids"]
                    .as_array()
                    .is_some_and(|b| !b.is_empty()),
            "the decode engine got {params}"
        );
        let p0 = cluster.engine_debug("p0").await?;
        ensure!(
            p0["requests"]["prefill"].as_u64() == Some(1),
            "p0's engine: {p0}"
        );

        // Later turns, short appends: bypass, on the worker holding them.
        for (turn, response) in turns.iter().enumerate().skip(1) {
            ensure!(
                path(response) == "bypass",
                "turn {turn}: {}",
                response["switchyard"]
            );
            ensure!(
                decode(response) == home,
                "turn {turn} left {home}: {}",
                response["switchyard"]
            );
            ensure!(
                response["switchyard"]["decode_overlap_tokens"]
                    .as_u64()
                    .unwrap_or(0)
                    >= COLD_PROMPT as u64 / u64::from(BLOCK_SIZE) * u64::from(BLOCK_SIZE),
                "turn {turn}: {}",
                response["switchyard"]
            );
        }
        let engine = cluster.engine_debug(&home).await?;
        ensure!(
            engine["requests"]["local"].as_u64() == Some(2)
                && engine["requests"]["decode"].as_u64() == Some(1),
            "{home}'s engine: {engine}"
        );

        // The agents count no unknown parent or lost gap.
        for w in &cluster.workers {
            let metrics = cluster
                .http
                .get(format!("{}/metrics", w.agent.url()))
                .send()
                .await?
                .text()
                .await?;
            for bad in ["unknown_parents", "gaps_unrecovered", "malformed_batches"] {
                ensure!(
                    !metrics
                        .lines()
                        .any(|l| l.contains(&format!("what=\"{bad}\"")) && !l.ends_with(" 0")),
                    "{}: {bad}:\n{metrics}",
                    w.name
                );
            }
        }
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// A client that leaves mid-stream: the adapter closes the engine's HTTP
/// stream, which is how vLLM learns to abort a request.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_that_leaves_cancels_its_request_on_the_engine() -> Result<()> {
    let cluster = Cluster::start_with(
        &[
            ("p0", "prefill", VLLM_ARRAYS),
            ("d0", "decode", VLLM_ARRAYS),
        ],
        1,
    )
    .await?;
    let result = cluster.leave_mid_stream("d0").await;
    result.with_context(|| cluster.logs())
}
