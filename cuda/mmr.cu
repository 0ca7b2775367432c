// Products of weights in the 32-element block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with a
// batch of activation columns on F16 tensor cores, the weights unpacked to F16 in
// registers (src/backend/cuda/lower/mmq.rs takes them for these types at every width of
// the tensor-core products): dst[r, c] = sum_l a[l, r] * b[l, c], F32 results.
//
//   mmr_c<BN>_<q>: weights of type q in ggml's blocks (mmr_split_c<BN>_<q>: frozen weights
//     in split rows), b the activations as F16 columns (column c at b + c * b_nb1, its k
//     elements dense). A block takes MMR_ROWS = 128 weight rows, 16 a warp (an m16 tile),
//     by BN = 8, 16, 32 or 64 columns (the grid of mmq_*: column tiles, row tiles, parts
//     of K that mmq_reduce adds up) and walks K in chunks of MMR_K = 128 elements, four
//     32-element blocks, one barrier a chunk:
//       - lane 4g + t of a warp loads block t of the chunk of its rows g and g + 8 into
//         registers mmr_ahead chunks ahead (the four lanes of a quad read a row's four
//         blocks side by side) and unpacks it to F16 there (unpack_f16x4: q s + o, one
//         rounding). Word j of the block, elements 4j..4j+3, is the lane's part of the A
//         fragments of the chunk's step j (of 8, 16 elements of k each): positions 2t,
//         2t + 1 and 2t + 8, 2t + 9. A sum over k does not depend on which elements a
//         step takes, so the weights never pass through shared memory nor move between
//         lanes; the activations take the same order.
//       - the chunk's activation columns are copied into shared memory asynchronously
//         (cp.async), MMR_STAGES - 1 chunks ahead: elements 8P..8P+7 of block t of column
//         c (16 bytes) at piece 4 (P ^ (c & 1)) + t of the column's 256 bytes, so that a
//         lane's B fragments of steps 2P and 2P + 1 are one 16-byte load and the quads of
//         two neighbouring columns read different banks;
//       - each warp multiplies its 16 rows by the BN columns (mma.sync m16n8k16, F16 x F16
//         -> F32) into F32 accumulators.
//     mmh_*'s weights make a round trip through shared memory as F16; here they stay in
//     registers, which leaves room for more warps and more loads in flight.
#include "mmq_units.cuh"

constexpr int MMR_THREADS = MMR_WARPS * WARP_SIZE;
constexpr int MMR_STAGES = 3;          // chunks of activations in shared memory
constexpr int MMR_PIECES = MMR_K / 8;  // 16-byte pieces of a column's chunk
static_assert(MMR_ROWS == 16 * MMR_WARPS, "a warp takes 16 rows");
static_assert(MMR_K == 4 * 32, "a chunk is one 32-element block a lane of a quad");

// Chunks of weights a lane holds in registers: 3, but 2 where the bytes of a Q4_1, 5- or
// 8-bit block leave too few registers for a third within the 128 of two blocks an SM (up
// to 32 columns; at 64, one block an SM, every type takes 3).
template <typename T, int BN>
__host__ __device__ constexpr int mmr_ahead() {
    return BN < 64 && sizeof(typename T::Raw) > 20 ? 2 : 3;
}

// A lane's weights: block t of each chunk of the warp's rows g and g + 8, for lane 4g + t
// (rows past m read row m - 1, whose results are not written; a block past the row's end
// reads the row's last block, against zero activations).
template <typename T>
struct LaneRows {
    static_assert(T::UNIT == 1 && !T::HALVES, "one 32-element block a unit, one scale each");
    const char* row[2];
    int nb, t;

    __device__ __forceinline__ LaneRows(const MmqArgs& p, i64 row0, int lane) {
        t = lane % 4;
#pragma unroll
        for (int i = 0; i < 2; ++i) row[i] = p.a + min(row0 + lane / 4 + 8 * i, p.m - 1) * p.a_nb1;
        nb = (int)(p.k / T::QK);
    }
    __device__ __forceinline__ int unit(int ch) const { return min(4 * ch + t, nb - 1); }
    __device__ __forceinline__ void fetch(int ch, typename T::Raw (&raw)[2]) const {
#pragma unroll
        for (int i = 0; i < 2; ++i) T::fetch(row[i], nb, unit(ch), raw[i]);
    }
};

