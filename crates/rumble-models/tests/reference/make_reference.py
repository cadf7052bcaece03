"""Makes the Hugging Face reference checkpoints that tests/reference.rs checks rumble against.

For each case it builds a small transformers model (LLaMA with grouped-query attention and tied
embeddings, and with full heads, untied; Qwen2 with q/k/v biases and head_dim 1, and with 7 query
heads per key/value head and tied embeddings; LLaMA with `llama3` and with `linear` RoPE scaling,
their thresholds set so that the 12 positions see kept, blended and divided frequencies), sets every parameter to random values (norm
weights and biases included, so nothing is trivially one or zero), and writes with
`save_pretrained` (transformers' own config.json and model.safetensors). It then runs the model
in float64 on fixed token ids with `labels = input_ids` and stores the loss, the logits and every
parameter's gradient in reference.safetensors.

It also takes folders that rumble wrote (`rumble train --out DIR`): transformers loads them with
`from_pretrained` and the same reference is written beside them, which checks the other direction
(rumble's config.json and safetensors, bf16 included, read by transformers).

usage: python make_reference.py OUT_DIR [--only CASE,...] [RUMBLE_CHECKPOINT_DIR ...]   (needs torch, transformers,
safetensors)
"""
import json, os, sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

out_dir = sys.argv[1]


def config(cls, vocab, hidden, inter, heads, kv_heads, eps, theta, tied):
    return cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
               num_attention_heads=heads, num_key_value_heads=kv_heads, rms_norm_eps=eps, rope_theta=theta,
               tie_word_embeddings=tied, max_position_embeddings=64)


CASES = {
    "llama_gqa_tied": config(LlamaConfig, 64, 32, 48, 4, 2, 1e-6, 10000.0, True),
    "qwen2_head_dim_1": config(Qwen2Config, 64, 8, 24, 8, 2, 1e-6, 1000000.0, False),
    "llama_mha_untied": config(LlamaConfig, 96, 48, 64, 4, 4, 1e-5, 500000.0, False),
    "qwen2_gqa7_tied": config(Qwen2Config, 80, 56, 40, 7, 1, 1e-6, 1000000.0, True),
    # head_dim 8: wavelengths 2 pi x [1, 10, 100, 1000]; kept below 16, divided above 64, blended between.
    "llama3_rope_scaled": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                      rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                       "original_max_position_embeddings": 64},
                                      tie_word_embeddings=True, max_position_embeddings=512),
    "llama_rope_linear": LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                                     rope_parameters={"rope_type": "linear", "rope_theta": 100.0, "factor": 4.0},
                                     tie_word_embeddings=True, max_position_embeddings=256),
}
# `--only a,b` makes only those cases (committed ones stay as they were made).
if len(sys.argv) > 2 and sys.argv[2] == "--only":
    CASES = {k: v for k, v in CASES.items() if k in sys.argv[3].split(",")}
    sys.argv[2:] = sys.argv[4:]
B, T = 2, 12


def reference(model, cfg, d):
    """Loss, logits and gradients of `model` in float64 on fixed ids, into d/reference.safetensors."""
    m64 = model.double()
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1))
    outputs = m64(input_ids=ids, labels=ids)
    outputs.loss.backward()
    ref = {"input_ids": ids.to(torch.int64), "loss": outputs.loss.detach().reshape(()),
           "logits": outputs.logits.detach().reshape(B * T, cfg.vocab_size)}
    for pname, p in m64.named_parameters():
        ref["grad." + pname] = p.grad.detach().clone()
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(d, "reference.safetensors"))
    print(json.dumps({"case": d, "loss": outputs.loss.item(), "files": sorted(os.listdir(d))}))


for name, cfg in CASES.items():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    d = os.path.join(out_dir, name)
    model.save_pretrained(d, safe_serialization=True)
    reference(model, cfg, d)

for d in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(d, attn_implementation="eager")
    reference(model, model.config, d)
import transformers
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}))
