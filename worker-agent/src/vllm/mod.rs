//! The real-engine adapter: vLLM (and SGLang) behind the agent's
//! [`crate::Engine`] trait (`worker-agent --engine vllm|sglang`).
//!
//! # KV events
//!
//! The engine publishes its KV-cache events on a ZMQ PUB socket
//! (`--kv-events-config '{"enable_kv_cache_events": true, "publisher":
//! "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'`)
//! as `[topic, seq, msgpack batch]`. The agent subscribes
//! (`--kv-events-endpoint tcp://ENGINE:5557`, `--kv-replay-endpoint
//! tcp://ENGINE:5558`, `--kv-events-topic`), with the ports offset by its
//! `--dp-rank` as the engine offsets them per data-parallel rank (one agent
//! and one worker identity, `name.rank`, per rank).
//!
//! - [`wire`] decodes frames, batches (array or map envelope) and events
//!   (tagged arrays or tagged maps; trailing defaults omitted; unknown keys
//!   ignored; hashes as u64, i64 or bytes).
//! - [`translate`] turns the engine's private block hashes into the
//!   router's canonical chained hashes (the dual key: own hash from the
//!   event's tokens and the parent's mapped hash; a map engine hash -> own
//!   hash for removals), tiers from `medium`, `AllBlocksCleared`.
//! - [`sequence`] orders batches: history from the replay socket at start
//!   (PUB/SUB drops what is published before the subscription reaches the
//!   publisher; the agent waits for nothing, it reads the engine's replay
//!   buffer from seq 0 and holds live batches meanwhile), gaps recovered by
//!   replay or else resynchronised (a new epoch with the translator's
//!   block set), engine restarts (a sequence going backwards: a new, empty
//!   epoch), unknown parents (a rebuild from the engine's history), and,
//!   when the SUB socket stays quiet (`--kv-idle-check`), a check of
//!   the replay socket for batches published after the last one seen (the
//!   ones a late subscription missed from an engine that went idle).
//! - [`zmq`] is the socket shell (the pure-Rust `zeromq` crate; why: see
//!   there).
//!
//! # Registration
//!
//! At start the adapter waits for the engine's API (`--engine-url`,
//! `/v1/models`, up to `--engine-startup-timeout`), and registers the
//! worker with the model the engine serves and the engine's block size:
//! mock-vllm says it at `/switchyard/config`; vLLM exports it as a label
//! of `vllm:cache_config_info` on `/metrics`; otherwise the deployment's
//! `--block-size` is assumed and checked against every `BlockStored`'s
//! `block_size`. A model or block size that differs from the deployment's
//! is refused at registration; a `BlockStored` of another block size
//! later stops the agent with a clear error (logged, counted in
//! `worker_agent_contract_refusals_total{reason="block_size"}`).
//!
//! # Load
//!
//! `/metrics` is scraped every `--engine-metrics-interval` ([`prom`]):
//! running and waiting requests, KV usage (`vllm:kv_cache_usage_perc`, or
//! the older `vllm:gpu_cache_usage_perc`) times the capacity. What the
//! engine does not export comes from the agent's own requests in flight:
//! prompt tokens still to prefill, blocks of decoding requests.
//!
//! # Generation
//!
//! Requests go to `/v1/completions` with the prompt as token ids
//! ([`openai`]): local (bypass) requests streamed as they are; a prefill
//! with `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode":
//! true}`, whose response's `kv_transfer_params` travel to the decode
//! worker (as JSON in `KvTransferParams.engine`), which sends them back to
//! its engine with `do_remote_prefill: true` (vLLM's NIXL connector).
//! Errors come back as `Failed`: unreachable, timeouts, 5xx, 408 and 429
//! retryable, other 4xx not. Streamed chunks must carry token ids
//! (`"return_token_ids": true`, newer vLLM; mock-vllm): an engine that
//! streams text only still finishes its requests, but no token ids reach
//! the router (counted).
//!
//! The third path (`--vllm-bidirectional-kv`, vLLM's bidirectional NIXL
//! transfer): when a prefill worker's agent asks for a prefix, the engine
//! is asked to export it (a one-token request of it with
//! `kv_transfer_params`), and the handle it returns goes to that agent,
//! whose prefill request sends it as its `kv_transfer_params`
//! (`proxy.rs`).
//!
//! # SGLang
//!
//! `--engine sglang` decodes SGLang's variant of the events (signed i64
//! hashes of the first 8 bytes of its SHA-256 chain, envelope `[ts,
//! events, attn_dp_rank]`, tagged maps with extra keys such as
//! `cache_salt` and `session_id`) and its metric names, and serves local
//! (bypass) requests. SGLang's own disaggregation handshake (bootstrap
//! host and room sent to both servers) is not implemented: remote legs on
//! an SGLang worker fail, not retryable. Note that a decode-mode SGLang
//! server cannot prefill locally, so bypass needs an aggregated-capable
//! decode server; and its page size must be the deployment's block size.

mod connect;
pub mod engine;
mod kv_task;
mod load;
pub mod openai;
pub mod prom;
mod proxy;
pub mod recent;
pub mod sequence;
pub mod translate;
pub mod wire;
pub mod zmq;

pub use engine::{EngineKind, VllmConfig, VllmEngine, VllmError};
pub use zmq::ReplayLimits;
