//! Hugging Face model folders: sharded checkpoints with their index, in both directions; dtype
//! casts on load when asked; errors that name the index, the shard or the tensor; and the
//! fixture's tokenizer.json (made by the `tokenizers` library) giving transformers' ids.

use std::path::{Path, PathBuf};

use rumble_core::DType;
use rumble_models::folder::{INDEX_FILE, SINGLE_FILE, copy_tokenizer_files, read_index, save_folder};
use rumble_models::{Config, OnDtypeMismatch, Tokenizer, Weights, preset};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rumble-folder-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn tiny(dtype: DType) -> Config {
    Config { dtype, ..preset("tiny").unwrap().config }
}

/// The fine-tuning fixture of the CLI tests (transformers' sharded save_pretrained).
fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../rumble-cli/tests/finetune/model")
}

#[test]
fn sharded_folders_round_trip_and_a_resave_drops_the_old_layout() {
    let cfg = tiny(DType::F32);
    let w = Weights::init(&cfg, 3).unwrap();
    let dir = tmp("shards");
    // A limit of a third of the weights: at least three shards.
    let written = save_folder(&dir, &cfg, &w, w.num_bytes() / 3).unwrap();
    assert!(written.len() >= 4 && written.last().unwrap().ends_with(INDEX_FILE), "{written:?}");
    let map = read_index(&dir.join(INDEX_FILE)).unwrap();
    assert!(map.contains_key("model.layers.0.mlp.gate_proj.weight"), "{map:?}");
    assert_eq!(Weights::load(&dir, &cfg).unwrap(), w);
    assert_eq!(Weights::load(&dir.join(INDEX_FILE), &cfg).unwrap(), w);
    assert_eq!(Config::from_file(&dir.join("config.json")).unwrap(), cfg);

    // Saved again under the limit: one file, and no stale index or shard left to shadow it.
    let w2 = Weights::init(&cfg, 4).unwrap();
    save_folder(&dir, &cfg, &w2, usize::MAX).unwrap();
    let mut names: Vec<String> =
        std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    names.sort();
    assert_eq!(names, ["config.json", SINGLE_FILE]);
    assert_eq!(Weights::load(&dir, &cfg).unwrap(), w2);
}

#[test]
fn transformers_shards_load_and_dtypes_cast_only_when_asked() {
    let dir = fixture();
    assert!(!dir.join(SINGLE_FILE).exists() && dir.join(INDEX_FILE).is_file());
    let cfg = Config::from_file(&dir.join("config.json")).unwrap();
    let w = Weights::load(&dir, &cfg).unwrap();
    assert!(w.tensors.iter().any(|(_, t)| t.to_f32().iter().any(|&x| x != 0.0 && x != 1.0)));

    let bf16 = Config { dtype: DType::BF16, ..cfg.clone() };
    let e = Weights::load(&dir, &bf16).unwrap_err().to_string();
    assert!(e.contains("model-0000") && e.contains("is f32, the model needs bf16"), "{e}");
    let cast = Weights::load_as(&dir, &bf16, OnDtypeMismatch::Cast).unwrap();
    for ((name, a), (_, b)) in w.tensors.iter().zip(&cast.tensors) {
        assert_eq!(b.ty.dtype, DType::BF16, "{name}");
        for (x, y) in a.to_f32().iter().zip(b.to_f32()) {
            assert!((x - y).abs() <= x.abs() / 128.0, "{name}: {x} -> {y}");
        }
    }
}

#[test]
fn bad_folders_and_indexes_name_what_is_wrong() {
    let cfg = Config::from_file(&fixture().join("config.json")).unwrap();
    let dir = tmp("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let e = Weights::load(&dir, &cfg).unwrap_err().to_string();
    assert!(e.contains("neither model.safetensors nor model.safetensors.index.json"), "{e}");
    for f in ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    let index = std::fs::read_to_string(fixture().join(INDEX_FILE)).unwrap();
    let cases = [
        (index.replace("\"model.norm.weight\"", "\"model.norm.weightx\""), "tensor `model.norm.weightx` in model-0"),
        (index.replacen("model-00002-of-00002", "../model-00002-of-00002", 1), "is not a file name"),
        (index.replacen("model-00002-of-00002.safetensors", "model-00003-of-00002.safetensors", 1), "00003"),
        ("{\"metadata\": {}}".to_string(), "`weight_map`"),
    ];
    for (text, want) in cases {
        std::fs::write(dir.join(INDEX_FILE), &text).unwrap();
        let e = Weights::load(&dir, &cfg).unwrap_err().to_string();
        assert!(e.contains(want), "{want}: {e}");
    }
    // A tensor the index maps to a shard that does not hold it.
    let moved = index.replacen("model-00001-of-00002", "model-00002-of-00002", 1);
    std::fs::write(dir.join(INDEX_FILE), moved).unwrap();
    let e = Weights::load(&dir, &cfg).unwrap_err().to_string();
    assert!(e.contains(INDEX_FILE) && e.contains("in model-00002-of-00002.safetensors, which does not hold it"), "{e}");
}

#[test]
fn the_fixture_tokenizer_gives_transformers_ids() {
    let tok = Tokenizer::from_folder(&fixture()).unwrap();
    assert_eq!((tok.bos(), tok.eos(), tok.vocab_size()), (Some(0), Some(1), 320));
    let text = "What is the capital of Peru?\nThe capital of Peru is Lima. Zebra!";
    // transformers 5.25: AutoTokenizer.from_pretrained(fixture)(text)["input_ids"].
    let want = [
        0, 277, 261, 264, 272, 270, 314, 283, 86, 32, 200, 273, 272, 270, 314, 283, 86, 261, 222, 45, 74, 78, 66, 15,
        222, 59, 70, 67, 83, 66, 2,
    ];
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids, want);
    assert_eq!(tok.decode(&ids, true).unwrap(), text);
    assert_eq!(tok.encode(text, false).unwrap(), want[1..]);

    // Copied along with a checkpoint, never onto itself.
    let out = tmp("tok");
    std::fs::create_dir_all(&out).unwrap();
    let copied = copy_tokenizer_files(&fixture(), &out).unwrap();
    assert_eq!(copied, ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]);
    assert_eq!(Tokenizer::from_folder(&out).unwrap().encode(text, true).unwrap(), want);
    assert!(copy_tokenizer_files(&out, &out).unwrap().is_empty());
    // A folder without tokenizer.json reads bytes.
    assert!(Tokenizer::from_folder(&tmp("none")).unwrap().is_bytes());
}
