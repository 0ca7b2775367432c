#!/usr/bin/env python3
"""Reference outputs of the default model from Hugging Face transformers.

transformers loads the SmolLM2-135M-Instruct Q4_1 GGUF (the file `graft pull` fetches)
and dequantizes its weights to float32; this script writes, for a few prompts of varied
text, the prompt's token ids, HF's greedy continuation with each step's top-1 minus top-2
logit margin (reference.json), and the float32 logits of the last prompt position of
each prompt (logits.safetensors, `[n_prompts, vocab]`), into a folder that
tests/models/default_model.rs compares graft against; and the token ids of a varied
text corpus (without special tokens added), which graft's tokenizer must match exactly.

graft computes with the Q4_1 blocks as stored (and, on the CPU's default path, Q8_1
activations), so its logits differ from these by the quantization of the activations;
the greedy tokens must agree wherever the margin is clear.

Usage (needs torch, transformers and gguf; CPU is enough):
    python3 scripts/make-smollm2-reference.py MODEL.gguf tests/fixtures/smollm2-reference
"""

import json
import os
import sys

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

# Tokenizer corpus: numbers, code, runs of whitespace, unicode, Chinese, contractions,
# special-token text and byte-level oddities; only the ids are compared.
TOKENIZE = [
    "Hello world",
    " leading space and trailing space ",
    "3.14159 2718281828 1,000,000 -42 +7e-10 0x1F 2026-11-23",
    "fn main() {\n    let x: Vec<u8> = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\n}",
    "a  b   c    d\n\n\nnew\r\nlines\t\ttabs",
    "I'm sure they're here, it's what we'd've done; y'all can't won't shouldn't",
    "naïve café résumé Ångström façade — “quotes” ‘single’ …",
    "Emoji: 🦀🚀👍🏽 and flags 🇫🇷 and ZWJ 👩‍👩‍👧",
    "中文分词测试：我们今天去北京天安门广场。",
    "日本語のテキストと한국어 텍스트, Русский текст, ελληνικά, עברית, العربية",
    "<|im_start|>user\nHi<|im_end|>",
    "   ",
    "\u00a0non-breaking\u00a0spaces and soft\u00adhyphen",
    "URL: https://example.com/path?q=1&r=two#frag and email a.b@c.org",
    "MiXeD CaSe WORDS and ALLCAPS and camelCaseIdentifiers snake_case_names",
]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Photosynthesis is the process by which plants",
    "1, 2, 3, 5, 8, 13, 21,",
]
STEPS = 16


def main():
    gguf_path, out = sys.argv[1], sys.argv[2]
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    tokenized = [{"text": t, "ids": tok(t, add_special_tokens=False).input_ids} for t in TOKENIZE]
    cases, last = [], []
    for text in PROMPTS:
        ids = tok(text).input_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float().numpy()
            seq = list(ids)
            greedy, margins = [], []
            for _ in range(STEPS):
                step = model(torch.tensor([seq])).logits[0, -1].float()
                top = torch.topk(step, 2)
                greedy.append(int(top.indices[0]))
                margins.append(float(top.values[0] - top.values[1]))
                seq.append(greedy[-1])
        last.append(logits.astype(np.float32))
        cases.append({
            "text": text,
            "ids": ids,
            "greedy": greedy,
            "margins": margins,
        })
        print(f"{text!r}: {len(ids)} ids, greedy {tok.decode(greedy)!r}", file=sys.stderr)
    meta = {"model": name, "transformers": __import__("transformers").__version__,
            "torch": torch.__version__, "tokenize": tokenized, "cases": cases}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(meta, f, ensure_ascii=False, indent=1)
    save_file({"logits": np.stack(last)}, os.path.join(out, "logits.safetensors"))


if __name__ == "__main__":
    main()
