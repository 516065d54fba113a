//! GPU-free model of one inference worker.
//!
//! A sans-IO core: no clock, no threads, no sockets, no randomness. Time is
//! a parameter (`now_us`, microseconds), so the same engine runs inside the
//! discrete-event cluster simulator (virtual time) and behind a live worker
//! agent (real time, possibly sped up).
//!
//! What it models:
//! - **continuous batching** with chunked prefill under a per-step token
//!   budget, a cap on running requests, a FCFS waiting queue, and vLLM-style
//!   recompute preemption when the KV cache is full (module `scheduler`);
//! - a **paged KV cache with prefix caching**: full blocks are named by the
//!   canonical chained hash ([`protocol::BlockHasher`]), finished requests'
//!   blocks stay cached until evicted least-recently-used, and storing and
//!   evicting emit the [`protocol::KvEvent`]s a real engine would report
//!   (module `kv_cache`), plain: the worker agent numbers them into
//!   batches;
//! - **step time** from a cost model calibrated on public figures
//!   ([`cost`], [`preset`]);
//! - **roles**: prefill-only requests leave after their prefill, requests
//!   whose KV was transferred are admitted without prefill compute, local
//!   (bypass) requests prefill only what is not cached ([`Mode`]);
//! - the time to move KV between workers ([`KvTransfer`]), and the third
//!   path's two ends: a request whose prompt starts with a prefix another
//!   worker supplies ([`EngineRequest::pull_tokens`]) asks its caller to
//!   pull it when it reaches the queue's head ([`Step::pulls`],
//!   [`Engine::pull_done`]), and the worker supplying it pins it
//!   ([`Engine::pin_prefix`]), its steps slower while the read runs;
//! - an optional **host-memory tier** (G2, [`HostOffload`]): evicted device
//!   blocks are written to host (`Stored` with [`protocol::Tier::Host`]),
//!   host blocks evict least-recently-used (`Removed` on host), and a
//!   prefix found on host is read back over the host link before its
//!   request is admitted, instead of being recomputed.
//!
//! # Driving an engine
//!
//! ```
//! use std::sync::Arc;
//! use engine_sim::{Engine, EngineRequest, Mode, Preset, StepOutput};
//! use protocol::{KvEvent, Role, WorkerId};
//!
//! let config = Preset::llama8b_h100().engine_config(16);
//! let worker = WorkerId::new("decode-0", 0).unwrap();
//! let mut engine = Engine::new(worker, Role::Both, config).unwrap();
//! engine
//!     .submit(EngineRequest {
//!         id: 7,
//!         prompt: (0..100).collect::<Vec<u32>>().into(),
//!         output_tokens: Arc::from(vec![1, 2, 3]),
//!         mode: Mode::LocalPrefill,
//!         pull_tokens: 0,
//!     })
//!     .unwrap();
//! let mut now = 0;
//! let mut tokens = 0;
//! while let Some(step) = engine.step(now) {
//!     now = step.end_us(); // outputs take effect when the step ends
//!     for out in &step.outputs {
//!         if matches!(out, StepOutput::FirstToken { .. } | StepOutput::Token { .. }) {
//!             tokens += 1;
//!         }
//!     }
//!     for event in engine.take_kv_events() {
//!         // hand `event` to the worker agent's KV core
//!         assert!(matches!(event, KvEvent::Stored { .. }));
//!     }
//! }
//! assert_eq!(tokens, 3);
//! assert!(engine.is_idle());
//! assert_eq!(engine.cached_prefix_tokens(&(0..100).collect::<Vec<u32>>()), 96);
//! ```
//!
//! # API
//!
//! - [`Engine::new`]`(worker, role, config)`; configurations come
//!   from a [`Preset`] ([`Preset::engine_config`]`(block_size)`).
//! - [`Engine::submit`]`(request)` queues an [`EngineRequest`]; a mode the
//!   role does not serve, a duplicate id, an empty prompt or output, or a
//!   request that cannot fit the cache is a [`SubmitError`].
//! - [`Engine::step`]`(now_us)` plans and runs the next step and returns a
//!   [`Step`] (duration, [`StepOutput`]s) or `None` when idle. The driver
//!   applies the outputs at [`Step::end_us`] and calls `step` again no
//!   earlier.
//! - [`Engine::take_kv_events`] returns the events since the last call,
//!   unnumbered (no worker, epoch or seq: the agent's `KvCore` numbers
//!   them, in production and in the simulator alike).
//!   [`Engine::restart`] empties the cache, returns the dropped requests,
//!   and the next events start with [`protocol::KvEvent::Cleared`].
//! - [`Engine::load_report`]`(now_us)`, [`Engine::cached_prefix_tokens`],
//!   [`Engine::cached_blocks`], [`Engine::cached_block_links`],
//!   [`Engine::block_counts`],
//!   [`Engine::stats`], [`Engine::is_idle`].
//!
//! # Request lifecycle
//!
//! A [`Mode::LocalPrefill`] request is admitted with its longest cached
//! prefix (whole blocks; at least one prompt token is computed), prefills
//! the rest in chunks, reports [`StepOutput::FirstToken`] at the end of its
//! last chunk, then one [`StepOutput::Token`] per step and
//! [`StepOutput::Finished`] with its last token. A [`Mode::PrefillOnly`]
//! request reports [`StepOutput::PrefillDone`] instead of a first token and
//! leaves. A [`Mode::KvReceived`] request is admitted with its whole prompt's
//! KV present (its blocks are stored, only what was not cached here counts
//! as received), samples its first token in its first step and decodes.
//! Blocks filled by generated tokens are stored too, so the next turn of a
//! conversation can hit them. A preempted request ([`StepOutput::Preempted`])
//! later prefills its prompt and the tokens it produced, then resumes.

pub mod config;
pub mod cost;
pub mod engine;
pub mod error;
mod host_tier;
mod kv_cache;
pub mod preset;
pub mod request;
mod scheduler;
pub mod transfer;

pub use config::{EngineConfig, HostOffload};
pub use cost::{CostModel, StepWork};
pub use engine::{Engine, EngineStats, PinnedPrefix, Pull, Step, StepOutput};
pub use error::{ConfigError, SubmitError};
pub use kv_cache::BlockCounts;
pub use preset::{Preset, DEFAULT_BLOCK_SIZE};
pub use request::{EngineRequest, Mode};
pub use transfer::{KvTransfer, SharedLinks};
