//! ARCHITECTURE.md's table of environment variables lists exactly the `RUMBLE_*` variables the
//! code reads: every `"RUMBLE_..."` string literal in the Rust sources under `crates/` (what
//! `std::env::var` and `Knobs` are given) is a row of the table, every row is still read
//! somewhere, and every variable `Knobs` reads is a row that says so.

use std::collections::BTreeSet;
use std::path::Path;

/// The names of the `"RUMBLE_[A-Z0-9_]+"` string literals in `text`.
fn literals(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for (i, _) in text.match_indices("\"RUMBLE_") {
        let rest = &text[i + 1..];
        let end =
            rest.find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')).unwrap_or(rest.len());
        if rest[end..].starts_with('"') && !rest[..end].ends_with('_') {
            found.insert(rest[..end].to_string());
        }
    }
    found
}

#[test]
fn every_variable_read_is_in_the_architecture_table() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let Ok(doc) = std::fs::read_to_string(root.join("ARCHITECTURE.md")) else {
        println!("skipped: ARCHITECTURE.md is not on this machine (a test binary built elsewhere)");
        return;
    };
    let section =
        doc.split("## Environment variables").nth(1).expect("ARCHITECTURE.md: no 'Environment variables' section");
    // Table rows: | `RUMBLE_X` | read by | effect |
    let rows: Vec<(String, String)> = section
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix("`RUMBLE_")?.strip_suffix('`')?;
            Some((format!("RUMBLE_{name}"), cells.get(2)?.to_string()))
        })
        .collect();
    let table: BTreeSet<String> = rows.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(table.len(), rows.len(), "ARCHITECTURE.md lists a variable twice");

    let files = rumble_core::testing::rust_sources(&root.join("crates"));
    let mut read = BTreeSet::new();
    for f in &files {
        read.extend(literals(&std::fs::read_to_string(f).unwrap()));
    }
    let missing: Vec<_> = read.difference(&table).collect();
    let stale: Vec<_> = table.difference(&read).collect();
    assert!(missing.is_empty(), "read in the code but not in ARCHITECTURE.md's table: {missing:?}");
    assert!(stale.is_empty(), "in ARCHITECTURE.md's table but read nowhere: {stale:?}");
    for v in rumble_cuda::knobs::VARIABLES {
        let by = rows.iter().find(|(n, _)| n == v).map(|(_, by)| by.as_str());
        assert_eq!(by, Some("cuda `Knobs`"), "{v}: the table should say `Knobs` reads it");
    }
    println!("{} variables, all in the table", read.len());
}

#[test]
fn literals_are_found_whole() {
    // (Spelt with `@` for the prefix, so that this file holds no such literal itself.)
    let text = r#"var("@A_1") "@B=1" "@ATTN_" x @C "@D""#.replace('@', "RUMBLE_");
    let found: Vec<String> = literals(&text).into_iter().collect();
    assert_eq!(found, ["@A_1".replace('@', "RUMBLE_"), "@D".replace('@', "RUMBLE_")]);
}
