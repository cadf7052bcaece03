//! `rumble generate` as a user runs it, on the CPU: after `rumble train` (with samples every
//! few steps), generation streams the prompt and its continuation, agrees with the JSON form,
//! decodes a JSONL batch, and refuses bad input with a one-line error; a Hugging Face folder
//! (sharded, with a tokenizer.json) generates through its tokenizer, text streamed as whole
//! characters; ids past a byte-level run's 256 show as U+FFFD with a note; `--bench` reports
//! no bandwidth when no decode step ran, and `--profile` is refused on the CPU.

mod common;

use std::path::Path;

use common::{lines, rumble, tmp};
use rumble_models::Tokenizer;
use rumble_models::generate::tokens::Detokenizer;
use serde_json::Value;

#[test]
fn train_then_generate_streams_and_batches() {
    let dir = tmp("cli", "generate");
    let o = dir.to_str().unwrap();
    let (ok, stdout, stderr) = rumble(&[
        "train",
        "--steps",
        "4",
        "--batch",
        "2",
        "--seq",
        "16",
        "--json",
        "--out",
        o,
        "--device",
        "cpu",
        "--sample-every",
        "2",
        "--prompt",
        "The town",
    ]);
    assert!(ok, "{stderr}");
    let samples: Vec<Value> = lines(&stdout).into_iter().filter(|l| l["event"] == "sample").collect();
    assert_eq!(samples.iter().map(|s| s["step"].as_u64().unwrap()).collect::<Vec<_>>(), [2, 4]);
    assert!(samples.iter().all(|s| s["text"].as_str().is_some_and(|t| !t.is_empty())), "{samples:?}");

    let base = ["generate", "--model", o, "--prompt", "The town", "--max-new-tokens", "24", "--device", "cpu"];
    let (ok, streamed, stderr) = rumble(&base);
    assert!(ok, "{stderr}");
    let (ok, js, stderr) = rumble(&[&base[..], &["--json"]].concat());
    assert!(ok, "{stderr}");
    let line = &lines(&js)[0];
    let tokens: Vec<u8> = line["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u8).collect();
    assert_eq!(tokens.len(), 24);
    let mut want = b"The town".to_vec();
    want.extend(&tokens);
    want.push(b'\n');
    assert_eq!(streamed.as_bytes(), &want[..], "stdout is the prompt, then each token's byte as it comes");

    let file = dir.join("prompts.jsonl");
    std::fs::write(&file, "{\"prompt\": \"The town\"}\n\n{\"prompt\": \"A much longer prompt than that\"}\n").unwrap();
    let (ok, out, stderr) = rumble(&[
        "generate",
        "--model",
        o,
        "--prompts",
        file.to_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--device",
        "cpu",
    ]);
    assert!(ok, "{stderr}");
    let ls = lines(&out);
    assert_eq!(ls.len(), 2);
    assert_eq!(ls[0]["tokens"], line["tokens"], "a batched, padded prompt decodes as it does alone (greedy)");
    assert_eq!(ls[1]["prompt"], "A much longer prompt than that");

    let (ok, _, stderr) = rumble(&["generate", "--model", o, "--prompt", "x", "--top-p", "0", "--device", "cpu"]);
    assert!(!ok && stderr.contains("top_p must be in (0, 1]"), "{stderr}");
    std::fs::write(&file, "{\"text\": 1}\n").unwrap();
    let (ok, _, stderr) = rumble(&["generate", "--model", o, "--prompts", file.to_str().unwrap(), "--device", "cpu"]);
    assert!(!ok && stderr.contains("prompts.jsonl:1: needs a \"prompt\" string"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A byte-level run of a model configured with more than 256 ids: the ids past the bytes print
/// as U+FFFD, and a note says how many there were. (Its training, on sequences longer than
/// `max_position_embeddings`, notes that too.)
#[test]
fn ids_past_the_byte_vocabulary_show_and_are_noted() {
    let dir = tmp("cli", "generate-past");
    let o = dir.join("run");
    let config = dir.join("config.json");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        &config,
        r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 8, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    let (c, o) = (config.to_str().unwrap(), o.to_str().unwrap());
    let (ok, _, stderr) =
        rumble(&["train", "--config", c, "--steps", "1", "--batch", "1", "--seq", "16", "--out", o, "--device", "cpu"]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("longer than the model's max_position_embeddings (8)"), "{stderr}");
    let base =
        ["generate", "--model", o, "--prompt", "ab", "--max-new-tokens", "32", "--temperature", "1", "--device", "cpu"];
    let (ok, js, stderr) = rumble(&[&base[..], &["--json"]].concat());
    assert!(ok, "{stderr}");
    let line = &lines(&js)[0];
    let ids: Vec<u64> = line["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap()).collect();
    let past = ids.iter().filter(|&&t| t >= 256).count();
    assert!(past > 0, "random weights over 512 ids sample some past the bytes: {line}");
    // Each id its byte, or the replacement character's three.
    let mut want = Vec::new();
    for &t in &ids {
        match u8::try_from(t) {
            Ok(b) => want.push(b),
            Err(_) => want.extend("\u{FFFD}".as_bytes()),
        }
    }
    let completion = String::from_utf8_lossy(&want);
    assert_eq!(line["completion"].as_str().unwrap(), completion);
    assert!(stderr.contains(&format!("note: {past} generated id(s)")) && stderr.contains("256 byte ids"), "{stderr}");
    let (ok, streamed, stderr) = rumble(&base);
    assert!(ok, "{stderr}");
    assert_eq!(streamed, format!("ab{completion}\n"), "the stream shows them too");
    assert!(stderr.contains("no tokenizer.json"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hugging_face_folder_generates_through_its_tokenizer() {
    let model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/finetune/model");
    let m = model.to_str().unwrap();
    let prompt = "What is the capital of Norway?\n";
    let base = ["generate", "--model", m, "--prompt", prompt, "--max-new-tokens", "16", "--device", "cpu"];
    let (ok, streamed, stderr) = rumble(&base);
    assert!(ok, "{stderr}");
    let (ok, js, stderr) = rumble(&[&base[..], &["--json"]].concat());
    assert!(ok, "{stderr}");
    let line = &lines(&js)[0];
    let completion = line["completion"].as_str().unwrap();
    let ids: Vec<u32> = line["tokens"].as_array().unwrap().iter().map(|t| t.as_u64().unwrap() as u32).collect();
    assert!(!ids.is_empty() && ids.len() <= 16, "{line}");
    assert_eq!(streamed, format!("{prompt}{completion}\n"), "stdout is the prompt, then the completion as it comes");
    // The completion is what the tokenizer makes of the ids (this one is byte-level BPE: the
    // ids alone decode to the same text), special tokens left out.
    let tok = Tokenizer::from_folder(&model).unwrap();
    let whole = tok.decode(&ids, true).unwrap();
    if !whole.contains('\u{FFFD}') {
        assert_eq!(completion, whole);
    }

    // Streaming gives whole characters only, and all of them: multi-byte characters split over
    // byte-level tokens are held back until complete.
    let text = "héllo wörld, ☃ and 🦀!";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() > text.chars().count() / 2, "{ids:?}");
    let mut d = Detokenizer::new(&tok, &[]);
    let mut out = Vec::new();
    for &id in &ids {
        let piece = d.push(i64::from(id)).unwrap();
        let piece_text = String::from_utf8(piece.clone()).unwrap();
        assert!(!piece_text.contains('\u{FFFD}'), "a piece holding part of a character: {piece_text:?}");
        out.extend(piece);
    }
    out.extend(d.finish().unwrap());
    assert_eq!(String::from_utf8(out).unwrap(), tok.decode(&ids, true).unwrap());
}

#[test]
fn generate_bench_reports_no_bandwidth_without_a_decode_step() {
    let bench = |new: &str| {
        let args = ["generate", "--bench", "--config", "tiny", "--batch", "2", "--prompt-len", "8", "--device", "cpu"];
        let (ok, stdout, stderr) = rumble(&[&args[..], &["--max-new-tokens", new]].concat());
        assert!(ok, "{stderr}");
        lines(&stdout).remove(0)
    };
    // One new token comes from the prefill: no decode step, so no step time and no fraction.
    let one = bench("1");
    assert_eq!(one["decode_steps"], 0, "{one}");
    assert!(one["hbm_fraction_at_4_8_tb_s"].is_null() && one["decode_step_ms"].is_null(), "{one}");
    let three = bench("3");
    assert_eq!(three["decode_steps"], 2, "{three}");
    assert!(three["hbm_fraction_at_4_8_tb_s"].as_f64().unwrap() > 0.0, "{three}");
    assert!(three["decode_step_ms"].as_f64().unwrap() > 0.0, "{three}");
    // --profile times CUDA launches: refused on the CPU with a one-line error, and needs --bench.
    let (ok, _, stderr) = rumble(&["generate", "--bench", "--profile", "--config", "tiny", "--device", "cpu"]);
    assert!(!ok && stderr.contains("--profile times CUDA launches"), "{stderr}");
    let (ok, _, stderr) = rumble(&["generate", "--profile", "--model", "x"]);
    assert!(!ok && stderr.contains("--bench"), "{stderr}");
}
