#!/usr/bin/env python3
"""Makes the tiny test fixtures under tests/fixtures/ with HF transformers: Llama, Qwen3,
Qwen2, Mistral, GPT-2, and the mixtures of experts Qwen3-MoE and Mixtral.

The fixtures are the reference graft is tested against: small random models written the
way Hugging Face writes checkpoints (config.json, safetensors, tokenizer.json), plus what
transformers itself computes for them (logits, greedy continuations, a trace).

    /path/to/python scripts/make-fixtures.py [NAME ...]   # torch, transformers >= 5, tokenizers
    /path/to/python scripts/make-fixtures.py --traces-only [NAME ...]

With no NAME it makes all of them; --traces-only rewrites only trace.safetensors, from
the folders as they are. Everything is seeded; re-running the script with the same torch
and transformers rewrites identical files. (With other versions the weights, tokenizers,
seeds and greedy tokens come out the same, but config.json's transformers_version,
reference.json's made_with and the float32 logits (at the 1e-6 level) differ, so remake
only the fixtures you change: the llama ones were made with torch 2.11 and transformers
5.17, the others, and every trace.safetensors, with torch 2.15 and transformers 5.23, so
the llama traces' logits are ~5e-6 off their reference.safetensors.) Weights are N(0, 0.2) with norm
weights around 1 and biases N(0, 0.2) (HF initialises biases to zero, which would hide
one that graft leaves out), and each model's seed is the first (from a fixed base) whose
greedy continuation has no EOS and wins every step by a logit margin of at least 0.1, far
above numerical noise, so tests can compare every greedy step. Fixtures:

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
- qwen3-tiny-f32:   Qwen3ForCausalLM: GQA (8 query heads, 2 KV heads, head_dim 16 set
                    explicitly: 8 * 16 = 128 != hidden_size 64), RMSNorm of each q and k
                    head over head_dim before rope (self_attn.q_norm / k_norm, weights
                    around 1), no biases, tied embeddings, rope_theta 1e6, eps 1e-6; F32;
                    classic config form (head_dim kept, as Qwen3 configs have it). The
                    tokenizer is Qwen's kind of byte-level BPE: NFC, Qwen's regex Split,
                    ByteLevel without regex, specials <|endoftext|> <|im_start|>
                    <|im_end|>, nothing added in front (no BOS in the prompt); bos is
                    <|endoftext|>, eos <|im_end|>.
- qwen3-tiny-bf16:  Qwen3 with 4 query heads of head_dim 32 (2 KV heads), untied lm_head,
                    BF16, config in the transformers 5 form; other weights.
- qwen2-tiny-f32:   Qwen2ForCausalLM: Llama plus biases on q_proj, k_proj and v_proj
                    (always on in Qwen2, no config key; o_proj has none), GQA (4 query
                    heads, 2 KV heads), untied, rope_theta 1e6, F32, the Qwen tokenizer
                    (eos <|endoftext|>). The config reads like the published Qwen2.5 ones:
                    no layer_types, sliding_window 32 with use_sliding_window false and
                    max_window_layers 1, which transformers turns into no window at all
                    (sliding_window None, every layer full causal): a loader that applies
                    sliding_window without looking at use_sliding_window gets layer 1's
                    long_logits wrong.
- mistral-tiny-f32: MistralForCausalLM: Llama with GQA (4 query heads, 2 KV heads) and a
                    sliding window of 48 in every layer, rope_theta 1e4, untied, F32,
                    the Llama 2 tokenizer (<s> in front). Window W means: query i sees
                    key j iff i - W < j <= i, i.e. itself and the W - 1 positions before
                    it (transformers' sliding_window_overlay, kv_idx > q_idx - W, and'ed
                    with causal kv_idx <= q_idx; checked numerically: hf-trace's attention
                    recomputed from q/k/v with this mask reproduces the eager result, with
                    W - 1 or W + 1 it does not). Prompt + greedy (39 tokens) stay inside
                    one window; the 280-token long sequence does not, and the script
                    checks that dropping the window (sliding_window=None) leaves positions
                    < 48 bit-identical and changes position 100 and long_logits.
- qwen3moe-tiny-f32: Qwen3MoeForCausalLM: qwen3-tiny-f32's attention (8 query heads of 16,
                    2 KV heads, q/k norms, tied embeddings) and in both blocks a mixture
                    of 8 SwiGLU experts of width 32, 3 per token, norm_topk_prob true
                    (the selected softmax weights renormalised); F32, classic config
                    with num_experts as published Qwen3-MoE configs have it.
- qwen3moe-tiny-bf16: the same with 6 experts of width 48, 2 per token,
                    norm_topk_prob false (the selected experts keep their softmax
                    weights over all experts), untied, BF16, the config as
                    transformers 5 writes it (the count as num_local_experts).
- mixtral-tiny-f32: MixtralForCausalLM: Mistral's attention without a window (4 query
                    heads, 2 KV heads, as published Mixtral configs: sliding_window
                    null), 8 experts of width 48, 2 per token (always renormalised);
                    F32, the Llama 2 tokenizer.
                    The experts are written the way save_pretrained writes them (its
                    default save_original_format): one tensor per expert,
                    mlp.experts.{e}.{gate,up,down}_proj (Qwen) and
                    block_sparse_moe.experts.{e}.{w1,w3,w2} (Mixtral, router
                    block_sparse_moe.gate), which transformers 5 fuses on load; the
                    script checks that loading leaves no key missing or unused. Router
                    weights are N(0, 0.2) like the rest, and each seed must also keep
                    every routing decision of the prompt, the greedy tokens and the long
                    sequence at least MIN_ROUTER_GAP (in router logits) from a tie
                    between the last chosen expert and the next, so that rounding (the
                    F16 KV cache) cannot change which experts run, and give a varied
                    greedy continuation (at least half its tokens distinct).
- gpt2-tiny-f32:    GPT2LMHeadModel: n_embd 64, 2 layers, 4 heads (multi-head), n_inner
                    null (so 4 * 64 = 256), n_positions 512 (learned position embeddings
                    added to the token embeddings), LayerNorm eps 1e-5 with weights around
                    1 and biases, gelu_new (the tanh approximation), biases on every
                    Conv1D (c_attn, c_proj, c_fc; Conv1D weights are [in, out]), lm_head
                    tied to transformer.wte; F32; names with the "transformer." prefix as
                    GPT2LMHeadModel's state_dict has them (parameters only). A byte-level
                    BPE (GPT-2's ByteLevel regex) with <|endoftext|> as bos and eos and
                    nothing added in front.

Each folder also holds reference.json and reference.safetensors:
- tokens: a prompt encoded with the fixture's tokenizer (with the BOS it adds, if any:
  Llama and Mistral add one, Qwen and GPT-2 none); prompt_text;
- logits [n_tokens, vocab]: HF logits of every prompt position, computed in float32 (the
  stored BF16/F16 weights are loaded and upcast to float32), eager attention;
- logits_f16kv [n_tokens, vocab]: the same float32 pass with keys and values rounded to
  float16 after rope (where the architecture has rope), the precision of graft's KV
  cache, for a tight comparison (the script prints how far it and HF's native BF16/F16
  run are from the float32 logits);
- greedy_tokens / greedy_margins: 24 greedy steps after the prompt (float32 reference)
  and the top-1 minus top-2 logit margin of each step;
- long_tokens, long_logits [32, vocab], long_first: a 280-token sequence (prompt, greedy
  tokens, then seeded random ids) and the float32 logits of its positions
  long_first..long_first+32, which straddle position 256 (a decode KV-length bucket
  boundary in graft).

and trace.safetensors: scripts/hf-trace.py's dump of the float32 forward pass over
`tokens` (embd, blk.{i}.attn_norm/q/k/v/kqv/attn_out/ffn_inp/ffn_norm/ffn_out/out,
output_norm, logits; see that script for the shapes), to compare with `graft trace`.
"""

