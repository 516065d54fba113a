//! How our index is set up for a measurement.
//!
//! The services size the block table at start (`DEFAULT_RESERVE_BLOCKS`),
//! before any event arrives; that is the figure compared with the peers. An
//! empty index that grows its table as blocks arrive (each growth rebuilds
//! the table) is measured beside it and printed, but not compared.

use kv_indexer::{OwnershipIndex, DEFAULT_RESERVE_BLOCKS};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Setup {
    /// Reserved for `DEFAULT_RESERVE_BLOCKS`, as the kv-indexer and the
    /// routers start (untimed, like building a peer's index).
    Service,
    /// Empty, growing its table as it goes.
    Unreserved,
}

impl Setup {
    pub fn index(self) -> OwnershipIndex {
        let mut index = OwnershipIndex::new();
        if self == Setup::Service {
            index.reserve(DEFAULT_RESERVE_BLOCKS);
        }
        index
    }

    pub fn name(self) -> &'static str {
        match self {
            Setup::Service => "ours (OwnershipIndex)",
            Setup::Unreserved => "ours, unreserved (not compared)",
        }
    }
}
