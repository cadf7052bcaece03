//! Codebase hygiene, checked inside `cargo test`: every Rust module of every crate opens with a
//! `//!` comment saying what it is for, and no test is `#[ignore]`d without a reason.

use std::path::Path;

#[test]
fn every_module_has_a_doc_comment_and_no_bare_ignores() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let files = rumble_core::testing::rust_sources(&crates);
    assert!(files.len() > 10, "found only {} files under {}", files.len(), crates.display());
    let mut missing = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
        if !first.starts_with("//!") {
            missing.push(format!("{}: lacks a `//!` module comment", f.display()));
        }
        if text.lines().any(|l| l.trim() == "#[ignore]") {
            missing.push(format!("{}: `#[ignore]` without a reason", f.display()));
        }
    }
    assert!(missing.is_empty(), "{}", missing.join("\n"));
}
