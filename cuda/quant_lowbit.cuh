// The traits structs of the low-bit K-quants (Q2_K, Q3_K), the non-linear 4-bit types
// (IQ4_NL, IQ4_XS), the lattice i-quants (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
// IQ1_M) and the ternary types (TQ1_0, TQ2_0), in the scheme of quant.cuh: QK, BYTES,
// SUBS, PAIRS, a W and its dot for the __dp4a decode products, deq8 for the dequantizing
// copies, get_rows and the dequantize-in-registers products. Layouts:
// src/quant/{kquants23,iq4,iqgrid,ternary}.rs.
//
// Every sub-block of 32 elements is read as one SubW: its quants as signed bytes, an
// integer scale per 16-element half (Q2_K: and a min), and the block's f32 factors; the
// dot product is sub_dot, the sums src/quant/dot.rs's dot_subs takes (the CPU oracle):
// d * d8 * (sc_a * sum_a(q y) + sc_b * sum_b(q y)), less dmin * d8 * (m_a * sum_a(y) +
// m_b * sum_b(y)) for Q2_K. The 256-element types take sub-blocks in pairs (PAIRS, their
// activations in the ACT_PAIRS layout), reading a pair's shared bytes once; IQ4_NL takes
// one block a lane like the other 32-element types. deq8 gives src/quant's dequantized
// bits: every product and sum rounded on its own (__fmul_rn, __fsub_rn), in ggml's order.
#pragma once

#include "iq_tables.cuh"
#include "quant.cuh"

// ---------------------------------------------------------------------------------------
// Shared pieces.

// One sub-block in registers (see above). d and dmin are the block's factors: for the
// lattice types d times 1/8 or 1/4, the part of their scale that is not an integer.
struct SubW {
    int q[8];
    int sc[2];
    int m[2];
    float d, dmin;
};

// A sub-block's dot product with one Q8_1 block (MINS: Q2_K's mins too).
template <bool MINS>
__device__ __forceinline__ float sub_dot(const SubW& w, const Act& y) {
    const int sa = dp4a_sum<0, 4>(w.q, y.q), sb = dp4a_sum<4, 8>(w.q, y.q);
    float r = w.d * (y.d * (float)(w.sc[0] * sa + w.sc[1] * sb));
    if (MINS) {
        const int ones[8] = {0x01010101, 0x01010101, 0x01010101, 0x01010101,
                             0x01010101, 0x01010101, 0x01010101, 0x01010101};
        const int ya = dp4a_sum<0, 4>(ones, y.q), yb = dp4a_sum<4, 8>(ones, y.q);
        r -= w.dmin * (y.d * (float)(w.m[0] * ya + w.m[1] * yb));
    }
    return r;
}

// Byte i of w.
__device__ __forceinline__ unsigned byte_of(unsigned w, int i) { return (w >> (8 * i)) & 0xffu; }

// Byte i of the N words w (little-endian), the word picked by selects: an index into a
// register array the compiler cannot resolve would put the array in local memory.
template <int N>
__device__ __forceinline__ unsigned byte_at(const int (&w)[N], int i) {
    unsigned word = (unsigned)w[0];
#pragma unroll
    for (int k = 1; k < N; ++k) word = (i >> 2) == k ? (unsigned)w[k] : word;
    return byte_of(word, i & 3);
}

// The 8 bytes at a 2-byte aligned address as two words.
__device__ __forceinline__ uint2 ld8_a2(const char* p) { return make_uint2((unsigned)ld_i32_a2(p), (unsigned)ld_i32_a2(p + 4)); }

// Byte i (0..8) of the two words v.
__device__ __forceinline__ unsigned byte8(uint2 v, int i) { return byte_of(i < 4 ? v.x : v.y, i & 3); }

// ggml's ksigns_iq2xs[i]: the 7 sign bits i and their parity as bit 7.
__device__ __forceinline__ unsigned ksign(unsigned i) {
    i &= 127u;
    return i | ((unsigned)(__popc(i) & 1) << 7);
}

// 1 in byte i where bit i of the 4 bits b is set.
__device__ __forceinline__ unsigned sign_ones(unsigned b) { return ((b & 0x0fu) * 0x00204081u) & 0x01010101u; }

// The 4 bytes of g negated where the byte of m is 0xff (m's bytes are 0 or 0xff), `one`
// holding 1 in those bytes. The bytes of g are lattice coordinates, never 0 (src/quant's
// test grid_coordinates_are_never_zero), so -g_i = (g_i ^ 0xff) + 1 carries nothing into
// the next byte: an xor and a plain add, where __vsub4(g ^ m, m) took four instructions.
__device__ __forceinline__ int negated4(unsigned g, unsigned m, unsigned one) { return (int)((g ^ m) + one); }

