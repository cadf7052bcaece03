"""transformers `generate` on the workloads of `rumble generate --bench`, for the side-by-side.

Random weights (bf16) from a config.json (bench/reference/generate/*.json), random prompts of
--prompt-len tokens, --new tokens decoded greedily with the static KV cache
(`cache_implementation="static"`), for each batch size; optionally with torch.compile
(`--compile`: transformers' own compile of the static-cache decode step). Prints one JSON line
per run with the same keys as rumble's: time_to_first_token_ms (a generate of one new token),
decode_tokens_per_s (the tokens after the first, over the time after the first), peak_bytes
(torch.cuda.max_memory_allocated), weight_bytes and kv_cache_bytes.

usage: python generate_ref.py CONFIG.json [--batch 1 16] [--prompt-len 512] [--new 256] [--compile]
"""
import argparse, json, time

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

ap = argparse.ArgumentParser()
ap.add_argument("config")
ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
ap.add_argument("--prompt-len", type=int, default=512)
ap.add_argument("--new", type=int, default=256)
ap.add_argument("--compile", action="store_true")
ap.add_argument("--repeat", type=int, default=2, help="timed runs (the first also warms up)")
a = ap.parse_args()

torch.manual_seed(0)
cfg = AutoConfig.from_pretrained(a.config)
model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().eval()
model.generation_config.eos_token_id = None
model.generation_config.pad_token_id = 0
weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())


def run(ids, new):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.no_grad():
        kw = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, cache_implementation="static",
                  eos_token_id=None, pad_token_id=0)
        if a.compile:
            kw["compile_config"] = transformers.CompileConfig(fullgraph=False)
        out = model.generate(ids, **kw)
    torch.cuda.synchronize()
    return time.perf_counter() - t0, out


for b in a.batch:
    ids = torch.randint(0, cfg.vocab_size, (b, a.prompt_len), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    best = None
    for _ in range(a.repeat):
        ttft, _ = run(ids, 1)
        total, out = run(ids, a.new)
        assert out.shape[1] == a.prompt_len + a.new
        decode = max(total - ttft, 1e-9)
        r = (ttft, decode)
        best = r if best is None or r[1] < best[1] else best
    ttft, decode = best
    kv = 2 * cfg.num_hidden_layers * b * (a.prompt_len + a.new) * cfg.num_key_value_heads * \
        getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads) * 2
    print(json.dumps({
        "event": "generate_ref", "config": a.config, "framework": "transformers" + (" + compile" if a.compile else ""),
        "batch": b, "prompt_len": a.prompt_len, "new_tokens": a.new, "time_to_first_token_ms": ttft * 1e3,
        "decode_tokens_per_s": b * (a.new - 1) / decode, "decode_step_ms": decode / (a.new - 1) * 1e3,
        "peak_bytes": torch.cuda.max_memory_allocated(), "weight_bytes": weight_bytes, "kv_cache_bytes": kv,
        "torch": torch.__version__, "transformers": transformers.__version__,
    }), flush=True)
