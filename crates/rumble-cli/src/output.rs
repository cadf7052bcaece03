//! Standard output and error without panics. `println!` panics when stdout is closed
//! (`rumble train --json | head -1`) or full (`> /dev/full`); here a failed stdout write is an
//! error the caller handles (`train` stops and keeps its checkpoint), and notes on stderr are
//! best effort: a closed stderr is ignored, never a panic.

use std::fmt::Display;
use std::io::Write;
use std::path::Path;

use rumble_models::{ModelError, Result};

/// The name stdout goes by in errors.
pub const STDOUT: &str = "<stdout>";

/// Writes `s` and a newline to stdout, flushed.
pub fn line(s: impl Display) -> Result<()> {
    text(format_args!("{s}\n"))
}

/// Writes `s` to stdout as it is, flushed.
pub fn text(s: impl Display) -> Result<()> {
    let mut out = std::io::stdout().lock();
    write!(out, "{s}").and_then(|_| out.flush()).map_err(|e| ModelError::io(STDOUT, e))
}

/// Whether `e` is stdout closed by its reader (EPIPE): the reader wanted no more, so the
/// command ends quietly with success.
pub fn is_broken_pipe(e: &ModelError) -> bool {
    matches!(e, ModelError::Io { path, source }
        if path == Path::new(STDOUT) && source.kind() == std::io::ErrorKind::BrokenPipe)
}

/// A line on stderr; a failure to write it is ignored.
#[macro_export]
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($arg)*);
    }};
}

/// `println!` that returns the stdout error instead of panicking: `outln!("{x}")?`.
#[macro_export]
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::output::line(format_args!($($arg)*))
    };
}
