// Dequantizing copies and get_rows from block-quantized tensors (cuda/quant.cuh's types):
//   cpy_<q>_f32, cpy_<q>_f16: dst = dequantize(src). One thread per 8 consecutive
//     elements of a block (flat grid-stride loop over nelements / 8 groups). src has
//     dense blocks along dim 0 (nb[0] = block bytes) at any row strides; dst any strides.
//     CPY_SAME_SHAPE writes element (i0, i1, i2, i3) of src to the same index of dst;
//     otherwise (CPY_RESHAPE, CPY_CONTIGUOUS) elements are matched in row-major order.
//     The values are the CPU's dequantize_row bits (then rounded to f16 for _f16).
//     Same-shape copies into dense, 16-byte aligned rows (the prefill's F16 weight copies)
//     take deq_rows: 32-bit index math and 16-byte stores.
//   cpy_split_<q>_f16 (q4_0, q4_1, q5_0, q5_1, q8_0, q5_k, q6_k): cpy_<q>_f16 from a frozen
//     weight in split rows (Split, SplitQ5_K, SplitQ6_K in quant.cuh), the prefill's F16 copy: deq_rows only
//     (the lowering checks that it fits, src/backend/cuda/lower/mul_mat_q.rs), the same
//     values.
//   split_rows_<q> (the same types): the rows of src (ggml's blocks, dense, rows src.nb[1]
//     apart) into split rows at dst (rows dst.nb[1] apart, 16-byte aligned, nb[1] a
//     multiple of 16; Q6_K: any even address and row length, rows rotated by their
//     address): one thread per block, n blocks in all. src and dst must not overlap.
//   get_rows_<q>: F32 dst row (i1, i2, i3) = dequantized table row ids[i1, i2, i3] of
//     matrix (i2, i3). One block per dst row, a thread per 8-element group; an id outside
//     0..rows is recorded in the index-error record and its dst row zero-filled.
#include "quant.cuh"
#include "quant_lowbit.cuh"

// Whether the rows of t (dims 1..3) lie nb[1] apart, so that row r is at data + r nb[1].
__device__ __forceinline__ bool flat_rows(const Tensor4& t) {
    return t.nb[2] == t.nb[1] * t.ne[1] && t.nb[3] == t.nb[2] * t.ne[2];
}

// Whether cpy_deq can take deq_rows: the same shape, flat rows on both sides, dst elements
// dense in 16-byte aligned rows, fewer than 2^31 groups of 8.
template <typename D>
__device__ __forceinline__ bool deq_rows_fit(const CpyArgs& p) {
    return p.mode == CPY_SAME_SHAPE && p.dst.nb[0] == (i64)sizeof(D) && p.dst.nb[1] % 16 == 0 &&
           (uintptr_t)p.dst.data % 16 == 0 && flat_rows(p.src) && flat_rows(p.dst) &&
           p.n / 8 < (i64)INT32_MAX;
}

// cpy_deq when deq_rows_fit: a thread per group of 8 as there, but 32-bit index math
// (one division per group) and 16-byte stores. (A thread per 32-element sub-block, the
// block header read once, measured slower on an H100: 12.8k vs 14.9k tok/s prefill of a
// Q4_0 7B, two runs of the same day.)
// R: the row reader (Blocks<Q> or Split, quant.cuh).
template <typename R, typename D>
__device__ void deq_rows(const CpyArgs& p) {
    const unsigned per_row = (unsigned)(p.src.ne[0] / 8), groups = (unsigned)(p.n / 8);
    const i64 nb = p.src.ne[0] / R::QK;
    for (unsigned gi = blockIdx.x * blockDim.x + threadIdx.x; gi < groups; gi += gridDim.x * blockDim.x) {
        const unsigned r = gi / per_row, g = gi - r * per_row;
        float v[8];
        R::deq8(p.src.data + r * p.src.nb[1], nb, g / (R::QK / 8), (int)(g % (R::QK / 8)), v);
        store8<D>(p.dst.data + r * p.dst.nb[1] + 8 * (i64)g * (i64)sizeof(D), v);
    }
}

