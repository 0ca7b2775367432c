// The ggml block types on the device: one traits struct per weight type, used by the
// dequantizing copies (convert.cu), the quantized matrix-vector products (mul_mat_q.cu)
// and the quantizing copies (quantize.cu). The byte layouts are those of src/quant/mod.rs.
//
// Every struct has:
//   QK, BYTES, SUBS      elements and bytes of a block; SUBS = QK / 32, its 32-element
//                        sub-blocks (one Q8_1 activation block each)
//   W                    one sub-block in registers for the dp4a path: its quants (8
//                        ints, int k holds elements 4k..4k+3, one per byte, like a Q8_1
//                        block's qs; the K-quants keep the bytes as loaded and take their
//                        sub-block's bits in dot) and what scales them
//   PAIRS                whether mul_mat_vec_q's lanes take sub-blocks two at a time (the
//                        K-quants, whose neighbouring sub-blocks share bytes) or one (the
//                        32-element types); it picks the layout of the Q8_1 activations
//                        (act_at), and Q8Layout::of in src/backend/fusion.rs must
//                        agree
//   load(blk, sub, w)    reads sub-block `sub` of the block at blk (all but Q4_K, Q5_K)
//   load2<A>(blk, j, w0, w1)  with PAIRS: sub-blocks j (even) and j + 1 of the block at
//                        blk, in shared memory at alignment A (or in global memory:
//                        A = GLOBAL16, Q4_K and Q5_K, at a 16-byte aligned address;
//                        A = GLOBAL8, IQ4_XS, at an 8-byte aligned one)
//   dot(w, y)            the sub-block's dot product with one Q8_1 block, integer sums by
//                        __dp4a, scales and offsets applied in f32 as src/quant/dot.rs does
//   deq8(blk, g, v)      elements 8g..8g+7 of the block, dequantized exactly as
//                        src/quant's dequantize_row (no fused multiply-add, same order)
//
// Blocks are 18, 20, 22, ... bytes, so a block is only 2-byte aligned: every read below is
// a 16-bit load (or two of them forming a 32-bit word), never a wider unaligned one. The
// reads take a memory space M: Gmem (read-only global data, through the non-coherent
// cache) or Smem (a warp's copy of a weight row in shared memory, mul_mat_q.cu); `load`
// takes it as a template argument, deq8 reads global memory.
// Adding a type is one more struct here (or in quant_lowbit.cuh, the low-bit K-quants, the
// i-quants and the ternary types, which the files that instantiate them include) plus its
// kernel instantiations.
#pragma once

#include "common.cuh"

// ---------------------------------------------------------------------------------------
// 2-byte aligned reads of read-only data, in global (Gmem) or shared (Smem) memory.

struct Gmem {
    static constexpr bool SHARED = false;
    static __device__ __forceinline__ unsigned u16(const char* p) {
        return __ldg(reinterpret_cast<const unsigned short*>(p));
    }
};
struct Smem {
    static constexpr bool SHARED = true;
    static __device__ __forceinline__ unsigned u16(const char* p) {
        return *reinterpret_cast<const unsigned short*>(p);
    }
};

template <typename M = Gmem>
__device__ __forceinline__ unsigned ld_u16(const char* p) { return M::u16(p); }

// The 32-bit little-endian word at a 2-byte aligned address.
template <typename M = Gmem>
__device__ __forceinline__ int ld_i32_a2(const char* p) {
    return (int)(M::u16(p) | (M::u16(p + 2) << 16));
}

// N consecutive 32-bit little-endian words at a 2-byte aligned address. In shared memory
// (the weights mul_mat_vec_q stages) the N + 1 aligned words around them, funnel-shifted
// (the word past the end, whose upper half is not used, only when p is not 4-byte
// aligned), instead of 2 N 16-bit loads. Every type but Q6_K reads its quants this way
// (Q4_0 now the 5 words around its whole block, in its own load; the K-quants 16-byte
// words in aligned rows): on the H100 that took the Llama-2-7B decode from 388 to 407
// tok/s (Q4_0), 262 to 274 (Q8_0) and 352 to 361 (Q4_K). Q6_K keeps 16-bit reads: its
// two runs (ql, qh) as words gave 312 -> 302.
template <typename M, int N>
__device__ __forceinline__ void ld_words(const char* p, int* out) {
    if constexpr (M::SHARED) {
        // pointer arithmetic, not an integer round trip: the loads stay shared-memory ones
        const unsigned off = (unsigned)(uintptr_t)p & 2u;
        const unsigned* a = reinterpret_cast<const unsigned*>(p - off);
        const unsigned sh = off * 8u;  // 0 or 16
        unsigned lo = a[0];
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const unsigned hi = (i + 1 < N || sh != 0u) ? a[i + 1] : 0u;
            out[i] = (int)__funnelshift_r(lo, hi, sh);
            lo = hi;
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i) out[i] = ld_i32_a2<M>(p + 4 * i);
    }
}

// ld_smem's alignment tags for read-only global memory at a 16-byte (GLOBAL16) or an
// 8-byte (GLOBAL8) aligned address.
constexpr int GLOBAL16 = -16;
constexpr int GLOBAL8 = -8;

// N consecutive 32-bit words at p in shared memory, p A-byte aligned: 16-byte loads for
// A = 16, ld_words otherwise; A = GLOBAL16 (GLOBAL8): p in read-only global memory,
// 16-byte (8-byte) aligned, read as 16-byte (8-byte) loads through the non-coherent cache.
template <int A, int N>
__device__ __forceinline__ void ld_smem(const char* p, int* out) {
    if constexpr (A == GLOBAL8 && N % 2 == 0) {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) {
            const int2 v = __ldg(reinterpret_cast<const int2*>(p) + i);
            out[2 * i] = v.x, out[2 * i + 1] = v.y;
        }
    } else if constexpr (A == GLOBAL16 && N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const int4 v = __ldg(reinterpret_cast<const int4*>(p) + i);
            out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
        }
    } else if constexpr (A >= 16 && N % 4 == 0) {
#pragma unroll
        for (int i = 0; i < N / 4; ++i) {
            const int4 v = reinterpret_cast<const int4*>(p)[i];
            out[4 * i] = v.x, out[4 * i + 1] = v.y, out[4 * i + 2] = v.z, out[4 * i + 3] = v.w;
        }
    } else {
        ld_words<Smem, N>(p, out);
    }
}

