//! The KV-event publisher, as vLLM's `ZmqEventPublisher`: a PUB socket
//! sending `[topic, seq, payload]` (seq counting from 0 per process) and a
//! ROUTER replay socket answering a start seq with every buffered batch
//! from it on, then the end marker (seq -1, empty payload).

use std::collections::VecDeque;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};
use worker_agent::vllm::wire::END_SEQ;
use zeromq::{PubSocket, RouterSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The last batches, for replays. Pure.
#[derive(Debug)]
pub struct ReplayBuffer {
    batches: VecDeque<(u64, Bytes)>,
    capacity: usize,
}

impl ReplayBuffer {
    pub fn new(capacity: usize) -> Self {
        Self {
            batches: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    pub fn push(&mut self, seq: u64, payload: Bytes) {
        if self.batches.len() == self.capacity {
            self.batches.pop_front();
        }
        self.batches.push_back((seq, payload));
    }

    /// Every buffered batch from `start` on.
    pub fn from(&self, start: u64) -> impl Iterator<Item = &(u64, Bytes)> {
        self.batches.iter().filter(move |(s, _)| *s >= start)
    }

    pub fn len(&self) -> usize {
        self.batches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }
}

/// How the publisher is set up.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// PUB endpoint to bind (`tcp://*:PORT`).
    pub endpoint: String,
    /// ROUTER endpoint to bind, if any.
    pub replay_endpoint: Option<String>,
    pub topic: String,
    pub buffer: usize,
    /// Put the topic frame in replay replies too (newer vLLM builds).
    pub replay_topic_frame: bool,
}

/// Binds the sockets (so that a bind error fails the start).
pub async fn bind(
    config: &PublisherConfig,
) -> Result<(PubSocket, Option<RouterSocket>), crate::Error> {
    let mut publisher = PubSocket::new();
    let endpoint = worker_agent::vllm::zmq::bind_endpoint(&config.endpoint);
    publisher
        .bind(&endpoint)
        .await
        .map_err(|e| crate::Error::Bind {
            what: "the KV event publisher",
            endpoint: endpoint.clone(),
            message: e.to_string(),
        })?;
    let router = match &config.replay_endpoint {
        Some(replay) => {
            let replay = worker_agent::vllm::zmq::bind_endpoint(replay);
            let mut router = RouterSocket::new();
            router.bind(&replay).await.map_err(|e| crate::Error::Bind {
                what: "the KV replay socket",
                endpoint: replay.clone(),
                message: e.to_string(),
            })?;
            Some(router)
        }
        None => None,
    };
    info!(
        endpoint,
        replay = config.replay_endpoint.as_deref().unwrap_or("none"),
        "KV events published"
    );
    Ok((publisher, router))
}

/// What the publisher loop waits for.
enum PubEvent {
    Stop,
    Batch(Option<Bytes>),
    Replay(zeromq::ZmqResult<ZmqMessage>),
}

/// Publishes the batches from `batches` until it closes or `stop`; the
/// number of batches published so far is sent on `published`.
pub async fn run(
    config: PublisherConfig,
    mut publisher: PubSocket,
    mut router: Option<RouterSocket>,
    mut batches: mpsc::Receiver<Bytes>,
    published: watch::Sender<u64>,
    mut stop: watch::Receiver<bool>,
) {
    let topic = Bytes::from(config.topic.clone().into_bytes());
    let mut buffer = ReplayBuffer::new(config.buffer);
    let mut seq = 0u64;
    loop {
        let event = tokio::select! {
            _ = stop.changed() => PubEvent::Stop,
            b = batches.recv() => PubEvent::Batch(b),
            r = async { router.as_mut().expect("guarded").recv().await }, if router.is_some() => PubEvent::Replay(r),
        };
        match event {
            PubEvent::Stop | PubEvent::Batch(None) => return,
            PubEvent::Batch(Some(payload)) => {
                let mut message = ZmqMessage::from(topic.clone());
                message.push_back(Bytes::copy_from_slice(&seq.to_be_bytes()));
                message.push_back(payload.clone());
                // A subscriber that does not read must not stall the engine:
                // like a PUB at its high-water mark, the batch is dropped
                // for it (the replay buffer still has it).
                match tokio::time::timeout(Duration::from_secs(1), publisher.send(message)).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => warn!(seq, error = %e, "publishing a KV batch failed"),
                    Err(_) => warn!(seq, "publishing a KV batch timed out"),
                }
                buffer.push(seq, payload);
                seq += 1;
                published.send_replace(seq);
            }
            PubEvent::Replay(Ok(request)) => {
                let frames = request.into_vec();
                // [identity, empty delimiter, start seq]
                let (identity, start) = match &frames[..] {
                    [identity, delimiter, start] if delimiter.is_empty() && start.len() == 8 => {
                        let start = u64::from_be_bytes(start[..].try_into().expect("8 bytes"));
                        (identity.clone(), start)
                    }
                    _ => {
                        warn!(frames = frames.len(), "an invalid replay request");
                        continue;
                    }
                };
                let Some(router) = router.as_mut() else {
                    continue;
                };
                let mut replies = 0;
                let mut failed = false;
                for (s, payload) in buffer.from(start) {
                    let mut reply = ZmqMessage::from(identity.clone());
                    reply.push_back(Bytes::new());
                    if config.replay_topic_frame {
                        reply.push_back(topic.clone());
                    }
                    reply.push_back(Bytes::copy_from_slice(&s.to_be_bytes()));
                    reply.push_back(payload.clone());
                    if !matches!(
                        tokio::time::timeout(Duration::from_secs(1), router.send(reply)).await,
                        Ok(Ok(()))
                    ) {
                        failed = true;
                        break;
                    }
                    replies += 1;
                }
                if failed {
                    warn!(start, "a replay could not be sent whole");
                    continue;
                }
                let mut end = ZmqMessage::from(identity);
                end.push_back(Bytes::new());
                if config.replay_topic_frame {
                    end.push_back(topic.clone());
                }
                end.push_back(Bytes::from_static(&END_SEQ));
                end.push_back(Bytes::new());
                let _ = tokio::time::timeout(Duration::from_secs(1), router.send(end)).await;
                debug!(start, replies, "replay served");
            }
            PubEvent::Replay(Err(e)) => {
                debug!(error = %e, "replay socket error");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_buffer_keeps_the_last_batches() {
        let mut b = ReplayBuffer::new(3);
        for s in 0..5 {
            b.push(s, Bytes::from(vec![s as u8]));
        }
        assert_eq!(b.len(), 3);
        assert_eq!(
            b.from(0).map(|(s, _)| *s).collect::<Vec<_>>(),
            vec![2, 3, 4]
        );
        assert_eq!(b.from(4).map(|(s, _)| *s).collect::<Vec<_>>(), vec![4]);
        assert_eq!(b.from(9).count(), 0);
    }
}
