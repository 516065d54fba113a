//! Least privilege on the bus: the nats-server configuration of one user
//! per role, each allowed only the subjects its role needs, from the
//! subjects of [`protocol::subjects`] (so the two cannot drift apart).
//!
//! - An agent (`agent-NAME-RANK`, one per worker) publishes only its own
//!   worker's KV events and load (and may create only the KV-event
//!   stream), subscribes only to its own generate,
//!   cancel, resync and ping subjects, and answers only the requests it was sent
//!   (`allow_responses`).
//! - The indexer alone publishes deltas and snapshots (and administers the
//!   streams); it answers status and overlap queries and asks agents to
//!   resync.
//! - Routers alone publish generation requests, cancels, liveness probes
//!   of agents, decisions, progress and their heartbeats; they read the deltas, snapshots and decision log.
//! - `replay` only reads the logs and asks the indexer's status.
//!
//! Everyone subscribes only to its own inbox (`_INBOX.USER.>`, the prefix
//! [`crate::NatsAuth::inbox_prefix`] derives from the user): no one reads
//! another role's replies, which carry prompts and completions. A client
//! without credentials is refused.
//!
//! `deploy/nats/switchyard.conf` is this configuration for the workers of
//! `docker-compose.yml` and `scripts/dev`, passwords read from
//! `SWITCHYARD_NATS_PASSWORD_*` variables (`nats-conf` writes it for other
//! workers).

use std::fmt::Write as _;

use protocol::{subjects, WorkerId};

/// The user name of the indexer.
pub const INDEXER_USER: &str = "indexer";
/// The user name every router replica shares.
pub const ROUTER_USER: &str = "router";
/// The user name of the `replay` tool.
pub const REPLAY_USER: &str = "replay";

/// The user name of a worker's agent: `agent-NAME-RANK`.
pub fn agent_user(worker: &WorkerId) -> String {
    format!("agent-{}", worker.subject_tokens().replace('.', "-"))
}

/// The inbox prefix of a user: its replies arrive under it, and only it
/// may subscribe there.
pub fn inbox_prefix(user: &str) -> String {
    format!("_INBOX.{user}")
}

/// The variable the shipped configuration reads a user's password from:
/// `SWITCHYARD_NATS_PASSWORD_AGENT_DECODE_0_0`.
pub fn password_variable(user: &str) -> String {
    format!(
        "SWITCHYARD_NATS_PASSWORD_{}",
        user.replace(['-', '.'], "_").to_ascii_uppercase()
    )
}

/// Where the configuration takes each user's password from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passwords<'a> {
    /// `$SWITCHYARD_NATS_PASSWORD_USER`: nats-server reads the variable.
    FromEnvironment,
    /// One literal password for every user (tests).
    Literal(&'a str),
}

/// How long an agent may keep answering one request, and with how many
/// messages (a generation streams a chunk per step).
const RESPONSE_MAX_MSGS: u32 = 1_000_000;
const RESPONSE_EXPIRES: &str = "1h";

/// JetStream API subjects every reader of the streams needs: stream info,
/// creating missing streams (the streams' names are fixed, so a role can
/// create only Switchyard's), and its own consumers.
fn stream_reader_api(streams: &[&str]) -> Vec<String> {
    let mut allow = vec![
        "$JS.API.INFO".to_owned(),
        "$JS.API.STREAM.INFO.*".to_owned(),
        "$JS.API.STREAM.NAMES".to_owned(),
    ];
    for stream in streams {
        allow.extend([
            format!("$JS.API.CONSUMER.CREATE.{stream}"),
            format!("$JS.API.CONSUMER.CREATE.{stream}.>"),
            format!("$JS.API.CONSUMER.DURABLE.CREATE.{stream}.*"),
            format!("$JS.API.CONSUMER.INFO.{stream}.*"),
            format!("$JS.API.CONSUMER.DELETE.{stream}.*"),
            format!("$JS.API.CONSUMER.MSG.NEXT.{stream}.*"),
            format!("$JS.API.STREAM.MSG.GET.{stream}"),
            format!("$JS.API.DIRECT.GET.{stream}"),
            format!("$JS.API.DIRECT.GET.{stream}.>"),
        ]);
    }
    // Flow control of ordered consumers.
    allow.push("$JS.FC.>".to_owned());
    allow
}

/// Creating the streams that are missing (what every service does at
/// start; the indexer then sets their limits).
fn stream_creator_api() -> Vec<String> {
    [
        subjects::KV_EVENTS_STREAM,
        subjects::INDEX_DELTAS_STREAM,
        subjects::DECISIONS_STREAM,
    ]
    .iter()
    .map(|stream| format!("$JS.API.STREAM.CREATE.{stream}"))
    .collect()
}