// Byte i of a 2-byte aligned array.
template <typename M = Gmem>
__device__ __forceinline__ unsigned ld_u8(const char* p, int i) {
    return (M::u16(p + (i & ~1)) >> (8 * (i & 1))) & 0xffu;
}

// The f16 at a 2-byte aligned address, as f32.
template <typename M = Gmem>
__device__ __forceinline__ float ld_f16(const char* p) { return __half2float(__ushort_as_half((unsigned short)M::u16(p))); }

// Four bits b0..b3 moved to bit 4 of bytes 0..3 (the fifth bit of four 5-bit quants).
__device__ __forceinline__ int spread4(unsigned bits) {
    return (int)(((bits & 1u) << 4) | ((bits & 2u) << 11) | ((bits & 4u) << 18) | ((bits & 8u) << 25));
}

// ---------------------------------------------------------------------------------------
// Q8_1 activations, as quantize_q8_1_f32 writes them for the decode products: column c of
// k elements at b + c * b_nb1 (16-byte aligned) holds the quants, k rounded up to groups
// of 16 sub-blocks (512 bytes), then the k / 32 (d, sum) pairs as half2 at
// act_quant_bytes(k) + 4 s. The quants are interleaved so that the 8 lanes of a quarter
// warp loading one 16-byte piece each read 128 contiguous bytes, one transaction (32-byte
// blocks in a row took two), in one of two layouts (act_at), by the order in which the
// product's lanes take sub-blocks:
//   ACT_BLOCKS (the 32-element types: lane s takes sub-block s): groups of 8 sub-blocks,
//     their first 16 quants, then their last 16;
//   ACT_PAIRS (the K-quants: lane t takes sub-blocks 2t and 2t + 1): groups of 16, four
//     runs of 128 bytes holding one piece of each of the group's 8 pairs (the even
//     sub-blocks' first halves, their second halves, then the odd ones').

// Bytes of the quants of a column of k activations (k rounded up to whole groups).
__device__ __forceinline__ i64 act_quant_bytes(i64 k) { return (k + 511) & ~(i64)511; }

// Byte offset of element e (0..31) of sub-block s in a column's quants.
__device__ __forceinline__ i64 act_at(i64 s, int e, i64 layout) {
    if (layout == ACT_PAIRS) return 512 * (s >> 4) + 256 * (s & 1) + 128 * (e >> 4) + 16 * ((s >> 1) & 7) + (e & 15);
    return 256 * (s >> 3) + 128 * (e >> 4) + 16 * (s & 7) + (e & 15);
}

struct Act {
    int q[8];
    float d, s;
};

__device__ __forceinline__ void act_from(int4 lo, int4 hi, Act& y) {
    y.q[0] = lo.x, y.q[1] = lo.y, y.q[2] = lo.z, y.q[3] = lo.w;
    y.q[4] = hi.x, y.q[5] = hi.y, y.q[6] = hi.z, y.q[7] = hi.w;
}

// Sub-block s of a column of k activations in the ACT_BLOCKS layout.
__device__ __forceinline__ void load_act(const char* col, i64 k, int s, Act& y) {
    const int4* q = reinterpret_cast<const int4*>(col + act_at(s, 0, ACT_BLOCKS));
    act_from(q[0], q[8], y);
    const float2 ds = __half22float2(*reinterpret_cast<const __half2*>(col + act_quant_bytes(k) + 4 * (i64)s));
    y.d = ds.x;
    y.s = ds.y;
}

// Sub-blocks s (even) and s + 1 of a column of k activations in the ACT_PAIRS layout.
__device__ __forceinline__ void load_act2(const char* col, i64 k, int s, Act& a, Act& b) {
    const int4* q = reinterpret_cast<const int4*>(col + act_at(s, 0, ACT_PAIRS));
    act_from(q[0], q[8], a);
    act_from(q[16], q[24], b);
    const uint2 u = *reinterpret_cast<const uint2*>(col + act_quant_bytes(k) + 4 * (i64)s);
    const float2 fa = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
    const float2 fb = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
    a.d = fa.x, a.s = fa.y, b.d = fb.x, b.s = fb.y;
}

// Rust's `x as i8`: truncation, saturating, NaN to 0.
__device__ __forceinline__ int sat_i8(float x) {
    if (x != x) return 0;
    const float t = truncf(x);
    return t < -128.0f ? -128 : (t > 127.0f ? 127 : (int)t);
}

// 1 / d, or 0 for a zero scale (an all-zero block).
__device__ __forceinline__ float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// The (d, d * sum) pair of sub-block s of a column of k activations, as half2 at
// act_quant_bytes(k) + 4 s.
__device__ __forceinline__ void store_act_scales(char* col, i64 k, i64 s, float d, int sum) {
    unsigned short* ds = reinterpret_cast<unsigned short*>(col + act_quant_bytes(k) + 4 * s);
    ds[0] = __half_as_ushort(__float2half_rn(d));
    ds[1] = __half_as_ushort(__float2half_rn((float)sum * d));
}

