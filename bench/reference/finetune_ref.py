"""The fine-tuning loop a user would otherwise run, beside `rumble train --init-from FOLDER --data DATA`.

transformers' AutoModelForCausalLM from FOLDER with f32 weights (SDPA attention), bf16
autocast around the forward and the loss, torch.optim.AdamW(fused=True) with rumble's defaults
(betas 0.9/0.95, eps 1e-8, weight decay 0.1), the global gradient norm clipped (--clip), the
learning rate warmed up linearly then cosine to a tenth (rumble's schedule). The data is packed as
rumble packs it (crates/rumble-models/src/data/packed.rs): each record tokenized by FOLDER's
tokenizer (`prompt` with the tokenizer's specials, `response` without; a `text` record with
them), EOS appended unless the tokenizer ended it so, the loss only on response (and text)
tokens, documents joined into one stream cut into windows of T + 1 tokens (the first T the
inputs, the last T the targets), visited in a seeded random order.

usage: python3 bench/reference/finetune_ref.py FOLDER DATA --executor eager|compile
           [--batch 4] [--seq 1024] [--steps 30] [--lr 1e-4] [--clip 1.0] [--warmup-steps 2]

Prints one JSON line with the keys of rumble train's `done` line:
  tokens_per_s  tokens over the seconds of the steps after the first --warmup-steps (compile
                and autotuning happen in those)
  peak_bytes    torch.cuda.max_memory_allocated() over the whole run (weights, AdamW state,
                activations, the f32 logits of the loss)
  mfu           model FLOPs per second of those steps over 989e12 (the H100/H200 dense bf16
                peak); model FLOPs as rumble's suite counts them: 6 per parameter and token
                outside the embeddings, the lm_head's 6 * C * V per token, causal attention's
                6 * L * H * D * T^2 per sequence
"""
import argparse
import json
import math
import random
import time

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ap = argparse.ArgumentParser()
ap.add_argument("folder")
ap.add_argument("data")
ap.add_argument("--executor", choices=["eager", "compile"], required=True)
ap.add_argument("--batch", type=int, default=4)
ap.add_argument("--seq", type=int, default=1024)
ap.add_argument("--steps", type=int, default=30)
ap.add_argument("--lr", type=float, default=1e-4)
ap.add_argument("--clip", type=float, default=1.0)
ap.add_argument("--warmup-steps", type=int, default=2, help="steps left out of the timing")
ap.add_argument("--seed", type=int, default=0)
a = ap.parse_args()
dev = torch.device("cuda")
torch.manual_seed(a.seed)
PEAK_BF16 = 989e12
IGNORE = -100

# The data, packed as rumble packs it.
tok = AutoTokenizer.from_pretrained(a.folder)
eos = tok.eos_token_id
ids, is_target = [], []
with open(a.data) as f:
    for line in f:
        if not line.strip():
            continue
        r = json.loads(line)
        if "text" in r:
            prompt, body = [], tok(r["text"])["input_ids"]
        else:
            prompt = tok(r["prompt"])["input_ids"]
            body = tok(r["response"], add_special_tokens=False)["input_ids"]
        if eos is not None and (not body or body[-1] != eos):
            body = body + [eos]
        ids += prompt + body
        is_target += [False] * len(prompt) + [True] * len(body)
T = a.seq
windows = (len(ids) - 1) // T
if windows < a.batch:
    raise SystemExit(f"{a.data}: {len(ids)} tokens make {windows} windows of seq {T}; batch {a.batch} needs more")
stream = torch.tensor(ids, dtype=torch.long)
targets_all = torch.where(torch.tensor(is_target), stream, torch.full_like(stream, IGNORE))
order, epoch = [], 0


def next_batch():
    global order, epoch
    xs, ys = [], []
    for _ in range(a.batch):
        if not order:
            order = list(range(windows))
            random.Random(a.seed * 1_000_003 + epoch).shuffle(order)
            epoch += 1
        w = order.pop()
        xs.append(stream[w * T:w * T + T])
        ys.append(targets_all[w * T + 1:w * T + T + 1])
    return torch.stack(xs).to(dev, non_blocking=True), torch.stack(ys).to(dev, non_blocking=True)


# The model in f32 (whatever the folder stores), AdamW fused, bf16 autocast.
model = AutoModelForCausalLM.from_pretrained(a.folder, attn_implementation="sdpa").float().to(dev)
model.config.use_cache = False
model.train()
cfg = model.config
emb = {id(p) for m in (model.get_input_embeddings(), model.get_output_embeddings()) for p in m.parameters()}
body_params = sum(p.numel() for p in model.parameters() if id(p) not in emb)
heads = cfg.num_attention_heads
head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
flops_per_step = (6 * body_params * a.batch * T + 6 * cfg.hidden_size * cfg.vocab_size * a.batch * T
                  + 6 * cfg.num_hidden_layers * heads * head_dim * T * T * a.batch)
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
warm = max(1, min(100, a.steps // 10))


def lr_at(step):  # rumble's LrSchedule (cosine): linear warm-up, then cosine down to a tenth
    if step <= warm:
        return a.lr * step / warm
    frac = min(1.0, (step - warm) / max(1, a.steps - warm))
    return 0.1 * a.lr + 0.9 * a.lr * 0.5 * (1 + math.cos(math.pi * frac))


fwd = torch.compile(model) if a.executor == "compile" else model


def step(i, x, y):
    for g in opt.param_groups:
        g["lr"] = lr_at(i)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = fwd(input_ids=x).logits  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), ignore_index=IGNORE)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


losses, times = [], []
for i in range(1, a.steps + 1):
    x, y = next_batch()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    loss = step(i, x, y)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
    losses.append(float(loss))
timed = times[a.warmup_steps:] or times[-1:]
secs = sum(timed)
print(json.dumps({
    "event": "done", "workload": "finetune", "executor": f"torch-{a.executor}",
    "batch": a.batch, "seq": T, "steps": a.steps, "timed_steps": len(timed),
    "tokens_per_s": round(a.batch * T * len(timed) / secs),
    "peak_bytes": torch.cuda.max_memory_allocated(),
    "mfu": round(flops_per_step * len(timed) / secs / PEAK_BF16, 4),
    "first_loss": losses[0], "final_loss": losses[-1], "params": sum(p.numel() for p in model.parameters()),
    "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
}), flush=True)
