//! Fuzzing of the readers of user files: each reader takes arbitrary bytes and must return
//! (`Ok` or a clear error), never panic, hang or wrap an size. Readers are listed once in
//! [`READERS`] (config.json, safetensors, JSONL data, tokenizer.json): adding one is one line
//! there.
//!
//! In CI: `proptest` runs a few hundred cases a reader (arbitrary bytes, and mutations of valid
//! seeds). Long runs, with a mutation loop for a set time (run in the dev profile so arithmetic
//! overflow panics instead of wrapping):
//!
//! ```text
//! RUMBLE_FUZZ_SECS=600 RUMBLE_FUZZ_READER=config cargo test -p rumble-cli --test fuzz_readers \
//!     fuzz_for_a_while -- --nocapture
//! ```
//!
//! A panicking input is written to `target/fuzz-crash-READER-N.bin` before the test fails.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::time::{Duration, Instant};

use proptest::prelude::*;
use rumble_core::cpu::Rng;
use rumble_models::data::packed::parse_jsonl;
use rumble_models::{Config, Dataset, Tokenizer, Validation, Weights, guard, preset, weights};

/// A reader: its name, the function run on the bytes, and valid seed inputs to mutate.
struct Reader {
    name: &'static str,
    run: fn(&[u8]),
    seeds: fn() -> Vec<Vec<u8>>,
}

const READERS: &[Reader] = &[
    Reader { name: "config", run: read_config, seeds: config_seeds },
    Reader { name: "safetensors", run: read_safetensors, seeds: safetensors_seeds },
    Reader { name: "jsonl", run: read_jsonl, seeds: jsonl_seeds },
    Reader { name: "tokenizer", run: read_tokenizer, seeds: tokenizer_seeds },
];

/// The fine-tuning fixture (a model folder with a BPE tokenizer.json, and JSONL data).
fn fixture(name: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/finetune").join(name)
}

/// The fixture folder's tokenizer, read once.
fn bpe() -> &'static Tokenizer {
    static TOK: std::sync::OnceLock<Tokenizer> = std::sync::OnceLock::new();
    TOK.get_or_init(|| Tokenizer::from_folder(&fixture("model")).unwrap())
}

/// JSONL data: parse the records, then tokenize, split (a validation fraction) and pack them
/// into windows through bytes and through the fixture's BPE tokenizer, and draw batches.
fn read_jsonl(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(docs) = parse_jsonl(text, Path::new("fuzz.jsonl")) else { return };
    for (tok, vocab) in [(&Tokenizer::bytes(), 256), (bpe(), bpe().vocab_size())] {
        let val = Validation::Fraction(0.25);
        if let Ok(mut d) = Dataset::new(docs.clone(), "fuzz.jsonl", &val, tok, 4, vocab, 1) {
            for _ in 0..3 {
                let b = d.train.next_batch(2);
                assert_eq!((b.tokens.len(), b.targets.len()), (8, 8));
            }
            if let Some(v) = &d.val {
                let _ = v.all_batches(2);
            }
        }
    }
}

fn jsonl_seeds() -> Vec<Vec<u8>> {
    let data = std::fs::read_to_string(fixture("data.jsonl")).unwrap();
    let head: String = data.lines().take(12).map(|l| format!("{l}\n")).collect();
    vec![
        head.into_bytes(),
        b"{\"prompt\": \"Q: 2+2?\\n\", \"response\": \"4\"}\n\n{\"text\": \"caf\\u00e9 \\ud83d\\ude00\"}\n".to_vec(),
        b"{\"text\": \"\"}\n{\"prompt\": \"\", \"response\": \"x\", \"extra\": [1, {}]}\n".to_vec(),
    ]
}

/// tokenizer.json bytes: read them (no special-token files beside them), then encode and
/// decode a few texts.
fn read_tokenizer(bytes: &[u8]) {
    let Ok(t) = Tokenizer::from_bytes(bytes, Path::new("/nonexistent-fuzz-dir/tokenizer.json")) else { return };
    for text in ["", "The capital of Peru is Lima.", "caf\u{e9} \u{1f600} \0 <s></s>"] {
        if let Ok(ids) = t.encode(text, true) {
            let _ = t.decode(&ids, false);
            let _ = t.decode(&ids, true);
        }
    }
    let _ = t.decode(&[0, 1, 2, u32::MAX], false);
}