// Element `lane` of sub-block s of a column of k activations, quantized by the whole warp
// (lane = element) into the split layout above (ACT_BLOCKS or ACT_PAIRS): d = amax / 127
// (NaN or infinite for a block holding a NaN or an infinity: its products are not finite),
// quants rounded half away from zero, sum = d * (sum of the quants), as src/quant's quantize_row for Q8_1 rounds
// (no expression here can contract into a fused multiply-add). Every lane must call it.
// ACT_F16: the element as F16 at its place in the column (no quantization, no shuffles).
__device__ __forceinline__ void store_act(float x, char* col, i64 k, i64 s, int lane, i64 layout) {
    if (layout == ACT_F16) {
        reinterpret_cast<__half*>(col)[32 * s + lane] = __float2half_rn(x);
        return;
    }
    const float amax = warp_max(fabsf(x));
    const float d = amax / 127.0f;
    const int q = sat_i8(roundf(x * inverse(d)));
    int sum = q;
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    col[act_at(s, lane, layout)] = (char)q;
    if (lane == 0) store_act_scales(col, k, s, d, sum);
}

// store_act for 4 elements at once: group g (elements 4g..4g+3) of a column of k
// activations, the 8 groups of a 32-element block held by 8 consecutive lanes. The same
// scale, rounding and sum as store_act, so the same bytes. Every lane of the warp calls
// it; `valid` lanes store (a block's 8 lanes are all valid or none).
__device__ __forceinline__ void store_act4(float4 v, char* col, i64 k, int g, bool valid, i64 layout) {
    if (layout == ACT_F16) {
        if (valid) {
            __half2* h = reinterpret_cast<__half2*>(col) + 2 * g;
            h[0] = __floats2half2_rn(v.x, v.y), h[1] = __floats2half2_rn(v.z, v.w);
        }
        return;
    }
    float amax = fmax_nan(fmax_nan(fabsf(v.x), fabsf(v.y)), fmax_nan(fabsf(v.z), fabsf(v.w)));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) amax = fmax_nan(amax, __shfl_xor_sync(FULL_MASK, amax, o));
    const float d = amax / 127.0f;
    const float id = inverse(d);
    const int q0 = sat_i8(roundf(v.x * id)), q1 = sat_i8(roundf(v.y * id));
    const int q2 = sat_i8(roundf(v.z * id)), q3 = sat_i8(roundf(v.w * id));
    int sum = q0 + q1 + q2 + q3;
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    if (!valid) return;
    *reinterpret_cast<unsigned*>(col + act_at(g / 8, 4 * (g % 8), layout)) =
        (unsigned)(q0 & 0xff) | (unsigned)(q1 & 0xff) << 8 | (unsigned)(q2 & 0xff) << 16 | (unsigned)q3 << 24;
    if (g % 8 == 0) store_act_scales(col, k, g / 8, d, sum);
}

// sum of the byte products of w[from..to) and y.q[from..to) (signed bytes).
template <int FROM, int TO>
__device__ __forceinline__ int dp4a_sum(const int* w, const int* y) {
    int s = 0;
#pragma unroll
    for (int k = FROM; k < TO; ++k) s = __dp4a(w[k], y[k], s);
    return s;
}

// ---------------------------------------------------------------------------------------
// Exact dequantization helpers (no contraction into fma: the CPU rounds each step).

__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }

// ---------------------------------------------------------------------------------------
// The 32-element types.

// The 8 low (shift 0) or high (shift 4) nibbles of 8 bytes at p.
__device__ __forceinline__ void nibbles8(const char* p, int shift, int* q) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const unsigned u = ld_u16(p + 2 * k);
        q[2 * k] = (int)((u >> shift) & 15u);
        q[2 * k + 1] = (int)((u >> (8 + shift)) & 15u);
    }
}

// The 32 quants of a 4-bit block from its 16 bytes as 4 words v: low nibbles are
// elements 0..15, high 16..31.
__device__ __forceinline__ void nibbles_of(const int* v, int* q) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        q[k] = v[k] & 0x0f0f0f0f;
        q[k + 4] = (v[k] >> 4) & 0x0f0f0f0f;
    }
}

// Quants of a 4-bit block at qs (nibbles_of).
template <typename M>
__device__ __forceinline__ void load_nibbles(const char* qs, int* q) {
    int v[4];
    ld_words<M, 4>(qs, v);
    nibbles_of(v, q);
}

// The 32 quants of a 5-bit block from its 16 nibble bytes as 4 words v and its fifth bits
// qh (bit i: element i).
__device__ __forceinline__ void fives_of(const int* v, unsigned qh, int* q) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        q[k] = (v[k] & 0x0f0f0f0f) | spread4(qh >> (4 * k));
        q[k + 4] = ((v[k] >> 4) & 0x0f0f0f0f) | spread4(qh >> (16 + 4 * k));
    }
}

// Quants of a 5-bit block: nibbles at qs, fifth bits in qh (fives_of).
template <typename M>
__device__ __forceinline__ void load_5bit(const char* qs, unsigned qh, int* q) {
    int v[4];
    ld_words<M, 4>(qs, v);
    fives_of(v, qh, q);
}

// Elements 8g..8g+7 of a 4-bit block's quants (qs), plus the fifth bits of qh when FIVE.
template <bool FIVE>
__device__ __forceinline__ void quants8_legacy(const char* qs, unsigned qh, int g, int* q) {
    nibbles8(qs + 8 * (g & 1), 4 * (g >> 1), q);
    if (FIVE) {
#pragma unroll
        for (int i = 0; i < 8; ++i) q[i] |= (int)(((qh >> (8 * g + i)) & 1u) << 4);
    }
}