// The quants of a lane's two blocks as int8 words (q[i][j]: row g + 8 i, elements
// 4j..4j+3) and each block's scale and offset as F16 pairs.
template <typename T>
__device__ __forceinline__ void mmr_quants(const typename T::Raw (&raw)[2], int u, int (&q)[2][8],
                                           __half2 (&s)[2], __half2 (&o)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        typename T::Slot w;
        T::unpack(raw[i], u, q[i], &w);
        float fs, fo;
        affine(w, 0, fs, fo);
        s[i] = __float2half2_rn(fs), o[i] = __float2half2_rn(fo);
    }
}

// The 16-byte pieces of the BN activation columns from col0 of chunk ch, copied
// asynchronously into yb as the header lays them out (zeros past n and past k), one group.
template <int BN>
__device__ __forceinline__ void mmr_copy(const MmqArgs& p, i64 col0, int ch, f16* yb) {
    constexpr int PIECES = BN * MMR_PIECES;
#pragma unroll
    for (int r = 0; r < (PIECES + MMR_THREADS - 1) / MMR_THREADS; ++r) {
        const int i = (int)threadIdx.x + r * MMR_THREADS;
        if (PIECES % MMR_THREADS != 0 && i >= PIECES) break;
        const int c = i / MMR_PIECES, s = i % MMR_PIECES, t = s / 4, piece = s % 4;
        const i64 e = (i64)ch * MMR_K + 8 * s;
        const bool ok = col0 + c < p.n && e < p.k;
        const char* src = ok ? p.b + (col0 + c) * p.b_nb1 + 2 * e : p.b;
        copy16_or_zero(reinterpret_cast<char*>(yb + c * MMR_K + 8 * (4 * (piece ^ (c & 1)) + t)), src, ok);
    }
    stage_commit();
}

// 16 bytes of shared memory, loaded where the code has it: as volatile as the mma.sync
// around it, the compiler keeps it there instead of hoisting a chunk's B fragments (up to
// 32 16-byte loads at 64 columns) into registers ahead of their products.
__device__ __forceinline__ uint4 lds128_here(const f16* p) {
    uint4 v;
    const unsigned a = (unsigned)__cvta_generic_to_shared(p);
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(a));
    return v;
}

// The warp's 16 rows of one chunk (quants q, scales s, offsets o) by its BN activation
// columns in yb, added into acc (acc[j]: n8 tile j, as mma's d fragment).
template <int BN>
__device__ __forceinline__ void mmr_mma(const int (&q)[2][8], const __half2 (&s)[2], const __half2 (&o)[2],
                                        const f16* yb, int lane, float (&acc)[BN / 8][4]) {
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int piece = 0; piece < 4; ++piece) {
        uint32_t a[2][4];  // step 2 piece + h
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int j = 2 * piece + h;
            const uint2 lo = unpack_f16x4(q[0][j], s[0], o[0]), hi = unpack_f16x4(q[1][j], s[1], o[1]);
            a[h][0] = lo.x, a[h][1] = hi.x, a[h][2] = lo.y, a[h][3] = hi.y;
        }
        // column 8j + g: its parity is g's
        const f16* col = yb + g * MMR_K + 8 * (4 * (piece ^ (g & 1)) + t);
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const uint4 b = lds128_here(col + 8 * j * MMR_K);
            mma_16816(acc[j], a[0], b.x, b.y);
            mma_16816(acc[j], a[1], b.z, b.w);
        }
    }
}