import argparse
import contextlib
import importlib.util
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.models.gpt2 import modeling_gpt2
from transformers.models.llama import modeling_llama
from transformers.models.mistral import modeling_mistral
from transformers.models.mixtral import modeling_mixtral
from transformers.models.qwen2 import modeling_qwen2
from transformers.models.qwen3 import modeling_qwen3
from transformers.models.qwen3_moe import modeling_qwen3_moe

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
MIN_ROUTER_GAP = 1e-3  # every routing decision must clear a tie by this (see router_gap)

# model_type -> (model class, modeling module whose eager_attention_forward f16_kv patches)
MODELS = {
    "llama": (LlamaForCausalLM, modeling_llama),
    "qwen3": (Qwen3ForCausalLM, modeling_qwen3),
    "qwen2": (Qwen2ForCausalLM, modeling_qwen2),
    "mistral": (MistralForCausalLM, modeling_mistral),
    "qwen3_moe": (Qwen3MoeForCausalLM, modeling_qwen3_moe),
    "mixtral": (MixtralForCausalLM, modeling_mixtral),
    "gpt2": (GPT2LMHeadModel, modeling_gpt2),
}

# Qwen2's pre-tokenizer split (tokenizer.json of the published Qwen2/Qwen2.5/Qwen3 models)
QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