struct BlockQ4_0 {
    static constexpr int QK = 32, BYTES = 18, SUBS = 1;
    static constexpr bool PAIRS = false;
    struct W {
        int q[8];
        float d;
    };
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int, W& w) {
        if constexpr (M::SHARED) {
            // The 5 aligned words around the 18 bytes (a block 2 bytes past a word takes
            // d from the first word's top half and its quants as whole words; an aligned
            // one shifts them out of the 5 words): 5 loads, where d apart took 5 or 6.
            const unsigned mis = (unsigned)(uintptr_t)b & 2u;
            const unsigned* a = reinterpret_cast<const unsigned*>(b - mis);
            unsigned v[5];
#pragma unroll
            for (int i = 0; i < 5; ++i) v[i] = a[i];
            w.d = __half2float(__ushort_as_half((unsigned short)(mis ? v[0] >> 16 : v[0] & 0xffffu)));
            int n[4];
#pragma unroll
            for (int k = 0; k < 4; ++k) n[k] = (int)(mis ? v[k + 1] : __funnelshift_r(v[k], v[k + 1], 16));
            nibbles_of(n, w.q);
        } else {
            w.d = ld_f16<M>(b);
            load_nibbles<M>(b + 2, w.q);
        }
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int s = dp4a_sum<0, 8>(w.q, y.q);
        return w.d * ((float)s * y.d - 8.0f * y.s);
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) { deq8_split(b, b + 2, g, v); }
    // Split rows (Split below): the block from its header at h and its quant bytes as words.
    static __device__ __forceinline__ void from_split(const char* h, const int* v, W& w) {
        nibbles_of(v, w.q);
        w.d = ld_f16(h);
    }
    // deq8 of a block with its header (d) at h and its quant bytes at qs.
    static __device__ __forceinline__ void deq8_split(const char* h, const char* qs, int g, float* v) {
        const float d = ld_f16(h);
        int q[8];
        quants8_legacy<false>(qs, 0, g, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = mul_rn((float)(q[i] - 8), d);
    }
};

struct BlockQ4_1 {
    static constexpr int QK = 32, BYTES = 20, SUBS = 1;
    static constexpr bool PAIRS = false;
    struct W {
        int q[8];
        float d, m;
    };
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int, W& w) {
        w.d = ld_f16<M>(b);
        w.m = ld_f16<M>(b + 2);
        load_nibbles<M>(b + 4, w.q);
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int s = dp4a_sum<0, 8>(w.q, y.q);
        return (float)s * (w.d * y.d) + w.m * y.s;
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) { deq8_split(b, b + 4, g, v); }
    static __device__ __forceinline__ void from_split(const char* h, const int* v, W& w) {
        w.d = ld_f16(h);
        w.m = ld_f16(h + 2);
        nibbles_of(v, w.q);
    }
    // deq8 of a block with its header (d, m) at h and its quant bytes at qs.
    static __device__ __forceinline__ void deq8_split(const char* h, const char* qs, int g, float* v) {
        const float d = ld_f16(h), m = ld_f16(h + 2);
        int q[8];
        quants8_legacy<false>(qs, 0, g, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(mul_rn((float)q[i], d), m);
    }
};

struct BlockQ5_0 {
    static constexpr int QK = 32, BYTES = 22, SUBS = 1;
    static constexpr bool PAIRS = false;
    struct W {
        int q[8];
        float d;
    };
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int, W& w) {
        w.d = ld_f16<M>(b);
        load_5bit<M>(b + 6, (unsigned)ld_i32_a2<M>(b + 2), w.q);
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int s = dp4a_sum<0, 8>(w.q, y.q);
        return w.d * ((float)s * y.d - 16.0f * y.s);
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) { deq8_split(b, b + 6, g, v); }
    static __device__ __forceinline__ void from_split(const char* h, const int* v, W& w) {
        w.d = ld_f16(h);
        fives_of(v, (unsigned)ld_i32_a2(h + 2), w.q);
    }
    // deq8 of a block with its header (d, qh) at h and its quant bytes at qs.
    static __device__ __forceinline__ void deq8_split(const char* h, const char* qs, int g, float* v) {
        const float d = ld_f16(h);
        int q[8];
        quants8_legacy<true>(qs, (unsigned)ld_i32_a2(h + 2), g, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = mul_rn((float)(q[i] - 16), d);
    }
};

struct BlockQ5_1 {
    static constexpr int QK = 32, BYTES = 24, SUBS = 1;
    static constexpr bool PAIRS = false;
    struct W {
        int q[8];
        float d, m;
    };
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int, W& w) {
        w.d = ld_f16<M>(b);
        w.m = ld_f16<M>(b + 2);
        load_5bit<M>(b + 8, (unsigned)ld_i32_a2<M>(b + 4), w.q);
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int s = dp4a_sum<0, 8>(w.q, y.q);
        return (float)s * (w.d * y.d) + w.m * y.s;
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) { deq8_split(b, b + 8, g, v); }
    static __device__ __forceinline__ void from_split(const char* h, const int* v, W& w) {
        w.d = ld_f16(h);
        w.m = ld_f16(h + 2);
        fives_of(v, (unsigned)ld_i32_a2(h + 4), w.q);
    }
    // deq8 of a block with its header (d, m, qh) at h and its quant bytes at qs.
    static __device__ __forceinline__ void deq8_split(const char* h, const char* qs, int g, float* v) {
        const float d = ld_f16(h), m = ld_f16(h + 2);
        int q[8];
        quants8_legacy<true>(qs, (unsigned)ld_i32_a2(h + 4), g, q);
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fadd_rn(mul_rn((float)q[i], d), m);
    }
};

// Q8_0 (scale at 0, quants at 2) and Q8_1 (scale at 0, sum at 2, quants at 4).
template <int QS, int NBYTES>
struct BlockQ8 {
    static constexpr int QK = 32, BYTES = NBYTES, SUBS = 1;
    static constexpr bool PAIRS = false;
    struct W {
        int q[8];
        float d;
    };
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int, W& w) {
        w.d = ld_f16<M>(b);
        ld_words<M, 8>(b + QS, w.q);
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int s = dp4a_sum<0, 8>(w.q, y.q);
        return w.d * y.d * (float)s;
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) { deq8_split(b, b + QS, g, v); }
    static __device__ __forceinline__ void from_split(const char* h, const int* v, W& w) {
#pragma unroll
        for (int k = 0; k < 8; ++k) w.q[k] = v[k];
        w.d = ld_f16(h);
    }
    // deq8 of a block with its scale at h and its 32 quant bytes at qs.
    static __device__ __forceinline__ void deq8_split(const char* h, const char* qs, int g, float* v) {
        const float d = ld_f16(h);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const unsigned u = ld_u16(qs + 8 * g + 2 * k);
            v[2 * k] = mul_rn((float)(signed char)(u & 0xffu), d);
            v[2 * k + 1] = mul_rn((float)(signed char)(u >> 8), d);
        }
    }
};
typedef BlockQ8<2, 34> BlockQ8_0;
typedef BlockQ8<4, 36> BlockQ8_1;

