//! The ZMQ side of the adapter: the SUB socket on the engine's publisher
//! and one-shot DEALER replays. A thin shell: frames go to
//! [`super::sequence::RankCore`] untouched.
//!
//! # Why the pure-Rust `zeromq` crate
//!
//! The agent only needs SUB and DEALER over TCP against libzmq publishers
//! (vLLM and SGLang use pyzmq). The pure-Rust `zeromq` crate speaks ZMTP
//! 3 with the NULL mechanism, which libzmq PUB and ROUTER sockets accept,
//! builds in seconds and brings no C++ toolchain into the image; the
//! `zmq` crate would compile a bundled libzmq (about 45 s per profile,
//! CI builds two) for features the agent does not use (CURVE, ipc,
//! socket options tuning). The fixture tests run a pyzmq (libzmq)
//! publisher against this code, so the interoperability is tested.
//! What `zeromq` lacks is covered here: connection timeouts on every
//! connect, endpoints with `*` (which libzmq binds to every interface)
//! rewritten for a bind, and SUB reconnection delays (its own backoff,
//! 0.1 s doubling to 30 s) made visible through its monitor: a
//! reconnection makes the core rebuild from the engine's history.

use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::Instant;
use zeromq::{DealerSocket, Socket, SocketOptions, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use super::wire::{parse_replay, ReplayFrame};

/// The endpoint of data-parallel rank `rank`: the TCP port offset by the
/// rank, as vLLM and SGLang do.
pub fn offset_endpoint(endpoint: &str, rank: u32) -> Result<String, String> {
    if rank == 0 {
        return Ok(endpoint.to_owned());
    }
    let (base, port) = endpoint
        .rsplit_once(':')
        .ok_or_else(|| format!("endpoint {endpoint:?} has no port"))?;
    let port: u32 = port
        .parse()
        .map_err(|_| format!("endpoint {endpoint:?} has no numeric port"))?;
    let port = port + rank;
    if port > u32::from(u16::MAX) {
        return Err(format!(
            "endpoint {endpoint:?} offset by rank {rank} is past port 65535"
        ));
    }
    Ok(format!("{base}:{port}"))
}

/// Checks an endpoint the agent connects to: `tcp://host:port`.
pub fn check_connect_endpoint(endpoint: &str) -> Result<(), String> {
    let rest = endpoint
        .strip_prefix("tcp://")
        .ok_or_else(|| format!("endpoint {endpoint:?} is not tcp://host:port"))?;
    let (host, port) = rest
        .rsplit_once(':')
        .ok_or_else(|| format!("endpoint {endpoint:?} has no port"))?;
    if host.is_empty() || host == "*" {
        return Err(format!(
            "endpoint {endpoint:?}: the agent connects, so name the engine's host (e.g. tcp://127.0.0.1:5557)"
        ));
    }
    port.parse::<u16>()
        .map_err(|_| format!("endpoint {endpoint:?} has no valid port"))?;
    Ok(())
}

/// An endpoint to bind: libzmq's `*` (every interface) as `0.0.0.0`.
pub fn bind_endpoint(endpoint: &str) -> String {
    endpoint.replacen("tcp://*:", "tcp://0.0.0.0:", 1)
}

/// Connects a SUB socket to `endpoint` subscribed to `topic`, retrying
/// until `deadline`. The subscription reaches the publisher shortly after
/// this returns: what is published before is covered by the replay.
pub async fn connect_sub(
    endpoint: &str,
    topic: &str,
    deadline: Instant,
) -> Result<SubSocket, String> {
    loop {
        let mut options = SocketOptions::default();
        options.connect_timeout(Duration::from_secs(2));
        let mut sub = SubSocket::with_options(options);
        let last = match tokio::time::timeout(Duration::from_secs(3), sub.connect(endpoint)).await {
            Ok(Ok(())) => {
                tokio::time::timeout(Duration::from_secs(2), sub.subscribe(topic))
                    .await
                    .map_err(|_| format!("subscribing on {endpoint} timed out"))?
                    .map_err(|e| format!("subscribing on {endpoint}: {e}"))?;
                return Ok(sub);
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_owned(),
        };
        if Instant::now() >= deadline {
            return Err(format!("connecting to {endpoint}: {last}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// What a replay task reports.
#[derive(Debug)]
pub enum ReplayMsg {
    Batch { seq: u64, payload: Bytes },
    End,
    Failed(String),
}

/// Limits of one replay.
#[derive(Debug, Clone, Copy)]
pub struct ReplayLimits {
    pub connect: Duration,
    /// Longest wait for the next reply.
    pub idle: Duration,
    /// Longest replay overall.
    pub total: Duration,
}

/// Asks `endpoint` for every batch from `from` on, over a fresh DEALER
/// socket, and reports them on `out` (ending with `End` or `Failed`).
pub async fn replay(
    endpoint: String,
    from: u64,
    limits: ReplayLimits,
    out: mpsc::UnboundedSender<ReplayMsg>,
) {
    let result = replay_inner(&endpoint, from, limits, &out).await;
    let _ = out.send(match result {
        Ok(()) => ReplayMsg::End,
        Err(e) => ReplayMsg::Failed(format!("replay from {endpoint}: {e}")),
    });
}

async fn replay_inner(
    endpoint: &str,
    from: u64,
    limits: ReplayLimits,
    out: &mpsc::UnboundedSender<ReplayMsg>,
) -> Result<(), String> {
    let deadline = Instant::now() + limits.total;
    let mut options = SocketOptions::default();
    options.connect_timeout(limits.connect);
    let mut dealer = DealerSocket::with_options(options);
    tokio::time::timeout(limits.connect, dealer.connect(endpoint))
        .await
        .map_err(|_| "connecting timed out".to_owned())?
        .map_err(|e| format!("connecting: {e}"))?;
    // [empty delimiter, start seq]: the engine's ROUTER reads
    // [identity, delimiter, start].
    let mut request = ZmqMessage::from(Bytes::new());
    request.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
    tokio::time::timeout(limits.connect, dealer.send(request))
        .await
        .map_err(|_| "sending the request timed out".to_owned())?
        .map_err(|e| format!("sending the request: {e}"))?;
    loop {
        let wait = limits
            .idle
            .min(deadline.saturating_duration_since(Instant::now()));
        let message = tokio::time::timeout(wait, dealer.recv())
            .await
            .map_err(|_| format!("no reply within {wait:?}"))?
            .map_err(|e| format!("receiving: {e}"))?;
        let frames = message.into_vec();
        match parse_replay(&frames).map_err(|e| format!("bad reply: {e}"))? {
            ReplayFrame::End => return Ok(()),
            ReplayFrame::Batch { seq, payload } => {
                let payload = frames
                    .last()
                    .filter(|f| f.as_ref() == payload)
                    .cloned()
                    .unwrap_or_else(|| Bytes::copy_from_slice(payload));
                if out.send(ReplayMsg::Batch { seq, payload }).is_err() {
                    return Ok(());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints() {
        assert_eq!(offset_endpoint("tcp://h:5557", 0).unwrap(), "tcp://h:5557");
        assert_eq!(offset_endpoint("tcp://h:5557", 3).unwrap(), "tcp://h:5560");
        assert!(offset_endpoint("tcp://h", 1).is_err());
        assert!(offset_endpoint("tcp://h:65535", 1).is_err());
        assert!(check_connect_endpoint("tcp://127.0.0.1:5557").is_ok());
        assert!(check_connect_endpoint("tcp://*:5557").is_err());
        assert!(check_connect_endpoint("ipc:///tmp/x").is_err());
        assert!(check_connect_endpoint("tcp://h:port").is_err());
        assert_eq!(bind_endpoint("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bind_endpoint("tcp://127.0.0.1:1"), "tcp://127.0.0.1:1");
    }
}
