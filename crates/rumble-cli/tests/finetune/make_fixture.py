"""Makes the fine-tuning fixture that tests/finetune.rs trains with `rumble train`.

`model/`: a small LLaMA written by transformers' `save_pretrained`, sharded into two files with
`model.safetensors.index.json` (`max_shard_size` below the model's size), with a byte-level BPE
`tokenizer.json` trained here by the `tokenizers` library (BOS added by its post-processor, as
LLaMA's is) and the `tokenizer_config.json` transformers writes for it. `data.jsonl`: prompt /
response pairs (loss on the responses) and plain `text` records, and `val.jsonl` held out.

usage: python make_fixture.py OUT_DIR   (needs torch, transformers, tokenizers)
"""
import json, os, random, sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
rng = random.Random(0)
COUNTRIES = [("France", "Paris"), ("Spain", "Madrid"), ("Italy", "Rome"), ("Japan", "Tokyo"),
             ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Chile", "Santiago"), ("Egypt", "Cairo"),
             ("Norway", "Oslo"), ("Canada", "Ottawa"), ("Cuba", "Havana"), ("Greece", "Athens")]
COLORS = ["red", "green", "blue", "yellow", "black", "white"]


def record():
    if rng.random() < 0.7:
        c, cap = rng.choice(COUNTRIES)
        return {"prompt": f"What is the capital of {c}?\n", "response": f"The capital of {c} is {cap}."}
    a, b = rng.sample(COLORS, 2)
    return {"text": f"The {a} ball is next to the {b} box, and the {b} box is under the {a} ball."}


def write_jsonl(path, n):
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps(record()) + "\n")


write_jsonl(os.path.join(out, "data.jsonl"), 400)
write_jsonl(os.path.join(out, "val.jsonl"), 40)

# A byte-level BPE tokenizer, trained on the data.
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>"],
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
texts = [json.loads(l) for l in open(os.path.join(out, "data.jsonl"))]
tok.train_from_iterator([r.get("text") or r["prompt"] + r["response"] for r in texts], trainer)
bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6,
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                  tie_word_embeddings=False, max_position_embeddings=256, bos_token_id=bos, eos_token_id=eos)
model = LlamaForCausalLM(cfg)
size = sum(p.numel() * p.element_size() for p in model.parameters())
model_dir = os.path.join(out, "model")
model.save_pretrained(model_dir, max_shard_size=f"{size * 6 // 10 // 1000}KB")
fast.save_pretrained(model_dir)
print(json.dumps({"vocab": tok.get_vocab_size(), "bytes": size, "files": sorted(os.listdir(model_dir))}))
