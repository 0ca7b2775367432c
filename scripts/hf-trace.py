#!/usr/bin/env python3
"""Dumps the named intermediate tensors of an HF model's forward pass, to compare with
`graft trace` (which writes the same names, shapes and metadata).

    python scripts/hf-trace.py --model DIR (--prompt TEXT | --tokens 1,2,3) --out FILE.safetensors [--dtype float32]

DIR is an HF checkpoint folder (config.json, safetensors, and tokenizer.json for
--prompt, which is encoded with add_special_tokens=True). The model is loaded with
AutoModelForCausalLM and eager attention (float32 unless --dtype says otherwise) and run
once over all the tokens. Supported architectures (config.json model_type): llama,
mistral, qwen2, qwen3, qwen3_moe, mixtral, gpt2.

The file holds F32 tensors (n = number of tokens, the batch dimension dropped):

    embd               [n, n_embd]   input of block 0 (token embeddings; GPT-2: + positions)
    blk.{i}.attn_norm  [n, n_embd]   output of the block's first norm (input_layernorm / ln_1)
    blk.{i}.q          [n, n_head, head_dim]      queries after q_norm (Qwen3) and rope
    blk.{i}.k          [n, n_kv_head, head_dim]   keys after k_norm (Qwen3) and rope
    blk.{i}.v          [n, n_kv_head, head_dim]   values
    blk.{i}.kqv        [n, n_head * head_dim]     attention result, heads merged (o_proj's input)
    blk.{i}.attn_out   [n, n_embd]   output of o_proj / attn.c_proj (bias included)
    blk.{i}.ffn_inp    [n, n_embd]   residual after attention (input of the second norm)
    blk.{i}.ffn_norm   [n, n_embd]   output of post_attention_layernorm / ln_2
    blk.{i}.ffn_out    [n, n_embd]   the MLP's output (down_proj / mlp.c_proj, bias included;
                                     a mixture of experts' weighted sum)
    blk.{i}.out        [n, n_embd]   the block's output (ffn_inp + ffn_out)
    output_norm        [n, n_embd]   output of the final norm (model.norm / ln_f)
    logits             [n, vocab]

with metadata graft.trace.order (the names above in execution order, comma-separated),
graft.trace.source ("hf-trace.py DIR") and graft.trace.tokens (the ids, comma-separated);
the same trace always gives the same bytes.

Values come from forward hooks; q and k after rope, which no hook sees, from wrapping the
modeling module's apply_rotary_pos_emb during the run. GPT-2's q, k and v are the three
thirds of c_attn's output. Before writing, the script checks that the tensors fit
together (residual sums, attention recomputed from q/k/v, final norm + lm_head of the last
block's output against the logits) and prints the largest relative error of each check.
"""

import argparse
import json
import struct
import sys
from pathlib import Path

import torch

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral", "gpt2")
LAYER_NAMES = ("attn_norm", "q", "k", "v", "kqv", "attn_out", "ffn_inp", "ffn_norm", "ffn_out", "out")


def trace_order(n_layer):
    names = ["embd"]
    for i in range(n_layer):
        names += [f"blk.{i}.{s}" for s in LAYER_NAMES]
    return names + ["output_norm", "logits"]


class Parts:
    """The modules of one architecture that the hooks attach to."""

    def __init__(self, model):
        kind = model.config.model_type
        if kind not in SUPPORTED:
            raise SystemExit(f"hf-trace: model_type {kind!r} is not supported (only {', '.join(SUPPORTED)})")
        self.kind = kind
        self.modeling = sys.modules[type(model).__module__]
        if kind == "gpt2":
            base = model.transformer
            self.layers = list(base.h)
            self.final_norm = base.ln_f
        else:
            base = model.model
            self.layers = list(base.layers)
            self.final_norm = base.norm
        self.lm_head = model.lm_head

    def norm1(self, l):
        return l.ln_1 if self.kind == "gpt2" else l.input_layernorm

    def norm2(self, l):
        return l.ln_2 if self.kind == "gpt2" else l.post_attention_layernorm

    def attn(self, l):
        return l.attn if self.kind == "gpt2" else l.self_attn

    def o_proj(self, l):
        return l.attn.c_proj if self.kind == "gpt2" else l.self_attn.o_proj

    def n_head(self, l):
        a = self.attn(l)
        return a.num_heads if self.kind == "gpt2" else a.config.num_attention_heads

    def n_kv_head(self, l):
        a = self.attn(l)
        return a.num_heads if self.kind == "gpt2" else a.config.num_key_value_heads

    def head_dim(self, l):
        return self.attn(l).head_dim

    def window(self, l):
        """The sliding window of layer l's attention (None: full causal)."""
        a = self.attn(l)
        if hasattr(a, "sliding_window"):  # qwen2/qwen3: per layer type
            return a.sliding_window
        return getattr(a.config, "sliding_window", None)  # mistral: every layer


