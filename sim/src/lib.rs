//! Cluster simulator.
