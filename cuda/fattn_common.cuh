// Shared pieces of the attention kernels (cuda/fattn.cu: flash_attn_ext; cuda/fattn_paged.cu:
// paged_attn): loading 8 consecutive elements of a K/V row as f32 for every cache type
// (common.cuh's load8, specialized here for Q8_0 and Q4_0), flash_attn_ext's per-row mask
// and slope and the key's score from q . k; the CUDA-core decode pieces (lane groups, the
// online softmax of a group, the merge of a block's groups, the streamed stage) and the
// tensor-core pieces (mma and ldmatrix, the shapes of the prefill and decode blocks, one
// K/V tile's scores, softmax and P.V). Each kernel family keeps its own addressing of K/V
// rows and its own masking; the pieces take the scores as a function where they differ.
//
// A K/V row is `d` elements starting at at(t, 0, j, hk, b). Every head dim the kernels
// take (16, 32, 64, 80, 96, 112, 128, 256) is a multiple of 16, so a row splits into whole
// 8-element pieces; the quantized types need d % 32 == 0 (whole blocks per row), which the
// lowering checks. Piece `e0` (a multiple of 8) of a row:
//   F32, F16, BF16: 32 or 16 bytes at e0 (16-byte vector loads when `vec`, which the
//     lowering sets when every row start is 16-byte aligned; element loads otherwise);
//   Q8_0 (34-byte blocks: f16 d, i8 qs[32]): d * qs[e0 % 32 ..][0..8];
//   Q4_0 (18-byte blocks: f16 d, u8 qs[16], element i < 16 the low nibble of qs[i], i + 16
//     the high one): d * (nibble - 8).
// Block reads are 16-bit (blocks are only 2-byte aligned).
#pragma once

#include <type_traits>

#include "common.cuh"

struct KvQ8_0 {};
struct KvQ4_0 {};

// load8 (common.cuh) for the quantized cache types:
template <>
__device__ __forceinline__ void load8<KvQ8_0>(const char* row, int e0, bool, float out[8]) {
    const char* blk = row + (e0 / 32) * 34;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(blk);
    const float d = __half2float(__ushort_as_half(w[0]));
    const uint16_t* qs = w + 1 + (e0 % 32) / 2;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint16_t two = qs[i];
        out[2 * i] = d * (float)(int8_t)(two & 0xff);
        out[2 * i + 1] = d * (float)(int8_t)(two >> 8);
    }
}

template <>
__device__ __forceinline__ void load8<KvQ4_0>(const char* row, int e0, bool, float out[8]) {
    const char* blk = row + (e0 / 32) * 18;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(blk);
    const float d = __half2float(__ushort_as_half(w[0]));
    const int within = e0 % 32;
    const uint16_t* qs = w + 1 + (within % 16) / 2;
    const int shift = within >= 16 ? 4 : 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint16_t two = qs[i];
        out[2 * i] = d * (float)((int)((two >> shift) & 0xf) - 8);
        out[2 * i + 1] = d * (float)((int)((two >> (8 + shift)) & 0xf) - 8);
    }
}

// The mask row of query i for head h in batch b (nullptr without a mask).
__device__ __forceinline__ const char* mask_row(const FattnArgs& p, i64 i, i64 h, i64 b) {
    if (p.mask.data == nullptr) return nullptr;
    return at(p.mask, 0, i, h % p.mask.ne[2], b % p.mask.ne[3]);
}

// slope * mask[j] of a mask row (0 without a mask): -inf hides key j.
__device__ __forceinline__ float mask_bias(const FattnArgs& p, const char* mrow, float slope, i64 j) {
    if (mrow == nullptr) return 0.0f;
    const char* e = mrow + j * p.mask.nb[0];
    const float m = p.mask_f16 ? __half2float(*reinterpret_cast<const f16*>(e))
                               : *reinterpret_cast<const float*>(e);
    return m == -INFINITY ? -INFINITY : slope * m;
}