fn tokenizer_seeds() -> Vec<Vec<u8>> {
    vec![
        std::fs::read(fixture("model/tokenizer.json")).unwrap(),
        br#"{"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"[UNK]": 0, "the": 1, "capital": 2}, "unk_token": "[UNK]"}}"#
            .to_vec(),
    ]
}

/// config.json text: parse, validate and, when small, build the model's forward trace (which
/// checks every size the config leads to).
fn read_config(bytes: &[u8]) {
    let Ok(text) = std::str::from_utf8(bytes) else { return };
    let Ok(cfg) = Config::from_json_str(text, "fuzz.json") else { return };
    let _ = cfg.num_params();
    let _ = cfg.check_step_sizes(usize::MAX, 2, 1);
    let _ = cfg.check_step_sizes(3, 1 << 40, 1);
    if cfg.checked_num_params().is_some_and(|n| n <= 1 << 20) && cfg.num_hidden_layers <= 2 {
        let _ = rumble_models::build_forward(&cfg, 1, 4, rumble_models::Objective::CausalLm, true);
    }
}

fn config_seeds() -> Vec<Vec<u8>> {
    let mut seeds: Vec<Vec<u8>> =
        ["tiny", "seed-qwen2"].iter().map(|p| preset(p).unwrap().config.to_json_string().into_bytes()).collect();
    seeds.push(
        br#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 16, "intermediate_size": 32,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "dtype": "bfloat16",
            "tie_word_embeddings": true}"#
            .to_vec(),
    );
    seeds
}

/// safetensors bytes: parse, then scan every tensor for non-finite values.
fn read_safetensors(bytes: &[u8]) {
    if let Ok(tensors) = weights::parse_safetensors(bytes, Path::new("fuzz.safetensors")) {
        for (_, t) in &tensors {
            let _ = guard::first_non_finite(t);
        }
    }
}

fn safetensors_seeds() -> Vec<Vec<u8>> {
    static SEEDS: std::sync::OnceLock<Vec<Vec<u8>>> = std::sync::OnceLock::new();
    SEEDS.get_or_init(make_safetensors_seeds).clone()
}

