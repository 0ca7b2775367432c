#!/usr/bin/env python3
"""Writes a Llama-shaped GGUF file with seeded random F16 weights and a placeholder
vocabulary, so that llama.cpp and graft can be timed on the very same file.

    python3 scripts/peer/make-random-gguf.py OUT.gguf [--preset llama2-7b] [--seed 0]

Presets: llama2-7b (32 heads, 32 KV heads), llama3-8b (32 heads, 8 KV heads, 128,256
tokens), tiny (2 layers, for checking the script). llama-quantize turns the file into any
other type. The vocabulary is SentencePiece-style placeholder pieces (`<unk>`, `<s>`,
`</s>`, then `▁t3`, `▁t4`, ...): benchmarks feed token ids, so the text means nothing.

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

# n_embd, n_ff, n_layer, n_head, n_head_kv, n_vocab, rope base, context length
PRESETS = {
    "llama2-7b": (4096, 11008, 32, 32, 32, 32000, 10000.0, 4096),
    "llama3-8b": (4096, 14336, 32, 32, 8, 128256, 500000.0, 8192),
    "tiny": (256, 688, 2, 8, 4, 512, 10000.0, 512),
}

# Values are windows of one pool of N(0, 0.02) samples at random offsets: a 7B file takes
# seconds to fill, not minutes, and no weight is zero or repeats within a row's reach.
POOL_LEN = 1 << 25


def tensors(d, ff, layers, heads, kv_heads, vocab):
    """(name, numpy shape, kind) of every tensor, in file order; shapes are ggml's ne
    reversed (rows first)."""
    kv = kv_heads * (d // heads)
    yield "token_embd.weight", (vocab, d), "random"
    for i in range(layers):
        b = f"blk.{i}."
        yield b + "attn_norm.weight", (d,), "ones"
        yield b + "attn_q.weight", (d, d), "random"
        yield b + "attn_k.weight", (kv, d), "random"
        yield b + "attn_v.weight", (kv, d), "random"
        yield b + "attn_output.weight", (d, d), "random"
        yield b + "ffn_norm.weight", (d,), "ones"
        yield b + "ffn_gate.weight", (ff, d), "random"
        yield b + "ffn_up.weight", (ff, d), "random"
        yield b + "ffn_down.weight", (d, ff), "random"
    yield "output_norm.weight", (d,), "ones"
    yield "output.weight", (vocab, d), "random"


def values(rng, pool, shape, kind):
    """The tensor's data: F32 ones for norms, a window of the F16 pool otherwise."""
    if kind == "ones":
        return np.ones(shape, dtype=np.float32)
    n = int(np.prod(shape))
    start = int(rng.integers(0, len(pool)))
    reps = -(-(start + n) // len(pool))
    flat = pool[start:start + n] if reps == 1 else np.tile(pool, reps)[start:start + n]
    return np.ascontiguousarray(flat).reshape(shape)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the GGUF file to write")
    ap.add_argument("--preset", default="llama2-7b", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    d, ff, layers, heads, kv_heads, vocab, base, ctx = PRESETS[a.preset]
    rng = np.random.default_rng(a.seed)
    pool = (rng.standard_normal(POOL_LEN, dtype=np.float32) * 0.02).astype(np.float16)

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name(f"random {a.preset}, seed {a.seed}")
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_block_count(layers)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d // heads)
    w.add_rope_freq_base(base)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("llama")
    pieces = ["<unk>", "<s>", "</s>"] + [f"\u2581t{i}" for i in range(3, vocab)]
    w.add_token_list(pieces)
    w.add_token_scores([0.0, 0.0, 0.0] + [-float(i) for i in range(3, vocab)])
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.NORMAL] * (vocab - 3))
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    plan = list(tensors(d, ff, layers, heads, kv_heads, vocab))
    for name, shape, kind in plan:
        dtype = np.float32 if kind == "ones" else np.float16
        nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
        w.add_tensor_info(name, shape, np.dtype(dtype), nbytes)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, kind in plan:
        w.write_tensor_data(values(rng, pool, shape, kind))
    w.close()
    print(f"make-random-gguf: wrote {a.out} (random {a.preset}, F16, seed {a.seed})")


if __name__ == "__main__":
    main()