fn snapshot_stream() -> String {
    format!("OBJ_{}", subjects::SNAPSHOT_BUCKET)
}

/// One user's permissions.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Permissions {
    publish: Vec<String>,
    subscribe: Vec<String>,
    /// Answers to requests it was sent.
    responds: bool,
}

fn agent(worker: &WorkerId) -> Permissions {
    let mut publish = vec![
        subjects::kv_events(worker),
        subjects::kv_events_live(worker),
        subjects::load(worker),
        // A prefill leg's query for the KV handle of the decode worker
        // it pulls a prefix from.
        subjects::KV_HANDLE_ALL.to_owned(),
    ];
    publish.extend([
        "$JS.API.INFO".to_owned(),
        format!("$JS.API.STREAM.INFO.{}", subjects::KV_EVENTS_STREAM),
        format!("$JS.API.STREAM.CREATE.{}", subjects::KV_EVENTS_STREAM),
    ]);
    Permissions {
        publish,
        subscribe: vec![
            subjects::generate(worker),
            subjects::cancel(worker),
            subjects::resync(worker),
            subjects::ping(worker),
            subjects::kv_handle(worker),
            subjects::kv_reannounce(worker),
            format!("{}.>", inbox_prefix(&agent_user(worker))),
        ],
        responds: true,
    }
}

fn indexer() -> Permissions {
    let bucket = subjects::SNAPSHOT_BUCKET;
    Permissions {
        publish: vec![
            subjects::INDEX_DELTAS.to_owned(),
            subjects::INDEX_DELTAS_LIVE.to_owned(),
            // A standby's probe of the leader.
            subjects::INDEX_LEADER.to_owned(),
            // Requests to announce their recent KV batches again.
            subjects::KV_REANNOUNCE_ALL.to_owned(),
            // Resync requests to any agent.
            subjects::RESYNC_ALL.to_owned(),
            // The streams' administrator: limits, consumers, trimming, the
            // snapshot bucket.
            "$JS.API.>".to_owned(),
            format!("$JS.ACK.{}.>", subjects::KV_EVENTS_STREAM),
            format!("$O.{bucket}.>"),
            "$JS.FC.>".to_owned(),
        ],
        subscribe: vec![
            subjects::INDEX_OVERLAP.to_owned(),
            subjects::INDEX_STATUS.to_owned(),
            subjects::INDEX_LEADER.to_owned(),
            subjects::INDEX_REANNOUNCE.to_owned(),
            subjects::KV_EVENTS_LIVE_ALL.to_owned(),
            format!("{}.>", inbox_prefix(INDEXER_USER)),
        ],
        responds: true,
    }
}

fn router() -> Permissions {
    let mut publish = vec![
        subjects::GENERATE_ALL.to_owned(),
        subjects::CANCEL_ALL.to_owned(),
        subjects::PING_ALL.to_owned(),
        subjects::ROUTER_HEARTBEATS_ALL.to_owned(),
        subjects::DECISIONS_ALL.to_owned(),
        subjects::PROGRESS_ALL.to_owned(),
        subjects::INDEX_STATUS.to_owned(),
        subjects::INDEX_OVERLAP.to_owned(),
        subjects::INDEX_REANNOUNCE.to_owned(),
    ];
    publish.extend(stream_creator_api());
    // Whether an indexer is pulling KV events (readiness).
    publish.push(format!(
        "$JS.API.CONSUMER.INFO.{}.{}",
        subjects::KV_EVENTS_STREAM,
        subjects::KV_INDEXER_CONSUMER
    ));
    publish.extend(stream_reader_api(&[
        subjects::INDEX_DELTAS_STREAM,
        subjects::DECISIONS_STREAM,
        &snapshot_stream(),
    ]));
    Permissions {
        publish,
        subscribe: vec![
            subjects::LOAD_ALL.to_owned(),
            subjects::PROGRESS_ALL.to_owned(),
            subjects::ROUTER_HEARTBEATS_ALL.to_owned(),
            subjects::INDEX_DELTAS_LIVE.to_owned(),
            format!("{}.>", inbox_prefix(ROUTER_USER)),
        ],
        responds: false,
    }
}

fn replay() -> Permissions {
    let mut publish = vec![subjects::INDEX_STATUS.to_owned()];
    publish.extend(stream_reader_api(&[
        subjects::KV_EVENTS_STREAM,
        subjects::INDEX_DELTAS_STREAM,
        subjects::DECISIONS_STREAM,
        &snapshot_stream(),
    ]));
    Permissions {
        publish,
        subscribe: vec![format!("{}.>", inbox_prefix(REPLAY_USER))],
        responds: false,
    }
}