// Chunk i of the block's part: its activations land in buffer i % MMR_STAGES, its weights
// are in `raw`, which then takes chunk i + mmr_ahead's.
template <typename T, int BN>
__device__ __forceinline__ void mmr_step(const MmqArgs& p, const LaneRows<T>& w, f16 (*yb)[BN * MMR_K], i64 col0,
                                         int first, int i, int nch, typename T::Raw (&raw)[2], int lane,
                                         float (&acc)[BN / 8][4]) {
    stage_wait<MMR_STAGES - 2>();
    __syncthreads();  // chunk i is in its buffer; every warp is done with chunk i - 1's
    const int ahead = i + MMR_STAGES - 1;
    if (ahead < nch) {
        mmr_copy<BN>(p, col0, first + ahead, yb[ahead % MMR_STAGES]);
    } else {
        stage_commit();  // an empty group keeps the count the waits assume
    }
    int q[2][8];
    __half2 s[2], o[2];
    mmr_quants<T>(raw, w.unit(first + i), q, s, o);
    constexpr int AHEAD = mmr_ahead<T, BN>();
    if (i + AHEAD < nch) w.fetch(first + i + AHEAD, raw);
    mmr_mma<BN>(q, s, o, yb[i % MMR_STAGES], lane, acc);
}

// The weights of the part's first chunks, as many as are held ahead (those it has).
template <typename T, int AHEAD>
__device__ __forceinline__ void mmr_first(const LaneRows<T>& w, int first, int nch, typename T::Raw (&r0)[2],
                                          typename T::Raw (&r1)[2], typename T::Raw (&r2)[2]) {
    w.fetch(first, r0);
    if (nch > 1) w.fetch(first + 1, r1);
    if (AHEAD > 2 && nch > 2) w.fetch(first + 2, r2);
}

template <typename T, int BN>
__device__ void mmr(const MmqArgs& p) {
    static_assert(BN % 8 == 0 && BN <= 64, "column tiles of 8 to 64");
    __shared__ __align__(16) f16 yb[MMR_STAGES][BN * MMR_K];
    pdl_launch_dependents();
    const int warp = (int)threadIdx.x / WARP_SIZE, lane = (int)threadIdx.x % WARP_SIZE;
    const i64 col0 = blockIdx.x * (i64)BN, row0 = blockIdx.y * (i64)MMR_ROWS + 16 * warp;
    const int first = (int)(blockIdx.z * p.chunks);
    const int nch = (int)min(p.chunks, (p.k + MMR_K - 1) / MMR_K - first);
    const LaneRows<T> w(p, row0, lane);
    constexpr int AHEAD = mmr_ahead<T, BN>();
    static_assert(AHEAD == 2 || AHEAD == 3, "two or three sets of registers");
    typename T::Raw r0[2], r1[2], r2[2];  // r2: unused with two
    // Weights nothing in the plan writes: the first chunks load before the wait.
    if (p.prefetch) mmr_first<T, AHEAD>(w, first, nch, r0, r1, r2);
    pdl_wait();
    if (!p.prefetch) mmr_first<T, AHEAD>(w, first, nch, r0, r1, r2);
#pragma unroll
    for (int s = 0; s < MMR_STAGES - 1; ++s) {
        if (s < nch) {
            mmr_copy<BN>(p, col0, first + s, yb[s]);
        } else {
            stage_commit();
        }
    }
    float acc[BN / 8][4] = {};
    for (int i = 0; i < nch; i += AHEAD) {
        mmr_step<T, BN>(p, w, yb, col0, first, i, nch, r0, lane, acc);
        if (i + 1 < nch) mmr_step<T, BN>(p, w, yb, col0, first, i + 1, nch, r1, lane, acc);
        if (AHEAD > 2 && i + 2 < nch) mmr_step<T, BN>(p, w, yb, col0, first, i + 2, nch, r2, lane, acc);
    }
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const i64 r = row0 + g + 8 * (e / 2), c = col0 + 8 * j + 2 * t + e % 2;
            if (r < p.m && c < p.n) p.dst[(blockIdx.z * p.n + c) * p.m + r] = with_res(acc[j][e], p.res, c * p.m + r);
        }
    }
}

// The instantiations (mmr_c<BN>_<q>, mmr_split_c<BN>_<q>: the 32-element types of mmq_* by
// every column tile) are generated by build.rs from the table in build/instances.rs.
#include "mmr.inst.cuh"
