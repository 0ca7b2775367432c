// The weight units of the batched products of block-quantized weights on tensor cores
// (mmq.cu: int8 tensor cores on Q8_1 activations; mmh.cu: F16 tensor cores on the weights
// unpacked to F16): how a thread loads a unit of a weight row into registers a chunk
// ahead and unpacks it into int8 quants and the scales of its sub-blocks.
//
// Every type's traits (Mmq* below) have:
//   QK, UNIT, HALVES     elements of a block; sub-blocks a thread loads as one unit; whether
//                        the scales cover 16-element halves of a sub-block (Q6_K)
//   Raw                  a unit's bytes in registers, as loaded (nothing computed from them,
//                        so that a load a chunk ahead does not wait for its data)
//   Slot                 what scales a sub-block's integer sums (a few floats), and
//     Slot::term(w, s0, s1, y)  the sub-block's share of the result from its integer sum
//                        s0 (HALVES: s0, s1 the sums of its two halves) with the Q8_1
//                        block y = (d, d * sum)
//   fetch(row, nb, u, r) loads unit u (sub-blocks UNIT u ..) of the row at `row` (nb blocks)
//   unpack(r, u, q, w)   its quants as int8 words (8 a sub-block; word k holds elements
//                        4k..4k+3, as mma's fragments take them) and its sub-blocks' slots
#pragma once

#include "quant.cuh"

// The integer s (|s| < 2^22) as a float: 1.5 * 2^23 + s has a unit ulp, so both steps are exact.
__device__ __forceinline__ float small_i2f(int s) { return __int_as_float(0x4B400000 + s) - 12582912.0f; }

// A product's result v with res[i] added when res is given (a fused residual add, read by
// the thread that writes the result, so res may be the result's own memory).
__device__ __forceinline__ float with_res(float v, const float* res, i64 i) { return res == nullptr ? v : v + res[i]; }

__device__ __forceinline__ float f16_bits(unsigned h) { return __half2float(__ushort_as_half((unsigned short)h)); }


// The N 32-bit words at p (read-only global memory, 2-byte aligned): 16-byte loads when p is
// 16-byte aligned, 16-bit ones otherwise.
template <int N>
__device__ __forceinline__ void load_words(const char* p, int* out) {
    static_assert(N % 4 == 0, "whole 16-byte words");
    if (((uintptr_t)p & 15u) == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const int4 v = __ldg(reinterpret_cast<const int4*>(p) + i);
            out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = ld_i32_a2(p + 4 * i);
    }
}

// The N / 4 16-byte words at p (16-byte aligned, read once) as N 32-bit words.
template <int N>
__device__ __forceinline__ void stream_words(const char* p, int* out) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
        const int4 v = ld_stream16(p + 16 * i);
        out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
    }
}

// ---------------------------------------------------------------------------------------
// The 32-element types: H bytes of header (the f16 d; Q4_1 and Q5_1: then the f16 m; Q5_0
// and Q5_1: then 4 bytes of fifth bits) and QB bytes of quants a block, in ggml's blocks or
// in split rows (SPLIT: every block's quants at row + QB b, then every header at
// row + QB nb + H b). A unit is one block.

template <int H, int QB, bool SPLIT>
struct LegacyRows {
    static constexpr int QK = 32, UNIT = 1, BYTES = H + QB;
    static constexpr bool HALVES = false;
    struct Raw {
        int v[QB / 4];      // the quant bytes as words
        unsigned h[H / 2];  // the header as 16-bit halves
    };
    static __device__ __forceinline__ void fetch(const char* row, int nb, int u, Raw& r) {
        const char* head = SPLIT ? row + QB * (i64)nb + H * (i64)u : row + BYTES * (i64)u;
#pragma unroll
        for (int i = 0; i < H / 2; ++i) r.h[i] = ld_u16(head + 2 * i);
        if constexpr (SPLIT) {
            stream_words<QB / 4>(row + QB * (i64)u, r.v);
        } else {
#pragma unroll
            for (int i = 0; i < QB / 4; ++i) r.v[i] = ld_i32_a2(head + H + 4 * i);
        }
    }
};

// The slot of Q4_0 (OFF 8), Q5_0 (16) and Q8_0 (0): quants offset by OFF, the offset
// applied through the Q8_1 block's d * sum: d * (s d8 - OFF s8).
template <int OFF>
struct OffsetSlot {
    float d;
    static __device__ __forceinline__ float term(const OffsetSlot& w, int s, int, float2 y) {
        if constexpr (OFF == 0) return w.d * y.x * small_i2f(s);
        return w.d * (small_i2f(s) * y.x - (float)OFF * y.y);
    }
};

