//! Router replicas' presence on the bus: each one says it is alive every
//! heartbeat period and that it leaves when it stops, so that its peers
//! release the ledger reservations of its decisions within seconds of a
//! crash or a stop, instead of after the ledger's TTL.

use serde::{Deserialize, Serialize};

/// Published by a router replica on [`crate::subjects::router_heartbeat`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RouterHeartbeat {
    /// The replica's id (also the subject's last token).
    pub replica: String,
    /// Whether the replica is alive or leaving.
    pub state: Presence,
    /// The replica's heartbeat period (ms): a peer that hears nothing for a
    /// few periods takes the replica for dead.
    pub every_ms: u64,
    /// The replica's clock when sent (for logs; peers use their own).
    pub at_ms: u64,
}

/// What a [`RouterHeartbeat`] says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Presence {
    /// Serving; its reservations stand.
    Alive,
    /// Stopping after its drain: every reservation it still holds in a
    /// peer's ledger is void.
    Leaving,
}
