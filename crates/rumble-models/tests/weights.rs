//! Safetensors checkpoints: bit-for-bit round trips and an error naming the file and tensor for
//! every kind of bad input.

use std::path::PathBuf;

use rumble_core::{DType, TensorType};
use rumble_models::host::{self, HostTensor};
use rumble_models::weights::{read_safetensors, write_safetensors};
use rumble_models::{Config, Weights, preset};

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rumble-weights-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tiny(dtype: DType) -> Config {
    Config { dtype, num_hidden_layers: 1, ..preset("tiny").unwrap().config }
}

#[test]
fn round_trip_is_bit_for_bit_in_f32_and_bf16() {
    for dtype in [DType::F32, DType::BF16] {
        let cfg = tiny(dtype);
        let w = Weights::init(&cfg, 42).unwrap();
        assert!(w.tensors.iter().all(|(_, t)| t.ty.dtype == dtype));
        let path = tmp("rt").join(format!("{dtype}.safetensors"));
        w.save(&path).unwrap();
        let back = Weights::load(&path, &cfg).unwrap();
        assert_eq!(back, w, "{dtype}");
        // Saving what was loaded gives the same file, byte for byte.
        let path2 = path.with_extension("again");
        back.save(&path2).unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), std::fs::read(&path2).unwrap());
    }
}

#[test]
fn init_follows_hugging_face_and_the_seed() {
    let cfg = Config { qkv_bias: true, ..tiny(DType::F32) };
    let w = Weights::init(&cfg, 1).unwrap();
    let vals = |n: &str| host::to_f32s(w.get(n).unwrap()).unwrap();
    assert!(vals("model.norm.weight").iter().all(|&x| x == 1.0));
    assert!(vals("model.layers.0.self_attn.q_proj.bias").iter().all(|&x| x == 0.0));
    let q = vals("model.layers.0.self_attn.q_proj.weight");
    let std = (q.iter().map(|x| x * x).sum::<f32>() / q.len() as f32).sqrt();
    assert!((std - 0.02).abs() < 0.002, "std {std}");
    assert_eq!(Weights::init(&cfg, 1).unwrap(), w);
    assert_ne!(Weights::init(&cfg, 2).unwrap(), w);
}

/// rumble packs gate and up projections into one parameter; files keep Hugging Face's two
/// tensors (saved split, loaded stacked), and a file holding the packed tensor loads too.
#[test]
fn gate_and_up_are_packed_inside_and_split_in_files() {
    let cfg = tiny(DType::F32);
    let w = Weights::init(&cfg, 9).unwrap();
    let packed = w.get("model.layers.0.mlp.gate_up_proj.weight").unwrap();
    let f = cfg.intermediate_size;
    assert_eq!(packed.ty.dims(), &[2 * f, cfg.hidden_size]);
    assert!(w.get("model.layers.0.mlp.gate_proj.weight").is_none());
    let path = tmp("packed").join("hf.safetensors");
    w.save(&path).unwrap();
    let stored = read_safetensors(&path).unwrap();
    let get = |n: &str| stored.iter().find(|(k, _)| k == n).map(|(_, t)| t.clone()).unwrap();
    let (gate, up) = (get("model.layers.0.mlp.gate_proj.weight"), get("model.layers.0.mlp.up_proj.weight"));
    assert!(stored.iter().all(|(k, _)| !k.contains("gate_up")));
    assert_eq!(gate.ty.dims(), &[f, cfg.hidden_size]);
    assert_eq!([gate.bytes.clone(), up.bytes.clone()].concat(), packed.bytes);
    assert_ne!(gate.bytes, up.bytes);
    // Packed in the file: the same weights.
    let path2 = tmp("packed").join("packed.safetensors");
    write_safetensors(&path2, &w.tensors).unwrap();
    assert_eq!(Weights::load(&path2, &cfg).unwrap(), w);
    // A part with the wrong shape is named.
    let e = load_error("badpart", |t| {
        let i = t.iter().position(|(n, _)| n == "model.layers.0.mlp.up_proj.weight").unwrap();
        t[i].1 = host::zeros(&TensorType::new(DType::F32, [3, 4]));
    });
    assert!(e.contains("model.layers.0.mlp.up_proj.weight"), "{e}");
}

/// Writes the tiny model's weights with `edit` applied, and returns the error of loading them.
fn load_error(name: &str, edit: impl FnOnce(&mut Vec<(String, HostTensor)>)) -> String {
    let cfg = tiny(DType::F32);
    let mut tensors = Weights::init(&cfg, 0).unwrap().hf_tensors();
    edit(&mut tensors);
    let path = tmp("bad").join(format!("{name}.safetensors"));
    write_safetensors(&path, &tensors).unwrap();
    Weights::load(&path, &cfg).unwrap_err().to_string()
}

