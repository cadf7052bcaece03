"""Makes a Hugging Face model folder and a JSONL dataset to fine-tune on, for `scripts/gpu finetune`.

OUT/: the model of a config.json (default bench/suite/Qwen2.5-0.5B/config.json) with random
bf16 weights, written by transformers' `save_pretrained` in shards (`--max-shard-size`, with
`model.safetensors.index.json`); a byte-level BPE `tokenizer.json` trained here by the
`tokenizers` library on the dataset's text (its vocabulary at most the config's, `<|endoftext|>`
its end-of-text token, no BOS added: Qwen2's convention) and the `tokenizer_config.json`
transformers writes for it; the config's bos/eos ids point at that token.
OUT/train.jsonl: `prompt` / `response` records of generated text (the loss is on the responses).
Everything follows from --seed: the same seed writes the same files.

usage: python3 bench/reference/make_finetune_folder.py OUT [--config FILE] [--seed 0]
           [--records 20000] [--vocab 16384] [--max-shard-size 400MB]
(needs torch, transformers, tokenizers)
"""
import argparse
import json
import os
import random

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

ap = argparse.ArgumentParser()
ap.add_argument("out")
ap.add_argument("--config", default="bench/suite/Qwen2.5-0.5B/config.json")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--records", type=int, default=20000)
ap.add_argument("--vocab", type=int, default=16384, help="BPE vocabulary asked for (capped at the config's)")
ap.add_argument("--max-shard-size", default="400MB")
a = ap.parse_args()
os.makedirs(a.out, exist_ok=True)
rng = random.Random(a.seed)

# Generated text: short questions about made-up things and answers built from the same words,
# so a model can learn something in a few hundred steps.
NOUNS = ["river", "engine", "garden", "planet", "library", "bridge", "forest", "harbor", "market", "castle",
         "valley", "tower", "island", "station", "kitchen", "mountain", "village", "factory", "museum", "desert"]
ADJS = ["old", "quiet", "bright", "narrow", "ancient", "busy", "cold", "green", "hidden", "tall", "broken",
        "golden", "empty", "distant", "small", "famous"]
VERBS = ["crosses", "feeds", "guards", "faces", "surrounds", "powers", "follows", "hides", "lights", "shelters"]
NAMES = ["Ada", "Boris", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lars", "Mina"]


def phrase():
    return f"the {rng.choice(ADJS)} {rng.choice(NOUNS)}"


def record():
    who, a_, b_ = rng.choice(NAMES), phrase(), phrase()
    verb = rng.choice(VERBS)
    kind = rng.randrange(3)
    if kind == 0:
        prompt = f"Question: what {verb} {b_} near {who}'s home?\nAnswer:"
        response = f" {a_.capitalize()} {verb} {b_}, and {who} walks there every {rng.choice(['morning', 'evening', 'week'])}."
    elif kind == 1:
        n = rng.randrange(2, 40)
        prompt = f"Question: how many {rng.choice(NOUNS)}s did {who} count beside {a_}?\nAnswer:"
        response = f" {who} counted {n} of them beside {a_}, {rng.choice(['more', 'fewer'])} than last year."
    else:
        prompt = f"Describe {a_} in one sentence.\n"
        response = (f"{a_.capitalize()} {verb} {b_}; {rng.choice(NAMES)} says it is "
                    f"{rng.choice(ADJS)} and {rng.choice(ADJS)}.")
    return {"prompt": prompt, "response": response}


records = [record() for _ in range(a.records)]
with open(os.path.join(a.out, "train.jsonl"), "w") as f:
    for r in records:
        f.write(json.dumps(r) + "\n")

cfg = AutoConfig.from_pretrained(a.config)
EOT = "<|endoftext|>"
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=min(a.vocab, cfg.vocab_size), special_tokens=[EOT],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train_from_iterator((r["prompt"] + r["response"] for r in records), trainer)
eot = tok.token_to_id(EOT)
assert tok.get_vocab_size() <= cfg.vocab_size, (tok.get_vocab_size(), cfg.vocab_size)
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOT, pad_token=EOT)

cfg.bos_token_id = cfg.eos_token_id = eot
torch.manual_seed(a.seed)
model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
model.generation_config.bos_token_id = model.generation_config.eos_token_id = eot
model.save_pretrained(a.out, max_shard_size=a.max_shard_size)
fast.save_pretrained(a.out)
print(json.dumps({"out": a.out, "config": a.config, "params": sum(p.numel() for p in model.parameters()),
                  "vocab": tok.get_vocab_size(), "config_vocab": cfg.vocab_size, "eos": eot,
                  "records": len(records), "files": sorted(os.listdir(a.out))}), flush=True)
