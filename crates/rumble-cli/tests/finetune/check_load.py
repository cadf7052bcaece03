"""Loads a folder that `rumble train` wrote (fine-tuned from make_fixture.py's model) with
transformers, as a user would, and checks it: the model and its tokenizer load with
`from_pretrained`, and on the held-out val.jsonl its loss on the response tokens (prompt tokens
masked with -100, as the fine-tuning did) is below the loss of the model it started from.
Prints one JSON line; exits non-zero if a check fails.

usage: python check_load.py RUMBLE_OUT_DIR FIXTURE_DIR   (needs torch, transformers)
"""
import json, os, sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

out_dir, fixture = sys.argv[1], sys.argv[2]
records = [json.loads(l) for l in open(os.path.join(fixture, "val.jsonl")) if l.strip()]


def response_loss(d):
    tok = AutoTokenizer.from_pretrained(d)
    model = AutoModelForCausalLM.from_pretrained(d).float().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for r in records:
            if "text" in r:
                ids = tok(r["text"])["input_ids"] + [tok.eos_token_id]
                labels = list(ids)
            else:
                p = tok(r["prompt"])["input_ids"]
                resp = tok(r["response"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                ids, labels = p + resp, [-100] * len(p) + resp
            out = model(input_ids=torch.tensor([ids]), labels=torch.tensor([labels]))
            n = sum(1 for x in labels[1:] if x != -100)
            total, count = total + out.loss.item() * n, count + n
    return total / count, tok


before, _ = response_loss(os.path.join(fixture, "model"))
after, tok = response_loss(out_dir)
ok = after < before and tok.bos_token_id is not None and tok.eos_token_id is not None
print(json.dumps({"ok": ok, "val_loss_before": before, "val_loss_after": after,
                  "bos": tok.bos_token_id, "eos": tok.eos_token_id, "files": sorted(os.listdir(out_dir))}))
sys.exit(0 if ok else 1)