template <typename Q, typename D>
__device__ void cpy_deq(const CpyArgs& p) {
    pdl_enter();
    if (deq_rows_fit<D>(p)) {
        deq_rows<Blocks<Q>, D>(p);
        return;
    }
    const i64 groups = p.n / 8;
    for (i64 gi = blockIdx.x * (i64)blockDim.x + threadIdx.x; gi < groups; gi += (i64)gridDim.x * blockDim.x) {
        i64 is[4];
        unflatten(p.src.ne, gi * 8, is);
        const char* blk = at(p.src, 0, is[1], is[2], is[3]) + (is[0] / Q::QK) * p.src.nb[0];
        float v[8];
        Q::deq8(blk, (int)((is[0] % Q::QK) / 8), v);
        if (p.mode == CPY_SAME_SHAPE) {
            char* d = at(p.dst, is[0], is[1], is[2], is[3]);
#pragma unroll
            for (int i = 0; i < 8; ++i) store<D>(d + i * p.dst.nb[0], v[i]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                i64 id[4];
                unflatten(p.dst.ne, gi * 8 + i, id);
                store<D>(at(p.dst, id[0], id[1], id[2], id[3]), v[i]);
            }
        }
    }
}

template <typename Q>
__device__ void get_rows_q(const RowsArgs& p) {
    pdl_enter();
    const RowIndex r = row_index(p.dst.ne, blockIdx.x);
    const int id = *reinterpret_cast<const int*>(at(p.ids, r.i1, r.i2, r.i3, 0));
    const i64 rows = p.src.ne[1];
    char* d = at(p.dst, 0, r.i1, r.i2, r.i3);
    const i64 ne0 = p.dst.ne[0];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) record_index_error(p.err, p.tag, id, r.i1, rows);
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) store<float>(d + i0 * p.dst.nb[0], 0.0f);
        return;
    }
    const char* s = at(p.src, 0, id, r.i2, r.i3);
    for (i64 g = threadIdx.x; g < ne0 / 8; g += blockDim.x) {
        float v[8];
        Q::deq8(s + (g * 8 / Q::QK) * p.src.nb[0], (int)(g % (Q::QK / 8)), v);
#pragma unroll
        for (int i = 0; i < 8; ++i) store<float>(d + (g * 8 + i) * p.dst.nb[0], v[i]);
    }
}

// The loop of the split_rows_<q> kernels, one thread per block (n blocks in all): f(blk,
// row, nb, b) for block b of each row of nb blocks, blk its ggml bytes in src, row the
// row of dst it goes to.
template <int QK, int BYTES, typename F>
__device__ __forceinline__ void each_block(const CpyArgs& p, F f) {
    pdl_enter();
    const i64 nb = p.src.ne[0] / QK;
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        const i64 r = i / nb, b = i - r * nb;
        f(p.src.data + r * p.src.nb[1] + BYTES * b, p.dst.data + r * p.dst.nb[1], nb, b);
    }
}

// The 16 bytes at a 2-byte aligned address.
__device__ __forceinline__ int4 ld16_a2(const char* q) {
    return make_int4(ld_i32_a2(q), ld_i32_a2(q + 4), ld_i32_a2(q + 8), ld_i32_a2(q + 12));
}

// split_rows_<q> of the 32-element types (Split in quant.cuh).
template <typename S>
__device__ void split_rows(const CpyArgs& p) {
    each_block<S::QK, S::BYTES>(p, [](const char* blk, char* row, i64 nb, i64 b) {
#pragma unroll
        for (int w = 0; w < S::QB / 16; ++w) {
            *reinterpret_cast<int4*>(row + S::QB * b + 16 * w) = ld16_a2(blk + S::H + 16 * w);
        }
#pragma unroll
        for (int h = 0; h < S::H; h += 2) {
            *reinterpret_cast<unsigned short*>(row + S::QB * nb + S::H * b + h) = (unsigned short)ld_u16(blk + h);
        }
    });
}

