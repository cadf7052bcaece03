//! rumble's core: everything that needs no GPU.
//!
//! In pipeline order: [`ir`] (traces, the builder, the text form, the verifier) ->
//! [`autodiff`] (VJP rules, joint and split traces) -> [`passes`] (trace-to-trace rewrites) ->
//! [`plan`] (lifetimes, one arena, LOAD) -> [`cost`] (predicted node times) -> [`compile`]
//! (the one entry point running passes, choices and the planner) -> [`cpu`] (the reference
//! backend and CPU executors).

pub mod autodiff;
pub mod compile;
pub mod cost;
pub mod cpu;
pub mod error;
pub mod ir;
pub mod passes;
pub mod plan;
pub mod testing;

pub use error::{Error, Result};
pub use ir::{DType, Graph, HeadLayout, Shape, Tensor, TensorType, Trace, ValueId};