// The 4 bytes of g with the signs b (bit i: byte i negated).
__device__ __forceinline__ int signed4(unsigned g, unsigned b) {
    const unsigned one = sign_ones(b);
    return negated4(g, one * 0xffu, one);
}

// A lattice table of 32-bit points in shared memory, the decode products' copy
// (mul_mat_q.cu's mmvq stages it when the kernel starts: stage_grid). A warp's 32 lanes
// look up points at random: from global memory a lookup takes a wavefront of the L1 cache
// per 128-byte line of the table it touches (up to 8 of IQ3_XXS's 1 KB, all 16 of IQ3_S's
// 2 KB), from shared memory about as many cycles as lanes fall in one bank: on an H200
// that made the IQ3 products on the 7B shapes 1-9% faster (the instructions that unpack a
// point, not its lookup, set their pace). The tables of 64-bit points (IQ2, IQ1: 2-16 KB)
// stay in global memory: a block of 4 rows would copy more of them than it reads of
// weights.
template <int WORDS, int ID>
__device__ __forceinline__ unsigned* smem_grid() {
    __shared__ unsigned table[WORDS];
    return table;
}

// The 4 bytes of IQ4_NL's levels indexed by the 4 bytes of idx (each 0..15): two byte
// permutes of the level table (lower and upper 8), picked by bit 3 of each index.
__device__ __forceinline__ int iq4_levels4(unsigned idx) {
    const unsigned sel = (idx & 0x7u) | ((idx >> 4) & 0x70u) | ((idx >> 8) & 0x700u) | ((idx >> 12) & 0x7000u);
    const unsigned lo = __byte_perm(KVALUES_IQ4NL_W0, KVALUES_IQ4NL_W1, sel);
    const unsigned hi = __byte_perm(KVALUES_IQ4NL_W2, KVALUES_IQ4NL_W3, sel);
    const unsigned m = ((idx & 0x08080808u) >> 3) * 0xffu;
    return (int)((lo & ~m) | (hi & m));
}

// The levels of the 8 nibbles of word v: of its low nibbles (bytes 0..3) into lo, of its high
// ones into hi. Each nibble looks itself up in the lower and the upper 8 levels at once
// (__byte_perm reads the low 3 bits of a selector nibble), its bit 3 picks one of the two,
// and two more permutes sort the levels into low and high nibbles: 6 permutes for 8 levels.
__device__ __forceinline__ void iq4_levels8(unsigned v, int& lo, int& hi) {
    const unsigned pick = ((v & 0x88888888u) >> 1) | 0x32103210u;
    unsigned t[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned s = v >> (16 * i);
        const unsigned l = __byte_perm(KVALUES_IQ4NL_W0, KVALUES_IQ4NL_W1, s);
        const unsigned h = __byte_perm(KVALUES_IQ4NL_W2, KVALUES_IQ4NL_W3, s);
        t[i] = __byte_perm(l, h, pick >> (16 * i));  // nibbles 4i .. 4i + 3, in order
    }
    lo = (int)__byte_perm(t[0], t[1], 0x6420);
    hi = (int)__byte_perm(t[0], t[1], 0x7531);
}

// The 32 levels of an IQ4 group of 16 bytes held as 4 words v (low nibbles: elements
// 0..15, high: 16..31).
__device__ __forceinline__ void iq4_sub(const int* v, int* q) {
#pragma unroll
    for (int k = 0; k < 4; ++k) iq4_levels8((unsigned)v[k], q[k], q[k + 4]);
}

// 8 elements of an IQ4 group of 16 bytes at qs: elements i0..i0+7 (i0 a multiple of 8)
// times dl, as src/quant/iq4.rs dequantizes them.
__device__ __forceinline__ void iq4_deq8(const char* qs, int i0, float dl, float* v) {
    const uint2 b = ld8_a2(qs + (i0 & 15));
    const int shift = i0 >= 16 ? 4 : 0;
    const unsigned lv[2] = {(unsigned)iq4_levels4((b.x >> shift) & 0x0f0f0f0fu),
                            (unsigned)iq4_levels4((b.y >> shift) & 0x0f0f0f0fu)};
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = mul_rn(dl, (float)(signed char)byte_of(lv[i >> 2], i & 3));
}

// The 2-bit field f (0..3) of each byte of the 8 words w, into q.
__device__ __forceinline__ void fields2(const int* w, int f, int* q) {
#pragma unroll
    for (int k = 0; k < 8; ++k) q[k] = ((unsigned)w[k] >> (2 * f)) & 0x03030303u;
}

