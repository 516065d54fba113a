//! Shared by the agent's integration tests (each uses a part of it).
#![allow(dead_code)]

use std::time::Duration;

use anyhow::{Context, Result};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use worker_agent::{AgentError, Config};

/// An agent running in a task until [`Agent::shutdown`].
pub struct Agent {
    task: JoinHandle<Result<(), AgentError>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Agent {
    pub fn start(config: Config) -> Self {
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(worker_agent::run(config, async {
            let _ = stopped.await;
        }));
        Self {
            task,
            stop: Some(stop),
        }
    }

    /// Waits (at most `wait`) for the agent to end on its own: its outcome.
    pub async fn outcome(self, wait: Duration) -> Result<Result<(), AgentError>> {
        Ok(timeout(wait, self.task).await??)
    }

    /// Ends the agent's task at once, as a crash would: no deregistration.
    pub fn kill(&self) {
        self.task.abort();
    }

    /// Stops the agent and waits (at most `wait`) for it to end cleanly.
    pub async fn shutdown(mut self, wait: Duration) -> Result<()> {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        timeout(wait, &mut self.task)
            .await??
            .context("the agent failed")?;
        Ok(())
    }
}
