//! The one error type of the core crate. Every variant names what went wrong and where:
//! the op and its argument types, the node, the line of text, the file or the key.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An op was applied to arguments of the wrong shape or dtype (build time).
    #[error("{op}({args}): {msg}")]
    Op { op: String, args: String, msg: String },

    /// The verifier found a malformed trace.
    #[error("invalid trace `{trace}` at {at}: {msg}")]
    Verify { trace: String, at: String, msg: String },

    /// The text form could not be read.
    #[error("parse error, line {line}: {msg}\n    {text}")]
    Parse { line: usize, text: String, msg: String },

    /// Autodiff was asked for something it cannot do.
    #[error("autodiff: {0}")]
    Autodiff(String),

    /// A kernel met bad data at run time (an index out of range, a missing input).
    #[error("{op}: {msg}")]
    Runtime { op: String, msg: String },

    /// A backend lacks an op or a dtype.
    #[error("{backend} backend does not support {what}")]
    Unsupported { backend: String, what: String },

    /// A memory plan or its execution is wrong.
    #[error("plan: {0}")]
    Plan(String),

    #[error("{path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },

    #[error("{0}")]
    Msg(String),
}

impl Error {
    pub fn msg(m: impl Into<String>) -> Self {
        Error::Msg(m.into())
    }
    pub fn runtime(op: impl Into<String>, msg: impl Into<String>) -> Self {
        Error::Runtime { op: op.into(), msg: msg.into() }
    }
}

/// `bail!("...")` returns an `Error::Msg` from the enclosing function.
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::Error::Msg(format!($($arg)*))) };
}
