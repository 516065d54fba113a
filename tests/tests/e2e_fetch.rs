//! The third path end to end on mock-vllm engines with vLLM's bidirectional
//! KV transfer (`--bidirectional-kv-xfer`): a long append to a
//! conversation held on a decode worker goes to the prefill worker with the
//! prefix fetched from that decode worker (router `--prefix-fetch`, agents
//! `--vllm-bidirectional-kv`). The prefill worker's agent asked the decode
//! worker's agent for the prefix, whose engine exported it (a one-token
//! request of it) and returned a handle, which the prefill worker's engine
//! was sent and with which it read exactly the prompt's prefix from the
//! decode engine (mock-vllm fails a pull of other tokens); the decode
//! engine got the prefill engine's handoff, and `replay verify` reproduces
//! the decision.

mod cluster;

use std::process::Command;

use anyhow::{ensure, Context, Result};
use cluster::{
    decode, output, path, tokens, Cluster, Engine, ExtraFlags, Wire, ANSWER, BLOCK_SIZE,
};
use serde_json::Value;

const VLLM: Engine = Engine::MockVllm(Wire {
    encoding: "array",
    hash_flavour: "vllm",
    replay_topic_frame: false,
});

#[tokio::test(flavor = "multi_thread")]
async fn a_long_append_fetches_its_prefix_from_the_decode_worker() -> Result<()> {
    let extra = ExtraFlags {
        router: vec!["--prefix-fetch=true".into()],
        agent: vec!["--vllm-bidirectional-kv=true".into()],
        engine: vec!["--bidirectional-kv-xfer=true".into()],
    };
    let cluster =
        Cluster::start_with_flags(&[("p0", "prefill", VLLM), ("d0", "decode", VLLM)], 1, extra)
            .await?;
    let result = async {
        // Turn 0: cold and long, remote (p0 -> d0). Turn 1: an append of
        // 1500 tokens, short enough for the ISL rule to bypass on d0, which
        // then holds 1500 more tokens than p0. Turn 2: a long append (3000
        // tokens), remote: p0 pulls what d0 holds beyond its own prefix.
        let mut prompt = tokens(77, 4_000);
        let mut responses = Vec::new();
        for (turn, append) in [(0, 1_500), (1, 3_000), (2, 0)] {
            if turn > 0 {
                let held = (prompt.len() - append_of(turn - 1)) as u64 / 16 * 16;
                let c = &cluster;
                c.eventually("the previous turn's blocks to reach the router", || {
                    let prompt = &prompt;
                    async move {
                        let d = c.route(0, prompt).await?;
                        Ok(d["decode_overlap_tokens"].as_u64().unwrap_or(0) >= held)
                    }
                })
                .await?;
            }
            let response = cluster
                .complete(0, &format!("fetch-turn{turn}"), &prompt, ANSWER)
                .await?;
            prompt.extend(output(&response));
            prompt.extend(tokens(7_700 + turn as u64, append));
            responses.push(response);
        }
        let paths: Vec<&str> = responses.iter().map(path).collect();
        ensure!(
            paths == ["remote", "bypass", "remote_fetch"],
            "paths {paths:?}: {:?}",
            responses
                .iter()
                .map(|r| &r["switchyard"])
                .collect::<Vec<_>>()
        );
        let info = &responses[2]["switchyard"];
        ensure!(decode(&responses[2]) == "d0", "{info}");
        let reason = info["reason"].as_str().unwrap_or_default();
        ensure!(
            reason.contains("prefix fetched") && reason.contains("pulled from d0"),
            "{info}"
        );
        let p_held = info["prefill_overlap_tokens"]
            .as_u64()
            .context("p0's overlap")?;
        let d_held = info["decode_overlap_tokens"]
            .as_u64()
            .context("d0's overlap")?;
        ensure!(d_held >= p_held + 1_024, "{info}");

        // The prefill engine pulled d0's prefix with the handle d0's engine
        // exported for turn 2 (the whole blocks the router saw d0 hold),
        // and read exactly the prompt's tokens...
        let p0 = cluster.engine_debug("p0").await?;
        ensure!(
            p0["prefix_pulls_received"] == 1
                && p0["pulls_declined"] == 0
                && p0["pull_mismatches"] == 0,
            "p0's engine: {p0}"
        );
        let pull = &p0["last_pull_params"];
        let d0_id = cluster.worker("d0")?.engine_id.as_str();
        let pulled = pull["remote_num_tokens"].as_u64().unwrap_or(0);
        ensure!(
            pull["remote_engine_id"] == d0_id
                && pull["remote_request_id"]
                    .as_str()
                    .is_some_and(|id| id.contains("fetch-turn2"))
                && pull["do_remote_decode"] == true
                && pull["do_remote_prefill"] == false
                && pulled <= d_held
                && pulled + u64::from(BLOCK_SIZE) > d_held
                && pull["transfer_mode"] == "pull",
            "p0 got {pull}"
        );
        ensure!(p0["requests"]["prefill"] == 2, "p0's engine: {p0}");
        // ... and reported it cached once pulled (only the rest computed).
        let cached = responses[2]["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64();
        ensure!(
            cached.is_some_and(|c| c >= d_held - u64::from(BLOCK_SIZE)),
            "cached {cached:?} of {d_held} pulled: {}",
            responses[2]["usage"]
        );
        // The decode engine exported turn 2's prefix, and the decode legs
        // of turns 0 and 2 (vLLM exports every request that came with
        // transfer params; the bypass of turn 1 came with none); one was
        // read.
        let d0 = cluster.engine_debug("d0").await?;
        ensure!(
            d0["handles_exported"] == 3 && d0["handles_read"] == 1,
            "d0's engine: {d0}"
        );
        // The decode engine got p0's handoff both remote times.
        let p0_id = cluster.worker("p0")?.engine_id.as_str();
        ensure!(
            d0["kv_transfer_params_received"] == 2
                && d0["last_kv_transfer_params"]["remote_engine_id"] == p0_id,
            "d0's engine: {d0}"
        );
        // p0's agent counted the pull.
        let metrics = agent_metrics(&cluster, "p0").await?;
        ensure!(
            metrics.contains(r#"worker_agent_engine_prefix_fetches_total{outcome="pulled"} 1"#),
            "{metrics}"
        );
        // d0's agent had one export made and gave its handle.
        let metrics = agent_metrics(&cluster, "d0").await?;
        ensure!(
            metrics.contains(r#"worker_agent_kv_handle_queries_total{outcome="given"} 1"#)
                && metrics.contains("worker_agent_kv_export_recomputed_tokens_total"),
            "{metrics}"
        );

        // The decision log replays it: the fetch and its source reproduced.
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("window.syx");
        let file_arg = file.to_str().context("a UTF-8 path")?;
        let nats = cluster.nats.url();
        let login = cluster.nats_login(bus::permissions::REPLAY_USER);
        let mut export = vec!["export", "--nats", &nats, "--out", file_arg];
        export.extend(login.iter().map(String::as_str));
        run_replay(&export)?;
        let verify: Value =
            serde_json::from_str(&run_replay(&["verify", "--file", file_arg, "--json"])?)?;
        ensure!(
            verify["decisions"] == 3 && verify["reproduced"] == 3,
            "{verify}"
        );
        let explained: Value = serde_json::from_str(&run_replay(&[
            "explain",
            "fetch-turn2",
            "--file",
            file_arg,
            "--json",
        ])?)?;
        let fetch = &explained["explanation"]["fetch"];
        ensure!(
            fetch["source"] == "d0" && fetch["pulled_tokens"].as_u64() >= Some(1_024),
            "{explained}"
        );
        ensure!(explained["reproduced"] == true, "{explained}");
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}

/// The `/metrics` text of worker `name`'s agent.
async fn agent_metrics(cluster: &Cluster, name: &str) -> Result<String> {
    let url = format!("{}/metrics", cluster.worker(name)?.agent.url());
    Ok(cluster.http.get(url).send().await?.text().await?)
}

/// The tokens appended after turn `turn`'s answer.
fn append_of(turn: usize) -> usize {
    [1_500, 3_000][turn]
}

fn run_replay(args: &[&str]) -> Result<String> {
    let out = Command::new(tests::binary("replay")?)
        .args(args)
        .output()
        .context("running replay")?;
    ensure!(
        out.status.success(),
        "replay {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}