// The 2-bit field of elements e0..e0+7 (e0 a multiple of 8) of Q2_K's quant layout (qs:
// per 128 elements, byte l holds elements l, l + 32, l + 64, l + 96).
__device__ __forceinline__ void fields2_8(const char* qs, int e0, int* q) {
    const uint2 v = ld8_a2(qs + 32 * (e0 >> 7) + (e0 & 31));
    const int shift = 2 * ((e0 & 127) >> 5);
#pragma unroll
    for (int i = 0; i < 8; ++i) q[i] = (int)((byte8(v, i) >> shift) & 3u);
}

// What every type here shares: a sub-block in registers and its dot product (MINS: Q2_K's
// mins too).
template <bool MINS = false>
struct SubBlocks {
    typedef SubW W;
    static __device__ __forceinline__ float dot(const W& w, const Act& y) { return sub_dot<MINS>(w, y); }
};

// The 256-element types (BYTES a block): 8 sub-blocks, taken in pairs.
template <int B, bool MINS = false>
struct Pairs256 : SubBlocks<MINS> {
    static constexpr int QK = 256, BYTES = B, SUBS = 8;
    static constexpr bool PAIRS = true;
    static constexpr int PA = 2;
};

// ---------------------------------------------------------------------------------------
// Q2_K: scales[16] (scale | min << 4 per 16 elements), qs[64], d, dmin.

struct BlockQ2_K : Pairs256<84, true> {
    // Sub-blocks j (even) and j + 1: fields j % 4 and j % 4 + 1 of the same 32 bytes.
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[8];
        ld_words<Smem, 8>(b + 16 + 32 * (j >> 2), qs);
        const unsigned sc = (unsigned)ld_i32_a2<Smem>(b + 2 * j);
        const float d = ld_f16<Smem>(b + 80), dmin = ld_f16<Smem>(b + 82);
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            fields2(qs, (j & 3) + u, w[u]->q);
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned s = byte_of(sc, 2 * u + h);
                w[u]->sc[h] = (int)(s & 15u);
                w[u]->m[h] = (int)(s >> 4);
            }
            w[u]->d = d, w[u]->dmin = dmin;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const unsigned s = ld_u8(b, g >> 1);
        const float dl = mul_rn(ld_f16(b + 80), (float)(s & 15u)), ml = mul_rn(ld_f16(b + 82), (float)(s >> 4));
        int q[8];
        fields2_8(b + 16, 8 * g, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fsub_rn(mul_rn(dl, (float)q[i]), ml);
    }
};

// ---------------------------------------------------------------------------------------
// Q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), d.

// The 6-bit scale h (0..15) of Q3_K's 12 scale bytes s, less 32.
__device__ __forceinline__ int q3_k_scale(const int (&s)[3], int h) {
    // byte h & 7 of the first 8 (low nibble for h < 8, high after), byte 8 + (h & 3) for
    // the top bits; the words picked by selects, so s stays in registers
    const unsigned lw = (unsigned)((h & 4) ? s[1] : s[0]);
    const unsigned low = (byte_of(lw, h & 3) >> (h & 8 ? 4 : 0)) & 15u;
    const unsigned high = (byte_of((unsigned)s[2], h & 3) >> (2 * (h >> 2))) & 3u;
    return (int)(low | (high << 4)) - 32;
}

struct BlockQ3_K : Pairs256<110> {
    // Sub-blocks j (even) and j + 1: low bits as fields of the same 32 bytes of qs, the
    // high bit as bit j (j + 1) of the 32 bytes of hmask.
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[8], hm[8], s[3];
        ld_words<Smem, 8>(b + 32 + 32 * (j >> 2), qs);
        ld_words<Smem, 8>(b, hm);
        ld_words<Smem, 3>(b + 96, s);
        const float d = ld_f16<Smem>(b + 108);
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            const int sub = j + u;
            fields2(qs, sub & 3, w[u]->q);
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned hb = ((unsigned)hm[k] >> sub) & 0x01010101u;
                w[u]->q[k] = (int)__vsub4((unsigned)w[u]->q[k] | (hb << 2), 0x04040404u);
            }
            w[u]->sc[0] = q3_k_scale(s, 2 * sub);
            w[u]->sc[1] = q3_k_scale(s, 2 * sub + 1);
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int h = g >> 1, e0 = 8 * g;
        const unsigned low = h < 8 ? ld_u8(b + 96, h) & 15u : ld_u8(b + 96, h - 8) >> 4;
        const unsigned high = (ld_u8(b + 96, 8 + (h & 3)) >> (2 * (h >> 2))) & 3u;
        const float dl = mul_rn(ld_f16(b + 108), (float)((int)(low | (high << 4)) - 32));
        int q[8];
        fields2_8(b + 32, e0, q);
        const uint2 hm = ld8_a2(b + (e0 & 31));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned hb = (byte8(hm, i) >> (e0 >> 5)) & 1u;
            v[i] = mul_rn(dl, (float)(q[i] - (hb ? 0 : 4)));
        }
    }
};

