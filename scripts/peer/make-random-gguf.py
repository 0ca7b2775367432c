#!/usr/bin/env python3
"""Writes a Llama- or Qwen3-MoE-shaped GGUF file with seeded random weights (F16, or
Q8_0 with --type q8_0) and a placeholder vocabulary, so that llama.cpp and graft can be
timed on the very same file.

    python3 scripts/peer/make-random-gguf.py OUT.gguf [--preset llama2-7b] [--type f16] [--seed 0]

Presets: llama2-7b (32 heads, 32 KV heads), llama3-8b (32 heads, 8 KV heads, 128,256
tokens), tiny (2 layers, for checking the script), and the mixtures of experts
qwen3-30b-a3b (`qwen3moe`: 48 layers, 32 heads of 128, 4 KV heads, q/k norms, 128
experts of width 768, 8 a token, 151,936 tokens: 30.5 B parameters) and tiny-moe (2
layers, 8 experts, 2 a token); and for scripts/make-lowbit-fixtures.sh lowbit (1 layer of
rows of 256 elements, 64 tokens: the source of the committed llama-quantize files),
mixes-gqa and mixes-mha (16 layers, 4 and 1 query heads a KV head, the second with rows of
288 elements in ffn_down: the shapes whose per-tensor types llama-quantize's mixes are
checked on). llama-quantize turns the file into any other type (from a Q8_0 file with
--allow-requantize). --type q8_0 writes random Q8_0 blocks directly (F16
scales, random int8 quants): the 30 B model is 32 GB in Q8_0 against 61 GB in F16. The vocabulary is SentencePiece-style placeholder pieces (`<unk>`, `<s>`,
`</s>`, then `▁t3`, `▁t4`, ...): benchmarks feed token ids, so the text means nothing.
`--char-vocab` makes the pieces after `</s>` `▁` and single characters (a..z, 0..9, A..Z)
instead, so that llama.cpp's tools that read text (llama-imatrix) can tokenize text of
those characters.

Needs numpy and the `gguf` package (`python3 -m pip install gguf numpy`, or llama.cpp's
own `gguf-py` folder on PYTHONPATH). Tensors are written one at a time, so the script
holds one tensor in memory, not the whole model.
"""
import argparse
import sys

import numpy as np

try:
    import gguf
except ImportError:
    sys.exit("make-random-gguf: error: no `gguf` module: python3 -m pip install gguf numpy "
             "(or put llama.cpp's gguf-py folder on PYTHONPATH)")

# n_embd, n_ff (of an expert), n_layer, n_head, n_head_kv, n_vocab, rope base, context
# length, then for a mixture of experts (architecture qwen3moe): head size, experts,
# experts per token
PRESETS = {
    "llama2-7b": (4096, 11008, 32, 32, 32, 32000, 10000.0, 4096),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0, 8192),
    "tiny": (256, 688, 2, 8, 4, 512, 10000.0, 512),
    "qwen3-30b-a3b": (2048, 768, 48, 32, 4, 151936, 1000000.0, 40960, 128, 128, 8),
    "tiny-moe": (256, 128, 2, 8, 4, 512, 1000000.0, 512, 32, 8, 2),
    "lowbit": (256, 256, 1, 4, 2, 64, 10000.0, 256),
    "mixes-gqa": (256, 512, 16, 8, 2, 64, 10000.0, 256),
    "mixes-mha": (256, 288, 16, 4, 4, 64, 10000.0, 256),
}

# Values are windows of one pool of N(0, 0.02) samples at random offsets: a 7B file takes
# seconds to fill, not minutes, and no weight is zero or repeats within a row's reach.
POOL_LEN = 1 << 25


def tensors(d, ff, layers, heads, kv_heads, vocab, head_dim=None, experts=0):
    """(name, numpy shape, kind) of every tensor, in file order; shapes are ggml's ne
    reversed (rows first). A mixture of experts has q/k norms, the router
    (`ffn_gate_inp`, F32 like llama.cpp's converters write it) and the experts' stacks
    `ffn_{gate,up,down}_exps` in place of the MLP."""
    hd = head_dim or d // heads
    q, kv = heads * hd, kv_heads * hd
    yield "token_embd.weight", (vocab, d), "random"
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), "ones"
        yield b + "attn_q.weight", (q, d), "random"
        yield b + "attn_k.weight", (kv, d), "random"
        yield b + "attn_v.weight", (kv, d), "random"
        if experts:
            yield b + "attn_q_norm.weight", (hd,), "ones"
            yield b + "attn_k_norm.weight", (hd,), "ones"
        yield b + "attn_output.weight", (d, q), "random"
        yield b + "ffn_norm.weight", (d,), "ones"
        if experts:
            yield b + "ffn_gate_inp.weight", (experts, d), "router"
            yield b + "ffn_gate_exps.weight", (experts, ff, d), "random"
            yield b + "ffn_up_exps.weight", (experts, ff, d), "random"
            yield b + "ffn_down_exps.weight", (experts, d, ff), "random"
        else:
            yield b + "ffn_gate.weight", (ff, d), "random"
            yield b + "ffn_up.weight", (ff, d), "random"
            yield b + "ffn_down.weight", (d, ff), "random"
    yield "output_norm.weight", (d,), "ones"
    yield "output.weight", (vocab, d), "random"