fn make_safetensors_seeds() -> Vec<Vec<u8>> {
    let text = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4, "intermediate_size": 4,
        "num_hidden_layers": 1, "num_attention_heads": 2, "head_dim": 2}"#;
    let cfg = Config::from_json_str(text, "seed.json").unwrap();
    let w = Weights::init(&cfg, 1).unwrap();
    // One folder per thread: the proptest cases and the timed run may make seeds at once.
    let dir =
        std::env::temp_dir().join(format!("rumble-fuzz-seed-{}-{:?}", std::process::id(), std::thread::current().id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    w.save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
    vec![bytes]
}

/// Values a mutation splices in: sizes at the edges of 31, 32, 62 and 64 bits, odd numbers.
const INTERESTING: &[&str] = &[
    "0",
    "-1",
    "1",
    "2147483648",
    "4294967296",
    "4611686018427387904",
    "18446744073709551615",
    "18446744073709551616",
    "1e308",
    "-1e308",
    "NaN",
    "null",
    "true",
    "\"\"",
    "[]",
    "{}",
    "0.0",
    "1e-320",
    "9007199254740993",
];

/// One random change of `input`: bit flips, byte runs, interesting numbers, cuts and copies.
fn mutate(rng: &mut Rng, input: &[u8], seeds: &[Vec<u8>]) -> Vec<u8> {
    let mut v = input.to_vec();
    for _ in 0..1 + rng.below(4) {
        let n = v.len();
        match rng.below(8) {
            0 if n > 0 => {
                let i = rng.below(n);
                v[i] ^= 1 << rng.below(8);
            }
            1 if n > 0 => {
                let i = rng.below(n);
                v[i] = rng.below(256) as u8;
            }
            2 => {
                // Replace a run of digits (a JSON number) or any point with an interesting value.
                let at = if n > 0 { rng.below(n) } else { 0 };
                let start = (0..=at).rev().find(|&i| i == 0 || !v[i - 1].is_ascii_digit()).unwrap_or(at);
                let end = (at..n).find(|&i| !v[i].is_ascii_digit()).unwrap_or(n).max(start);
                let s = INTERESTING[rng.below(INTERESTING.len())].as_bytes();
                v.splice(start..end, s.iter().copied());
            }
            3 if n > 0 => {
                let a = rng.below(n);
                let b = (a + 1 + rng.below(64)).min(n);
                v.drain(a..b);
            }
            4 if n > 0 => {
                let a = rng.below(n);
                let b = (a + 1 + rng.below(64)).min(n);
                let chunk = v[a..b].to_vec();
                let at = rng.below(n);
                v.splice(at..at, chunk);
            }
            5 => v.truncate(if n > 0 { rng.below(n) } else { 0 }),
            6 if !seeds.is_empty() => {
                // Splice a piece of another seed.
                let s = &seeds[rng.below(seeds.len())];
                if !s.is_empty() {
                    let a = rng.below(s.len());
                    let b = (a + 1 + rng.below(128)).min(s.len());
                    let at = if n > 0 { rng.below(n) } else { 0 };
                    v.splice(at..at, s[a..b].iter().copied());
                }
            }
            _ if n >= 8 => {
                // safetensors' header length (the first 8 bytes) set to an edge value.
                let len = [0u64, 1, 7, (n as u64).saturating_sub(8), n as u64, u64::MAX, 1 << 32][rng.below(7)];
                v[..8].copy_from_slice(&len.to_le_bytes());
            }
            _ => v.push(rng.below(256) as u8),
        }
    }
    v
}

/// Runs `reader` on `input`; on a panic, keeps the input and fails.
fn run_one(reader: &Reader, input: &[u8], case: u64) {
    if catch_unwind(AssertUnwindSafe(|| (reader.run)(input))).is_err() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
        let path = dir.join(format!("fuzz-crash-{}-{case}.bin", reader.name));
        let _ = std::fs::write(&path, input);
        panic!("reader `{}` panicked on case {case}; input kept in {}", reader.name, path.display());
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn readers_take_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        for r in READERS {
            run_one(r, &bytes, 0);
        }
    }

    #[test]
    fn readers_take_mutated_seeds(seed in any::<u64>()) {
        let mut rng = Rng::new(seed);
        for r in READERS {
            let seeds = (r.seeds)();
            let base = &seeds[rng.below(seeds.len())];
            let input = mutate(&mut rng, base, &seeds);
            run_one(r, &input, seed);
        }
    }
}

/// The long run: `RUMBLE_FUZZ_SECS` seconds (default 5) of mutations for each reader, or only
/// `RUMBLE_FUZZ_READER`; prints the number of cases and how many the reader accepted.
#[test]
fn fuzz_for_a_while() {
    let secs: u64 = std::env::var("RUMBLE_FUZZ_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
    let only = std::env::var("RUMBLE_FUZZ_READER").ok();
    for r in READERS.iter().filter(|r| only.as_deref().is_none_or(|o| o == r.name)) {
        let seeds = (r.seeds)();
        // Inputs that still parse are kept as new bases (a little coverage feedback).
        let mut corpus = seeds.clone();
        let mut rng = Rng::for_name(secs, r.name);
        let t0 = Instant::now();
        let (mut cases, mut accepted) = (0u64, 0u64);
        while t0.elapsed() < Duration::from_secs(secs) {
            let base = corpus[rng.below(corpus.len())].clone();
            let input = mutate(&mut rng, &base, &seeds);
            run_one(r, &input, cases);
            if accepts(r.name, &input) {
                accepted += 1;
                if corpus.len() < 4096 {
                    corpus.push(input);
                }
            }
            cases += 1;
        }
        println!(
            "fuzz {}: {cases} cases in {:.0} s, {accepted} accepted, no panic",
            r.name,
            t0.elapsed().as_secs_f64()
        );
        assert!(cases > 0);
    }
}

/// Whether the reader accepts `input` (a new base for mutations).
fn accepts(name: &str, input: &[u8]) -> bool {
    match name {
        "config" => std::str::from_utf8(input).is_ok_and(|t| Config::from_json_str(t, "f.json").is_ok()),
        "safetensors" => weights::parse_safetensors(input, Path::new("f")).is_ok(),
        "jsonl" => std::str::from_utf8(input).is_ok_and(|t| parse_jsonl(t, Path::new("f.jsonl")).is_ok()),
        "tokenizer" => Tokenizer::from_bytes(input, Path::new("/nonexistent-fuzz-dir/tokenizer.json")).is_ok(),
        _ => false,
    }
}