// ---------------------------------------------------------------------------------------
// IQ4_NL (d, qs[16]) and IQ4_XS (d, scales_h, scales_l[4], qs[128]).

struct BlockIQ4_NL : SubBlocks<> {
    static constexpr int QK = 32, BYTES = 18, SUBS = 1;
    static constexpr bool PAIRS = false;
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int, W& w) {
        int v[4];
        ld_words<M, 4>(b + 2, v);
        iq4_sub(v, w.q);
        w.sc[0] = w.sc[1] = 1;
        w.m[0] = w.m[1] = 0;
        w.d = ld_f16<M>(b), w.dmin = 0.0f;
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) { iq4_deq8(b + 2, 8 * g, ld_f16(b), v); }
};

// IQ4_XS's 6-bit scale of sub-block j from its header words h0 (d, scales_h) and h1
// (scales_l), less 32.
__device__ __forceinline__ int iq4_xs_scale(unsigned h0, unsigned h1, int j) {
    const unsigned low = (h1 >> (4 * j)) & 15u, high = (h0 >> (16 + 2 * j)) & 3u;
    return (int)(low | (high << 4)) - 32;
}

struct BlockIQ4_XS : Pairs256<136> {
    // Sub-blocks j (even) and j + 1: 32 contiguous bytes of qs, the 8-byte header once. A
    // block is 17 8-byte words, so in rows at 8-byte aligned addresses (A = GLOBAL8, read in
    // place) the header and the quants are 8-byte loads.
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int h[2], qs[8];
        ld_smem<A == GLOBAL8 ? GLOBAL8 : 2, 2>(b, h);
        ld_smem<A == GLOBAL8 ? GLOBAL8 : 2, 8>(b + 8 + 16 * j, qs);
        const float d = __half2float(__ushort_as_half((unsigned short)((unsigned)h[0] & 0xffffu)));
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            iq4_sub(qs + 4 * u, w[u]->q);
            w[u]->sc[0] = w[u]->sc[1] = iq4_xs_scale((unsigned)h[0], (unsigned)h[1], j + u);
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2;
        const unsigned h0 = (unsigned)ld_i32_a2(b), h1 = (unsigned)ld_i32_a2(b + 4);
        const float dl = mul_rn(ld_f16(b), (float)iq4_xs_scale(h0, h1, j));
        iq4_deq8(b + 8 + 16 * j, 8 * (g & 3), dl, v);
    }
};

// ---------------------------------------------------------------------------------------
// The lattice i-quants. A group of 8 elements is one 8-value lattice point (IQ2, IQ1) or
// two 4-value ones (IQ3) and 8 sign bits (IQ1: a shift of +-1/8 instead).

// The 8 values of 8-byte lattice point p with the 8 sign bits s into q[0], q[1].
__device__ __forceinline__ void point8(unsigned long long p, unsigned s, int* q) {
    q[0] = signed4((unsigned)p, s);
    q[1] = signed4((unsigned)(p >> 32), s >> 4);
}

// Writes scale * g_i * sign_i for the 8 bytes of lattice point p, sign bits s (ggml's
// order: the scale times the magnitude, then the sign).
__device__ __forceinline__ void put8(float scale, unsigned long long p, unsigned s, float* v) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const float x = mul_rn(scale, (float)((p >> (8 * i)) & 0xffu));
        v[i] = (s >> i) & 1u ? -x : x;
    }
}

// d (0.5 + s) / c for the IQ2 (c = 4) and IQ3_XXS (c = 2) scales, as ggml rounds it.
__device__ __forceinline__ float half_step_scale(float d, unsigned s, float inv_c) {
    return mul_rn(mul_rn(d, 0.5f + (float)s), inv_c);
}

// IQ2_XXS: d, per 32 elements a word of 4 grid indices and a word of 4 x 7 sign bits and
// a 4-bit scale.
struct BlockIQ2_XXS : Pairs256<66> {
    static __device__ __forceinline__ void sub(unsigned idx, unsigned aux, float d8, W& w) {
#pragma unroll
        for (int l = 0; l < 4; ++l) point8(IQ2XXS_GRID[byte_of(idx, l)], ksign(aux >> (7 * l)), w.q + 2 * l);
        w.sc[0] = w.sc[1] = 2 * (int)(aux >> 28) + 1;
        w.m[0] = w.m[1] = 0;
        w.d = d8, w.dmin = 0.0f;
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int v[4];
        ld_words<Smem, 4>(b + 2 + 8 * j, v);
        const float d8 = ld_f16<Smem>(b) * 0.125f;
        sub((unsigned)v[0], (unsigned)v[1], d8, w0);
        sub((unsigned)v[2], (unsigned)v[3], d8, w1);
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned aux = (unsigned)ld_i32_a2(b + 6 + 8 * j);
        const float db = half_step_scale(ld_f16(b), aux >> 28, 0.25f);
        put8(db, IQ2XXS_GRID[ld_u8(b + 2 + 8 * j, l)], ksign(aux >> (7 * l)), v);
    }
};