def hf_trace():
    """scripts/hf-trace.py as a module (its name has a dash)."""
    spec = importlib.util.spec_from_file_location("hf_trace", ROOT / "scripts" / "hf-trace.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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


def qwen_tokenizer():
    """A byte-level BPE the way Qwen2/Qwen3 write theirs: NFC, their regex split, then
    ByteLevel without regex; specials <|endoftext|>, <|im_start|>, <|im_end|>; nothing
    added in front (Qwen has no BOS)."""
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    endoftext, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    return tok, endoftext, im_end


def gpt2_tokenizer():
    """GPT-2's byte-level BPE: the ByteLevel regex split, <|endoftext|> (its BOS and EOS)
    as the one special token, nothing added in front."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_lines(), trainer)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok, tok.token_to_id("<|endoftext|>")


def random_model(cfg, seed: int):
    """A float32 model with N(0, INIT_RANGE) weights and norm weights around 1 (so a
    missing norm multiplication shows up in the logits); biases (Qwen2's q/k/v, all of
    GPT-2's, LayerNorm's) N(0, INIT_RANGE), not HF's zeros, so a missing bias shows too."""
    torch.manual_seed(seed)
    model = MODELS[cfg.model_type][0](cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or is_layer_norm_weight(name):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(INIT_RANGE * torch.randn_like(p))
            elif ".experts." in name or name.endswith("mlp.gate.weight"):
                # the router (zeros in Qwen3-MoE's __init__) and the experts' stacks
                p.copy_(INIT_RANGE * torch.randn_like(p))
    return model


def is_layer_norm_weight(name):
    """GPT-2's LayerNorm weights: h.{i}.ln_1 / ln_2, ln_f."""
    return name.split(".")[-2] in ("ln_1", "ln_2", "ln_f") and name.endswith(".weight")


def state_dict(model, dtype, tied):
    """The parameters as save_pretrained names them (buffers, if a model had any
    persistent ones, are left out), the tied lm_head too; experts one tensor each."""
    params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items() if k in params}
    if tied:
        del sd["lm_head.weight"]  # shares memory with the embedding table
    return split_experts(sd, model.config.model_type)


def split_experts(sd, model_type):
    """transformers 5 holds each block's experts as two stacks, mlp.experts.gate_up_proj
    [E, 2 ff, hidden] (gate rows first) and mlp.experts.down_proj [E, hidden, ff];
    checkpoints (and save_pretrained) keep one tensor per expert under the original
    names: Qwen's mlp.experts.{e}.{gate,up,down}_proj.weight, Mixtral's
    block_sparse_moe.experts.{e}.{w1,w3,w2}.weight with the router at
    block_sparse_moe.gate.weight."""
    if model_type not in ("qwen3_moe", "mixtral"):
        return sd
    names = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w3", "w2")}[model_type]
    block = "mlp" if model_type == "qwen3_moe" else "block_sparse_moe"
    out = {}
    for k, v in sd.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            pre = k[: -len("mlp.experts.gate_up_proj")] + block + ".experts."
            ff = v.shape[1] // 2
            for e in range(v.shape[0]):
                out[f"{pre}{e}.{names[0]}.weight"] = v[e, :ff].contiguous()
                out[f"{pre}{e}.{names[1]}.weight"] = v[e, ff:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            pre = k[: -len("mlp.experts.down_proj")] + block + ".experts."
            for e in range(v.shape[0]):
                out[f"{pre}{e}.{names[2]}.weight"] = v[e].contiguous()
        elif k.endswith("mlp.gate.weight"):
            out[k[: -len("mlp.gate.weight")] + block + ".gate.weight"] = v
        else:
            out[k] = v
    return out


def varied(cfg, toks):
    """Whether a continuation is varied enough to test decoding: for the mixtures of
    experts (added later, with this rule), at least half the greedy tokens distinct (a
    model stuck on one token would pass a test that compares only those); the older
    fixtures' seeds were picked without it."""
    return cfg.model_type not in ("qwen3_moe", "mixtral") or len(set(toks)) >= len(toks) // 2


def router_gap(model, ids):
    """The smallest margin, over every token and block, between the router logit of the
    last expert a token goes through and the next one (inf for a dense model)."""
    if model.config.model_type not in ("qwen3_moe", "mixtral"):
        return float("inf")
    k = model.config.num_experts_per_tok
    gaps = []

    def hook(mod, args, out):
        top = torch.topk(out[0].float(), k + 1, dim=-1).values
        gaps.append(float((top[:, k - 1] - top[:, k]).min()))

    hooks = [l.mlp.gate.register_forward_hook(hook) for l in model.model.layers]
    try:
        logits_of(model, ids)
    finally:
        for h in hooks:
            h.remove()
    return min(gaps)


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


def classic_config(cfg, dtype_name: str) -> dict:
    """config.json in the pre-transformers-5 form: rope_theta + rope_scaling, torch_dtype."""
    d = cfg.to_diff_dict()
    rp = d.pop("rope_parameters", None)  # GPT-2 has none
    d.pop("dtype", None)
    head_dim = getattr(cfg, "head_dim", None)
    if head_dim is not None and head_dim * cfg.num_attention_heads == cfg.hidden_size:
        d.pop("head_dim", None)  # like real Llama 2 configs: derived from hidden / heads
    if rp is not None:
        d["rope_theta"] = rp.pop("rope_theta")
        d["rope_scaling"] = None if rp.get("rope_type", "default") == "default" else rp
    d["torch_dtype"] = dtype_name
    return d


def qwen2_config(cfg, dtype_name: str) -> dict:
    """The classic form the way published Qwen2/Qwen2.5 configs read: no layer_types, and
    a sliding_window that use_sliding_window=false switches off (transformers then sets
    sliding_window to None: every layer attends to all earlier positions). Window 32 and
    max_window_layers 1 would window layer 1 if the flag were ignored, which the long
    logits (280 positions) would show."""
    d = classic_config(cfg, dtype_name)
    d.pop("layer_types", None)
    d["sliding_window"] = 32
    d["use_sliding_window"] = False
    d["max_window_layers"] = 1
    return d


def qwen3moe_config(cfg, dtype_name: str) -> dict:
    """The classic form as the published Qwen3-MoE configs read: the expert count as
    num_experts (transformers 5 writes its attribute name, num_local_experts)."""
    d = classic_config(cfg, dtype_name)
    d["num_experts"] = d.pop("num_local_experts")
    return d


def new_config(cfg: LlamaConfig, dtype_name: str) -> dict:
    d = cfg.to_diff_dict()
    d["dtype"] = dtype_name
    return d


@contextlib.contextmanager
def f16_kv(modeling=modeling_llama):
    """HF's eager attention with keys and values rounded to float16 (after rope), which
    is exactly the precision of graft's KV cache. `modeling` is the architecture's
    modeling module: its attention looks eager_attention_forward up there at each call
    (GPT-2's too, with q/k/v from c_attn, no rope)."""
    orig = modeling.eager_attention_forward

    def rounded(module, query, key, value, *args, **kwargs):
        return orig(module, query, key.half().float(), value.half().float(), *args, **kwargs)

    modeling.eager_attention_forward = rounded
    try:
        yield
    finally:
        modeling.eager_attention_forward = orig


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


def rounded_model(cfg, seed, dtype):
    """random_model with its parameters rounded to `dtype` and back: the model the
    fixture's folder holds (buffers such as rope's inv_freq stay float32, as when the
    folder is loaded; `.to(dtype)` would round those too, which moves late positions)."""
    model = random_model(cfg, seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())
    return model


def long_sequence(cfg, seed, ids, g_toks):
    """The N_LONG-token sequence of seed `seed`: the prompt, the greedy tokens, then
    seeded random ids."""
    gen = torch.Generator().manual_seed(seed + 1)
    fill = torch.randint(0, cfg.vocab_size, (N_LONG - len(ids) - len(g_toks),), generator=gen)
    return ids + g_toks + [int(t) for t in fill]


def pick_seed(cfg, base, dtype, ids):
    """The first seed from `base` whose model (rounded to `dtype`) has a greedy
    continuation without EOS where every step wins by at least MIN_MARGIN, so that a
    test can compare all steps far above numerical noise."""
    eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, list) else [cfg.eos_token_id]
    for seed in range(base, base + 1000):
        model = rounded_model(cfg, seed, dtype)
        toks, margins = greedy(model, ids, N_GREEDY)
        if min(margins) >= MIN_MARGIN and not set(toks) & set(eos) and varied(cfg, toks):
            if router_gap(model, long_sequence(cfg, seed, ids, toks)) >= MIN_ROUTER_GAP:
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
    ref = load(folder, torch.float32)
    if cfg.model_type == "qwen2" and ref.config.sliding_window is not None:
        raise SystemExit(f"{name}: transformers kept a sliding window despite use_sliding_window=false")
    tensors = {"logits": logits_of(ref, ids).contiguous()}
    with f16_kv(MODELS[cfg.model_type][1]):
        tensors["logits_f16kv"] = logits_of(ref, ids).contiguous()
    if nmse(tensors["logits_f16kv"], tensors["logits"]) == 0:
        raise SystemExit(f"{name}: rounding K/V to float16 changed nothing (the patch missed the attention)")
    native_nmse = None
    if dtype != torch.float32:
        native = load(folder, dtype)
        native_nmse = nmse(logits_of(native, ids), tensors["logits"])
    g_toks, g_margins = greedy(ref, ids, N_GREEDY)
    long_tokens = long_sequence(cfg, seed, ids, g_toks)
    long_all = logits_of(ref, long_tokens)
    gap = router_gap(ref, long_tokens)
    if gap < MIN_ROUTER_GAP:
        raise SystemExit(f"{name}: a routing decision of the long sequence is {gap:.2e} from a tie; pick another base seed")
    tensors["long_logits"] = long_all[LONG_FIRST : LONG_FIRST + LONG_WINDOW].contiguous()
    save_file(tensors, folder / "reference.safetensors")
    window_note = ""
    w = getattr(ref.config, "sliding_window", None)
    if w is not None:
        window_note = "; " + check_window(folder, w, long_tokens, long_all, len(ids) + len(g_toks))
    write_trace(name, ref, ids)

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
        f"{window_note}"
    )


