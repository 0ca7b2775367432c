#!/usr/bin/env python3
"""Makes the tiny Llama test fixtures under tests/fixtures/ with HF transformers.

The fixtures are the reference graft is tested against: small random Llama models
written the way Hugging Face writes checkpoints (config.json, safetensors, tokenizer.json),
plus what transformers itself computes for them (logits, greedy continuations).

    /path/to/python scripts/make-fixtures.py      # torch, transformers >= 5, tokenizers

Everything is seeded; re-running the script rewrites identical files. Weights are
N(0, 0.2) with norm weights around 1, and each model's seed is the first (from a fixed
base) whose greedy continuation has no EOS and wins every step by a logit margin of at
least 0.1, far above numerical noise, so tests can compare every greedy step. Fixtures:

- llama2-tiny-f32:  Llama 2 style: multi-head attention, untied lm_head, F32, rope_theta
                    1e4; config in the classic form (rope_theta + rope_scaling: null,
                    torch_dtype); a sentencepiece-like BPE (Metaspace) adding <s>.
- llama3-tiny-bf16: Llama 3 style: GQA (8 query heads, 2 KV heads, head_dim 16 set
                    explicitly, so n_head * head_dim != hidden_size), tied embeddings,
                    rope_theta 5e5 with llama3 rope scaling whose small
                    original_max_position_embeddings (64) makes the scaling change the
                    frequencies; BF16; config in the transformers 5 form (rope_parameters,
                    dtype); a byte-level BPE adding <|begin_of_text|>; eos is a list.
- llama3-tiny-f16:  the same architecture in F16 with other weights, config in the
                    classic form with a llama3 rope_scaling dict, stored as two shards
                    with model.safetensors.index.json.

Each folder also holds reference.json and reference.safetensors:
- tokens: a prompt encoded with the fixture's tokenizer (BOS included); prompt_text;
- logits [n_tokens, vocab]: HF logits of every prompt position, computed in float32 (the
  stored BF16/F16 weights are loaded and upcast to float32), eager attention;
- logits_f16kv [n_tokens, vocab]: the same float32 pass with keys and values rounded to
  float16 after rope, the precision of graft's KV cache, for a tight comparison (the
  script prints how far it and HF's native BF16/F16 run are from the float32 logits);
- greedy_tokens / greedy_margins: 24 greedy steps after the prompt (float32 reference)
  and the top-1 minus top-2 logit margin of each step;
- long_tokens, long_logits [32, vocab], long_first: a 280-token sequence (prompt, greedy
  tokens, then seeded random ids) and the float32 logits of its positions
  long_first..long_first+32, which straddle position 256 (a decode KV-length bucket
  boundary in graft).
"""

import contextlib
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "scripts" / "fixture-corpus.txt"
OUT = ROOT / "tests" / "fixtures"

VOCAB = 512
PROMPT = "The old lighthouse keeper walked along the shore at night"
N_GREEDY = 24
N_LONG = 280
LONG_WINDOW = 32
LONG_FIRST = 248  # positions 248..280 straddle 256
INIT_RANGE = 0.2  # std of the random weights; large enough for clear greedy margins
MIN_MARGIN = 0.1  # every reference greedy step must win by at least this (see pick_seed)


def corpus_lines():
    return [l for l in CORPUS.read_text(encoding="utf-8").splitlines() if l.strip()]


def llama2_tokenizer():
    """A sentencepiece-like BPE: words marked with U+2581, <s> added in front."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    return tok, bos, tok.token_to_id("</s>")


def llama3_tokenizer():
    """A GPT-2 style byte-level BPE (every byte has a token), BOS added in front."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    ids = [tok.token_to_id(s) for s in specials]
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", ids[0])],
    )
    return tok, ids[0], [ids[1], ids[2]]


def random_model(cfg: LlamaConfig, seed: int) -> LlamaForCausalLM:
    """A float32 model with N(0, INIT_RANGE) weights and norm weights around 1 (so a
    missing norm multiplication shows up in the logits)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    return model


def state_dict(model, dtype, tied):
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if tied:
        del sd["lm_head.weight"]  # shares memory with model.embed_tokens.weight
    return sd


def write_weights(folder: Path, sd, shards: int):
    names = sorted(sd)
    if shards == 1:
        save_file(sd, folder / "model.safetensors", metadata={"format": "pt"})
        return
    per = (len(names) + shards - 1) // shards
    weight_map = {}
    total = 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: sd[n] for n in names[s * per : (s + 1) * per]}
        save_file(part, folder / fname, metadata={"format": "pt"})
        for n, t in part.items():
            weight_map[n] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def classic_config(cfg: LlamaConfig, dtype_name: str) -> dict:
    """config.json in the pre-transformers-5 form: rope_theta + rope_scaling, torch_dtype."""
    d = cfg.to_diff_dict()
    rp = d.pop("rope_parameters")
    d.pop("dtype", None)
    if cfg.head_dim * cfg.num_attention_heads == cfg.hidden_size:
        d.pop("head_dim", None)  # like real Llama 2 configs: derived from hidden / heads
    d["rope_theta"] = rp.pop("rope_theta")
    d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    d["torch_dtype"] = dtype_name
    return d


def new_config(cfg: LlamaConfig, dtype_name: str) -> dict:
    d = cfg.to_diff_dict()
    d["dtype"] = dtype_name
    return d


@contextlib.contextmanager
def f16_kv():
    """HF's eager attention with keys and values rounded to float16 (after rope), which
    is exactly the precision of graft's KV cache."""
    orig = modeling_llama.eager_attention_forward

    def rounded(module, query, key, value, *args, **kwargs):
        return orig(module, query, key.half().float(), value.half().float(), *args, **kwargs)

    modeling_llama.eager_attention_forward = rounded
    try:
        yield
    finally:
        modeling_llama.eager_attention_forward = orig