def q8_0_blocks(rng, shape):
    """Random Q8_0 data of `shape` (elements; the last dimension a multiple of 32): each
    block an F16 scale around 0.02 / 64 and 32 random int8 quants, as uint8 bytes with
    the last dimension in bytes (34 per block), the layout gguf's writer takes."""
    n_blocks = int(np.prod(shape)) // 32
    blocks = np.empty((n_blocks, 34), dtype=np.uint8)
    scales = (0.02 / 64 * (0.5 + rng.random(n_blocks, dtype=np.float32))).astype(np.float16)
    blocks[:, :2] = scales.view(np.uint8).reshape(n_blocks, 2)
    blocks[:, 2:] = rng.integers(-127, 128, size=(n_blocks, 32), dtype=np.int8).view(np.uint8)
    return blocks.reshape(*shape[:-1], shape[-1] // 32 * 34)


def values(rng, pool, shape, kind):
    """The tensor's data: F32 ones for norms, a window of the F16 pool otherwise."""
    if kind == "ones":
        return np.ones(shape, dtype=np.float32)
    if kind == "router":
        return (rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(np.float32)
    n = int(np.prod(shape))
    start = int(rng.integers(0, len(pool)))
    reps = -(-(start + n) // len(pool))
    flat = pool[start:start + n] if reps == 1 else np.tile(pool, reps)[start:start + n]
    return np.ascontiguousarray(flat).reshape(shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--preset", default="llama2-7b", choices=sorted(PRESETS))
    ap.add_argument("--type", default="f16", choices=["f16", "q8_0"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--char-vocab", action="store_true",
                    help="pieces of single characters (for tools that read text)")
    a = ap.parse_args()
    d, ff, layers, heads, kv_heads, vocab, base, ctx, *moe = PRESETS[a.preset]
    head_dim, experts, used = moe or (d // heads, 0, 0)
    rng = np.random.default_rng(a.seed)
    pool = (rng.standard_normal(POOL_LEN, dtype=np.float32) * 0.02).astype(np.float16)

    w = gguf.GGUFWriter(a.out, "qwen3moe" if experts else "llama")
    w.add_name(f"random {a.preset}, seed {a.seed}")
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5 if not experts else 1e-6)
    if experts:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(experts)
        w.add_expert_used_count(used)
        w.add_expert_feed_forward_length(ff)
    q8 = a.type == "q8_0"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    pieces = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab)]
    if a.char_vocab:
        chars = "\u2581abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
        if vocab - 3 > len(chars):
            sys.exit(f"make-random-gguf: error: --char-vocab has {len(chars)} pieces, "
                     f"the preset {a.preset} needs {vocab - 3}")
        pieces = ["<unk>", "<s>", "</s>"] + list(chars[:vocab - 3])
    w.add_token_list(pieces)
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, vocab)])
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    plan = list(tensors(d, ff, layers, heads, kv_heads, vocab, head_dim, experts))
    for name, shape, kind in plan:
        if kind == "random" and q8:
            nbytes = int(np.prod(shape)) // 32 * 34
            raw = (*shape[:-1], shape[-1] // 32 * 34)
            w.add_tensor_info(name, raw, np.dtype(np.uint8), nbytes, gguf.GGMLQuantizationType.Q8_0)
            continue
        dtype = np.float16 if kind == "random" else np.float32
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in plan:
        data = q8_0_blocks(rng, shape) if kind == "random" and q8 else values(rng, pool, shape, kind)
        w.write_tensor_data(data)
    w.close()
    print(f"make-random-gguf: wrote {a.out} (random {a.preset}, {a.type.upper()}, seed {a.seed})")


if __name__ == "__main__":
    main()