def load(folder, dtype, **overrides):
    """The fixture as transformers reads it: the class config.json's model_type names,
    eager attention; every tensor of the folder used and none missing."""
    model, info = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager", output_loading_info=True, **overrides
    )
    bad = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    if bad:
        raise SystemExit(f"{folder.name}: transformers did not load the folder as written: {bad}")
    return model.eval()


def check_window(folder, w, long_tokens, long_all, n_short):
    """That transformers applies the sliding window w (query i sees keys i-w < j <= i):
    without it (sliding_window=None) the logits of positions < w stay bit-identical, and
    those far past w change, long_logits' too."""
    if n_short > w:
        raise SystemExit(f"{folder.name}: prompt + greedy ({n_short} tokens) would already exceed the window {w}")
    full = logits_of(load(folder, torch.float32, sliding_window=None), long_tokens)
    if not torch.equal(full[:w], long_all[:w]):
        raise SystemExit(f"{folder.name}: positions inside the window changed without it")
    late = nmse(long_all[100], full[100])
    in_long = nmse(long_all[LONG_FIRST : LONG_FIRST + LONG_WINDOW], full[LONG_FIRST : LONG_FIRST + LONG_WINDOW])
    if not (late > 1e-4 and in_long > 1e-4):
        raise SystemExit(f"{folder.name}: the sliding window {w} does not change late positions")
    return f"sliding window {w}: without it, position 100 NMSE {late:.2e}, long_logits {in_long:.2e}"