// The slot of Q4_1 and Q5_1: s (d d8) + m s8.
struct AffineSlot {
    float d, m;
    static __device__ __forceinline__ float term(const AffineSlot& w, int s, int, float2 y) {
        return small_i2f(s) * (w.d * y.x) + w.m * y.y;
    }
};

template <bool SPLIT>
struct MmqQ4_0 : LegacyRows<2, 16, SPLIT> {
    typedef typename LegacyRows<2, 16, SPLIT>::Raw Raw;
    typedef OffsetSlot<8> Slot;
    static __device__ __forceinline__ void unpack(const Raw& r, int, int* q, Slot* w) {
        nibbles_of(r.v, q);
        w[0].d = f16_bits(r.h[0]);
    }
};

template <bool SPLIT>
struct MmqQ4_1 : LegacyRows<4, 16, SPLIT> {
    typedef typename LegacyRows<4, 16, SPLIT>::Raw Raw;
    typedef AffineSlot Slot;
    static __device__ __forceinline__ void unpack(const Raw& r, int, int* q, Slot* w) {
        nibbles_of(r.v, q);
        w[0] = {f16_bits(r.h[0]), f16_bits(r.h[1])};
    }
};

template <bool SPLIT>
struct MmqQ5_0 : LegacyRows<6, 16, SPLIT> {
    typedef typename LegacyRows<6, 16, SPLIT>::Raw Raw;
    typedef OffsetSlot<16> Slot;
    static __device__ __forceinline__ void unpack(const Raw& r, int, int* q, Slot* w) {
        fives_of(r.v, r.h[1] | (r.h[2] << 16), q);
        w[0].d = f16_bits(r.h[0]);
    }
};

template <bool SPLIT>
struct MmqQ5_1 : LegacyRows<8, 16, SPLIT> {
    typedef typename LegacyRows<8, 16, SPLIT>::Raw Raw;
    typedef AffineSlot Slot;
    static __device__ __forceinline__ void unpack(const Raw& r, int, int* q, Slot* w) {
        fives_of(r.v, r.h[2] | (r.h[3] << 16), q);
        w[0] = {f16_bits(r.h[0]), f16_bits(r.h[1])};
    }
};

template <bool SPLIT>
struct MmqQ8_0 : LegacyRows<2, 32, SPLIT> {
    typedef typename LegacyRows<2, 32, SPLIT>::Raw Raw;
    typedef OffsetSlot<0> Slot;
    static __device__ __forceinline__ void unpack(const Raw& r, int, int* q, Slot* w) {
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = r.v[k];
        w[0].d = f16_bits(r.h[0]);
    }
};

// ---------------------------------------------------------------------------------------
// The K-quants: 256-element blocks of 8 sub-blocks.

// A Q4_K / Q5_K sub-block's d * scale and dmin * min (both exact in f32: an f16 times a
// 6-bit integer); its share: d * sc * (d8 * sum) - dmin * m * s8.
struct K4Slot {
    float ds, dm;
    static __device__ __forceinline__ float term(const K4Slot& w, int s, int, float2 y) {
        return w.ds * (y.x * small_i2f(s)) - w.dm * y.y;
    }
};

// The slots of sub-blocks j and j + 1 from a Q4_K / Q5_K header as 4 words h.
__device__ __forceinline__ void k4_slots(const int* h, int j, K4Slot* w) {
    const float d = f16_bits((unsigned)h[0] & 0xffffu), dmin = f16_bits((unsigned)h[0] >> 16);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        int sc, m;
        scale_min_words(h + 1, j + i, sc, m);
        w[i].ds = d * (float)sc;
        w[i].dm = dmin * (float)m;
    }
}

// Q4_K (FIVE false) and Q5_K in ggml's blocks (d, dmin, scales[12], [qh[32]], qs[128]),
// read in place: 16-byte loads when the block is 16-byte aligned (144 and 176 bytes keep
// every block of an aligned row aligned), 16-bit ones otherwise. A unit is the pair of
// sub-blocks 2c, 2c + 1 (c = u % 4) of block u / 4: the low and high nibbles of 32 quant
// bytes, and for Q5_K bits 2c and 2c + 1 of the 32 bytes of fifth bits.
template <bool FIVE>
struct MmqK4 {
    static constexpr int QK = 256, UNIT = 2, BYTES = FIVE ? 176 : 144, QS = FIVE ? 48 : 16;
    static constexpr bool HALVES = false;
    struct Raw {
        int h[4], qs[8], qh[FIVE ? 8 : 4];
    };
    typedef K4Slot Slot;
    static __device__ __forceinline__ void fetch(const char* row, int, int u, Raw& r) {
        const char* blk = row + BYTES * (i64)(u >> 2);
        load_words<4>(blk, r.h);
        load_words<8>(blk + QS + 32 * (u & 3), r.qs);
        if constexpr (FIVE) load_words<8>(blk + 16, r.qh);
    }
    static __device__ __forceinline__ void unpack(const Raw& r, int u, int* q, Slot* w) {
        const int c = u & 3;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            q[k] = r.qs[k] & 0x0f0f0f0f;
            q[8 + k] = (r.qs[k] >> 4) & 0x0f0f0f0f;
            if constexpr (FIVE) {
                q[k] |= ((r.qh[k] >> (2 * c)) & 0x01010101) << 4;
                q[8 + k] |= ((r.qh[k] >> (2 * c + 1)) & 0x01010101) << 4;
            }
        }
        k4_slots(r.h, 2 * c, w);
    }
};