def nmse(a, b):
    return float(((a - b) ** 2).sum() / (b**2).sum())


@torch.no_grad()
def logits_of(model, ids):
    return model(torch.tensor([ids])).logits[0].float()


@torch.no_grad()
def greedy(model, ids, n):
    seq = list(ids)
    toks, margins = [], []
    for _ in range(n):
        last = logits_of(model, seq)[-1]
        top = torch.topk(last, 2)
        toks.append(int(top.indices[0]))
        margins.append(float(top.values[0] - top.values[1]))
        seq.append(toks[-1])
    return toks, margins


def pick_seed(cfg, base, dtype, ids):
    """The first seed from `base` whose model (rounded to `dtype`) has a greedy
    continuation without EOS where every step wins by at least MIN_MARGIN, so that a
    test can compare all steps far above numerical noise."""
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    for seed in range(base, base + 1000):
        model = random_model(cfg, seed).to(dtype).float()
        toks, margins = greedy(model, ids, N_GREEDY)
        if min(margins) >= MIN_MARGIN and not set(toks) & set(eos):
            return seed
    raise SystemExit(f"no seed in {base}..{base + 1000} gives margins >= {MIN_MARGIN}")


def make(name, cfg, base_seed, dtype, dtype_name, tok, config_form, shards):
    folder = OUT / name
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    ids = tok.encode(PROMPT).ids
    seed = pick_seed(cfg, base_seed, dtype, ids)
    model = random_model(cfg, seed)
    write_weights(folder, state_dict(model, dtype, cfg.tie_word_embeddings), shards)
    conf = config_form(cfg, dtype_name)
    (folder / "config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
    tok.save(str(folder / "tokenizer.json"))

    # The reference: HF reads the folder back (config as written, stored weights upcast).
    ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    tensors = {"logits": logits_of(ref, ids).contiguous()}
    with f16_kv():
        tensors["logits_f16kv"] = logits_of(ref, ids).contiguous()
    native_nmse = None
    if dtype != torch.float32:
        native = LlamaForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager").eval()
        native_nmse = nmse(logits_of(native, ids), tensors["logits"])
    g_toks, g_margins = greedy(ref, ids, N_GREEDY)
    gen = torch.Generator().manual_seed(seed + 1)
    fill = torch.randint(0, cfg.vocab_size, (N_LONG - len(ids) - len(g_toks),), generator=gen)
    long_tokens = ids + g_toks + [int(t) for t in fill]
    tensors["long_logits"] = logits_of(ref, long_tokens)[LONG_FIRST : LONG_FIRST + LONG_WINDOW].contiguous()
    save_file(tensors, folder / "reference.safetensors")

    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    hit = [t for t in g_toks if t in eos]
    if hit:
        raise SystemExit(f"{name}: the greedy continuation contains EOS {hit}")
    meta = {
        "prompt_text": PROMPT,
        "tokens": ids,
        "greedy_tokens": g_toks,
        "greedy_margins": [round(m, 6) for m in g_margins],
        "long_tokens": long_tokens,
        "long_first": LONG_FIRST,
        "dtype": dtype_name,
        "seed": seed,
        "made_with": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    (folder / "reference.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(
        f"{name}: seed {seed}, {len(ids)} prompt tokens, greedy {g_toks[:8]}..., "
        f"min margin {min(g_margins):.4f}, median {sorted(g_margins)[len(g_margins) // 2]:.4f}; "
        f"NMSE vs f32: F16 K/V {nmse(tensors['logits_f16kv'], tensors['logits']):.2e}, "
        f"native {dtype_name} run {native_nmse if native_nmse is None else f'{native_nmse:.2e}'}"
    )


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    tok2, bos2, eos2 = llama2_tokenizer()
    cfg2 = LlamaConfig(
        vocab_size=tok2.get_vocab_size(),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=bos2,
        eos_token_id=eos2,
    )
    make("llama2-tiny-f32", cfg2, 200, torch.float32, "float32", tok2, classic_config, 1)

    tok3, bos3, eos3 = llama3_tokenizer()

    def cfg3():
        return LlamaConfig(
            vocab_size=tok3.get_vocab_size(),
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=512,
            rms_norm_eps=1e-5,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            tie_word_embeddings=True,
            initializer_range=INIT_RANGE,
            bos_token_id=bos3,
            eos_token_id=eos3,
        )

    make("llama3-tiny-bf16", cfg3(), 300, torch.bfloat16, "bfloat16", tok3, new_config, 1)
    make("llama3-tiny-f16", cfg3(), 400, torch.float16, "float16", tok3, classic_config, 2)


if __name__ == "__main__":
    main()