// ---------------------------------------------------------------------------------------
// The K-quants: 256-element super-blocks, 8 sub-blocks of 32.

// The 6-bit scale and min of sub-block j from the 12 packed bytes at s.
template <typename M = Gmem>
__device__ __forceinline__ void scale_min_k4(const char* s, int j, int& sc, int& m) {
    if (j < 4) {
        sc = (int)(ld_u8<M>(s, j) & 63u);
        m = (int)(ld_u8<M>(s, j + 4) & 63u);
    } else {
        const unsigned b = ld_u8<M>(s, j + 4);
        sc = (int)((b & 0x0fu) | ((ld_u8<M>(s, j - 4) >> 6) << 4));
        m = (int)((b >> 4) | ((ld_u8<M>(s, j) >> 6) << 4));
    }
}

// scale_min_k4 from the 12 scale bytes held as 3 words s, without branches (the lanes of
// a warp take sub-blocks on both sides of j = 4).
__device__ __forceinline__ void scale_min_words(const int* s, int j, int& sc, int& m) {
    const auto byte = [&](int i) {
        const unsigned w = (unsigned)(i < 4 ? s[0] : (i < 8 ? s[1] : s[2]));
        return (w >> (8 * (i & 3))) & 0xffu;
    };
    const unsigned bj = byte(j), b4 = byte(j + 4), bl = byte(j & 3);
    sc = (int)(j < 4 ? (bj & 63u) : ((b4 & 0x0fu) | ((bl >> 6) << 4)));
    m = (int)(j < 4 ? (b4 & 63u) : ((b4 >> 4) | ((bj >> 6) << 4)));
}

// A Q4_K / Q5_K header as 4 words h (d and dmin, then the 12 scale bytes) into the
// sub-blocks j (even) and j + 1 of a pair (W: a j, d, dmin, sc and m each).
template <typename W>
__device__ __forceinline__ void k4_head(const int* h, int j, W& w0, W& w1) {
    w0.j = j, w1.j = j + 1;
    w0.d = w1.d = __half2float(__ushort_as_half((unsigned short)(h[0] & 0xffff)));
    w0.dmin = w1.dmin = __half2float(__ushort_as_half((unsigned short)((unsigned)h[0] >> 16)));
    scale_min_words(h + 1, j, w0.sc, w0.m);
    scale_min_words(h + 1, j + 1, w1.sc, w1.m);
}

// A Q4_K / Q5_K sub-block's sum from its integer dot product s with the Q8_1 block y.
template <typename W>
__device__ __forceinline__ float k4_sum(const W& w, const Act& y, int s) {
    return w.d * (y.d * (float)(w.sc * s)) - w.dmin * (y.s * (float)w.m);
}

// Q4_K (FIVE false) and Q5_K (FIVE true): d, dmin, scales[12], [qh[32]], qs[128].
template <bool FIVE>
struct BlockK4 {
    static constexpr int QK = 256, BYTES = FIVE ? 176 : 144, SUBS = 8;
    static constexpr int QS = FIVE ? 48 : 16;
    // The 32 quant bytes of sub-blocks j & ~1 and j | 1 (low and high nibbles) and, for
    // Q5_K, the block's 32 bytes of fifth bits, as loaded; dot takes sub-block j's bits.
    struct W {
        int qs[8], qh[8];
        int j, sc, m;
        float d, dmin;
    };
    static constexpr bool PAIRS = true;
    static constexpr int PA = 16;  // BYTES is a multiple of 16
    // Sub-blocks j (even) and j + 1, which share their quant bytes and the block's header:
    // the header (d, dmin, scales) as 4 words, the quant bytes (and the fifth bits) as 8,
    // at alignment A: 16-byte loads in a 16-byte aligned row.
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        int h[4];
        ld_smem<A, 4>(b, h);
        ld_smem<A, 8>(b + QS + 32 * (j >> 1), w0.qs);
        if (FIVE) ld_smem<A, 8>(b + 16, w0.qh);
#pragma unroll
        for (int k = 0; k < 8; ++k) w1.qs[k] = w0.qs[k], w1.qh[k] = FIVE ? w0.qh[k] : 0;
        k4_head(h, j, w0, w1);
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int shift = 4 * (w.j & 1);
        int q[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            q[k] = (w.qs[k] >> shift) & 0x0f0f0f0f;
            if (FIVE) q[k] |= ((w.qh[k] >> w.j) & 0x01010101) << 4;
        }
        return k4_sum(w, y, dp4a_sum<0, 8>(q, y.q));
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        if (((uintptr_t)b & 15u) == 0) {
            deq8_aligned(b, g, v);
            return;
        }
        const int j = g >> 2, off = 8 * (g & 3);
        int sc, m;
        scale_min_k4(b + 4, j, sc, m);
        const float dj = mul_rn(ld_f16(b), (float)sc), mj = mul_rn(ld_f16(b + 2), (float)m);
        int q[8];
        nibbles8(b + QS + 32 * (j >> 1) + off, 4 * (j & 1), q);
        if (FIVE) {
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                const unsigned h = ld_u16(b + 16 + off + i);
                q[i] |= (int)(((h >> j) & 1u) << 4);
                q[i + 1] |= (int)(((h >> (8 + j)) & 1u) << 4);
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) v[i] = __fsub_rn(mul_rn(dj, (float)q[i]), mj);
    }
    // deq8 of a 16-byte aligned block (144 and 176 bytes are multiples of 16, so rows of
    // whole blocks that start aligned keep every block aligned): the same values from 6
    // wide loads instead of 12-14 two-byte ones (d and dmin as one word, the 12 scale bytes
    // as three, 8 quant bytes and 8 fifth-bit bytes as one 8-byte load each).
    static __device__ __forceinline__ void deq8_aligned(const char* b, int g, float* v) {
        const int j = g >> 2, off = 8 * (g & 3);
        const unsigned dd = __ldg(reinterpret_cast<const unsigned*>(b));
        const unsigned s[3] = {__ldg(reinterpret_cast<const unsigned*>(b + 4)),
                               __ldg(reinterpret_cast<const unsigned*>(b + 8)),
                               __ldg(reinterpret_cast<const unsigned*>(b + 12))};
        const auto byte = [&](int i) { return (s[i >> 2] >> (8 * (i & 3))) & 0xffu; };
        int sc, m;
        if (j < 4) {
            sc = (int)(byte(j) & 63u);
            m = (int)(byte(j + 4) & 63u);
        } else {
            const unsigned hb = byte(j + 4);
            sc = (int)((hb & 0x0fu) | ((byte(j - 4) >> 6) << 4));
            m = (int)((hb >> 4) | ((byte(j) >> 6) << 4));
        }
        const float d = __half2float(__ushort_as_half((unsigned short)(dd & 0xffffu)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dd >> 16)));
        const float dj = mul_rn(d, (float)sc), mj = mul_rn(dmin, (float)m);
        const uint2 qs = __ldg(reinterpret_cast<const uint2*>(b + QS + 32 * (j >> 1) + off));
        const int shift = 4 * (j & 1);
        uint2 qh = make_uint2(0u, 0u);
        if (FIVE) qh = __ldg(reinterpret_cast<const uint2*>(b + 16 + off));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned w = i < 4 ? qs.x : qs.y, h = i < 4 ? qh.x : qh.y;
            int q = (int)((w >> (8 * (i & 3) + shift)) & 15u);
            if (FIVE) q |= (int)(((h >> (8 * (i & 3) + j)) & 1u) << 4);
            v[i] = __fsub_rn(mul_rn(dj, (float)q), mj);
        }
    }
};
typedef BlockK4<false> BlockQ4_K;
typedef BlockK4<true> BlockQ5_K;