// split_rows_q6_k, into the layout of SplitQ6_K (quant.cuh).
__device__ void split_rows_q6k(const CpyArgs& p) {
    each_block<256, 210>(p, [](const char* blk, char* row, i64 nb, i64 b) {
        const int o = SplitQ6_K::rot(row);
#pragma unroll
        for (int pr = 0; pr < 4; ++pr) {
            const int c = pr >> 1, tt = pr & 1;  // half c, sub-blocks 4c + 2tt and 4c + 2tt + 1
            int w[12];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const unsigned l0 = (unsigned)ld_i32_a2(blk + 64 * c + 4 * k);
                const unsigned l1 = (unsigned)ld_i32_a2(blk + 64 * c + 32 + 4 * k);
                w[k] = (int)(((l0 >> (4 * tt)) & 0x0f0f0f0fu) | (((l1 >> (4 * tt)) & 0x0f0f0f0fu) << 4));
            }
#pragma unroll
            for (int m = 0; m < 4; ++m) {
                unsigned hw = 0;
#pragma unroll
                for (int s = 0; s < 4; ++s) {
                    const unsigned h = (unsigned)ld_i32_a2(blk + 128 + 32 * c + 4 * (m + 4 * (s & 1)));
                    hw |= ((h >> (2 * (2 * tt + (s >> 1)))) & 0x03030303u) << (2 * s);
                }
                w[8 + m] = (int)hw;
            }
            int4* dst = reinterpret_cast<int4*>(row + o + 192 * b + 48 * pr);
#pragma unroll
            for (int v = 0; v < 3; ++v) dst[v] = make_int4(w[4 * v], w[4 * v + 1], w[4 * v + 2], w[4 * v + 3]);
        }
        *reinterpret_cast<int4*>(row + o + 192 * nb + 16 * b) = ld16_a2(blk + 192);
        i64 at = 208 * nb + 2 * b + o;
        if (at >= 210 * nb) at -= 210 * nb;
        *reinterpret_cast<unsigned short*>(row + at) = (unsigned short)ld_u16(blk + 208);
    });
}

// split_rows_q5_k, into the layout of SplitQ5_K (quant.cuh).
__device__ void split_rows_q5k(const CpyArgs& p) {
    each_block<256, 176>(p, [](const char* blk, char* row, i64 nb, i64 b) {
        *reinterpret_cast<int4*>(row + 160 * nb + 16 * b) = ld16_a2(blk);
#pragma unroll
        for (int w = 0; w < 8; ++w) *reinterpret_cast<int4*>(row + 128 * b + 16 * w) = ld16_a2(blk + 48 + 16 * w);
        unsigned qh[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) qh[k] = (unsigned)ld_i32_a2(blk + 16 + 4 * k);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            unsigned h = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k) h |= ((qh[k] >> j) & 0x01010101u) << k;
            *reinterpret_cast<unsigned*>(row + 128 * nb + 32 * b + 4 * j) = h;
        }
    });
}

template <typename S>
__device__ void cpy_split(const CpyArgs& p) {
    pdl_enter();
    deq_rows<S, f16>(p);
}

extern "C" __global__ void cpy_split_q4_0_f16(const CpyArgs p) { cpy_split<SplitQ4_0>(p); }
extern "C" __global__ void cpy_split_q8_0_f16(const CpyArgs p) { cpy_split<SplitQ8_0>(p); }
extern "C" __global__ void split_rows_q4_0(const CpyArgs p) { split_rows<SplitQ4_0>(p); }
extern "C" __global__ void split_rows_q8_0(const CpyArgs p) { split_rows<SplitQ8_0>(p); }
extern "C" __global__ void cpy_split_q4_1_f16(const CpyArgs p) { cpy_split<SplitQ4_1>(p); }
extern "C" __global__ void cpy_split_q5_0_f16(const CpyArgs p) { cpy_split<SplitQ5_0>(p); }
extern "C" __global__ void cpy_split_q5_1_f16(const CpyArgs p) { cpy_split<SplitQ5_1>(p); }
extern "C" __global__ void split_rows_q4_1(const CpyArgs p) { split_rows<SplitQ4_1>(p); }
extern "C" __global__ void split_rows_q5_0(const CpyArgs p) { split_rows<SplitQ5_0>(p); }
extern "C" __global__ void split_rows_q5_1(const CpyArgs p) { split_rows<SplitQ5_1>(p); }

