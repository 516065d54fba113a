//! What others wrote, against our router: the official `openai` Python
//! client (`tests/clients/openai_client.py`) drives a cluster of processes.
//! Runs with `$SWITCHYARD_PYTHON` (scripts/test makes a venv with `openai`
//! from scripts/requirements-test.txt); skipped with a note without it.

mod cluster;

use anyhow::{ensure, Context, Result};
use cluster::{Cluster, MODEL};

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
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/clients/openai_client.py");
    let mut cluster = Cluster::start(&["p0"], &["d0", "d1"], 0).await?;
    cluster.start_router_with("r0", &[tokenizer_flag()])?;
    cluster.wait_ready().await?;
    let url = cluster.routers[0].url();
    let out = tokio::process::Command::new(&python)
        .args([script, &url, MODEL])
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