// Frozen Q5_K weights in split rows (SplitQ5_K in quant.cuh): a unit, the pair 2c, 2c + 1
// of block b = u / 4, is 32 quant bytes at row + 128 b + 32 c, the pair's fifth bits as
// two words at row + 128 nb + 32 b + 8 c (byte i of sub-block j's word holds at bit k the
// fifth bit of its element 4k + i) and the block's header at row + 160 nb + 16 b.
struct MmqSplitQ5_K {
    static constexpr int QK = 256, UNIT = 2;
    static constexpr bool HALVES = false;
    struct Raw {
        int h[4], qs[8];
        unsigned fb[2];
    };
    typedef K4Slot Slot;
    static __device__ __forceinline__ void fetch(const char* row, int nb, int u, Raw& r) {
        const i64 b = u >> 2;
        const int c = u & 3;
        stream_words<4>(row + 160 * (i64)nb + 16 * b, r.h);
        stream_words<8>(row + 128 * b + 32 * c, r.qs);
        const uint2 fb = __ldg(reinterpret_cast<const uint2*>(row + 128 * (i64)nb + 32 * b + 8 * c));
        r.fb[0] = fb.x, r.fb[1] = fb.y;
    }
    static __device__ __forceinline__ void unpack(const Raw& r, int u, int* q, Slot* w) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                q[8 * i + k] = ((r.qs[k] >> (4 * i)) & 0x0f0f0f0f) | (int)(((r.fb[i] >> k) & 0x01010101u) << 4);
            }
        }
        k4_slots(r.h, 2 * (u & 3), w);
    }
};

// A Q6_K sub-block's d and its two 8-bit scales (the first half's in the low byte); its
// share: d * (d8 * (sa * sum_a + sb * sum_b)). Each product of a scale and a half's sum is
// an integer below 2^23 and so is their sum: exact in f32, the integer the CPU converts.
struct Q6Slot {
    float d;
    unsigned sab;
    static __device__ __forceinline__ float term(const Q6Slot& w, int s0, int s1, float2 y) {
        const float sa = (float)(signed char)(w.sab & 0xffu), sb = (float)(signed char)((w.sab >> 8) & 0xffu);
        return w.d * (y.x * (sa * small_i2f(s0) + sb * small_i2f(s1)));
    }
};

// Q6_K quants from low nibbles (shifted by ns) and high bit pairs (shifted by hs) as words:
// (lo | hi << 4) - 32, four at a time.
__device__ __forceinline__ int q6_word(unsigned lo, unsigned hi, int ns, int hs) {
    return (int)__vsub4(((lo >> ns) & 0x0f0f0f0fu) | (((hi >> hs) & 0x03030303u) << 4), 0x20202020u);
}

// Q6_K in ggml's blocks (ql[128], qh[64], scales[16], d; 210 bytes, so 2-byte aligned, read
// as 16-bit halves). Sub-block j: half c = j / 4, quarter t = j % 4, low nibbles at bit
// 4 (t / 2) of ql bytes 64 c + 32 (t & 1), high bit pairs at bit 2t of qh bytes 32 c. A
// unit, the pair 2p, 2p + 1 (p = u % 4) of block u / 4, shares its half's qh bytes and the
// nibble of its ql bytes: 64 bytes of ql, 32 of qh, its 4 scales and d.
struct MmqQ6_K {
    static constexpr int QK = 256, UNIT = 2;
    static constexpr bool HALVES = true;
    struct Raw {
        int ql[16], qh[8];
        unsigned sc, d;
    };
    typedef Q6Slot Slot;
    static __device__ __forceinline__ void fetch(const char* row, int, int u, Raw& r) {
        const char* blk = row + 210 * (i64)(u >> 2);
        const int p = u & 3;
#pragma unroll
        for (int k = 0; k < 16; ++k) r.ql[k] = ld_i32_a2(blk + 64 * (p >> 1) + 4 * k);
#pragma unroll
        for (int k = 0; k < 8; ++k) r.qh[k] = ld_i32_a2(blk + 128 + 32 * (p >> 1) + 4 * k);
        r.sc = (unsigned)ld_i32_a2(blk + 192 + 4 * p);
        r.d = ld_u16(blk + 208);
    }
    static __device__ __forceinline__ void unpack(const Raw& r, int u, int* q, Slot* w) {
        const int t = 2 * (u & 1);  // the pair's first quarter: 0 or 2
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                q[8 * i + k] = q6_word((unsigned)r.ql[8 * i + k], (unsigned)r.qh[k], 4 * (t >> 1), 2 * (t + i));
            }
            w[i].d = f16_bits(r.d);
            w[i].sab = (r.sc >> (16 * i)) & 0xffffu;
        }
    }
};

