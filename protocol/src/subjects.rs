//! Every NATS subject, JetStream stream, object-store bucket and etcd key
//! prefix, defined once.

use crate::ids::WorkerId;

/// JetStream stream of every worker's [`crate::KvEventBatch`]es.
pub const KV_EVENTS_STREAM: &str = "SY_KV_EVENTS";
/// All KV-event subjects (the stream's filter).
pub const KV_EVENTS_ALL: &str = "sy.kv.events.>";

/// The kv-indexer's durable consumer of the KV-event stream, by default
/// (routers watch it to tell whether an indexer is running).
pub const KV_INDEXER_CONSUMER: &str = "kv-indexer";

/// The subject one worker publishes its KV events on.
pub fn kv_events(worker: &WorkerId) -> String {
    format!("sy.kv.events.{}", worker.subject_tokens())
}

/// Core NATS: every worker's [`crate::KvEventBatch`]es announced as its
/// agent forms them, outside every stream (the indexer's subscription).
/// The indexer applies an announced batch that is next in its worker's
/// order ahead of the stream, which stays the record: a KV-event stream
/// without a leader (an election, a full store) does not leave the index
/// behind the engines.
pub const KV_EVENTS_LIVE_ALL: &str = "sy.kv.live.>";

/// The subject one worker announces its KV batches on.
pub fn kv_events_live(worker: &WorkerId) -> String {
    format!("sy.kv.live.{}", worker.subject_tokens())
}

/// Core NATS: the indexer saw a gap in a worker's announced batches (its
/// connection moved to another NATS node, and announcements were lost
/// meanwhile): that worker's agent announces its batches after the
/// indexer's position again. The body is the position, as text
/// ([`kv_reannounce_body`]).
pub fn kv_reannounce(worker: &WorkerId) -> String {
    format!("sy.kv.reannounce.{}", worker.subject_tokens())
}

/// Every worker's [`kv_reannounce`] subject (the indexer's publish
/// permission).
pub const KV_REANNOUNCE_ALL: &str = "sy.kv.reannounce.*.*";

/// The body of a [`kv_reannounce`] request: the epoch and the last seq of
/// it the indexer holds, `"EPOCH SEQ"`.
pub fn kv_reannounce_body(epoch: u64, last_seq: u64) -> String {
    format!("{epoch} {last_seq}")
}

/// The position a [`kv_reannounce`] request names, or `None` when its body
/// is not `"EPOCH SEQ"`.
pub fn parse_kv_reannounce_body(body: &[u8]) -> Option<(u64, u64)> {
    let text = std::str::from_utf8(body).ok()?;
    let (epoch, seq) = text.trim().split_once(' ')?;
    Some((epoch.parse().ok()?, seq.parse().ok()?))
}

/// Message id of a KV batch: JetStream drops a republished batch within
/// the stream's duplicate window.
pub fn kv_batch_msg_id(worker: &WorkerId, epoch: u64, seq: u64) -> String {
    format!("kv.{}.{epoch}.{seq}", worker.subject_tokens())
}

/// The JetStream message id of a decision's log entry: a decision sent
/// again (its first write unconfirmed) is stored once.
pub fn decision_msg_id(decision: &crate::DecisionId) -> String {
    format!("decision.{decision}")
}

/// JetStream stream of the indexer's canonical [`crate::IndexDelta`]s. The
/// stream sequence of delta `n` is `n`: the indexer publishes each delta
/// expecting the stream's last sequence to be `n - 1`, which also fences
/// off a second indexer.
pub const INDEX_DELTAS_STREAM: &str = "SY_INDEX_DELTAS";
pub const INDEX_DELTAS: &str = "sy.index.deltas";
/// The same deltas on core NATS, outside every stream, sent as they are
/// made (and again while the stream does not confirm them): a router
/// follows them ahead of the stream, which stays the record it checks them
/// against, so an election of the stream's leader does not stop routing on
/// a current index.
pub const INDEX_DELTAS_LIVE: &str = "sy.index.live";
/// Core NATS, no body: a router that missed announcements (its connection
/// moved to another NATS node) asks the indexer to announce the deltas the
/// stream has not confirmed yet again.
pub const INDEX_REANNOUNCE: &str = "sy.index.reannounce";

/// Object-store bucket of [`crate::IndexSnapshot`]s.
pub const SNAPSHOT_BUCKET: &str = "sy-index-snapshots";
/// The stream JetStream keeps the snapshot bucket in (`OBJ_` + bucket).
pub const SNAPSHOT_STREAM: &str = "OBJ_sy-index-snapshots";
/// Object name of the newest snapshot.
pub const SNAPSHOT_LATEST: &str = "latest";

/// Request/reply: overlap queries answered by the indexer.
pub const INDEX_OVERLAP: &str = "sy.index.overlap";

/// Request/reply: the indexer's [`crate::IndexStatus`] (position, digest).
pub const INDEX_STATUS: &str = "sy.index.status";
/// Answered by the leading kv-indexer from its election on (by a task of
/// its own, whatever its loop is doing): a standby asks it, and NATS's "no
/// responders" three times running tells it the leader is gone before the
/// leader's etcd lease runs out.
pub const INDEX_LEADER: &str = "sy.index.leader";

/// Core NATS: load reports (not persisted).
pub const LOAD_ALL: &str = "sy.load.>";

pub fn load(worker: &WorkerId) -> String {
    format!("sy.load.{}", worker.subject_tokens())
}

/// JetStream stream of every replica's [`crate::DecisionRecord`]s: the
/// decision log.
pub const DECISIONS_STREAM: &str = "SY_DECISIONS";
pub const DECISIONS_ALL: &str = "sy.decisions.>";