// A q . k dot product as a score takes it: NaN when it is not finite, so that an infinity
// in q or k can neither pass for a masked key (-inf) nor be capped to a finite score.
__device__ __forceinline__ float finite_or_nan(float dot) { return isfinite(dot) ? dot : __int_as_float(0x7fc00000); }

// The score of a key from its q . k dot product and its mask bias, as the CPU reference:
// scale, then softcap, then the bias.
__device__ __forceinline__ float score(const FattnArgs& p, float dot, float bias) {
    float s = p.scale * finite_or_nan(dot);
    if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
    return s + bias;
}

// ---------------------------------------------------------------------------------------
// Decode on CUDA cores (fattn_vec*, fattn_paged_vec*, fattn_paged_any*).

// log2(e): exp(x) = exp2(x * LOG2E_F), the hardware's exp2 after one multiply.
constexpr float LOG2E_F = 1.4426950408889634f;

// Lanes per key group of fattn_vec: D / 8 rounded up to a power of two.
template <int D>
__host__ __device__ constexpr int vec_lanes() {
    return D <= 16 ? 2 : D <= 32 ? 4 : D <= 64 ? 8 : D <= 128 ? 16 : 32;
}

// The running softmax state of one row merged with another (m, l, acc).
__device__ __forceinline__ void merge_state(float& m, float& l, float acc[8], float m2, float l2,
                                            const float acc2[8]) {
    const float mx = fmax_nan(m, m2);
    if (mx == -INFINITY) return;
    const float c1 = m == -INFINITY ? 0.0f : expf(m - mx);
    const float c2 = m2 == -INFINITY ? 0.0f : expf(m2 - mx);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * c1 + acc2[i] * c2;
    m = mx;
}

// q . k for one key by a group of L lanes: the lane's 8 elements (qa, qb: q's elements
// e0..e0+8) against its piece of the key's row, then a butterfly over the group, so every
// lane of the group ends with the sum.
template <int L, typename P>
__device__ __forceinline__ float group_dot(const P& kp, float4 qa, float4 qb) {
    float dot = qa.x * kp.get(0) + qa.y * kp.get(1) + qa.z * kp.get(2) + qa.w * kp.get(3) + qb.x * kp.get(4) +
                qb.y * kp.get(5) + qb.z * kp.get(6) + qb.w * kp.get(7);
#pragma unroll
    for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
    return dot;
}

// The online softmax step of a row for U keys with scores s (-inf for a masked key) and
// V pieces vp, mx the row's new maximum (not -inf): the state (m, l, acc) rescaled to mx,
// then each key's weight exp(s - mx) added to l and its V piece to acc. exp(x - mx) is
// exp2((x - mx) log2 e): one multiply and the hardware exp2 (expf's range reduction was
// most of the per-key instructions).
template <int U, typename P>
__device__ __forceinline__ void online_add(float mx, const float (&s)[U], const P (&vp)[U], float& m, float& l,
                                           float (&acc)[8]) {
    const float c = exp2f((m - mx) * LOG2E_F);
    l *= c;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] *= c;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const float w = exp2f((s[u] - mx) * LOG2E_F);  // 0 for a masked key
        l += w;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[i] += w * vp[u].get(i);
    }
    m = mx;
}

// 8 elements of a K/V row as loaded: F16 and BF16 stay packed in one 16-byte register
// quad until used (so a lane can hold several keys' rows in flight), the other types are
// converted at load.
template <typename T>
struct Piece {
    float f[8];
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = 0.0f;
    }
    __device__ __forceinline__ void load(const char* row, int e0, bool vec) { load8<T>(row, e0, vec, f); }
    __device__ __forceinline__ float get(int i) const { return f[i]; }
};

