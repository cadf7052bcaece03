//! The benchmark suite (bench/suite): its published configs span the geometries it promises and
//! parse with rumble's `Config` (or fail naming the key the suite marks as pending), and
//! `rumble bench --suite` runs its cases on the CPU with small overrides, one JSON line per case
//! carrying the FLOPs compare.py needs, an error line for a case it cannot run.

mod common;

use std::path::PathBuf;

use common::{lines, rumble};
use rumble_models::Config;
use serde_json::Value;

fn suite_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../bench/suite/suite.json")
}

fn cases() -> Vec<Value> {
    let text = std::fs::read_to_string(suite_file()).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    doc["cases"].as_array().unwrap().clone()
}

/// Reads a case's config with its `layers` override applied; `Err` carries the message.
fn config(case: &Value) -> Result<Config, String> {
    let path = suite_file().parent().unwrap().join(case["config"].as_str().unwrap()).join("config.json");
    let mut c = Config::from_file(&path).map_err(|e| e.to_string())?;
    if let Some(l) = case["layers"].as_u64() {
        c.num_hidden_layers = l as usize;
    }
    Ok(c)
}

/// Model FLOPs of a forward and backward, from the config's shapes (BENCHMARKS.md's formula,
/// written out per projection rather than from rumble's parameter list).
fn flops(c: &Config, batch: usize, seq: usize) -> f64 {
    let (h, kv, d, hid, inter) =
        (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.hidden_size, c.intermediate_size);
    let bias = if c.qkv_bias { (h + 2 * kv) * d } else { 0 };
    let layer = hid * h * d + 2 * hid * kv * d + h * d * hid + 3 * hid * inter + 2 * hid + bias;
    let body = (c.num_hidden_layers * layer + hid) as f64;
    let t = (batch * seq) as f64;
    6.0 * body * t
        + 6.0 * (hid * c.vocab_size) as f64 * t
        + 6.0 * (c.num_hidden_layers * h * d) as f64 * (seq * seq * batch) as f64
}

#[test]
fn suite_configs_parse_and_span_the_promised_geometries() {
    let cases = cases();
    assert!(cases.len() >= 8, "{} cases", cases.len());
    let mut parsed = Vec::new();
    for case in &cases {
        let name = case["name"].as_str().unwrap();
        match (config(case), case["pending"].as_str()) {
            (Ok(c), _) => parsed.push((c, case.clone())),
            // rumble does not read this key yet: the error must name it.
            (Err(e), Some(key)) => assert!(e.contains(&format!("`{key}`")), "{name}: {e}"),
            (Err(e), None) => panic!("{name}: {e}"),
        }
    }
    // Also over the pending cases: their published values, read as plain JSON.
    let all: Vec<Value> = cases
        .iter()
        .map(|c| {
            let p = suite_file().parent().unwrap().join(c["config"].as_str().unwrap()).join("config.json");
            serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
        })
        .collect();
    let num = |v: &Value, k: &str| v[k].as_u64().unwrap() as usize;
    let vocab: Vec<usize> = all.iter().map(|v| num(v, "vocab_size")).collect();
    let hidden: Vec<usize> = all.iter().map(|v| num(v, "hidden_size")).collect();
    assert!(vocab.iter().min() <= Some(&32_000) && vocab.iter().max() >= Some(&151_936), "{vocab:?}");
    assert!(hidden.iter().min() <= Some(&576) && hidden.iter().max() >= Some(&4096), "{hidden:?}");
    let heads: Vec<usize> = all
        .iter()
        .map(|v| {
            v["head_dim"].as_u64().map(|d| d as usize).unwrap_or(num(v, "hidden_size") / num(v, "num_attention_heads"))
        })
        .collect();
    assert!(heads.contains(&64) && heads.contains(&128), "{heads:?}");
    let gqa: Vec<usize> = all.iter().map(|v| num(v, "num_attention_heads") / num(v, "num_key_value_heads")).collect();
    assert!(gqa.contains(&1) && gqa.iter().any(|&g| g >= 7), "{gqa:?}");
    let tied: Vec<bool> = all.iter().map(|v| v["tie_word_embeddings"].as_bool().unwrap()).collect();
    assert!(tied.contains(&true) && tied.contains(&false));
    let (batch, seq): (Vec<u64>, Vec<u64>) =
        cases.iter().map(|c| (c["batch"].as_u64().unwrap(), c["seq"].as_u64().unwrap())).unzip();
    assert!(batch.contains(&1) && batch.contains(&8) && seq.contains(&512) && seq.contains(&4096));
    assert!(cases.iter().any(|c| c["layers"].is_u64()) && cases.iter().any(|c| c["layers"].is_null()));
    // Every config rumble reads is bf16, as the suite promises.
    for (c, case) in &parsed {
        assert_eq!(c.dtype, rumble_core::DType::BF16, "{}", case["name"]);
    }
}