// Frozen Q6_K weights in split rows (SplitQ6_K in quant.cuh), rotated by the row's address:
// a unit, pair p = u % 4 (sub-blocks 2p, 2p + 1) of block b = u / 4, is 48 bytes of
// repacked quants at 192 b + 48 p (32 of low nibbles, 16 of high bit pairs), its four
// scales at 192 nb + 16 b + 4 p and the block's d at 208 nb + 2 b (wrapping around).
struct MmqSplitQ6_K {
    static constexpr int QK = 256, UNIT = 2;
    static constexpr bool HALVES = true;
    struct Raw {
        int n[8], h[4];
        unsigned sc, d;
    };
    typedef Q6Slot Slot;
    static __device__ __forceinline__ void fetch(const char* row, int nb, int u, Raw& r) {
        const int o = SplitQ6_K::rot(row);
        const i64 b = u >> 2;
        const int p = u & 3;
        const char* q = row + o + 192 * b + 48 * p;
        stream_words<8>(q, r.n);
        stream_words<4>(q + 32, r.h);
        r.sc = __ldg(reinterpret_cast<const unsigned*>(row + o + 192 * (i64)nb + 16 * b + 4 * p));
        i64 at = 208 * (i64)nb + 2 * b + o;
        if (at >= 210 * (i64)nb) at -= 210 * (i64)nb;
        r.d = ld_u16(row + at);
    }
    static __device__ __forceinline__ void unpack(const Raw& r, int, int* q, Slot* w) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                q[8 * i + k] = q6_word((unsigned)r.n[k], (unsigned)r.h[k & 3], 4 * i, 2 * (k >> 2) + 4 * i);
            }
            w[i].d = f16_bits(r.d);
            w[i].sab = (r.sc >> (16 * i)) & 0xffffu;
        }
    }
};

// ---------------------------------------------------------------------------------------
// Units as F16 values, for the products on F16 tensor cores (mmh.cu, mmr.cu).

// The F16 value of a quant q: q * s + o for a sub-block's scale and offset (from its slot;
// `half`: which 16 elements of a Q6_K sub-block).
template <int OFF>
__device__ __forceinline__ void affine(const OffsetSlot<OFF>& w, int, float& s, float& o) {
    s = w.d, o = -(float)OFF * w.d;
}
__device__ __forceinline__ void affine(const AffineSlot& w, int, float& s, float& o) { s = w.d, o = w.m; }
__device__ __forceinline__ void affine(const K4Slot& w, int, float& s, float& o) { s = w.ds, o = -w.dm; }
__device__ __forceinline__ void affine(const Q6Slot& w, int half, float& s, float& o) {
    s = w.d * (float)(signed char)((w.sab >> (8 * half)) & 0xffu), o = 0.0f;
}

// The 4 int8 quants of word w as F16 values q * s + o (two half2 words, elements 0-1 then
// 2-3): each byte biased to 0..255 becomes the half 1024 + byte (0x64 as its high byte),
// less 1152 the quant exactly, then one fused multiply-add.
__device__ __forceinline__ uint2 unpack_f16x4(int w, __half2 s, __half2 o) {
    const unsigned u = (unsigned)w ^ 0x80808080u;
    const unsigned lo = __byte_perm(u, 0x64646464u, 0x5140), hi = __byte_perm(u, 0x64646464u, 0x7362);
    const __half2 bias = __half2half2(__ushort_as_half((unsigned short)0x6480));  // 1152
    const __half2 a = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&lo), bias), s, o);
    const __half2 b = __hfma2(__hsub2(*reinterpret_cast<const __half2*>(&hi), bias), s, o);
    return make_uint2(*reinterpret_cast<const unsigned*>(&a), *reinterpret_cast<const unsigned*>(&b));
}
