"""Reference measurements of rumble's benchmark workloads in PyTorch, torch.compile and Thunder.

usage: python3 bench/reference/torch_ref.py WORKLOAD EXECUTOR [--steps N] [--train]
       python3 bench/reference/torch_ref.py CASE EXECUTOR --suite bench/suite/suite.json [...]

  WORKLOAD  seed-llama | seed-qwen2 | small        (rumble's presets of the same names)
  CASE      with --suite: a case of the suite file; transformers' model class for its config.json
            (LlamaForCausalLM, Qwen2ForCausalLM, MistralForCausalLM...) with random weights in
            bf16, `layers` overriding num_hidden_layers; the line also carries the case's batch,
            seq, tokens and flops_per_step (the formula in BENCHMARKS.md, from this model's own
            parameter count: compare.py warns when it differs from rumble's)
  EXECUTOR  torch-eager | torch-compile | torch-compile-ro | thunder | thunder-cudagraph
  --train   add an AdamW step (lr 1e-4, weight decay 0.1) after the backward
  --profile FILE  after the timed steps, one more step under torch.profiler: the CUDA kernels
            by total device time (name, calls, ms) into FILE, to set beside `rumble bench --profile`

One process per configuration (peak memory is per process). Prints one JSON line with the same
keys `rumble bench --json` prints, so bench/compare.py can put them side by side:
  peak_allocated_bytes  torch.cuda.max_memory_allocated() over the first step (the seed's figure)
  device_used_bytes     rise of the device's used memory (cudaMemGetInfo) from before the model
                        was built to after the last step: counts caching, graphs and libraries
  first_step_ms         the first step, compilation and capture included
  median_step_ms        median of the steps after the first two (reduce-overhead records its
                        CUDA graphs on the second)
Each step is a forward, the objective, a backward producing every parameter gradient,
optionally the optimizer step, and zero_grad(set_to_none=True).
"""
import argparse
import json
import statistics
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("workload")
p.add_argument("executor")
p.add_argument("--steps", type=int, default=8)
p.add_argument("--train", action="store_true")
p.add_argument("--profile")
p.add_argument("--suite", help="a suite file: WORKLOAD names one of its cases")
args = p.parse_args()
dev = torch.device("cuda")
torch.manual_seed(0)
free0, total = torch.cuda.mem_get_info()


def wrap(model):
    """The executor applied to a module."""
    e = args.executor
    if e == "torch-eager":
        return model
    if e == "torch-compile":
        return torch.compile(model)
    if e == "torch-compile-ro":
        return torch.compile(model, mode="reduce-overhead")
    if e in ("thunder", "thunder-cudagraph"):
        from thunder.dynamo import ThunderCompiler
        transforms = []
        if e == "thunder-cudagraph":
            from thunder.transforms.cudagraph import CUDAGraphTransform
            transforms = [CUDAGraphTransform()]
        return torch.compile(model, backend=ThunderCompiler(transforms=transforms))
    raise SystemExit(f"unknown executor {e}")


def seed_llama():
    # litgpt's open_llama_3b with 10 layers, fp32, logits.sum(): the seed's program.
    import litgpt
    cfg = litgpt.Config.from_name("open_llama_3b", n_layer=10)
    with dev:
        model = litgpt.GPT(cfg)
    x = torch.randint(0, 255, (1, cfg.block_size), device=dev)
    if args.executor in ("thunder", "thunder-cudagraph"):
        # The seed jits the module with thunder.jit directly.
        import thunder
        transforms = []
        if args.executor == "thunder-cudagraph":
            from thunder.transforms.cudagraph import CUDAGraphTransform
            transforms = [CUDAGraphTransform()]
        fn = thunder.jit(model, transforms=transforms)
    else:
        fn = wrap(model)
    return model, lambda: fn(x).sum()


def hf(kind, seq, **kw):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config
    cfg = (LlamaConfig if kind == "llama" else Qwen2Config)(rms_norm_eps=1e-6, **kw)
    if kind == "qwen2":
        cfg.hidden_size = cfg.num_attention_heads  # the seed's shape: head_dim 1
    with dev:
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device=dev)
    fn = wrap(model)
    return model, lambda: fn(input_ids=ids, labels=ids).loss