#[test]
fn missing_tensor_is_named() {
    let e = load_error("missing", |t| t.retain(|(n, _)| n != "model.layers.0.mlp.up_proj.weight"));
    assert!(
        e.contains("missing.safetensors") && e.contains("missing tensor `model.layers.0.mlp.up_proj.weight`"),
        "{e}"
    );
    assert!(e.contains("f32[176,64]"), "{e}");
}

#[test]
fn wrong_shape_is_named() {
    let e = load_error("shape", |t| {
        assert_eq!(t[2].0, "model.layers.0.self_attn.k_proj.weight");
        t[2].1 = host::zeros(&TensorType::new(DType::F32, [64, 64]));
    });
    assert!(e.contains("`model.layers.0.self_attn.k_proj.weight` has shape [64, 64], the model needs [32, 64]"), "{e}");
    let e = load_error("shape2", |t| t[0].1 = host::zeros(&TensorType::new(DType::F32, [255, 64])));
    assert!(e.contains("`model.embed_tokens.weight` has shape [255, 64], the model needs [256, 64]"), "{e}");
}

#[test]
fn wrong_dtype_is_named() {
    let e = load_error("dtype", |t| {
        let ty = t[0].1.ty.with_dtype(DType::BF16);
        t[0].1 = host::zeros(&ty);
    });
    assert!(e.contains("`model.embed_tokens.weight` is bf16, the model needs f32"), "{e}");
}

#[test]
fn unexpected_tensor_is_named() {
    let e = load_error("extra", |t| t.push(("model.layers.7.mlp.up_proj.weight".into(), host::scalar_f32(1.0))));
    assert!(e.contains("unexpected tensor `model.layers.7.mlp.up_proj.weight`"), "{e}");
    // A stored lm_head next to tied embeddings is fine (transformers writes one).
    let cfg = tiny(DType::F32);
    let mut tensors = Weights::init(&cfg, 0).unwrap().tensors;
    tensors.push(("lm_head.weight".into(), tensors[0].1.clone()));
    let path = tmp("tied").join("tied.safetensors");
    write_safetensors(&path, &tensors).unwrap();
    Weights::load(&path, &cfg).unwrap();
}

#[test]
fn truncated_and_garbage_files_are_refused() {
    let cfg = tiny(DType::F32);
    let path = tmp("trunc").join("model.safetensors");
    Weights::init(&cfg, 0).unwrap().save(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    for cut in [bytes.len() - 100, 20, 3] {
        let p = path.with_extension(format!("cut{cut}"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        let e = Weights::load(&p, &cfg).unwrap_err().to_string();
        assert!(e.contains(&format!("cut{cut}")) && e.contains("not a valid safetensors file"), "{e}");
    }
    let p = path.with_extension("text");
    std::fs::write(&p, b"this is not a checkpoint at all").unwrap();
    assert!(Weights::load(&p, &cfg).unwrap_err().to_string().contains("not a valid safetensors file"));
    let e = Weights::load(&path.with_extension("nope"), &cfg).unwrap_err().to_string();
    assert!(e.contains("model.nope"), "{e}");
}

#[test]
fn writes_are_atomic_and_leave_no_temp_files() {
    let dir = tmp("atomic");
    let path = dir.join("w.safetensors");
    let t = vec![("a".to_string(), host::from_f32s(DType::F32, &[2], &[1.0, 2.0]).unwrap())];
    write_safetensors(&path, &t).unwrap();
    write_safetensors(&path, &t).unwrap();
    let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("w.safetensors")]);
    assert_eq!(read_safetensors(&path).unwrap(), t);
    // A folder that does not exist: an error naming the path, nothing written.
    let e = write_safetensors(&dir.join("no/such/dir/w.safetensors"), &t).unwrap_err().to_string();
    assert!(e.contains("no/such/dir/w.safetensors"), "{e}");
}

#[test]
fn checkpoint_folder_has_model_and_config() {
    let cfg = tiny(DType::BF16);
    let w = Weights::init(&cfg, 3).unwrap();
    let dir = tmp("ckpt").join("run");
    rumble_models::save_checkpoint(&dir, &cfg, &w).unwrap();
    assert_eq!(Config::from_file(&dir.join("config.json")).unwrap(), cfg);
    assert_eq!(Weights::load(&dir.join("model.safetensors"), &cfg).unwrap(), w);
}