/// The nats-server configuration (an `authorization` block) of the
/// indexer, the routers, `replay` and one agent per worker of `agents`.
pub fn nats_server_config(agents: &[WorkerId], passwords: Passwords<'_>) -> String {
    let mut users: Vec<(String, Permissions)> = vec![
        (INDEXER_USER.to_owned(), indexer()),
        (ROUTER_USER.to_owned(), router()),
        (REPLAY_USER.to_owned(), replay()),
    ];
    users.extend(agents.iter().map(|w| (agent_user(w), agent(w))));

    let mut out = String::from(
        "# Switchyard's users and their subject permissions (bus::permissions; regenerate with\n\
         # `cargo run -p bus --bin nats-conf -- WORKER...`). Clients without credentials are refused.\n\
         authorization {\n  users = [\n",
    );
    for (user, permissions) in users {
        let password = match passwords {
            Passwords::FromEnvironment => format!("${}", password_variable(&user)),
            Passwords::Literal(password) => format!("{password:?}"),
        };
        let _ = writeln!(
            out,
            "    {{\n      user: {user:?}\n      password: {password}"
        );
        let _ = writeln!(out, "      permissions: {{");
        let _ = writeln!(
            out,
            "        publish: {{ allow: {} }}",
            list(&permissions.publish)
        );
        let _ = writeln!(
            out,
            "        subscribe: {{ allow: {} }}",
            list(&permissions.subscribe)
        );
        if permissions.responds {
            let _ = writeln!(
                out,
                "        allow_responses: {{ max: {RESPONSE_MAX_MSGS}, expires: {RESPONSE_EXPIRES:?} }}"
            );
        }
        let _ = writeln!(out, "      }}\n    }}");
    }
    out.push_str("  ]\n}\n");
    out
}

fn list(subjects: &[String]) -> String {
    let quoted: Vec<String> = subjects.iter().map(|s| format!("{s:?}")).collect();
    format!("[{}]", quoted.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(name: &str) -> WorkerId {
        WorkerId::new(name, 0).unwrap()
    }

    #[test]
    fn an_agent_publishes_only_its_own_worker_and_handle_queries() {
        let d0 = agent(&worker("d0"));
        assert!(d0.publish.contains(&"sy.kv.events.d0.0".to_owned()));
        assert!(d0.publish.contains(&"sy.load.d0.0".to_owned()));
        assert!(d0.publish.contains(&"sy.kv.live.d0.0".to_owned()));
        // Of other workers' subjects, only the KV-handle queries (a
        // prefill leg asking its source for the blocks it pulls).
        assert!(d0
            .publish
            .iter()
            .filter(|s| s.as_str() != subjects::KV_HANDLE_ALL)
            .all(|s| !s.contains('>')
                && !s.contains('*')
                && !s.starts_with("sy.index")
                && !s.starts_with("sy.worker")));
        assert!(d0
            .subscribe
            .iter()
            .all(|s| s.contains("d0.0") || s.starts_with("_INBOX.agent-d0-0.")));
    }

    #[test]
    fn only_the_indexer_publishes_deltas_and_snapshots() {
        for permissions in [router(), replay(), agent(&worker("d0"))] {
            assert!(!permissions
                .publish
                .iter()
                .any(|s| s == subjects::INDEX_DELTAS
                    || s == subjects::INDEX_DELTAS_LIVE
                    || s.starts_with("$O.")
                    || s == "$JS.API.>"));
        }
        for subject in [subjects::INDEX_DELTAS, subjects::INDEX_DELTAS_LIVE] {
            assert!(indexer().publish.contains(&subject.to_owned()));
        }
    }

    #[test]
    fn the_shipped_configuration_is_this_one() {
        let shipped = include_str!("../../deploy/nats/switchyard.conf");
        assert_eq!(
            shipped,
            nats_server_config(&shipped_workers(), Passwords::FromEnvironment),
            "deploy/nats/switchyard.conf is out of date: regenerate it with \
             `cargo run -p bus --bin nats-conf -- {}`",
            shipped_workers()
                .iter()
                .map(|w| w.to_string())
                .collect::<Vec<_>>()
                .join(" ")
        );
    }

    /// The agents of docker-compose.yml and scripts/dev.
    fn shipped_workers() -> Vec<WorkerId> {
        [
            "prefill-0",
            "decode-0",
            "decode-1",
            "decode-2",
            "vllm-prefill-0",
            "vllm-decode-0",
            "vllm-decode-1",
        ]
        .map(worker)
        .to_vec()
    }
}
