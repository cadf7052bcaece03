//! Codebase hygiene, checked inside `cargo test`: every Rust module of every crate opens with a
//! `//!` comment saying what it is for, and no test is `#[ignore]`d without a reason.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        if p.is_dir() {
            if p.file_name().is_some_and(|n| n != "target") {
                rust_files(&p, out);
            }
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn every_module_has_a_doc_comment_and_no_bare_ignores() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&crates, &mut files);
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