// Q6_K: ql[128], qh[64], scales[16] (i8), d. Sub-block j = elements 32j..32j+31: half
// c = j / 4 of the super-block, quarter t = j % 4 of that half.
struct BlockQ6_K {
    static constexpr int QK = 256, BYTES = 210, SUBS = 8;
    struct W {
        int q[8];
        int sa, sb;
        float d;
    };
    template <typename M>
    static __device__ __forceinline__ void load(const char* b, int j, W& w) {
        const int c = j >> 2, t = j & 3;
        const char* ql = b + 64 * c + 32 * (t & 1);
        const char* qh = b + 128 + 32 * c;
        const int nshift = 4 * (t >> 1), hshift = 2 * t;
#pragma unroll
        for (int k = 0; k < 8; ++k) {
            const int lo = (ld_i32_a2<M>(ql + 4 * k) >> nshift) & 0x0f0f0f0f;
            const int hi = ((ld_i32_a2<M>(qh + 4 * k) >> hshift) & 0x03030303) << 4;
            w.q[k] = (int)__vsub4((unsigned)(lo | hi), 0x20202020u);
        }
        const unsigned s = ld_u16<M>(b + 192 + 2 * j);
        w.sa = (int)(signed char)(s & 0xffu);
        w.sb = (int)(signed char)(s >> 8);
        w.d = ld_f16<M>(b + 208);
    }
    static constexpr bool PAIRS = true;  // its activations are shared with Q4_K's
    static constexpr int PA = 2;
    // Sub-blocks j and j + 1 one at a time (they share only qh).
    template <int A>
    static __device__ __forceinline__ void load2(const char* b, int j, W& w0, W& w1) {
        load<Smem>(b, j, w0);
        load<Smem>(b, j + 1, w1);
    }
    static __device__ __forceinline__ float dot(const W& w, const Act& y) {
        const int sa = dp4a_sum<0, 4>(w.q, y.q), sb = dp4a_sum<4, 8>(w.q, y.q);
        return w.d * (y.d * (float)(w.sa * sa + w.sb * sb));
    }
    static __device__ __forceinline__ void deq8(const char* b, int g, float* v) {
        const int e = 8 * g, c = e >> 7, r = e & 127, t = r >> 5, l0 = r & 31;
        const char* ql = b + 64 * c + 32 * (t & 1) + l0;
        const char* qh = b + 128 + 32 * c + l0;
        const int nshift = 4 * (t >> 1), hshift = 2 * t;
        const float dj = mul_rn(ld_f16(b + 208), (float)(signed char)ld_u8(b + 192, e >> 4));
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            const unsigned l = ld_u16(ql + i), h = ld_u16(qh + i);
            const int q0 = (int)(((l >> nshift) & 15u) | (((h >> hshift) & 3u) << 4)) - 32;
            const int q1 = (int)(((l >> (8 + nshift)) & 15u) | (((h >> (8 + hshift)) & 3u) << 4)) - 32;
            v[i] = mul_rn(dj, (float)q0);
            v[i + 1] = mul_rn(dj, (float)q1);
        }
    }
};

// The block of row element i0 (QK | i0) of a row at `row` with blocks `nb0` bytes apart.
template <typename Q>
__device__ __forceinline__ const char* block_of(const char* row, i64 i0, i64 nb0) {
    return row + (i0 / Q::QK) * nb0;
}

// ---------------------------------------------------------------------------------------
// Row readers for the kernels that take a weight row and a block index (the decode
// products, the dequantizing copy of the prefill's weights): where block b of a row of nb
// blocks lies.