// IQ2_XS: d, qs[32] as u16 (9-bit grid index, 7 sign bits), scales[8] (4 bits per 16).
struct BlockIQ2_XS : Pairs256<74> {
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int v[4];
        ld_words<Smem, 4>(b + 2 + 8 * j, v);
        const unsigned s = ld_u16<Smem>(b + 66 + j);
        const float d8 = ld_f16<Smem>(b) * 0.125f;
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                const unsigned e = ((unsigned)v[2 * u + (l >> 1)] >> (16 * (l & 1))) & 0xffffu;
                point8(IQ2XS_GRID[e & 511u], ksign(e >> 9), w[u]->q + 2 * l);
            }
            const unsigned su = byte_of(s, u);
            w[u]->sc[0] = 2 * (int)(su & 15u) + 1;
            w[u]->sc[1] = 2 * (int)(su >> 4) + 1;
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d8, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned e = ld_u16(b + 2 + 2 * (4 * j + l)), s = ld_u8(b + 66, j);
        const float db = half_step_scale(ld_f16(b), l < 2 ? s & 15u : s >> 4, 0.25f);
        put8(db, IQ2XS_GRID[e & 511u], ksign(e >> 9), v);
    }
};

// IQ2_S: d, qs[32] (grid index low bits), signs[32], qh[8] (2 high index bits per group),
// scales[8] (4 bits per 16).
struct BlockIQ2_S : Pairs256<82> {
    static __device__ __forceinline__ unsigned index(unsigned lo, unsigned qh, int l) {
        return lo | ((qh << (8 - 2 * l)) & 0x300u);
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[2], sg[2];
        ld_words<Smem, 2>(b + 2 + 4 * j, qs);
        ld_words<Smem, 2>(b + 34 + 4 * j, sg);
        const unsigned qh = ld_u16<Smem>(b + 66 + j), s = ld_u16<Smem>(b + 74 + j);
        const float d8 = ld_f16<Smem>(b) * 0.125f;
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                const unsigned i = index(byte_of((unsigned)qs[u], l), byte_of(qh, u), l);
                point8(IQ2S_GRID[i], byte_of((unsigned)sg[u], l), w[u]->q + 2 * l);
            }
            const unsigned su = byte_of(s, u);
            w[u]->sc[0] = 2 * (int)(su & 15u) + 1;
            w[u]->sc[1] = 2 * (int)(su >> 4) + 1;
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d8, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned i = index(ld_u8(b + 2, 4 * j + l), ld_u8(b + 66, j), l), s = ld_u8(b + 74, j);
        const float db = half_step_scale(ld_f16(b), l < 2 ? s & 15u : s >> 4, 0.25f);
        put8(db, IQ2S_GRID[i], ld_u8(b + 34, 4 * j + l), v);
    }
};

// Writes scale * g_i * sign_i for the two 4-byte IQ3 points p1, p2, sign bits s.
__device__ __forceinline__ void put4x2(float scale, unsigned p1, unsigned p2, unsigned s, float* v) {
    put8(scale, (unsigned long long)p1 | ((unsigned long long)p2 << 32), s, v);
}

// IQ3_XXS: d, qs[64] (one grid index per 4 elements), per 32 elements a word of 4 x 7
// sign bits and a 4-bit scale.
struct BlockIQ3_XXS : Pairs256<98> {
    // The lattice table load2 reads: its copy in shared memory (stage_grid). Its signs
    // come from ksign: a staged table of 64-bit sign masks (read at random, 8 bytes a
    // lookup) made the product about 10% slower on an H200.
    static constexpr int GRID_WORDS = 256;
    static __device__ __forceinline__ unsigned* grid_smem() { return smem_grid<GRID_WORDS, 0>(); }
    static __device__ __forceinline__ void stage(int t, int n) {
        for (int i = t; i < GRID_WORDS; i += n) grid_smem()[i] = IQ3XXS_GRID[i];
    }
    static __device__ __forceinline__ void sub(const int (&qs)[2], unsigned aux, float d4, W& w) {
        const unsigned* grid = grid_smem();
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned s = ksign(aux >> (7 * l));
            w.q[2 * l] = signed4(grid[byte_at(qs, 2 * l)], s);
            w.q[2 * l + 1] = signed4(grid[byte_at(qs, 2 * l + 1)], s >> 4);
        }
        w.sc[0] = w.sc[1] = 2 * (int)(aux >> 28) + 1;
        w.m[0] = w.m[1] = 0;
        w.d = d4, w.dmin = 0.0f;
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs0[2], qs1[2], aux[2];
        ld_words<Smem, 2>(b + 2 + 8 * j, qs0);
        ld_words<Smem, 2>(b + 10 + 8 * j, qs1);
        ld_words<Smem, 2>(b + 66 + 4 * j, aux);
        const float d4 = ld_f16<Smem>(b) * 0.25f;
        sub(qs0, (unsigned)aux[0], d4, w0);
        sub(qs1, (unsigned)aux[1], d4, w1);
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned aux = (unsigned)ld_i32_a2(b + 66 + 4 * j);
        const float db = half_step_scale(ld_f16(b), aux >> 28, 0.5f);
        const char* qs = b + 2 + 8 * j;
        put4x2(db, IQ3XXS_GRID[ld_u8(qs, 2 * l)], IQ3XXS_GRID[ld_u8(qs, 2 * l + 1)], ksign(aux >> (7 * l)), v);
    }
};

