"""Greedy token ids from transformers' `generate(do_sample=False)` on the reference checkpoints,
for tests/generate.rs (`greedy_tokens_equal_transformers_generate`).

For each case folder (written by make_reference.py) it loads the model in float32 with eager
attention, generates 64 new tokens greedily after a fixed prompt with end-of-sequence stopping
turned off (so all 64 are compared), and writes OUT_DIR/CASE.txt: a comment line, the prompt
ids, then the 64 new ids, space-separated.

usage: python make_generate_reference.py [REFERENCE_DIR [OUT_DIR]]
       (defaults: this folder and this folder's generate/; needs torch, transformers)
"""
import json, os, sys

import torch
import transformers
from transformers import AutoModelForCausalLM

here = os.path.dirname(os.path.abspath(__file__))
ref_dir = sys.argv[1] if len(sys.argv) > 1 else here
out_dir = sys.argv[2] if len(sys.argv) > 2 else os.path.join(here, "generate")
os.makedirs(out_dir, exist_ok=True)
NEW = 64

for case in ["llama_gqa_tied", "llama_mha_untied", "qwen2_gqa7_tied", "qwen2_head_dim_1"]:
    d = os.path.join(ref_dir, case)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    vocab = model.config.vocab_size
    prompt = [(i * 7 + 3) % vocab for i in range(9)]
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, min_new_tokens=0,
                             eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == NEW, (case, len(new))
    with open(os.path.join(out_dir, case + ".txt"), "w") as f:
        f.write(f"# transformers {transformers.__version__}, torch {torch.__version__}: generate(do_sample=False), "
                f"{NEW} new tokens, float32, eager attention\n")
        f.write(" ".join(map(str, prompt)) + "\n")
        f.write(" ".join(map(str, new)) + "\n")
    print(json.dumps({"case": case, "prompt": prompt, "new": new[:8]}))