def suite_case(name):
    """A case of the suite file: its model from config.json, random bf16 weights, random tokens."""
    import os

    from transformers import AutoConfig, AutoModelForCausalLM
    with open(args.suite) as f:
        cases = {c["name"]: c for c in json.load(f)["cases"]}
    if name not in cases:
        raise SystemExit(f"{args.suite}: no case `{name}` (cases: {', '.join(cases)})")
    c = cases[name]
    cfg = AutoConfig.from_pretrained(os.path.join(os.path.dirname(args.suite), c["config"]))
    if c.get("layers"):
        cfg.num_hidden_layers = c["layers"]
    with dev:
        model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    batch, seq = c["batch"], c["seq"]
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=dev)
    # Model FLOPs of a forward and backward (BENCHMARKS.md): 6 per parameter and token outside
    # the embeddings, the lm_head's 6 * C * V per token, causal attention's 6 * L * H * D * T^2
    # per sequence.
    emb = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
    body = sum(p.numel() for p in model.parameters() if id(p) not in emb)
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    tokens = batch * seq
    flops = (6 * body * tokens + 6 * cfg.hidden_size * cfg.vocab_size * tokens
             + 6 * cfg.num_hidden_layers * heads * head_dim * seq * seq * batch)
    INFO.update(case=name, batch=batch, seq=seq, layers=cfg.num_hidden_layers, tokens=tokens,
                params=sum(p.numel() for p in model.parameters()), flops_per_step=flops)
    fn = wrap(model)
    return model, lambda: fn(input_ids=ids, labels=ids).loss


INFO = {}
WORKLOADS = {
    "seed-llama": seed_llama,
    "seed-qwen2": lambda: hf("qwen2", 4096, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                             num_hidden_layers=5, num_attention_heads=28, num_key_value_heads=4,
                             max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=False),
    "small": lambda: hf("llama", 256, vocab_size=32000, hidden_size=768, intermediate_size=2048,
                        num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                        max_position_embeddings=1024, tie_word_embeddings=False),
}

if args.suite:
    model, objective = suite_case(args.workload)
elif args.workload in WORKLOADS:
    model, objective = WORKLOADS[args.workload]()
else:
    raise SystemExit(f"unknown workload `{args.workload}` ({', '.join(WORKLOADS)}, or a case with --suite)")
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1) if args.train else None


def step():
    if args.executor == "torch-compile-ro":
        torch.compiler.cudagraph_mark_step_begin()
    loss = objective()
    loss.backward()
    if opt is not None:
        opt.step()
    model.zero_grad(set_to_none=True)
    # A copy: under reduce-overhead the graph's output buffer is overwritten by the next step.
    return loss.detach().float().clone()


torch.cuda.synchronize()
torch.cuda.reset_peak_memory_stats()
t0 = time.perf_counter()
loss = step()
torch.cuda.synchronize()
first_ms = (time.perf_counter() - t0) * 1e3
peak = torch.cuda.max_memory_allocated()
times = []
for _ in range(args.steps - 1):
    t0 = time.perf_counter()
    step()
    torch.cuda.synchronize()
    times.append((time.perf_counter() - t0) * 1e3)
free1, _ = torch.cuda.mem_get_info()
if args.profile:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    rows = [(e.key, e.count, e.device_time_total / 1e3) for e in prof.key_averages() if e.device_time_total > 0]
    rows.sort(key=lambda r: -r[2])
    with open(args.profile, "w") as f:
        f.write(f"{args.workload} {args.executor}: device time of one step, by kernel: {sum(r[2] for r in rows):.3f} ms\n")
        f.write(f"{'ms':>9} {'calls':>6}  kernel\n")
        for name, count, ms in rows[:40]:
            f.write(f"{ms:9.3f} {count:6d}  {name[:150]}\n")
print(json.dumps({
    "workload": args.workload, "executor": args.executor, "train": args.train,
    "peak_allocated_bytes": peak,
    "peak_allocated_later_bytes": torch.cuda.max_memory_allocated(),
    "device_used_bytes": free0 - free1,
    "first_step_ms": round(first_ms, 2),
    "median_step_ms": round(statistics.median(times[1:] or times), 3) if times else None,
    "loss": float(loss),
    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, **INFO,
}), flush=True)