/// One run of two cases: a case rumble refuses prints an error line naming the key, and the
/// suite goes on to time the next with the overrides, its FLOPs per step as BENCHMARKS.md counts.
#[test]
fn bench_suite_runs_on_the_cpu_with_overrides_and_reports_a_refused_case() {
    // The suite's own smollm2-135m case beside a case rumble refuses (an architecture it does
    // not read, marked pending), in a suite file of the test's own.
    let dir = common::tmp("suite", "refused");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("SmolLM2-135M")).unwrap();
    std::fs::create_dir_all(dir.join("Gemma")).unwrap();
    let real = suite_file().parent().unwrap().join("SmolLM2-135M/config.json");
    std::fs::copy(real, dir.join("SmolLM2-135M/config.json")).unwrap();
    let mut gemma: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("SmolLM2-135M/config.json")).unwrap()).unwrap();
    gemma["architectures"] = serde_json::json!(["GemmaForCausalLM"]);
    std::fs::write(dir.join("Gemma/config.json"), gemma.to_string()).unwrap();
    let own = serde_json::json!({"cases": [
        cases().into_iter().find(|c| c["name"] == "smollm2-135m").unwrap(),
        {"name": "gemma", "config": "Gemma", "batch": 1, "seq": 16, "pending": "architectures"},
    ]});
    let suite = dir.join("suite.json");
    std::fs::write(&suite, own.to_string()).unwrap();
    let refused = &own["cases"][1];
    let bad_name = "gemma";
    let name = "smollm2-135m";
    let filter = format!("{name},{bad_name}");
    let args = [
        "bench",
        "--suite",
        suite.to_str().unwrap(),
        "--suite-filter",
        &filter,
        "--layers",
        "1",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--json",
    ];
    let (ok, stdout, stderr) = rumble(&args);
    assert!(!ok, "one case failed: the exit status says so");
    assert!(stderr.contains("1 of 2 suite cases failed") && stderr.contains(bad_name), "{stderr}");
    let ls = lines(&stdout);
    assert_eq!(ls.len(), 2, "{stdout}");
    let line = |n: &str| ls.iter().find(|l| l["case"] == n).unwrap_or_else(|| panic!("no line for {n}: {stdout}"));

    let bad = line(bad_name);
    let key = refused["pending"].as_str().unwrap();
    assert!(bad["error"].as_str().is_some_and(|e| e.contains(&format!("`{key}`"))), "{bad}");
    assert_eq!(bad["pending"], key, "{bad}");

    let l = line(name);
    assert!(l["error"].is_null(), "{l}");
    assert_eq!(l["executor"], "rumble-cpu", "{l}");
    assert_eq!((l["batch"].as_u64(), l["seq"].as_u64(), l["layers"].as_u64()), (Some(2), Some(16), Some(1)), "{l}");
    assert_eq!(l["tokens"], 32, "{l}");
    let case = cases().into_iter().find(|c| c["name"] == name).unwrap();
    let mut c = config(&case).unwrap();
    c.num_hidden_layers = 1;
    let want = flops(&c, 2, 16);
    let got = l["flops_per_step"].as_f64().unwrap();
    assert!((got / want - 1.0).abs() < 1e-9, "{name}: flops {got} vs {want}");
    assert!(l["median_step_ms"].as_f64().is_some_and(|m| m > 0.0), "{l}");
    // Random weights and tokens: the loss is near ln(vocab).
    let loss = l["last_loss"].as_f64().unwrap();
    let ln_v = (c.vocab_size as f64).ln();
    assert!((loss - ln_v).abs() < 1.5, "{name}: loss {loss}, ln(vocab) {ln_v}");
}

#[test]
fn bad_suite_arguments_get_clear_errors() {
    let suite = suite_file();
    let s = suite.to_str().unwrap();
    let (ok, _, stderr) = rumble(&["bench", "--suite", s, "--suite-filter", "nope", "--device", "cpu"]);
    assert!(!ok && stderr.contains("no case `nope`") && stderr.contains("smollm2-135m"), "{stderr}");
    let (ok, _, stderr) = rumble(&["bench", "--suite", "/nonexistent/suite.json", "--device", "cpu"]);
    assert!(!ok && stderr.contains("/nonexistent/suite.json"), "{stderr}");
    let (ok, _, stderr) = rumble(&["bench", "small", "--suite", s, "--device", "cpu"]);
    assert!(!ok && stderr.contains("--suite"), "{stderr}");
    let dir = std::env::temp_dir().join(format!("rumble-suite-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("suite.json");
    std::fs::write(&bad, r#"{"cases": [{"name": "x", "config": "c", "batch": 0, "seq": 16}]}"#).unwrap();
    let (ok, _, stderr) = rumble(&["bench", "--suite", bad.to_str().unwrap(), "--device", "cpu"]);
    assert!(!ok && stderr.contains("case `x`") && stderr.contains("`batch`"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