// ggml's layout: block b of type Q at row + b * Q::BYTES.
template <typename Q>
struct Blocks {
    static constexpr int QK = Q::QK, BYTES = Q::BYTES;
    static __device__ __forceinline__ void deq8(const char* row, i64, i64 b, int g, float* v) {
        Q::deq8(row + b * Q::BYTES, g, v);
    }
};

// Frozen weights in split rows (src/quant/split.rs, src/backend/cuda/split.rs): a row of nb
// blocks of B holds their QB quant bytes (16, Q8_0: 32) at row + QB b, then their
// headers, the block's other H = BYTES - QB bytes in ggml's order (the f16 scale, Q4_1's
// and Q5_1's f16 min, Q5_0's and Q5_1's 4 bytes of fifth bits), at row + QB nb + H b; as
// many bytes as in ggml's layout, rows of a multiple of 16 bytes so that every row stays
// 16-byte aligned and a block's quants are aligned 16-byte loads. The quants are read
// once: no L1 allocation.

__device__ __forceinline__ int4 ld_stream16(const char* p) {
    int4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.s32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <typename B, int QB_>
struct Split {
    typedef B Q;  // the block type: its W and dot
    static constexpr int QK = 32, BYTES = B::BYTES, QB = QB_, H = B::BYTES - QB_;
    static __device__ __forceinline__ const char* head(const char* row, i64 nb, i64 b) { return row + QB * nb + H * b; }
    // Block b as B::load gives it.
    static __device__ __forceinline__ void load(const char* row, int nb, int b, typename Q::W& w) {
        int v[QB / 4];
#pragma unroll
        for (int i = 0; i < QB / 16; ++i) {
            const int4 x = ld_stream16(row + QB * (i64)b + 16 * i);
            v[4 * i] = x.x, v[4 * i + 1] = x.y, v[4 * i + 2] = x.z, v[4 * i + 3] = x.w;
        }
        Q::from_split(head(row, nb, b), v, w);
    }
    // Elements 8g..8g+7 of block b, as B::deq8 gives them.
    static __device__ __forceinline__ void deq8(const char* row, i64 nb, i64 b, int g, float* v) {
        Q::deq8_split(head(row, nb, b), row + QB * b, g, v);
    }
};
typedef Split<BlockQ4_0, 16> SplitQ4_0;
typedef Split<BlockQ4_1, 16> SplitQ4_1;
typedef Split<BlockQ5_0, 16> SplitQ5_0;
typedef Split<BlockQ5_1, 16> SplitQ5_1;
typedef Split<BlockQ8_0, 32> SplitQ8_0;

// Frozen Q6_K weights in split rows (src/quant/split.rs): a row of nb >= 8 blocks holds one
// sequence of every block's 192 quant bytes (block b at 192 b), then every block's 16
// scales (at 192 nb + 16 b), then every block's d (at 208 nb + 2 b), as many bytes as
// ggml's row, rotated forward by the distance from the row's start to the next 16-byte
// boundary: a row's quants are aligned 16-byte loads wherever it starts (210-byte blocks
// leave a row of 11008 elements 9030 bytes long, so rows start at every even offset),
// and only the last d's wrap around to the row's start. A block's quants are its four
// pairs of sub-blocks (2p, 2p + 1), 48 bytes each at 48 p: 32 bytes of low nibbles
// (element i of sub-block 2p in the low half of byte i, of 2p + 1 in the high half), then
// 16 bytes of high bit pairs (element 4k + i of sub-block 2p + u in byte i of word k % 4,
// at bits 2 (2u + k / 4)). A lane's pair is three 16-byte loads and one 4-byte load of its
// four scales.
struct SplitQ6_K {
    // Sub-block 2p + u of a pair in registers as loaded (the pair's repacked quants, its
    // four scales, d), decoded in dot: the two sub-blocks of a pair share their registers,
    // so that two pairs in flight fit in those of 8 blocks an SM. dot gives
    // BlockQ6_K::dot's sums from the same values.
    struct Q {
        struct W {
            int n[8], h[4];
            unsigned sc;
            float d;
            int u;
        };
        static __device__ __forceinline__ float dot(const W& w, const Act& y) {
            int q[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned n = (unsigned)w.n[k] >> (4 * w.u), hk = (unsigned)w.h[k & 3] >> (2 * (k >> 2) + 4 * w.u);
                q[k] = (int)__vsub4((n & 0x0f0f0f0fu) | ((hk & 0x03030303u) << 4), 0x20202020u);
            }
            const int sa = dp4a_sum<0, 4>(q, y.q), sb = dp4a_sum<4, 8>(q, y.q);
            const int ca = (int)(signed char)((w.sc >> (16 * w.u)) & 0xffu);
            const int cb = (int)(signed char)((w.sc >> (16 * w.u + 8)) & 0xffu);
            return w.d * (y.d * (float)(ca * sa + cb * sb));
        }
    };
    static constexpr int QK = 256, BYTES = 210, SUBS = 8;
    // The rotation of the row at `row` (even: blocks are 210 bytes).
    static __device__ __forceinline__ int rot(const char* row) { return (int)((0u - (unsigned)(uintptr_t)row) & 15u); }
    static __device__ __forceinline__ float d(const char* row, int o, i64 nb, i64 b) {
        i64 at = 208 * nb + 2 * b + o;
        if (at >= 210 * nb) at -= 210 * nb;
        return ld_f16(row + at);
    }
    // Sub-blocks s (even) and s + 1 of the row.
    static __device__ __forceinline__ void load2(const char* row, int nb, int s, Q::W& w0, Q::W& w1) {
        const int o = rot(row), b = s >> 3, p = (s & 7) >> 1;
        const char* q = row + o + 192 * (i64)b + 48 * p;
        const int4 n0 = ld_stream16(q), n1 = ld_stream16(q + 16), h = ld_stream16(q + 32);
        w0.n[0] = n0.x, w0.n[1] = n0.y, w0.n[2] = n0.z, w0.n[3] = n0.w;
        w0.n[4] = n1.x, w0.n[5] = n1.y, w0.n[6] = n1.z, w0.n[7] = n1.w;
        w0.h[0] = h.x, w0.h[1] = h.y, w0.h[2] = h.z, w0.h[3] = h.w;
        w0.sc = __ldg(reinterpret_cast<const unsigned*>(row + o + 192 * (i64)nb + 16 * b + 4 * p));
        w0.d = d(row, o, nb, b);
        w0.u = 0;
        w1 = w0;
        w1.u = 1;
    }
    // Elements 8g..8g+7 of block b, as BlockQ6_K::deq8 gives them.
    static __device__ __forceinline__ void deq8(const char* row, i64 nb, i64 b, int g, float* v) {
        const int o = rot(row), j = g >> 2, gg = g & 3;
        const char* q = row + o + 192 * b + 48 * (j >> 1);
        const uint2 nib = __ldg(reinterpret_cast<const uint2*>(q + 8 * gg));
        const uint2 hb = __ldg(reinterpret_cast<const uint2*>(q + 32 + 8 * (gg & 1)));
        const int ns = 4 * (j & 1), hs = 2 * (2 * (j & 1) + (gg >> 1));
        const float dj = mul_rn(d(row, o, nb, b), (float)(signed char)ld_u8(row + o + 192 * nb + 16 * b, 2 * j + (gg >> 1)));
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned w = i < 4 ? nib.x : nib.y, h = i < 4 ? hb.x : hb.y;
            const int sh = 8 * (i & 3);
            const int q6 = (int)(((w >> (sh + ns)) & 15u) | (((h >> (sh + hs)) & 3u) << 4)) - 32;
            v[i] = mul_rn(dj, (float)q6);
        }
    }
};

