//! GPU-free model of one inference worker.