extern "C" __global__ void cpy_q4_0_f32(const CpyArgs p) { cpy_deq<BlockQ4_0, float>(p); }
extern "C" __global__ void cpy_q4_0_f16(const CpyArgs p) { cpy_deq<BlockQ4_0, f16>(p); }
extern "C" __global__ void get_rows_q4_0(const RowsArgs p) { get_rows_q<BlockQ4_0>(p); }
extern "C" __global__ void cpy_q4_1_f32(const CpyArgs p) { cpy_deq<BlockQ4_1, float>(p); }
extern "C" __global__ void cpy_q4_1_f16(const CpyArgs p) { cpy_deq<BlockQ4_1, f16>(p); }
extern "C" __global__ void get_rows_q4_1(const RowsArgs p) { get_rows_q<BlockQ4_1>(p); }
extern "C" __global__ void cpy_q5_0_f32(const CpyArgs p) { cpy_deq<BlockQ5_0, float>(p); }
extern "C" __global__ void cpy_q5_0_f16(const CpyArgs p) { cpy_deq<BlockQ5_0, f16>(p); }
extern "C" __global__ void get_rows_q5_0(const RowsArgs p) { get_rows_q<BlockQ5_0>(p); }
extern "C" __global__ void cpy_q5_1_f32(const CpyArgs p) { cpy_deq<BlockQ5_1, float>(p); }
extern "C" __global__ void cpy_q5_1_f16(const CpyArgs p) { cpy_deq<BlockQ5_1, f16>(p); }
extern "C" __global__ void get_rows_q5_1(const RowsArgs p) { get_rows_q<BlockQ5_1>(p); }
extern "C" __global__ void cpy_q8_0_f32(const CpyArgs p) { cpy_deq<BlockQ8_0, float>(p); }
extern "C" __global__ void cpy_q8_0_f16(const CpyArgs p) { cpy_deq<BlockQ8_0, f16>(p); }
extern "C" __global__ void get_rows_q8_0(const RowsArgs p) { get_rows_q<BlockQ8_0>(p); }
extern "C" __global__ void cpy_q8_1_f32(const CpyArgs p) { cpy_deq<BlockQ8_1, float>(p); }
extern "C" __global__ void cpy_q8_1_f16(const CpyArgs p) { cpy_deq<BlockQ8_1, f16>(p); }
extern "C" __global__ void get_rows_q8_1(const RowsArgs p) { get_rows_q<BlockQ8_1>(p); }
extern "C" __global__ void cpy_q4_k_f32(const CpyArgs p) { cpy_deq<BlockQ4_K, float>(p); }
extern "C" __global__ void cpy_q4_k_f16(const CpyArgs p) { cpy_deq<BlockQ4_K, f16>(p); }
extern "C" __global__ void get_rows_q4_k(const RowsArgs p) { get_rows_q<BlockQ4_K>(p); }
extern "C" __global__ void cpy_q5_k_f32(const CpyArgs p) { cpy_deq<BlockQ5_K, float>(p); }
extern "C" __global__ void cpy_q5_k_f16(const CpyArgs p) { cpy_deq<BlockQ5_K, f16>(p); }
extern "C" __global__ void get_rows_q5_k(const RowsArgs p) { get_rows_q<BlockQ5_K>(p); }
extern "C" __global__ void cpy_q6_k_f32(const CpyArgs p) { cpy_deq<BlockQ6_K, float>(p); }
extern "C" __global__ void cpy_q6_k_f16(const CpyArgs p) { cpy_deq<BlockQ6_K, f16>(p); }
extern "C" __global__ void get_rows_q6_k(const RowsArgs p) { get_rows_q<BlockQ6_K>(p); }
extern "C" __global__ void cpy_split_q6_k_f16(const CpyArgs p) { cpy_split<SplitQ6_K>(p); }
extern "C" __global__ void split_rows_q6_k(const CpyArgs p) { split_rows_q6k(p); }
extern "C" __global__ void cpy_split_q5_k_f16(const CpyArgs p) { cpy_split<SplitQ5_K>(p); }
extern "C" __global__ void split_rows_q5_k(const CpyArgs p) { split_rows_q5k(p); }

