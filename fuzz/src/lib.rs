//! Every decoder of bytes that come from outside the process, as a fuzz
//! target: bus messages, engines' ZMQ streams, HTTP bodies, the replay file,
//! the engine's SSE and metrics text, traces; and the indexer fed arbitrary
//! (decodable) batches, checked against its own replica.
//!
//! A target is a plain function of bytes that panics only on a bug: a
//! decoder that panics, or an oracle that fails (a message that does not
//! survive re-encoding, a replica whose digest differs from the indexer's).
//! `scripts/fuzz` runs each under AFL++ (the `afl/` crate beside this one);
//! this crate's test runs each over its seeds and deterministic mutations of
//! them, so the targets build and hold in every `scripts/test`.

pub mod bus_message;
pub mod engine_stream;
pub mod http_body;
pub mod indexer;
pub mod input;
pub mod mutate;
pub mod prom_text;
pub mod replay_file;
pub mod sse;
pub mod trace;

/// One fuzz target: its name (the AFL binary's argument and the corpus
/// folder), the function under test, and its seeds.
#[derive(Debug, Clone, Copy)]
pub struct Target {
    pub name: &'static str,
    pub what: &'static str,
    pub run: fn(&[u8]),
    pub seeds: fn() -> Vec<Vec<u8>>,
}

/// The targets, one home.
pub const TARGETS: &[Target] = &[
    Target {
        name: "bus_message",
        what: "every protocol::Message off the bus (first byte picks the type); decodes, or re-encodes to itself",
        run: bus_message::run,
        seeds: bus_message::seeds,
    },
    Target {
        name: "engine_stream",
        what: "vLLM/SGLang ZMQ frames and batches through the agent's RankCore (decode, translate, sequence)",
        run: engine_stream::run,
        seeds: engine_stream::seeds,
    },
    Target {
        name: "http_body",
        what: "a completion request body (the token-id scanner and serde); scanned tokens equal serde's",
        run: http_body::run,
        seeds: http_body::seeds,
    },
    Target {
        name: "replay_file",
        what: "a replay export, raw and as checksummed frames of arbitrary payloads, read back into records",
        run: replay_file::run,
        seeds: replay_file::seeds,
    },
    Target {
        name: "indexer",
        what: "arbitrary KV batches of three workers into KvIndexer; its deltas on a replica and its snapshot give its digest",
        run: indexer::run,
        seeds: indexer::seeds,
    },
    Target {
        name: "sse",
        what: "an engine's SSE stream, fed whole and split at every cut the input names; the same events",
        run: sse::run,
        seeds: sse::seeds,
    },
    Target {
        name: "prom_text",
        what: "an engine's /metrics text into samples and the load read from them",
        run: prom_text::run,
        seeds: prom_text::seeds,
    },
    Target {
        name: "trace",
        what: "a Mooncake-format trace",
        run: trace::run,
        seeds: trace::seeds,
    },
];

/// The target of this name.
pub fn target(name: &str) -> Option<&'static Target> {
    TARGETS.iter().find(|t| t.name == name)
}