// IQ3_S: d, qs[64] (grid index low bits), qh[8] (the 9th bits), signs[32], scales[4]
// (4 bits per 32).
struct BlockIQ3_S : Pairs256<110> {
    // The lattice table load2 reads: its copy in shared memory (stage_grid).
    static constexpr int GRID_WORDS = 512;
    static __device__ __forceinline__ unsigned* grid_smem() { return smem_grid<GRID_WORDS, 1>(); }
    static __device__ __forceinline__ void stage(int t, int n) {
        for (int i = t; i < GRID_WORDS; i += n) grid_smem()[i] = IQ3S_GRID[i];
    }
    // The points of `grid` of group l of a sub-block with index bytes q0, q1 and high bits qh.
    static __device__ __forceinline__ void points(const unsigned* grid, unsigned q0, unsigned q1, unsigned qh, int l,
                                                  unsigned& p1, unsigned& p2) {
        p1 = grid[q0 | ((qh << (8 - 2 * l)) & 256u)];
        p2 = grid[q1 | ((qh << (7 - 2 * l)) & 256u)];
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[2][2], sg[2];
        ld_words<Smem, 2>(b + 2 + 8 * j, qs[0]);
        ld_words<Smem, 2>(b + 10 + 8 * j, qs[1]);
        ld_words<Smem, 2>(b + 74 + 4 * j, sg);
        const unsigned qh = ld_u16<Smem>(b + 66 + j), s = ld_u8<Smem>(b + 106, j >> 1);
        const float d = ld_f16<Smem>(b);
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                unsigned p1, p2;
                points(grid_smem(), byte_at(qs[u], 2 * l), byte_at(qs[u], 2 * l + 1), byte_of(qh, u), l, p1, p2);
                const unsigned sgn = byte_of((unsigned)sg[u], l);
                w[u]->q[2 * l] = signed4(p1, sgn);
                w[u]->q[2 * l + 1] = signed4(p2, sgn >> 4);
            }
            w[u]->sc[0] = w[u]->sc[1] = 1 + 2 * (int)((s >> (4 * u)) & 15u);
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned s = (ld_u8(b + 106, j >> 1) >> (4 * (j & 1))) & 15u;
        const float db = mul_rn(ld_f16(b), (float)(1u + 2u * s));
        const char* qs = b + 2 + 8 * j;
        unsigned p1, p2;
        points(IQ3S_GRID, ld_u8(qs, 2 * l), ld_u8(qs, 2 * l + 1), ld_u8(b + 66, j), l, p1, p2);
        put4x2(db, p1, p2, ld_u8(b + 74, 4 * j + l), v);
    }
};

// The 8 quants 8 g - 1 or 8 g + 1 (minus: the shift's sign) of the ternary IQ1 point p:
// g + shift in eighths.
__device__ __forceinline__ void shifted8(unsigned long long p, bool minus, int* q) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const unsigned x = ((unsigned)(p >> (32 * h)) << 3) & 0xf8f8f8f8u;  // 8 g, bytewise
        q[h] = (int)(minus ? __vsub4(x, 0x01010101u) : __vadd4(x, 0x01010101u));
    }
}

// Writes scale * (g_i + delta) for the 8 bytes of IQ1 point p.
__device__ __forceinline__ void put8_shifted(float scale, unsigned long long p, float delta, float* v) {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = mul_rn(scale, (float)(signed char)((p >> (8 * i)) & 0xffu) + delta);
}