// The low-bit K-quants, the i-quants and the ternary types (cuda/quant_lowbit.cuh).
extern "C" __global__ void cpy_q2_k_f32(const CpyArgs p) { cpy_deq<BlockQ2_K, float>(p); }
extern "C" __global__ void cpy_q2_k_f16(const CpyArgs p) { cpy_deq<BlockQ2_K, f16>(p); }
extern "C" __global__ void get_rows_q2_k(const RowsArgs p) { get_rows_q<BlockQ2_K>(p); }
extern "C" __global__ void cpy_q3_k_f32(const CpyArgs p) { cpy_deq<BlockQ3_K, float>(p); }
extern "C" __global__ void cpy_q3_k_f16(const CpyArgs p) { cpy_deq<BlockQ3_K, f16>(p); }
extern "C" __global__ void get_rows_q3_k(const RowsArgs p) { get_rows_q<BlockQ3_K>(p); }
extern "C" __global__ void cpy_iq4_nl_f32(const CpyArgs p) { cpy_deq<BlockIQ4_NL, float>(p); }
extern "C" __global__ void cpy_iq4_nl_f16(const CpyArgs p) { cpy_deq<BlockIQ4_NL, f16>(p); }
extern "C" __global__ void get_rows_iq4_nl(const RowsArgs p) { get_rows_q<BlockIQ4_NL>(p); }
extern "C" __global__ void cpy_iq4_xs_f32(const CpyArgs p) { cpy_deq<BlockIQ4_XS, float>(p); }
extern "C" __global__ void cpy_iq4_xs_f16(const CpyArgs p) { cpy_deq<BlockIQ4_XS, f16>(p); }
extern "C" __global__ void get_rows_iq4_xs(const RowsArgs p) { get_rows_q<BlockIQ4_XS>(p); }
extern "C" __global__ void cpy_iq2_xxs_f32(const CpyArgs p) { cpy_deq<BlockIQ2_XXS, float>(p); }
extern "C" __global__ void cpy_iq2_xxs_f16(const CpyArgs p) { cpy_deq<BlockIQ2_XXS, f16>(p); }
extern "C" __global__ void get_rows_iq2_xxs(const RowsArgs p) { get_rows_q<BlockIQ2_XXS>(p); }
extern "C" __global__ void cpy_iq2_xs_f32(const CpyArgs p) { cpy_deq<BlockIQ2_XS, float>(p); }
extern "C" __global__ void cpy_iq2_xs_f16(const CpyArgs p) { cpy_deq<BlockIQ2_XS, f16>(p); }
extern "C" __global__ void get_rows_iq2_xs(const RowsArgs p) { get_rows_q<BlockIQ2_XS>(p); }
extern "C" __global__ void cpy_iq2_s_f32(const CpyArgs p) { cpy_deq<BlockIQ2_S, float>(p); }
extern "C" __global__ void cpy_iq2_s_f16(const CpyArgs p) { cpy_deq<BlockIQ2_S, f16>(p); }
extern "C" __global__ void get_rows_iq2_s(const RowsArgs p) { get_rows_q<BlockIQ2_S>(p); }
extern "C" __global__ void cpy_iq3_xxs_f32(const CpyArgs p) { cpy_deq<BlockIQ3_XXS, float>(p); }
extern "C" __global__ void cpy_iq3_xxs_f16(const CpyArgs p) { cpy_deq<BlockIQ3_XXS, f16>(p); }
extern "C" __global__ void get_rows_iq3_xxs(const RowsArgs p) { get_rows_q<BlockIQ3_XXS>(p); }
extern "C" __global__ void cpy_iq3_s_f32(const CpyArgs p) { cpy_deq<BlockIQ3_S, float>(p); }
extern "C" __global__ void cpy_iq3_s_f16(const CpyArgs p) { cpy_deq<BlockIQ3_S, f16>(p); }
extern "C" __global__ void get_rows_iq3_s(const RowsArgs p) { get_rows_q<BlockIQ3_S>(p); }
extern "C" __global__ void cpy_iq1_s_f32(const CpyArgs p) { cpy_deq<BlockIQ1_S, float>(p); }
extern "C" __global__ void cpy_iq1_s_f16(const CpyArgs p) { cpy_deq<BlockIQ1_S, f16>(p); }
extern "C" __global__ void get_rows_iq1_s(const RowsArgs p) { get_rows_q<BlockIQ1_S>(p); }
extern "C" __global__ void cpy_iq1_m_f32(const CpyArgs p) { cpy_deq<BlockIQ1_M, float>(p); }
extern "C" __global__ void cpy_iq1_m_f16(const CpyArgs p) { cpy_deq<BlockIQ1_M, f16>(p); }
extern "C" __global__ void get_rows_iq1_m(const RowsArgs p) { get_rows_q<BlockIQ1_M>(p); }
extern "C" __global__ void cpy_tq1_0_f32(const CpyArgs p) { cpy_deq<BlockTQ1_0, float>(p); }
extern "C" __global__ void cpy_tq1_0_f16(const CpyArgs p) { cpy_deq<BlockTQ1_0, f16>(p); }
extern "C" __global__ void get_rows_tq1_0(const RowsArgs p) { get_rows_q<BlockTQ1_0>(p); }
extern "C" __global__ void cpy_tq2_0_f32(const CpyArgs p) { cpy_deq<BlockTQ2_0, float>(p); }
extern "C" __global__ void cpy_tq2_0_f16(const CpyArgs p) { cpy_deq<BlockTQ2_0, f16>(p); }
extern "C" __global__ void get_rows_tq2_0(const RowsArgs p) { get_rows_q<BlockTQ2_0>(p); }
