//! Agentic load on the routers: `loadgen agentic` as a child process for
//! a fixed time, its JSON summary parsed into what a fault cost.

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// What a load window got: every turn sent, answered or not.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOutcome {
    pub sent: u64,
    pub ok: u64,
    /// Turns that got an error (an HTTP status or a broken stream).
    pub failed: u64,
    /// Failed turns that got no answer before the request timeout.
    pub hung: u64,
    /// Failed turns answered 5xx with no JSON error naming the problem.
    pub unclear_5xx: u64,
    /// Sends of a turn again through the other router (loadgen's
    /// `client_retries`: no response, a 429 or 503 with `Retry-After`, or
    /// a broken stream).
    pub client_retries: u64,
    /// Of those, turns sent again from the start after their stream was
    /// cut once the response began (their router died).
    pub streams_resent: u64,
    /// The first errors, as loadgen wrote them.
    pub first_errors: Vec<String>,
}

/// The load's settings: sessions arrive at `sessions_per_s` (workload
/// time, run `time_scale` times faster) for `duration`.
#[derive(Debug, Clone)]
pub struct Load {
    pub sessions_per_s: f64,
    pub duration: Duration,
    pub time_scale: f64,
    pub max_output_tokens: u32,
    pub request_timeout: Duration,
    pub seed: u64,
}

impl Default for Load {
    fn default() -> Self {
        Self {
            sessions_per_s: 1.0,
            duration: Duration::from_secs(8),
            time_scale: 4.0,
            max_output_tokens: 32,
            request_timeout: Duration::from_secs(20),
            seed: 1,
        }
    }
}

impl Load {
    /// Starts the load against `routers` (base URLs); the task's result is
    /// its outcome once every session ended.
    pub fn start(
        &self,
        routers: &[String],
    ) -> Result<tokio::task::JoinHandle<Result<LoadOutcome>>> {
        let mut command = tokio::process::Command::new(tests::binary("loadgen")?);
        command
            .arg("agentic")
            .arg(format!("--routers={}", routers.join(",")))
            .arg(format!("--sessions-per-s={}", self.sessions_per_s))
            .arg(format!("--duration-s={}", self.duration.as_secs_f64()))
            .arg(format!("--time-scale={}", self.time_scale))
            .arg(format!("--max-output-tokens={}", self.max_output_tokens))
            .arg(format!(
                "--request-timeout-s={}",
                self.request_timeout.as_secs().max(1)
            ))
            .arg(format!("--seed={}", self.seed))
            .env("RUST_LOG", "error")
            .kill_on_drop(true);
        Ok(tokio::spawn(async move {
            let output = command.output().await.context("running loadgen")?;
            ensure!(
                output.status.success(),
                "loadgen failed ({}): {}",
                output.status,
                String::from_utf8_lossy(&output.stderr)
            );
            let stdout = String::from_utf8_lossy(&output.stdout);
            let line = stdout
                .lines()
                .rev()
                .find(|l| l.trim_start().starts_with('{'))
                .context("loadgen printed no summary")?;
            parse_summary(&serde_json::from_str(line)?)
        }))
    }
}

/// The outcome in loadgen's summary (`turns`, `errors`, `first_errors`).
/// Hung and unclear turns are counted from the errors loadgen lists (the
/// first five): a lower bound when more failed.
pub fn parse_summary(summary: &Value) -> Result<LoadOutcome> {
    let ok = summary["turns"].as_u64().context("summary without turns")?;
    let failed = summary["errors"]
        .as_u64()
        .context("summary without errors")?;
    let first_errors: Vec<String> = summary["first_errors"]
        .as_array()
        .map(|e| {
            e.iter()
                .filter_map(|e| e.as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default();
    let client_retries = summary["client_retries"].as_u64().unwrap_or(0);
    let streams_resent = summary["retried"]["broken_stream"].as_u64().unwrap_or(0);
    let hung = first_errors
        .iter()
        .filter(|e| e.contains("timed out") || e.contains("operation timed out"))
        .count() as u64;
    let unclear_5xx = first_errors
        .iter()
        .filter(|e| e.contains("HTTP 5") && !e.contains("\"error\""))
        .count() as u64;
    Ok(LoadOutcome {
        sent: ok + failed,
        ok,
        failed,
        hung,
        unclear_5xx,
        client_retries,
        streams_resent,
        first_errors,
    })
}