template <typename H>
struct Piece16 {
    uint4 u;
    __device__ __forceinline__ void zero() { u = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void load(const char* row, int e0, bool vec) {
        const H* p = reinterpret_cast<const H*>(row) + e0;
        if (vec) {
            u = *reinterpret_cast<const uint4*>(p);
        } else {
            H* h = reinterpret_cast<H*>(&u);
#pragma unroll
            for (int i = 0; i < 8; ++i) h[i] = p[i];
        }
    }
    __device__ __forceinline__ float get(int i) const { return to_f32(reinterpret_cast<const H*>(&u)[i]); }
};
template <>
struct Piece<f16> : Piece16<f16> {};
template <>
struct Piece<bf16> : Piece16<bf16> {};

// The end of a decode block: the running states (m, l, acc) of its key groups merged, by
// a butterfly over the groups of each warp and then over the warps through shared memory,
// then every element e of its nrows rows handed to write(r, e, mx, sum, acc): the row's
// maximum, its sum of weights and its (unnormalized) accumulator at e. `sacc` starts
// zeroed.
template <int D, int R, typename Write>
__device__ __forceinline__ void finish_rows(float (&m)[R], float (&l)[R], float (&acc)[R][8], int nrows,
                                            float (*sacc)[vec_lanes<D>() * 8], float (*sm)[R], float (*sl)[R],
                                            Write write) {
    constexpr int L = vec_lanes<D>();
    constexpr int NW = FATTN_VEC_WARPS;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int sub = lane / L, e0 = (lane % L) * 8;
    const bool active = e0 < D;
    // Merge the key groups of the warp (a butterfly: every group ends with the sum).
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= nrows) break;
#pragma unroll
        for (int o = L; o < WARP_SIZE; o <<= 1) {
            const float m2 = __shfl_xor_sync(FULL_MASK, m[r], o);
            const float l2 = __shfl_xor_sync(FULL_MASK, l[r], o);
            float acc2[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(FULL_MASK, acc[r][i], o);
            merge_state(m[r], l[r], acc[r], m2, l2, acc2);
        }
        if (lane == 0) {
            sm[warp][r] = m[r];
            sl[warp][r] = l[r];
        }
    }
    __syncthreads();
    // Then the warps, through shared memory, one after another (a fixed order of the
    // additions, so that a run's result does not depend on how the warps were
    // scheduled): each adds its accumulator rescaled to the block's maximum.
    for (int w = 0; w < NW; ++w) {
        if (warp == w && sub == 0 && active) {
#pragma unroll
            for (int r = 0; r < R; ++r) {
                if (r >= nrows) break;
                float mx = -INFINITY;
                for (int v = 0; v < NW; ++v) mx = fmax_nan(mx, sm[v][r]);
                if (m[r] == -INFINITY) continue;
                const float f = expf(m[r] - mx);
#pragma unroll
                for (int i = 0; i < 8; ++i) sacc[r][e0 + i] += acc[r][i] * f;
            }
        }
        __syncthreads();
    }

    for (int idx = tid; idx < nrows * D; idx += blockDim.x) {
        const int r = idx / D, e = idx % D;
        float mx = -INFINITY, sum = 0.0f;
        for (int w = 0; w < NW; ++w) mx = fmax_nan(mx, sm[w][r]);
        if (mx != -INFINITY) {
            for (int w = 0; w < NW; ++w) {
                if (sm[w][r] != -INFINITY) sum += sl[w][r] * expf(sm[w][r] - mx);
            }
        }
        write(r, e, mx, sum, sacc[r][e]);
    }
}

