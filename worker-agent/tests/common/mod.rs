//! Shared by the agent's integration tests (each uses a part of it): the
//! agent in a task, a follower of a worker's KV batches.
#![allow(dead_code)]

use std::time::Duration;

use anyhow::{ensure, Context, Result};
use bus::{Bus, StreamLimits};
use futures::stream::BoxStream;
use futures::StreamExt;
use protocol::{BlockHash, KvEvent, KvEventBatch, WorkerId};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio::time::timeout;
use worker_agent::{AgentError, BlockMirror, Options};

/// An agent running in a task until [`Agent::shutdown`].
pub struct Agent {
    task: JoinHandle<Result<(), AgentError>>,
    stop: Option<oneshot::Sender<()>>,
}

impl Agent {
    /// Starts an agent with `options` (which must be valid).
    pub fn start(options: Options) -> Self {
        let config = options.validate().expect("valid agent options");
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

/// Follows one worker's KV batches on JetStream: checks that each epoch
/// is later than the last and starts at seq 0 with `Cleared`, that seqs
/// are gap-free within an epoch, and that every `Stored` parent is held;
/// mirrors the blocks.
pub struct KvFollower {
    batches: BoxStream<'static, Result<KvEventBatch>>,
    /// How long [`KvFollower::next`] waits for a batch.
    wait: Duration,
    pub epoch: Option<u64>,
    next_seq: u64,
    pub mirror: BlockMirror,
    /// Every epoch seen, in order.
    pub epochs: Vec<u64>,
}

impl KvFollower {
    /// Follows `worker` from its first batch in the stream.
    pub async fn new(bus: &Bus, worker: &WorkerId, wait: Duration) -> Result<Self> {
        bus.ensure_streams(&StreamLimits::default()).await?;
        Ok(Self {
            batches: tests::fixtures::kv_batches(bus.client(), worker).await?,
            wait,
            epoch: None,
            next_seq: 0,
            mirror: BlockMirror::new(),
            epochs: Vec::new(),
        })
    }

    /// A follower fed by hand ([`KvFollower::check`]): it reads no stream.
    pub fn detached(wait: Duration) -> Self {
        Self {
            batches: futures::stream::empty().boxed(),
            wait,
            epoch: None,
            next_seq: 0,
            mirror: BlockMirror::new(),
            epochs: Vec::new(),
        }
    }

    /// The next batch, checked and mirrored.
    pub async fn next(&mut self) -> Result<KvEventBatch> {
        self.next_within(self.wait)
            .await?
            .context("waiting for a KV batch")
    }

    /// The next batch if one comes within `wait`, checked and mirrored.
    pub async fn next_within(&mut self, wait: Duration) -> Result<Option<KvEventBatch>> {
        let Ok(next) = timeout(wait, self.batches.next()).await else {
            return Ok(None);
        };
        let batch = next.context("the KV batch stream ended")??;
        self.check(&batch)?;
        Ok(Some(batch))
    }

    /// Checks `batch` follows the ones before (epochs rising, each from
    /// seq 0 with `Cleared`, seqs gap-free, parents known) and mirrors it.
    pub fn check(&mut self, batch: &KvEventBatch) -> Result<()> {
        if Some(batch.epoch) != self.epoch {
            if let Some(old) = self.epoch {
                ensure!(batch.epoch > old, "epoch {} after {old}", batch.epoch);
            }
            ensure!(
                batch.seq == 0,
                "epoch {} starts at seq {}",
                batch.epoch,
                batch.seq
            );
            ensure!(
                batch.events.first() == Some(&KvEvent::Cleared),
                "epoch {} starts with {:?}",
                batch.epoch,
                batch.events.first()
            );
            self.epoch = Some(batch.epoch);
            self.epochs.push(batch.epoch);
            self.next_seq = 0;
        }
        ensure!(
            batch.seq == self.next_seq,
            "seq {} where {} was due",
            batch.seq,
            self.next_seq
        );
        self.next_seq += 1;
        for event in &batch.events {
            if let KvEvent::Stored {
                parent: Some(p), ..
            } = event
            {
                ensure!(
                    self.mirror.contains(*p),
                    "stored under an unknown parent {p:?}"
                );
            }
            self.mirror.apply(std::slice::from_ref(event));
        }
        Ok(())
    }

    /// Reads batches until every block of `want` is held.
    pub async fn until_holding(&mut self, want: &[BlockHash]) -> Result<()> {
        while !want.iter().all(|h| self.mirror.contains(*h)) {
            self.next().await?;
        }
        Ok(())
    }
}