def _first(x):
    return x[0] if isinstance(x, tuple) else x


@torch.no_grad()
def trace(model, ids):
    """Runs `model` over `ids` and returns ({name: float32 tensor}, names in order)."""
    parts = Parts(model)
    n = len(ids)
    got = {}
    hooks = []
    cur = [None]  # the layer whose attention is running (for the rope wrapper)

    def keep(name, t):
        if name in got:
            raise SystemExit(f"hf-trace: {name} captured twice")
        got[name] = t.detach()[0].float().contiguous().clone()

    def on_input(name):
        def pre(mod, args, kwargs):
            keep(name, args[0] if args else kwargs["hidden_states"])

        return pre

    def on_output(name):
        def post(mod, args, out):
            keep(name, _first(out))

        return post

    def add_pre(mod, name):
        hooks.append(mod.register_forward_pre_hook(on_input(name), with_kwargs=True))

    def add_post(mod, name):
        hooks.append(mod.register_forward_hook(on_output(name)))

    add_pre(parts.layers[0], "embd")
    for i, l in enumerate(parts.layers):
        p = f"blk.{i}."
        hd, nh, nkv = parts.head_dim(l), parts.n_head(l), parts.n_kv_head(l)
        add_post(parts.norm1(l), p + "attn_norm")

        def set_cur(mod, args, kwargs, i=i):
            cur[0] = i

        hooks.append(parts.attn(l).register_forward_pre_hook(set_cur, with_kwargs=True))
        if parts.kind == "gpt2":

            def split_qkv(mod, args, out, p=p, hd=hd):
                q, k, v = _first(out)[0].split(out.shape[-1] // 3, dim=-1)
                for s, t in (("q", q), ("k", k), ("v", v)):
                    keep(p + s, t.reshape(1, n, -1, hd))

            hooks.append(l.attn.c_attn.register_forward_hook(split_qkv))
        else:

            def on_v(mod, args, out, p=p, hd=hd):
                keep(p + "v", out.reshape(1, n, -1, hd))

            hooks.append(l.self_attn.v_proj.register_forward_hook(on_v))
        add_pre(parts.o_proj(l), p + "kqv")
        add_post(parts.o_proj(l), p + "attn_out")
        add_pre(parts.norm2(l), p + "ffn_inp")
        add_post(parts.norm2(l), p + "ffn_norm")
        add_post(l.mlp, p + "ffn_out")
        add_post(l, p + "out")
    add_post(parts.final_norm, "output_norm")

    orig_rope = getattr(parts.modeling, "apply_rotary_pos_emb", None)

    def rope(q, k, *args, **kwargs):
        qe, ke = orig_rope(q, k, *args, **kwargs)
        p = f"blk.{cur[0]}."
        keep(p + "q", qe.transpose(1, 2))  # [1, heads, n, hd] -> [1, n, heads, hd]
        keep(p + "k", ke.transpose(1, 2))
        return qe, ke

    if parts.kind != "gpt2":
        parts.modeling.apply_rotary_pos_emb = rope
    try:
        logits = model(torch.tensor([ids])).logits
    finally:
        if parts.kind != "gpt2":
            parts.modeling.apply_rotary_pos_emb = orig_rope
        for h in hooks:
            h.remove()
    keep("logits", logits)

    order = trace_order(len(parts.layers))
    missing = [x for x in order if x not in got]
    if missing:
        raise SystemExit(f"hf-trace: not captured: {', '.join(missing)}")
    for i, l in enumerate(parts.layers):
        p = f"blk.{i}."
        hd, nh, nkv = parts.head_dim(l), parts.n_head(l), parts.n_kv_head(l)
        want = {"q": [n, nh, hd], "k": [n, nkv, hd], "v": [n, nkv, hd], "kqv": [n, nh * hd]}
        for s, shape in want.items():
            if list(got[p + s].shape) != shape:
                raise SystemExit(f"hf-trace: {p + s} is {list(got[p + s].shape)}, expected {shape}")
    return {x: got[x] for x in order}, order


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def check(model, tensors):
    """How well the traced tensors fit together: {check: largest relative error}. Each
    recomputation repeats what the model does, so errors are rounding only (~1e-7 in
    float32); a wrong hook shows up as O(1)."""
    parts = Parts(model)
    dt = next(model.parameters()).dtype
    err = {"residual": 0.0, "attention": 0.0, "o_proj": 0.0}
    prev = tensors["embd"]
    n = prev.shape[0]
    for i, l in enumerate(parts.layers):
        p = f"blk.{i}."
        t = {s: tensors[p + s] for s in LAYER_NAMES}
        err["residual"] = max(err["residual"], _rel(prev + t["attn_out"], t["ffn_inp"]))
        err["residual"] = max(err["residual"], _rel(t["ffn_inp"] + t["ffn_out"], t["out"]))
        err["o_proj"] = max(err["o_proj"], _rel(parts.o_proj(l)(t["kqv"].to(dt)).float(), t["attn_out"]))
        # attention from q, k, v: causal (and the sliding window where the layer has one)
        nh, nkv = parts.n_head(l), parts.n_kv_head(l)
        q = t["q"].transpose(0, 1)  # [nh, n, hd]
        k = t["k"].transpose(0, 1).repeat_interleave(nh // nkv, dim=0)
        v = t["v"].transpose(0, 1).repeat_interleave(nh // nkv, dim=0)
        s = q @ k.transpose(1, 2) * parts.attn(l).scaling
        i_ = torch.arange(n)[:, None]
        j_ = torch.arange(n)[None, :]
        visible = j_ <= i_
        w = parts.window(l)
        if w is not None:
            visible &= j_ > i_ - w
        s = s.masked_fill(~visible, float("-inf"))
        kqv = (s.softmax(-1) @ v).transpose(0, 1).reshape(n, -1)
        err["attention"] = max(err["attention"], _rel(kqv, t["kqv"]))
        prev = t["out"]
    out = parts.lm_head(parts.final_norm(prev.to(dt)[None]))[0].float()
    err["final norm + lm_head"] = _rel(out, tensors["logits"])
    return err


def write(tensors, order, ids, out, source):
    """The safetensors file, written here rather than with safetensors.torch.save_file,
    whose header puts the metadata keys in a different order on every run: this way the
    same trace is the same bytes (tensors in execution order, 8-byte aligned header)."""
    meta = {
        "graft.trace.order": ",".join(order),
        "graft.trace.source": source,
        "graft.trace.tokens": ",".join(str(t) for t in ids),
    }
    header = {"__metadata__": meta}
    blobs = []
    offset = 0
    for name in order:
        t = tensors[name].detach().to(torch.float32).contiguous().cpu()
        blob = t.numpy().astype("<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(out, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for blob in blobs:
            f.write(blob)


def main():
    ap = argparse.ArgumentParser(
        description="Dump every named intermediate tensor of an HF model's forward pass "
        "(the names `graft trace` writes). Architectures (config.json model_type): "
        + ", ".join(SUPPORTED)
        + ".",
    )
    ap.add_argument("--model", required=True, help="HF checkpoint folder")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text, encoded with DIR/tokenizer.json (special tokens added)")
    src.add_argument("--tokens", help="comma-separated token ids")
    ap.add_argument("--out", required=True, help="the .safetensors file to write")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    a = ap.parse_args()

    folder = Path(a.model)
    conf = json.loads((folder / "config.json").read_text())
    if conf.get("model_type") not in SUPPORTED:
        raise SystemExit(
            f"hf-trace: model_type {conf.get('model_type')!r} is not supported (only {', '.join(SUPPORTED)})"
        )
    if a.tokens is not None:
        ids = [int(x) for x in a.tokens.split(",") if x.strip()]
    else:
        from tokenizers import Tokenizer

        ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(a.prompt, add_special_tokens=True).ids
    if not ids:
        raise SystemExit("hf-trace: no tokens")

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=getattr(torch, a.dtype), attn_implementation="eager"
    ).eval()
    tensors, order = trace(model, ids)
    for name, e in check(model, tensors).items():
        print(f"check {name}: max relative error {e:.1e}")
    write(tensors, order, ids, a.out, f"hf-trace.py {a.model}")
    print(f"wrote {len(order)} tensors over {len(ids)} tokens to {a.out}")


if __name__ == "__main__":
    main()
