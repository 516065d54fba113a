//! The limits on the exports an agent has its engine make for other
//! workers' prefill legs (the third path on vLLM's bidirectional
//! transfer): the service holds its answers to them
//! (`service/kv_handle.rs`), and the cluster simulator its modelled
//! exports (`sim --kv-export vllm-on-demand`).

use std::time::Duration;

/// How long an export may take on the source: within the asker's wait,
/// with room for the reply's trip. Dropped later, the engine's request is
/// aborted and nothing stays pinned for an asker that left.
pub const EXPORT_DEADLINE: Duration = Duration::from_millis(800);

/// Exports under way at once on one source; a query beyond them is
/// answered with none (`busy`): each is a request to the engine.
pub const MAX_EXPORTS: usize = 16;
