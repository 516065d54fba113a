//! Workloads: what requests arrive, when, and what the next turn of a
//! conversation looks like once the previous one finished.

mod agentic;
mod mooncake;
mod scripted;
mod synthetic;

use std::sync::Arc;

pub use agentic::{Agentic, AgenticConfig, Compaction};
pub use mooncake::{Mooncake, MooncakeConfig};
pub use scripted::Scripted;
pub use synthetic::{Synthetic, SyntheticConfig};

/// When a conversation's later turns arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arrivals {
    /// A turn is issued only once its predecessor's last token arrived,
    /// plus the think time (a trace's gap between the two turns): what a
    /// real client does.
    #[default]
    ClosedLoop,
    /// Every request at its trace timestamp, answered or not (a trace
    /// replay only; an overloaded cluster then sees turn k+1 before turn
    /// k's answer exists).
    OpenLoop,
}

/// One request a workload issues.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    /// Unique within the run.
    pub id: u64,
    /// The conversation (session) it belongs to.
    pub session: u64,
    /// Its turn in the conversation, from 0.
    pub turn: u32,
    pub prompt: Arc<[u32]>,
    /// The tokens the simulated model will produce (known in advance, so
    /// that the next turn can contain them).
    pub output: Arc<[u32]>,
}

/// A request and when it arrives (virtual microseconds).
#[derive(Debug, Clone)]
pub struct Arrival {
    pub at_us: u64,
    pub request: RequestSpec,
}

/// A source of requests. Requests that arrive on their own (open-loop
/// arrivals, session starts) are pulled one at a time, in time order, so
/// that only in-flight requests are in memory; closed-loop workloads issue a
/// conversation's next turn when the previous one finished.
pub trait Workload: Send {
    /// The next request arriving on its own, or `None` when there is none.
    fn next_arrival(&mut self) -> Option<Arrival>;
    /// The follow-up of a finished (or failed) request, if any.
    fn on_finished(&mut self, request: &RequestSpec, now_us: u64) -> Option<Arrival>;
    /// When the last session or request starts arriving: the end of the
    /// measurement window.
    fn arrival_window_us(&self) -> u64;
}

/// Appends `n` pseudo-tokens derived from `seed` (the same seed always
/// gives the same tokens).
pub fn pseudo_tokens(seed: u64, n: usize, out: &mut Vec<u32>) {
    protocol::trace::extend_block_tokens(seed, n, out);
}

/// A seed for one piece of content: mixes a run seed with labels.
pub(crate) fn content_seed(parts: &[u64]) -> u64 {
    let bytes: Vec<u8> = parts.iter().flat_map(|p| p.to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}