def write_trace(name, model, ids):
    """trace.safetensors: scripts/hf-trace.py's dump of the prompt's forward pass (what
    `graft trace` writes), after hf-trace's consistency checks."""
    tr = hf_trace()
    tensors, order = tr.trace(model, ids)
    errs = tr.check(model, tensors)
    if max(errs.values()) > 1e-5:
        raise SystemExit(f"{name}: the trace does not fit together: {errs}")
    tr.write(tensors, order, ids, OUT / name / "trace.safetensors", f"hf-trace.py tests/fixtures/{name}")


def main():
    ap = argparse.ArgumentParser(description="Makes the test fixtures under tests/fixtures/.")
    ap.add_argument("names", nargs="*", help="the fixtures to make (default: all)")
    ap.add_argument(
        "--traces-only",
        action="store_true",
        help="only rewrite trace.safetensors of the fixtures, from their folders as they are",
    )
    args = ap.parse_args()

    OUT.mkdir(parents=True, exist_ok=True)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)

    fixtures = {}  # name -> a function that makes it

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
    fixtures["llama2-tiny-f32"] = lambda n: make(n, cfg2, 200, torch.float32, "float32", tok2, classic_config, 1)

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

    fixtures["llama3-tiny-bf16"] = lambda n: make(n, cfg3(), 300, torch.bfloat16, "bfloat16", tok3, new_config, 1)
    fixtures["llama3-tiny-f16"] = lambda n: make(n, cfg3(), 400, torch.float16, "float16", tok3, classic_config, 2)

    tokq, endoftext_q, im_end_q = qwen_tokenizer()

    def qwen3_args(heads, head_dim, tied):
        """The settings of the Qwen3 fixtures, dense and mixtures of experts."""
        return dict(
            vocab_size=tokq.get_vocab_size(),
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=heads,
            num_key_value_heads=2,
            head_dim=head_dim,
            max_position_embeddings=512,
            rms_norm_eps=1e-6,
            rope_theta=1000000.0,
            tie_word_embeddings=tied,
            initializer_range=INIT_RANGE,
            bos_token_id=endoftext_q,
            eos_token_id=im_end_q,
        )

    def cfg_qwen3(heads, head_dim, tied):
        return Qwen3Config(**qwen3_args(heads, head_dim, tied))

    fixtures["qwen3-tiny-f32"] = lambda n: make(
        n, cfg_qwen3(8, 16, True), 500, torch.float32, "float32", tokq, classic_config, 1
    )
    fixtures["qwen3-tiny-bf16"] = lambda n: make(
        n, cfg_qwen3(4, 32, False), 600, torch.bfloat16, "bfloat16", tokq, new_config, 1
    )

    cfg_qwen2 = Qwen2Config(
        vocab_size=tokq.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=endoftext_q,
        eos_token_id=endoftext_q,
    )
    fixtures["qwen2-tiny-f32"] = lambda n: make(n, cfg_qwen2, 700, torch.float32, "float32", tokq, qwen2_config, 1)

    # the settings of the Mistral fixture, and with experts of the Mixtral one
    mistral_args = dict(
        vocab_size=tok2.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        sliding_window=48,
        tie_word_embeddings=False,
        initializer_range=INIT_RANGE,
        bos_token_id=bos2,
        eos_token_id=eos2,
    )
    cfg_mistral = MistralConfig(**mistral_args)
    fixtures["mistral-tiny-f32"] = lambda n: make(
        n, cfg_mistral, 800, torch.float32, "float32", tok2, classic_config, 1
    )

    def cfg_qwen3moe(heads, head_dim, tied, experts, used, ff, norm):
        return Qwen3MoeConfig(
            **qwen3_args(heads, head_dim, tied),
            moe_intermediate_size=ff,
            num_experts=experts,
            num_experts_per_tok=used,
            norm_topk_prob=norm,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )

    fixtures["qwen3moe-tiny-f32"] = lambda n: make(
        n, cfg_qwen3moe(8, 16, True, 8, 3, 32, True), 1733, torch.float32, "float32", tokq, qwen3moe_config, 1
    )
    fixtures["qwen3moe-tiny-bf16"] = lambda n: make(
        n, cfg_qwen3moe(4, 32, False, 6, 2, 48, False), 1100, torch.bfloat16, "bfloat16", tokq, new_config, 1
    )

    cfg_mixtral = MixtralConfig(
        **{
            **mistral_args,
            "intermediate_size": 48,
            "rope_theta": 1000000.0,
            "sliding_window": None,
        },
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    fixtures["mixtral-tiny-f32"] = lambda n: make(
        n, cfg_mixtral, 1200, torch.float32, "float32", tok2, classic_config, 1
    )

    tokg, endoftext_g = gpt2_tokenizer()
    cfg_gpt2 = GPT2Config(
        vocab_size=tokg.get_vocab_size(),
        n_embd=64,
        n_layer=2,
        n_head=4,
        n_positions=512,
        activation_function="gelu_new",
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=True,
        initializer_range=INIT_RANGE,
        bos_token_id=endoftext_g,
        eos_token_id=endoftext_g,
    )
    fixtures["gpt2-tiny-f32"] = lambda n: make(n, cfg_gpt2, 900, torch.float32, "float32", tokg, classic_config, 1)

    names = args.names or list(fixtures)
    unknown = [n for n in names if n not in fixtures]
    if unknown:
        raise SystemExit(f"unknown fixtures {unknown}; there are {list(fixtures)}")
    for name in names:
        if args.traces_only:
            ids = json.loads((OUT / name / "reference.json").read_text())["tokens"]
            write_trace(name, load(OUT / name, torch.float32), ids)
            print(f"{name}: trace.safetensors over {len(ids)} tokens")
        else:
            fixtures[name](name)


if __name__ == "__main__":
    main()
