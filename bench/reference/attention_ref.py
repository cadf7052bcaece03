"""PyTorch's scaled_dot_product_attention on the inputs rumble's attention bench used.

usage: python3 bench/reference/attention_ref.py DIR [--iters N]

DIR is what `RUMBLE_ATTN_DUMP=DIR attention-bench` wrote (crates/rumble-cuda/benches/attention.rs):
manifest.jsonl (one line per shape: dims, dtype, scale, rumble's forward and backward ms) and
raw little-endian files NAME.{q,k,v,do,o,lse,dq,dk,dv}.bin. For each shape this times
SDPA forward and forward+backward (CUDA events, causal, grouped-query heads through
enable_gqa, the default backend choice), checks rumble's o, lse, dq, dk and dv against
PyTorch's (relative L2 error, in f32), and prints a table with the ratio rumble / PyTorch of
the forward+backward time. Also writes DIR/attention_ref.jsonl.
"""
import argparse
import json
import math
import os

import torch
import torch.nn.functional as F

p = argparse.ArgumentParser()
p.add_argument("dir")
p.add_argument("--iters", type=int, default=20)
args = p.parse_args()
dev = torch.device("cuda")
DT = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}


def load(name, part, dtype, shape):
    with open(os.path.join(args.dir, f"{name}.{part}.bin"), "rb") as f:
        data = bytearray(f.read())
    return torch.frombuffer(data, dtype=dtype).reshape(shape).to(dev)


def timed(fn, iters, repeats=5):
    """Mean ms per call over `iters` calls, the median of `repeats` such runs (after a warm-up):
    one run of 20 calls at a fraction of a millisecond each was now and then twice as slow
    (host-side stalls), which a single measurement reports as PyTorch's time."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    runs = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize()
        runs.append(a.elapsed_time(b) / iters)
    return sorted(runs)[len(runs) // 2]


def rel(got, want):
    got, want = got.float(), want.float()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def backend_name(q, k, v, scale):
    """The SDPA backend the default dispatch picks (else the first one that runs alone)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        i = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=True)
        return SDPBackend(i).name.lower()
    except Exception:
        pass
    for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel([b]):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return b.name.lower()
        except RuntimeError:
            continue
    return "?"


rows = []
out = open(os.path.join(args.dir, "attention_ref.jsonl"), "w")
print(f"torch {torch.__version__} on {torch.cuda.get_device_name()}")
for line in open(os.path.join(args.dir, "manifest.jsonl")):
    m = json.loads(line)
    dt = DT[m["dtype"]]
    b, hq, hkv, t, d = m["b"], m["hq"], m["hkv"], m["t"], m["d"]
    name, scale = m["name"], m["scale"]
    q = load(name, "q", dt, (b, hq, t, d)).requires_grad_()
    k = load(name, "k", dt, (b, hkv, t, d)).requires_grad_()
    v = load(name, "v", dt, (b, hkv, t, d)).requires_grad_()
    do = load(name, "do", dt, (b, hq, t, d))

    def fwd():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

    def fwd_bwd():
        q.grad = k.grad = v.grad = None
        fwd().backward(do)

    with torch.no_grad():
        fwd_ms = timed(fwd, args.iters)
    total_ms = timed(fwd_bwd, args.iters)
    # The timed loop left its gradients in .grad; a second backward would add to them.
    q.grad = k.grad = v.grad = None
    o = fwd()
    o.backward(do)
    # PyTorch's lse, in f32 and the natural log, from the same scores (checked in chunks).
    lse = torch.empty(b, hq, t, device=dev)
    kk = k.detach().float().repeat_interleave(hq // hkv, dim=1)
    for i0 in range(0, t, 512):
        s = q.detach()[:, :, i0:i0 + 512].float() @ kk.transpose(-1, -2) * scale
        idx = torch.arange(i0, min(i0 + 512, t), device=dev)[:, None]
        s = s.masked_fill(torch.arange(t, device=dev)[None, :] > idx, -math.inf)
        lse[:, :, i0:i0 + 512] = torch.logsumexp(s, dim=-1)
    errs = {
        "o": rel(load(name, "o", dt, (b, hq, t, d)), o.detach()),
        "lse": rel(load(name, "lse", torch.float32, (b, hq, t)), lse),
        "dq": rel(load(name, "dq", dt, (b, hq, t, d)), q.grad),
        "dk": rel(load(name, "dk", dt, (b, hkv, t, d)), k.grad),
        "dv": rel(load(name, "dv", dt, (b, hkv, t, d)), v.grad),
    }
    ours = m["fwd_ms"] + m["bwd_ms"]
    r = {"name": name, "backend": backend_name(q.detach(), k.detach(), v.detach(), scale), "torch_fwd_ms": fwd_ms,
         "torch_total_ms": total_ms, "rumble_fwd_ms": m["fwd_ms"], "rumble_total_ms": ours,
         "ratio": ours / total_ms, "max_rel_err": max(errs.values()), "errs": errs}
    out.write(json.dumps(r) + "\n")
    rows.append(r)
    del q, k, v, do, o, kk, lse
    torch.cuda.empty_cache()

print()
print("attention fwd+bwd: rumble vs PyTorch SDPA (same inputs; ms; ratio = rumble / torch)")
print(f"{'shape':<22} {'torch backend':<20} {'torch fwd':>9} {'torch f+b':>9} {'rumble fwd':>10} {'rumble f+b':>10} {'ratio':>6}  max rel err vs torch")
for r in rows:
    print(f"{r['name']:<22} {r['backend']:<20} {r['torch_fwd_ms']:>9.3f} {r['torch_total_ms']:>9.3f} "
          f"{r['rumble_fwd_ms']:>10.3f} {r['rumble_total_ms']:>10.3f} {r['ratio']:>6.2f}  {r['max_rel_err']:.2e}  "
          + " ".join(f"{k}={v:.1e}" for k, v in r["errs"].items()))
