//! Data-parallel training (issue 20): one training-step trace becomes `world` rank traces that
//! exchange gradients through collective ops.
//!
//! [`buckets`] plans which gradients are reduced together.

pub mod buckets;

pub use buckets::{Bucket, GradSpec, Member, plan_buckets};
