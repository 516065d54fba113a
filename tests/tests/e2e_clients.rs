//! What others wrote, against our router with the shipped tokenizer: the
//! official `openai` Python client (`tests/clients/openai_client.py`) drives
//! a cluster of processes, with `$SWITCHYARD_PYTHON` (scripts/test makes a
//! venv with `openai` from scripts/requirements-test.txt); GuideLLM and
//! AIPerf smoke runs (`tests/clients/smoke_clients.py`) with
//! `$SWITCHYARD_CLIENTS_PYTHON` (scripts/clients makes their heavy venv from
//! scripts/requirements-clients.txt). Each skipped with a note without its
//! python.

mod cluster;

use anyhow::{ensure, Context, Result};
use cluster::{Cluster, Engine, Wire, MODEL};

/// `$SWITCHYARD_CLIENTS_PYTHON`, when it can import guidellm and aiperf.
fn python_with_benchmark_clients() -> Option<String> {
    let python = std::env::var("SWITCHYARD_CLIENTS_PYTHON")
        .ok()
        .filter(|p| !p.is_empty());
    let Some(python) = python else {
        eprintln!(
            "NOTE: SWITCHYARD_CLIENTS_PYTHON is not set: skipping the GuideLLM and AIPerf smoke runs \
             (scripts/clients runs them)"
        );
        return None;
    };
    let has_both = std::process::Command::new(&python)
        .args(["-c", "import guidellm, aiperf"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_both {
        eprintln!("NOTE: {python} lacks guidellm or aiperf: skipping their smoke runs");
        return None;
    }
    Some(python)
}

fn python_with_openai() -> Option<String> {
    let python = match std::env::var("SWITCHYARD_PYTHON") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            eprintln!(
                "NOTE: SWITCHYARD_PYTHON is not set: skipping the openai client test \
                 (scripts/test sets it from scripts/requirements-test.txt)"
            );
            return None;
        }
    };
    let has_openai = std::process::Command::new(&python)
        .args(["-c", "import openai"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_openai {
        eprintln!("NOTE: {python} has no `openai` package: skipping the openai client test");
        return None;
    }
    Some(python)
}

/// The router's flag for the shipped tokenizer (its chat template beside).
fn tokenizer_flag() -> String {
    format!("--tokenizer={}", tests::tokenizer::shipped().display())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_works_against_the_router() -> Result<()> {
    let Some(python) = python_with_openai() else {
        return Ok(());
    };
    let mut cluster = Cluster::start(&["p0"], &["d0", "d1"], 0).await?;
    cluster.start_router_with("r0", &[tokenizer_flag()])?;
    cluster.wait_ready().await?;
    run_openai_client(&python, &cluster, &[]).await
}

/// The same client on mock-vllm engines behind the vLLM adapter: several
/// choices, echo, and the engine's log-probabilities (mock-vllm's are
/// made up, deterministic) in the shapes the client parses.
#[tokio::test(flavor = "multi_thread")]
async fn the_official_openai_client_gets_logprobs_from_vllm_engines() -> Result<()> {
    let Some(python) = python_with_openai() else {
        return Ok(());
    };
    let vllm = Engine::MockVllm(Wire {
        encoding: "tagged",
        hash_flavour: "vllm",
        replay_topic_frame: true,
    });
    let mut cluster =
        Cluster::start_with(&[("p0", "prefill", vllm), ("d0", "decode", vllm)], 0).await?;
    cluster.start_router_with("r0", &[tokenizer_flag()])?;
    cluster.wait_ready().await?;
    run_openai_client(&python, &cluster, &["--engine", "vllm"]).await
}

/// Runs `clients/openai_client.py` against the cluster's first router; it
/// prints "all checks passed" when every check did.
async fn run_openai_client(python: &str, cluster: &Cluster, args: &[&str]) -> Result<()> {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/openai_client.py");
    let url = cluster.routers[0].url();
    let out = tokio::process::Command::new(python)
        .args([script, &url, MODEL])
        .args(args)
        .output()
        .await
        .context("running the openai client")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    ensure!(
        out.status.success() && stdout.contains("all checks passed"),
        "the openai client failed ({}):\n{stdout}\n{stderr}\n--- cluster logs ---\n{}",
        out.status,
        cluster.logs()
    );
    Ok(())
}

/// GuideLLM and AIPerf, 30 requests each in their default chat mode, with
/// no flag beyond the URL, the model and the tokenizer (and the count).
#[tokio::test(flavor = "multi_thread")]
async fn guidellm_and_aiperf_smoke_runs() -> Result<()> {
    let Some(python) = python_with_benchmark_clients() else {
        return Ok(());
    };
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/smoke_clients.py");
    let mut cluster = Cluster::start(&["p0"], &["d0", "d1"], 0).await?;
    cluster.start_router_with("r0", &[tokenizer_flag()])?;
    cluster.wait_ready().await?;
    let url = cluster.routers[0].url();
    let out_dir = tempfile::tempdir()?;
    let tokenizer = tests::tokenizer::shipped_dir();
    let out = tokio::process::Command::new(&python)
        .arg(script)
        .arg(&url)
        .arg(MODEL)
        .arg(&tokenizer)
        .arg(out_dir.path())
        .arg("30")
        .output()
        .await
        .context("running the smoke clients")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    eprintln!("{stdout}");
    ensure!(
        out.status.success() && stdout.contains("all checks passed"),
        "the smoke clients failed ({}):\n{stdout}\n{stderr}\n--- cluster logs ---\n{}",
        out.status,
        cluster.logs()
    );
    Ok(())
}