// A K/V row of D elements of type T in fattn_vec1s: SRC bytes in the cache, copied to
// shared memory in COPY-byte asynchronous copies into a slot of BYTES. 16-bit rows are
// copied by 16 bytes into slots of whole lane groups (fattn_vec's padded row); Q8_0 and
// Q4_0 rows (D / 32 blocks of 34 or 18 bytes) by 8 bytes where their length is a multiple
// of 8 (head dims 128 and 256), else by 4 (64), into slots rounded up to 16 bytes. Other
// quantized rows (head dims 32 and 96: 2-byte multiples) are not streamed.
template <typename T, int D>
struct KvRow {
    static constexpr int SRC = D * 2;
    static constexpr int COPY = 16;
    static constexpr int BYTES = vec_lanes<D>() * 8 * 2;
};
template <int D, int BLOCK>
struct KvRowQ {
    static constexpr int SRC = D / 32 * BLOCK;
    static constexpr int COPY = SRC % 8 == 0 ? 8 : 4;
    static constexpr int BYTES = (SRC + 15) / 16 * 16;
    static_assert(SRC % 4 == 0, "quantized rows are streamed in whole 4-byte words");
};
template <int D>
struct KvRow<KvQ8_0, D> : KvRowQ<D, 34> {};
template <int D>
struct KvRow<KvQ4_0, D> : KvRowQ<D, 18> {};

// N bytes from global src to shared dst (both N-byte aligned; N = 4, 8 or 16), as copy16.
template <int N>
__device__ __forceinline__ void copy_async(char* dst, const char* src) {
    if constexpr (N == 16) {
        copy16(dst, src);
    } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(d), "l"(src), "n"(N) : "memory");
#else
        using W = std::conditional_t<N == 8, uint2, unsigned>;
        *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
#endif
    }
}

// Stages and keys per lane group per stage of the streamed decode kernels (fattn_vec1s,
// fattn_paged_vec). Measured on fattn_vec1s, H200, 32 heads of 128 over 768, 2,304, 4,352
// and 16,640 keys (of which 576, 2,100, 4,160 and 16,448 visible), against 2 x 4, 3 x 2,
// 4 x 2, 4 x 1 and 8 x 1 at their best split: 2 x 2 was the fastest at 768, 4,352 and
// 16,640 keys, 6% behind 3 x 2 at 2,304.
constexpr int VEC1S_STAGES = 2;
constexpr int VEC1S_UNROLL = 2;

// One stage of a streamed decode block (fattn_vec1s, fattn_paged_vec) for a lane: the
// scores score_of(r, u, q . k) of its group's UN keys of the stage (K rows `ks`, V rows
// `vs` in shared memory; -inf for a key the row does not see) for each of the block's
// nrows query rows (q: qa, qb for one row, else qs), then each row's running state (m, l,
// acc) rescaled and the keys' V rows added. The K and V pieces are read from shared
// memory (and dequantized) once for all the rows. The barrier between the two lets the
// next stage's copies overwrite the buffer.
template <int D, typename T, int UN, int R, typename Score>
__device__ __forceinline__ void stream_stage(const char (*ks)[KvRow<T, D>::BYTES], const char (*vs)[KvRow<T, D>::BYTES],
                                             float4 qa, float4 qb, const float (*qs)[vec_lanes<D>() * 8], int nrows,
                                             Score score_of, float (&m)[R], float (&l)[R], float (&acc)[R][8]) {
    constexpr int L = vec_lanes<D>();
    constexpr int KPW = WARP_SIZE / L;
    constexpr int NW = FATTN_VEC_WARPS;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int sub = lane / L, e0 = (lane % L) * 8;
    const bool active = e0 < D;
    float s[R][UN], mx[R];
#pragma unroll
    for (int r = 0; r < R; ++r) mx[r] = m[r];
    Piece<T> vp[UN];
#pragma unroll
    for (int u = 0; u < UN; ++u) {
        const int key = (u * NW + warp) * KPW + sub;
        Piece<T> kp;
        kp.zero();
        vp[u].zero();
        if (active) {
            kp.load(ks[key], e0, true);
            vp[u].load(vs[key], e0, true);
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= nrows) break;  // uniform over the block
            if constexpr (R > 1) {
                qa = *reinterpret_cast<const float4*>(&qs[r][e0]);
                qb = *reinterpret_cast<const float4*>(&qs[r][e0 + 4]);
            }
            s[r][u] = score_of(r, u, group_dot<L>(kp, qa, qb));
            mx[r] = fmax_nan(mx[r], s[r][u]);
        }
    }
    __syncthreads();  // every lane has read the buffer: the next issue may overwrite it
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= nrows) break;
        if (mx[r] == -INFINITY) continue;  // every key so far masked
        online_add(mx[r], s[r], vp, m[r], l[r], acc[r]);
    }
}