// Frozen Q5_K weights in split rows (src/quant/split.rs): a row of nb blocks holds every
// block's 128 quant bytes as ggml has them (block b at 128 b), then every block's fifth
// bits by pair of sub-blocks (at 128 nb + 32 b + 8 p: for sub-block 2p + u, the word at
// 4u whose byte i holds at bit k the fifth bit of element 4k + i), then every block's 16
// header bytes (d, dmin, scales; at 160 nb + 16 b). 176-byte blocks keep rows of whole
// blocks 16-byte aligned, so nothing is rotated. A lane's pair is two 16-byte loads of
// quants, one 8-byte load of fifth bits and one 16-byte load of the header, where the
// in-place kernel loads all 32 bytes of fifth bits; the values are BlockQ5_K's, so the
// same sums.
struct SplitQ5_K {
    // One sub-block in registers: the pair's quant bytes (sub-block j's nibbles), its
    // fifth bits as one word, its scale and min.
    struct Q {
        struct W {
            int qs[8], h;
            int j, sc, m;
            float d, dmin;
        };
        static __device__ __forceinline__ float dot(const W& w, const Act& y) {
            const int shift = 4 * (w.j & 1);
            int q[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) q[k] = ((w.qs[k] >> shift) & 0x0f0f0f0f) | (((w.h >> k) & 0x01010101) << 4);
            return k4_sum(w, y, dp4a_sum<0, 8>(q, y.q));
        }
    };
    static constexpr int QK = 256, BYTES = 176, SUBS = 8;
    // Sub-blocks s (even) and s + 1 of the row.
    static __device__ __forceinline__ void load2(const char* row, int nb, int s, Q::W& w0, Q::W& w1) {
        const int b = s >> 3, j = s & 7;
        int h[4];
        ld_smem<GLOBAL16, 4>(row + 160 * (i64)nb + 16 * b, h);
        ld_smem<GLOBAL16, 8>(row + 128 * (i64)b + 16 * j, w0.qs);
        const uint2 fb = __ldg(reinterpret_cast<const uint2*>(row + 128 * (i64)nb + 32 * b + 4 * j));
#pragma unroll
        for (int k = 0; k < 8; ++k) w1.qs[k] = w0.qs[k];
        w0.h = (int)fb.x, w1.h = (int)fb.y;
        k4_head(h, j, w0, w1);
    }
    // Elements 8g..8g+7 of block b, as BlockQ5_K::deq8 gives them.
    static __device__ __forceinline__ void deq8(const char* row, i64 nb, i64 b, int g, float* v) {
        const int j = g >> 2, off = 8 * (g & 3);
        const char* h = row + 160 * nb + 16 * b;
        const unsigned dd = __ldg(reinterpret_cast<const unsigned*>(h));
        const int s[3] = {(int)__ldg(reinterpret_cast<const unsigned*>(h + 4)),
                          (int)__ldg(reinterpret_cast<const unsigned*>(h + 8)),
                          (int)__ldg(reinterpret_cast<const unsigned*>(h + 12))};
        int sc, m;
        scale_min_words(s, j, sc, m);
        const float d = __half2float(__ushort_as_half((unsigned short)(dd & 0xffffu)));
        const float dmin = __half2float(__ushort_as_half((unsigned short)(dd >> 16)));
        const float dj = mul_rn(d, (float)sc), mj = mul_rn(dmin, (float)m);
        const uint2 qs = __ldg(reinterpret_cast<const uint2*>(row + 128 * b + 32 * (j >> 1) + off));
        const unsigned fw = __ldg(reinterpret_cast<const unsigned*>(row + 128 * nb + 32 * b + 4 * j));
        const int shift = 4 * (j & 1);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const unsigned w = i < 4 ? qs.x : qs.y;
            const int e = off + i;  // element 4k + r of the sub-block: bit k of byte r
            int q = (int)((w >> (8 * (i & 3) + shift)) & 15u);
            q |= (int)(((fw >> (8 * (e & 3) + (e >> 2))) & 1u) << 4);
            v[i] = __fsub_rn(mul_rn(dj, (float)q), mj);
        }
    }
};