// IQ1_S: d, qs[32] (grid index low bits), qh[8] as u16 (3 index bits per group, a 3-bit
// scale, the shift's sign).
struct BlockIQ1_S : Pairs256<50> {
    static __device__ __forceinline__ void sub(unsigned qs, unsigned qh, float d8, W& w) {
#pragma unroll
        for (int l = 0; l < 4; ++l) {
            const unsigned i = byte_of(qs, l) | (((qh >> (3 * l)) & 7u) << 8);
            shifted8(IQ1S_GRID[i], (qh & 0x8000u) != 0, w.q + 2 * l);
        }
        w.sc[0] = w.sc[1] = 2 * (int)((qh >> 12) & 7u) + 1;
        w.m[0] = w.m[1] = 0;
        w.d = d8, w.dmin = 0.0f;
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[2];
        ld_words<Smem, 2>(b + 2 + 4 * j, qs);
        const unsigned qh = (unsigned)ld_i32_a2<Smem>(b + 34 + 2 * j);
        const float d8 = ld_f16<Smem>(b) * 0.125f;
        sub((unsigned)qs[0], qh & 0xffffu, d8, w0);
        sub((unsigned)qs[1], qh >> 16, d8, w1);
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned qh = ld_u16(b + 34 + 2 * j);
        const float dl = mul_rn(ld_f16(b), (float)(2u * ((qh >> 12) & 7u) + 1u));
        const unsigned i = ld_u8(b + 2, 4 * j + l) | (((qh >> (3 * l)) & 7u) << 8);
        put8_shifted(dl, IQ1S_GRID[i], (qh & 0x8000u) ? -0.125f : 0.125f, v);
    }
};

// IQ1_M: qs[32] (grid index low bits), qh[16] (3 index bits and the shift's sign per
// group), scales[8] as 4 u16 (3-bit scales per 16, d in their top nibbles).
struct BlockIQ1_M : Pairs256<56> {
    // The f16 d from the scale words s0 (scales 0, 1) and s1 (scales 2, 3).
    static __device__ __forceinline__ float d_of(unsigned s0, unsigned s1) {
        const unsigned bits = ((s0 >> 12) & 0xfu) | ((s0 >> 24) & 0xf0u) | ((s1 >> 4) & 0xf00u) | ((s1 >> 16) & 0xf000u);
        return __half2float(__ushort_as_half((unsigned short)bits));
    }
    // Group l of a sub-block: its grid point from the index byte q and qh byte h, and
    // whether its shift is negative.
    static __device__ __forceinline__ unsigned long long point(unsigned q, unsigned h, int l, bool& minus) {
        minus = (h & (l & 1 ? 0x80u : 0x08u)) != 0;
        return IQ1S_GRID[q | ((h << (l & 1 ? 4 : 8)) & 0x700u)];
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[2], sc[2];
        ld_words<Smem, 2>(b + 4 * j, qs);
        const unsigned qh = (unsigned)ld_i32_a2<Smem>(b + 32 + 2 * j);
        ld_words<Smem, 2>(b + 48, sc);
        const float d8 = d_of((unsigned)sc[0], (unsigned)sc[1]) * 0.125f;
        // (a select: sc[j >> 2] would put sc in local memory)
        const unsigned s16 = ((unsigned)(j >> 2 ? sc[1] : sc[0]) >> (16 * ((j >> 1) & 1))) & 0xffffu;
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
#pragma unroll
            for (int l = 0; l < 4; ++l) {
                bool minus;
                const unsigned long long p = point(byte_of((unsigned)qs[u], l), byte_of(qh, 2 * u + (l >> 1)), l, minus);
                shifted8(p, minus, w[u]->q + 2 * l);
            }
            w[u]->sc[0] = 2 * (int)((s16 >> (6 * u)) & 7u) + 1;
            w[u]->sc[1] = 2 * (int)((s16 >> (6 * u + 3)) & 7u) + 1;
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d8, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int j = g >> 2, l = g & 3;
        const unsigned s0 = (unsigned)ld_i32_a2(b + 48), s1 = (unsigned)ld_i32_a2(b + 52);
        const unsigned s16 = ld_u16(b + 48 + 2 * (j >> 1));
        const unsigned s = (s16 >> (6 * (j & 1) + 3 * (l >> 1))) & 7u;
        const float dl = mul_rn(d_of(s0, s1), (float)(2u * s + 1u));
        bool minus;
        const unsigned long long p = point(ld_u8(b, 4 * j + l), ld_u8(b + 32, 2 * j + (l >> 1)), l, minus);
        put8_shifted(dl, p, minus ? -0.125f : 0.125f, v);
    }
};

// ---------------------------------------------------------------------------------------
// The ternary types: values -1, 0, 1 times one d.

// TQ2_0: qs[64] (q + 1 in 2 bits, Q2_K's layout), d.
struct BlockTQ2_0 : Pairs256<66> {
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int qs[8];
        ld_words<Smem, 8>(b + 32 * (j >> 2), qs);
        const float d = ld_f16<Smem>(b + 64);
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            fields2(qs, (j & 3) + u, w[u]->q);
#pragma unroll
            for (int k = 0; k < 8; ++k) w[u]->q[k] = (int)__vsub4((unsigned)w[u]->q[k], 0x01010101u);
            w[u]->sc[0] = w[u]->sc[1] = 1;
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d, w[u]->dmin = 0.0f;
        }
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const float d = ld_f16(b + 64);
        int q[8];
        fields2_8(b, 8 * g, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = mul_rn((float)(q[i] - 1), d);
    }
};