// ---------------------------------------------------------------------------------------
// Tensor cores (fattn_mma, fattn_dec, fattn_paged_mma, fattn_paged_dec).

// 8 elements of K/V row `row` at e0, as 8 halves: a 16-byte copy for F16 rows that allow
// vector loads, a conversion otherwise. The row is always a valid one (the caller clamps
// the key) and the loads are unconditional, so that a thread's loads of a tile can all be
// in flight together.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 tile_piece(const char* row, int e0) {
    if constexpr (VEC && std::is_same<T, f16>::value) {
        return *reinterpret_cast<const uint4*>(reinterpret_cast<const f16*>(row) + e0);
    }
    float f[8];
    load8<T>(row, e0, VEC, f);
    uint4 packed;
    store8<f16>(reinterpret_cast<char*>(&packed), f);
    return packed;
}

// Shape of the prefill kernel for head dim D: BQ query rows per block (16 per warp), BK
// keys per tile; Q fragments held in registers for D <= 128 (read from shared memory per
// tile for D = 256), K/V tiles double-buffered for D <= 128 (one tile for D = 256, where
// two would pass the 48 KB of static shared memory).
template <int D>
struct MmaShape {
    static constexpr int BQ = D > 128 ? FATTN_MMA_ROWS_D256 : FATTN_MMA_ROWS;
    static constexpr int BK = D > 128 ? FATTN_MMA_KEYS / 2 : FATTN_MMA_KEYS;
    static constexpr int NT = BQ / 16 * WARP_SIZE;
    static constexpr int LD = D + 8;  // halves per tile row, padded: no bank conflicts
    static constexpr bool QREG = D <= 128;
    static constexpr int STAGES = D <= 128 ? 2 : 1;
    // Q is staged through the second K/V buffer when it is kept in registers.
    static_assert(!QREG || BQ == 2 * BK, "Q staging fits the second K/V buffer");
};

// The running state of one warp: 16 query rows (lane g owns rows g and g + 8, as the
// accumulator fragments of mma_16816), their max m, sum l and output o.
template <int D>
struct MmaState {
    float o[D / 8][4];
    float m[2], l[2];
};

// The state of a warp's rows rescaled to their new maxima (the old ones and the tile's
// mx): m, l and o updated, and ml = each row's new max times log2(e), with which the
// tile's weights are exp2(s log2e - ml) = exp(s - max).
template <int D>
__device__ __forceinline__ void rescale_rows(MmaState<D>& st, const float (&mx)[2], float (&ml)[2]) {
    float c[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float mnew = fmax_nan(st.m[r], mx[r]);
        // a row with no live key so far keeps mnew = -inf, and then every term is 0
        ml[r] = mnew == -INFINITY ? 0.0f : mnew * LOG2E_F;
        c[r] = exp2f(fmaf(st.m[r], LOG2E_F, -ml[r]));
        st.m[r] = mnew;
        st.l[r] *= c[r];
    }
    // (the accumulator keeps its scale while no row's max grows: most tiles after the
    // first few)
    if (__any_sync(FULL_MASK, c[0] != 1.0f || c[1] != 1.0f)) {
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            st.o[n][0] *= c[0];
            st.o[n][1] *= c[0];
            st.o[n][2] *= c[1];
            st.o[n][3] *= c[1];
        }
    }
}

