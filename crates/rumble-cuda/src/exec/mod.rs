//! executors