// The trits n of the 4 bytes of w (each ((x 3^n) mod 256) 3 >> 8, p3 = 3^n), less 1:
// the even and odd bytes in 16-bit lanes, where their products cannot carry.
__device__ __forceinline__ int trits4(unsigned w, unsigned p3) {
    unsigned e = ((w & 0x00ff00ffu) * p3) & 0x00ff00ffu;
    unsigned o = (((w >> 8) & 0x00ff00ffu) * p3) & 0x00ff00ffu;
    e = ((e * 3u) >> 8) & 0x00ff00ffu;
    o = ((o * 3u) >> 8) & 0x00ff00ffu;
    return (int)__vsub4(e | (o << 8), 0x01010101u);
}

// 3^n for n in 0..5.
__device__ __forceinline__ unsigned pow3(int n) { return n == 0 ? 1u : n == 1 ? 3u : n == 2 ? 9u : n == 3 ? 27u : 81u; }

// TQ1_0: qs[48] (five trits a byte), qh[4] (four), d. Element e lies in trit n of byte k:
// qs[e % 32] trit e / 32 for e < 160, qs[32 + (e - 160) % 16] trit (e - 160) / 16 for e <
// 240, qh[(e - 240) % 4] trit (e - 240) / 4 after; trit n of byte x is ((x 3^n) mod 256)
// 3 >> 8, q + 1. Sub-blocks 0..4 are trit j of qs[0..32]; 5 and 6 trits 2 (j - 5) and
// 2 (j - 5) + 1 of qs[32..48]; 7 trit 4 of qs[32..48], then trits 0..3 of qh.
struct BlockTQ1_0 : Pairs256<54> {
    // Sub-block j's quants.
    template <typename M>
    static __device__ __forceinline__ void quants(const char* b, int j, int* q) {
        if (j < 5) {
            int w[8];
            ld_words<M, 8>(b, w);
#pragma unroll
            for (int k = 0; k < 8; ++k) q[k] = trits4((unsigned)w[k], pow3(j));
            return;
        }
        int w[4];
        ld_words<M, 4>(b + 32, w);
        const int n = j == 7 ? 4 : 2 * (j - 5);
#pragma unroll
        for (int k = 0; k < 4; ++k) q[k] = trits4((unsigned)w[k], pow3(n));
        if (j < 7) {
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k + 4] = trits4((unsigned)w[k], pow3(n + 1));
        } else {
            const unsigned h = (unsigned)ld_i32_a2<M>(b + 48);
#pragma unroll
            for (int k = 0; k < 4; ++k) q[k + 4] = trits4(h, pow3(k));
        }
    }
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        const float d = ld_f16<Smem>(b + 52);
        W* w[2] = {&w0, &w1};
#pragma unroll
        for (int u = 0; u < 2; ++u) {
            quants<Smem>(b, j + u, w[u]->q);
            w[u]->sc[0] = w[u]->sc[1] = 1;
            w[u]->m[0] = w[u]->m[1] = 0;
            w[u]->d = d, w[u]->dmin = 0.0f;
        }
    }
    // Int k (quants 4 k .. 4 k + 3) of sub-block j, read from global memory on its own
    // (what quants computes for the whole sub-block).
    static __device__ __forceinline__ unsigned quant4(const char* b, int j, int k) {
        if (j < 5) return (unsigned)trits4((unsigned)ld_i32_a2(b + 4 * k), pow3(j));
        if (k < 4) return (unsigned)trits4((unsigned)ld_i32_a2(b + 32 + 4 * k), pow3(j == 7 ? 4 : 2 * (j - 5)));
        if (j < 7) return (unsigned)trits4((unsigned)ld_i32_a2(b + 32 + 4 * (k - 4)), pow3(2 * (j - 5) + 1));
        return (unsigned)trits4((unsigned)ld_i32_a2(b + 48), pow3(k - 4));
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const float d = ld_f16(b + 52);
        // elements 8 (g % 4)..: ints 2 (g % 4) and 2 (g % 4) + 1 of sub-block g / 4 (only
        // those: the whole sub-block in an array indexed by g would sit in local memory)
        const unsigned lo = quant4(b, g >> 2, 2 * (g & 3)), hi = quant4(b, g >> 2, 2 * (g & 3) + 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = mul_rn((float)(signed char)byte_of(i < 4 ? lo : hi, i & 3), d);
    }
};