pub fn decisions(replica: &str) -> String {
    format!("sy.decisions.{replica}")
}

/// Core NATS: [`crate::RequestProgress`] of dispatched requests, for every
/// replica's in-flight ledger.
pub const PROGRESS_ALL: &str = "sy.progress.>";

pub fn progress(replica: &str) -> String {
    format!("sy.progress.{replica}")
}

/// Core NATS: every router replica's [`crate::RouterHeartbeat`]s.
pub const ROUTER_HEARTBEATS_ALL: &str = "sy.routers.*.heartbeat";

/// The subject one router replica says it is alive (or leaving) on.
pub fn router_heartbeat(replica: &str) -> String {
    format!("sy.routers.{replica}.heartbeat")
}

/// Request/reply: generation requests served by a worker's agent.
pub fn generate(worker: &WorkerId) -> String {
    format!("sy.worker.{}.generate", worker.subject_tokens())
}

/// Every worker's generate subject (a router's publish permission).
pub const GENERATE_ALL: &str = "sy.worker.*.*.generate";

/// Core NATS: [`crate::CancelRequest`]s for the requests a worker serves.
pub fn cancel(worker: &WorkerId) -> String {
    format!("sy.worker.{}.cancel", worker.subject_tokens())
}

/// Every worker's cancel subject (a router's publish permission).
pub const CANCEL_ALL: &str = "sy.worker.*.*.cancel";

/// Request/reply: a liveness probe of a worker's agent, answered with an
/// empty message while it serves (also while it drains). A router probes
/// the worker of a quiet leg: "no responders" means the agent is gone, and
/// the leg fails at once instead of at its timeout. A probe may name the
/// leg (`LegProbe`): the agent answers whether it still serves it.
pub fn ping(worker: &WorkerId) -> String {
    format!("sy.worker.{}.ping", worker.subject_tokens())
}

/// Every worker's ping subject (a router's publish permission).
pub const PING_ALL: &str = "sy.worker.*.*.ping";

/// Request/reply: ask a worker's agent to publish its full block set again.
pub fn resync(worker: &WorkerId) -> String {
    format!("sy.worker.{}.resync", worker.subject_tokens())
}

/// Every worker's resync subject (the indexer's publish permission).
pub const RESYNC_ALL: &str = "sy.worker.*.*.resync";

/// Request/reply: a [`crate::KvHandleQuery`] to a worker's agent (from
/// the agent of a prefill worker about to pull a prefix from it).
pub fn kv_handle(worker: &WorkerId) -> String {
    format!("sy.worker.{}.kv_handle", worker.subject_tokens())
}

/// Every worker's KV-handle subject (an agent's publish permission).
pub const KV_HANDLE_ALL: &str = "sy.worker.*.*.kv_handle";

/// etcd: one key per registered worker, under the worker's lease.
pub const ETCD_WORKERS_PREFIX: &str = "/switchyard/workers/";

pub fn etcd_worker_key(worker: &WorkerId) -> String {
    format!("{ETCD_WORKERS_PREFIX}{}", worker.subject_tokens())
}

/// etcd: the highest KV epoch each worker's agent used (no lease: it
/// outlives the agent), so that a restarted agent starts a later epoch
/// even when the clock went back.
pub const ETCD_EPOCHS_PREFIX: &str = "/switchyard/epochs/";

pub fn etcd_epoch_key(worker: &WorkerId) -> String {
    format!("{ETCD_EPOCHS_PREFIX}{}", worker.subject_tokens())
}

/// etcd: the kv-indexers' leader election (etcd's election API; each
/// candidate's key is this prefix, a slash and its lease). Only the leader
/// consumes KV events and publishes deltas.
pub const ETCD_INDEXER_ELECTION: &str = "/switchyard/election/kv-indexer";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reannounce_body_reads_back_and_garbage_does_not() {
        let body = kv_reannounce_body(1_796_532_255_513, 42);
        assert_eq!(
            parse_kv_reannounce_body(body.as_bytes()),
            Some((1_796_532_255_513, 42))
        );
        for bad in [&b""[..], b"1", b"1 x", b"x 1", b"1 2 3", b"\xff 1", b"-1 2"] {
            assert_eq!(parse_kv_reannounce_body(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn worker_subjects_always_carry_the_rank() {
        let w = WorkerId::new("d0", 0).unwrap();
        assert_eq!(kv_events(&w), "sy.kv.events.d0.0");
        assert_eq!(
            generate(&WorkerId::new("d0", 2).unwrap()),
            "sy.worker.d0.2.generate"
        );
        assert!(kv_events(&w).starts_with(KV_EVENTS_ALL.trim_end_matches('>')));
        assert!(load(&w).starts_with(LOAD_ALL.trim_end_matches('>')));
        // The wildcards match the per-worker subjects, token for token.
        let matches = |pattern: &str, subject: &str| {
            let (p, s): (Vec<_>, Vec<_>) =
                (pattern.split('.').collect(), subject.split('.').collect());
            p.len() == s.len() && p.iter().zip(&s).all(|(p, s)| *p == "*" || p == s)
        };
        assert!(matches(GENERATE_ALL, &generate(&w)));
        assert!(matches(CANCEL_ALL, &cancel(&w)));
        assert!(matches(RESYNC_ALL, &resync(&w)));
        assert!(matches(PING_ALL, &ping(&w)));
        assert!(matches(ROUTER_HEARTBEATS_ALL, &router_heartbeat("r0")));
        assert_eq!(SNAPSHOT_STREAM, format!("OBJ_{SNAPSHOT_BUCKET}"));
    }
}
