//! Worker agent.
