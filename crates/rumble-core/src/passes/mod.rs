//! Passes: `Trace -> Trace` rewrites, each saying what it did.
//!
//! - [`schedule`]: a memory-aware topological reorder that lowers LOAD;
//! - [`remat`]: recompute cheap forward values in the backward instead of saving them.

pub mod remat;
pub mod schedule;
