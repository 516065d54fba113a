//! KV indexer.