// One K/V tile for one warp's 16 rows: scores S = Q K^T (mma, F32), scores(s, mx) turning
// them into the scores the softmax takes (scale, softcap, mask; -inf for a hidden key)
// and each of the lane's two rows' maximum over the tile, the online softmax update of
// the state, and o += P V with P reused as the A operand from registers.
template <int D, int BK, int LD, typename Scores>
__device__ __forceinline__ void mma_tile(const uint32_t (*qa)[4], const f16* ks, const f16* vs, int lane,
                                         MmaState<D>& st, Scores scores) {
    const int r8 = lane % 8, mi = lane / 8;
    float s[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int kt = 0; kt < D / 16; ++kt) {
#pragma unroll
        for (int n = 0; n < BK / 8; n += 2) {
            // matrices: keys n*8.. (d kt*16.., +8), keys (n+1)*8.. (d kt*16.., +8)
            uint32_t b[4];
            ldsm_x4<false>(&ks[((n + mi / 2) * 8 + r8) * LD + kt * 16 + (mi % 2) * 8], b);
            mma_16816(s[n], qa[kt], b[0], b[1]);
            mma_16816(s[n + 1], qa[kt], b[2], b[3]);
        }
    }
    float mx[2];
    scores(s, mx);
    float ml[2];
    rescale_rows(st, mx, ml);
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) s[n][x] = exp2f(fmaf(s[n][x], LOG2E_F, -ml[x / 2]));
        st.l[0] += s[n][0] + s[n][1];
        st.l[1] += s[n][2] + s[n][3];
    }
    // P as A fragments (16 x BK): k-tile kk is n-tiles 2kk, 2kk+1. Then o += P V, the B
    // fragments of two 8-wide d tiles per ldmatrix (transposed: V is [key][d]).
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t pa[4] = {pack_half2(s[2 * kk][0], s[2 * kk][1]), pack_half2(s[2 * kk][2], s[2 * kk][3]),
                                pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            // matrices: keys kk*16.. and kk*16+8.. of d n*8.., then of d (n+1)*8..
            uint32_t b[4];
            ldsm_x4<true>(&vs[(kk * 16 + (mi % 2) * 8 + r8) * LD + (n + mi / 2) * 8], b);
            mma_16816(st.o[n], pa, b[0], b[1]);
            mma_16816(st.o[n + 1], pa, b[2], b[3]);
        }
    }
}

// The A fragments of one warp's 16 rows of Q (qs: BQ x LD halves) for k-tile kt.
template <int LD>
__device__ __forceinline__ void q_frag(const f16* qs, int warp, int lane, int kt, uint32_t a[4]) {
    // matrices: rows 0-7 (d kt*16..), rows 8-15, rows 0-7 (d +8), rows 8-15 (d +8)
    const int mi = lane / 8;
    ldsm_x4<false>(&qs[(warp * 16 + (mi % 2) * 8 + lane % 8) * LD + kt * 16 + (mi / 2) * 8], a);
}

// The sum of a row's l over the 4 lanes of its quad, for rows a and b.
template <int D>
__device__ __forceinline__ void quad_sums(const MmaState<D>& st, float l[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] = st.l[r];
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
    }
}

// Calls body(ASYNC, VEC) (std::bool_constant arguments) with the way the K/V tiles of
// cache type T are loaded (kv_vec: every K/V row starts 16-byte aligned), one per way that
// can occur (fewer instantiations): F16 rows with 16-byte loads go through cp.async when
// the tiles are double-buffered, the quantized types read their blocks the same way
// whatever the alignment.
template <int D, typename T, typename Body>
__device__ __forceinline__ void with_tile_loads(bool kv_vec, Body body) {
    constexpr bool F16_ASYNC = std::is_same<T, f16>::value && MmaShape<D>::STAGES == 2;
    constexpr bool QUANT = std::is_same<T, KvQ8_0>::value || std::is_same<T, KvQ4_0>::value;
    if (kv_vec && !QUANT) {
        body(std::bool_constant<F16_ASYNC>{}, std::bool_constant<true>{});
    } else {
        body(std::bool_constant<false>{}, std::bool_constant<false>{});
    }
}
