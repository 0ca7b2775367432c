// Decode products with block-quantized weights (types of cuda/quant.cuh), F32 results:
// dst[r, c] = sum_l a[l, r] * b[l, c] (+ add[r, c]) for the ncols <= NC columns of b.
// Both kernels run one warp per row of `a`, GEMV_WARPS rows per thread block (grid.x =
// ceil(m / GEMV_WARPS)), read each weight once for all NC columns, reduce with warp
// shuffles in a fixed order, and take an optional F32 `add` (a fused residual add).
// Weights nothing in the plan writes start loading before the kernel waits for its
// predecessor (programmatic dependent launch): mul_mat_vec_q copies their first chunk,
// mul_mat_vec_dq pulls the first lines of the row into L2.
//
//   mul_mat_vec_q_c<NC>_<q>: b is the activations quantized to Q8_1 by quantize_q8_1_f32
//     (column c at b + c * b_nb1: quants, then scales and sums, in the layout of the
//     weight type, see act_at in quant.cuh). The warp
//     copies its weight row into shared memory 4096 elements at a time (16-byte
//     asynchronous copies, the next chunk in flight while the current one is used), so the
//     row is read from memory in full 16-byte words whatever the block size. The first
//     chunk's copy is issued before the wait and nothing is prefetched into L2: on the
//     H100 that took the 7B shapes from 5.96 / 13.51 / 20.78 / 14.39 us to 5.01 / 11.95 /
//     19.49 / 12.15 us (Q4_0 [4096, 4096] / [4096, 12288] / [4096, 22016] / [11008, 4096],
//     a replayed chain of 8-48 products), where an L2 prefetch of the row (before) or of a
//     whole block's rows (tried) cost time on the longer rows. Lane s then takes
//     32-element sub-blocks s, s + 32, ... of the chunk (the K-quants: the pairs 2s and
//     2s + 1, 2s + 64 and 2s + 65, ..., see chunk_pairs): its quants as 8 ints (read as
//     32-bit shared-memory words, see ld_words, or 16-byte ones for aligned K-quant rows;
//     Q6_K as 16-bit halves), integer dot products with __dp4a against 16-byte loads of
//     the activations, then the block's scales and offsets in f32 (src/quant/dot.rs is
//     the CPU oracle). IQ3_XXS and IQ3_S look their points up in a copy of the lattice
//     table that the block makes in shared memory first (stage_grid; quant_lowbit.cuh).
//   mul_mat_vec_qs_c<NC>_<q>: mul_mat_vec_q for frozen Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0
//     weights in split rows (Split in quant.cuh): nothing staged, lane s reads block s's
//     quants as one or two 16-byte loads straight from memory (a warp's loads are 512
//     contiguous bytes), its header as 2-byte ones, then the same dot products in the
//     same order as mul_mat_vec_q_c<NC>_<q>, so the same sums. Two blocks a lane in
//     flight (unroll 2, 48 registers for Q4_0): on the H100 that read the 7B shapes at
//     70 / 89 / 82 / 92% of the copy
//     bandwidth where the staged kernel read 66 / 81 / 74 / 84% ([4096, 4096] /
//     [4096, 11008] / [11008, 4096] / [4096, 12288], a replayed chain of 48 products with
//     programmatic dependent launch; unroll 1, 3, 4 and 8 and 8 rows a block measured
//     slower).
//   mul_mat_vec_qsp_c<NC>_<q>: the same for grids the GPU holds at once (the launcher's
//     one_wave): every block is resident from the start, so each lane's first blocks
//     (Q8_0: 1, then unroll 4; the others 4) are loaded before the wait, overlapping the
//     previous kernel's tail. In the same chain: Q4_0 [4096, 4096] 70 -> 86% and
//     [11008, 4096] 82 -> 93%, Q8_0 80 -> 82% and 88 -> 89%; on multi-wave grids
//     ([4096, 11008]) it lost 2-3%, so those keep mul_mat_vec_qs.
//   mul_mat_vec_qd_c<NC>_<q>: Q4_K and Q5_K rows at 16-byte aligned addresses (blocks of 144
//     and 176 bytes keep every block aligned) read in place, nothing staged: each lane's
//     pair of sub-blocks as 16-byte loads through the non-coherent cache, the first pair
//     before the wait, unroll 2; the pairs and order of mul_mat_vec_q, so the same sums.
//     IQ4_XS (blocks of 136 bytes) the same at 8-byte aligned rows, as 8-byte loads.
//     Q4_K in the chain: 65 / 77 / 73% -> 79 / 85 / 87% of the copy bandwidth on
//     [4096, 4096] / [4096, 11008] / [11008, 4096] (the same kernel without the early
//     pair: 59 / 82 / 67%).
//   mul_mat_vec_qs_c<NC>_<q>, mul_mat_vec_qsp_c<NC>_<q> for q5_k and q6_k: frozen weights
//     in split rows (SplitQ5_K, SplitQ6_K in quant.cuh), read by mmvq_direct: each lane's
//     pair of sub-blocks is Q6_K's three 16-byte loads of repacked quants and one 4-byte
//     load of its scales, or Q5_K's two 16-byte loads of quants, one 8-byte load of its
//     fifth bits and one 16-byte load of the header, the first pair before the wait; the
//     pairs and order of mul_mat_vec_q, so the same sums.
//     qs keeps two more pairs a lane in flight (unroll 2), which costs the registers of
//     the eighth block an SM; qsp, for grids the GPU holds at once at 8 blocks an SM (the
//     7B shapes of 4,096 rows: 1,024 blocks), keeps one.
//   mul_mat_vec_dq_c<NC>_<q>: b is F32. Lane g takes 8-element groups g, g + 32, ...:
//     dequantized in registers, dotted in f32 with the activations (16-byte loads when
//     vec, scalar otherwise). mul_mat_vec_dqs_c<NC>_<q>: the same on split rows.
//   mul_mat_vec_id_q_<q>, mul_mat_vec_id_qd_<q> (q4_k, q5_k): a decode step's mul_mat_id
//     (src/backend/cuda/lower/mul_mat_id.rs): the one-column body of mul_mat_vec_q_c1_<q>
//     (mul_mat_vec_qd_c1_<q> for aligned rows) for each column (i, t) of the step, a grid
//     row of blocks a column, on the rows of the column's expert (gemv_id).
//
// NC is 1, 2, 4 or 8; the launcher picks the smallest NC >= ncols.
#include "quant.cuh"
#include "quant_lowbit.cuh"

// Pulls the first 32 128-byte lines of a weight row into L2 (one line per lane).
__device__ __forceinline__ void prefetch_row(const char* a, i64 bytes, int lane) {
    const i64 off = (i64)lane * 128;
    if (off < bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(a + off));
}

// Adds the warp's partial sums, then lane 0 writes column c of row `row`.
template <int NC>
__device__ __forceinline__ void write_row(const QGemvArgs& p, i64 row, float* acc, int lane) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        if (c < p.ncols) {
            float v = warp_sum(acc[c]);
            if (lane == 0) {
                const i64 at = c * p.m + row;
                if (p.add) v += reinterpret_cast<const float*>(p.add)[at];
                reinterpret_cast<float*>(p.dst)[at] = v;
            }
        }
    }
}

// Staging of weight rows into shared memory for mmvq: CHUNK elements of a row at a time.
constexpr int CHUNK = 4096;

// The warp copies the n bytes at src (2-byte aligned, global) to dst (shared, the same
// address modulo 16): 16-byte copies for the aligned middle, 2-byte ones for the up to 14
// bytes on either side (lanes 0..6 and 8..14). Every read stays inside [src, src + n).
__device__ __forceinline__ void stage_bytes(char* dst, const char* src, int n, int lane) {
    const int head = min(n, (int)((16u - ((unsigned)(uintptr_t)src & 15u)) & 15u));
    const int body = (n - head) & ~15;
    const int tail = n - head - body;
    if (lane < head / 2) {
        reinterpret_cast<unsigned short*>(dst)[lane] = (unsigned short)ld_u16(src + 2 * lane);
    }
    const int t = lane - 8;
    if (t >= 0 && t < tail / 2) {
        const int o = head + body + 2 * t;
        *reinterpret_cast<unsigned short*>(dst + o) = (unsigned short)ld_u16(src + o);
    }
    for (int i = 16 * lane; i < body; i += 16 * WARP_SIZE) copy16(dst + head + i, src + head + i);
}

// The sums of the NC columns' sub-block s0 + s (b in the layout of Q: quant.cuh,
// act_at) with weight sub-block w, into acc.
template <typename Q, int NC>
__device__ __forceinline__ void dot_cols(const QGemvArgs& p, const typename Q::W& w, int s0, int s, float* acc) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        if (NC == 1 || c < p.ncols) {  // one column: ncols is 1, no test in the loop
            Act y;
            load_act(p.b + c * p.b_nb1, p.k, s0 + s, y);
            acc[c] += Q::dot(w, y);
        }
    }
}

// The sums of the NC columns' sub-blocks s0 + s (even) and s0 + s + 1 (b in the ACT_PAIRS layout)
// with the weight sub-blocks wa and wb, into acc.
template <typename Q, int NC>
__device__ __forceinline__ void dot_pairs(const QGemvArgs& p, const typename Q::W& wa, const typename Q::W& wb, int s0,
                                          int s, float* acc) {
#pragma unroll
    for (int c = 0; c < NC; ++c) {
        if (NC == 1 || c < p.ncols) {
            Act ya, yb;
            load_act2(p.b + c * p.b_nb1, p.k, s0 + s, ya, yb);
            acc[c] += Q::dot(wa, ya) + Q::dot(wb, yb);
        }
    }
}

// One staged chunk of nsub sub-blocks at w0 whose first is sub-block s0 of the row, into
// the lane's sums acc; b in the layout of Q (quant.cuh, act_at). A 32-element type's lane
// s takes sub-blocks s, s + 32, ... (ACT_BLOCKS).
template <typename Q, int NC>
__device__ __forceinline__ void chunk_single(const QGemvArgs& p, const char* w0, int nsub, int s0, int lane,
                                             float* acc) {
    for (int s = lane; s < nsub; s += WARP_SIZE) {
        typename Q::W w;
        Q::template load<Smem>(w0 + s * Q::BYTES, 0, w);
        dot_cols<Q, NC>(p, w, s0, s, acc);
    }
}

// A K-quant's lane t takes the pairs of sub-blocks 2t and 2t + 1, 2t + 64 and 2t + 65, ...
// (ACT_PAIRS), which share the block's header and, but for Q6_K, their quant bytes: read
// once for both (Q::load2, at alignment A). On the H100 that took the Llama-2-7B decode
// from 359 to 416 tok/s (Q4_K) and 336 to 378 (Q4_K_M); the 32-element types lost with
// pairs (Q4_0 420 -> 410-418, Q5_1 348 -> 300-304), so they keep one sub-block a lane.
template <typename Q, int NC, int A>
__device__ __forceinline__ void chunk_pairs(const QGemvArgs& p, const char* w0, int nsub, int s0, int lane,
                                            float* acc) {
    static_assert(Q::SUBS % 2 == 0, "a chunk of whole blocks holds whole pairs");
    for (int s = 2 * lane; s < nsub; s += 2 * WARP_SIZE) {
        typename Q::W wa, wb;
        Q::template load2<A>(w0 + (s / Q::SUBS) * Q::BYTES, s % Q::SUBS, wa, wb);
        dot_pairs<Q, NC>(p, wa, wb, s0, s, acc);
    }
}

// The 32-bit words of Q's lattice table that its load2 reads from shared memory
// (Q::GRID_WORDS; 0 for the types without one).
template <typename Q>
__host__ __device__ constexpr int grid_words(decltype(Q::GRID_WORDS)*) {
    return Q::GRID_WORDS;
}
template <typename Q>
__host__ __device__ constexpr int grid_words(...) {
    return 0;
}

static_assert(grid_words<BlockIQ3_XXS>(nullptr) == 256 && grid_words<BlockIQ3_S>(nullptr) == 512 &&
                  grid_words<BlockIQ2_XXS>(nullptr) == 0 && grid_words<BlockQ4_0>(nullptr) == 0,
              "the types with a staged table, and only they, name its size");

// Makes Q's lattice table in shared memory, if it has one (Q::stage): every thread of the
// block, before any returns (constant data: before the wait too).
template <typename Q>
__device__ __forceinline__ void stage_grid() {
    if constexpr (grid_words<Q>(nullptr) > 0) {
        Q::stage((int)threadIdx.x, (int)blockDim.x);
        __syncthreads();
    }
}

template <typename Q, int NC>
__device__ void mmvq(const QGemvArgs& p) {
    constexpr int CH = CHUNK / Q::QK * Q::BYTES;  // bytes of a chunk, a multiple of 16
    static_assert(CH % 16 == 0, "chunks keep the row's alignment");
    // two chunk buffers per warp, 16 bytes over for the row's misalignment
    __shared__ __align__(16) char stage[GEMV_WARPS][2][CH + 16];
    pdl_launch_dependents();
    stage_grid<Q>();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 row = blockIdx.x * (i64)GEMV_WARPS + warp;
    if (row >= p.m) return;  // the whole warp
    const char* a = p.a + row * p.a_nb1;
    const i64 row_bytes = p.k / Q::QK * Q::BYTES;
    const int mis = (int)((uintptr_t)a & 15u);
    const int nchunks = (int)((row_bytes + CH - 1) / CH);
    // Weights nothing in the plan writes: the first chunk's copy starts before the wait.
    if (p.prefetch) stage_bytes(stage[warp][0] + mis, a, (int)min((i64)CH, row_bytes), lane);
    pdl_wait();
    if (!p.prefetch) stage_bytes(stage[warp][0] + mis, a, (int)min((i64)CH, row_bytes), lane);
    stage_commit();
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    for (int ci = 0; ci < nchunks; ++ci) {
        const i64 c0 = (i64)ci * CH;
        if (ci + 1 < nchunks) {
            stage_bytes(stage[warp][(ci + 1) & 1] + mis, a + c0 + CH, (int)min((i64)CH, row_bytes - c0 - CH), lane);
        }
        stage_commit();
        stage_wait<1>();
        __syncwarp();
        const char* w0 = stage[warp][ci & 1] + mis;
        const int nsub = (int)(min((i64)CH, row_bytes - c0) / Q::BYTES) * Q::SUBS;
        const int s0 = (int)(c0 / Q::BYTES) * Q::SUBS;
        if constexpr (!Q::PAIRS) {
            chunk_single<Q, NC>(p, w0, nsub, s0, lane, acc);
        } else if (Q::PA > 2 && mis == 0) {  // wider loads only where the type has them
            chunk_pairs<Q, NC, Q::PA>(p, w0, nsub, s0, lane, acc);
        } else {
            chunk_pairs<Q, NC, 2>(p, w0, nsub, s0, lane, acc);
        }
        __syncwarp();  // the buffer is free for chunk ci + 2
    }
    write_row<NC>(p, row, acc, lane);
}

// One column of a decode step's mul_mat_id (mul_mat_vec_id_q*_<q>): column j = blockIdx.y
// is (i, t) = (j % n_used, j / n_used); GEMV, a one-column decode product (mmvq<Q, 1>,
// mmvq_direct<InPlace<Q>, 1, U>), runs on expert ids[i, t]'s rows, the Q8_1 column
// (i % b1) + b1 * t and dst[:, i, t]. With a second product (a2 not null: other experts
// of the same shape and type, the same inputs and ids), the grid's upper half of rows
// runs it into dst2. The ids come from the kernels before, so nothing is read before the
// wait. A bad id is recorded (by the column's first block) and the column zero-filled;
// its expert is never read.
template <void (*GEMV)(const QGemvArgs&)>
__device__ void gemv_id(const QGemvIdArgs& p) {
    pdl_enter();
    const int cols = p.a2 == nullptr ? (int)gridDim.y : (int)gridDim.y / 2;
    const bool second = (int)blockIdx.y >= cols;
    const int n_used = (int)p.n_used, j = (int)blockIdx.y - (second ? cols : 0);
    const int i = j % n_used, t = j / n_used;
    const int id = *reinterpret_cast<const int*>(p.ids + i * p.ids_nb0 + t * p.ids_nb1);
    const char* a = second ? p.a2 : p.a;
    char* dst = (second ? p.dst2 : p.dst) + i * p.dst_nb1 + t * p.dst_nb2;
    if (id < 0 || id >= p.n_expert) {
        const i64 row = blockIdx.x * (i64)GEMV_WARPS + threadIdx.x;
        if (threadIdx.x < GEMV_WARPS && row < p.m) reinterpret_cast<float*>(dst)[row] = 0.0f;
        if (blockIdx.x == 0 && threadIdx.x == 0) record_index_error(p.err, p.tag, id, t, p.n_expert);
        return;
    }
    const QGemvArgs q = {
        a + id * p.a_nb2,                               // a
        p.b + (i % (int)p.b1 + p.b1 * t) * p.b_nb1,     // b
        dst,                                            // dst
        nullptr,                                        // add
        p.k, p.m, 1, p.a_nb1, p.b_nb1,                  // k, m, ncols, a_nb1, b_nb1
        0, 0,                                           // vec, prefetch (the wait is past)
    };
    GEMV(q);
}

// 8 consecutive floats at x: two 16-byte loads when vec, else scalar ones.
__device__ __forceinline__ void load_x8(const float* x, bool vec, float* f) {
    if (vec) {
        const float4 u = __ldg(reinterpret_cast<const float4*>(x));
        const float4 v = __ldg(reinterpret_cast<const float4*>(x) + 1);
        f[0] = u.x, f[1] = u.y, f[2] = u.z, f[3] = u.w, f[4] = v.x, f[5] = v.y, f[6] = v.z, f[7] = v.w;
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = __ldg(x + i);
    }
}

// The lane's first PRE blocks of a split row: blocks lane, lane + 32, ...
template <typename S, int PRE>
__device__ __forceinline__ void load_first(const char* a, int nb, int lane, typename S::Q::W* w) {
#pragma unroll
    for (int u = 0; u < PRE; ++u) {
        if (lane + WARP_SIZE * u < nb) S::load(a, nb, lane + WARP_SIZE * u, w[u]);
    }
}

// Rows read in place (the reader of mmvq_direct): Q4_K and Q5_K at 16-byte aligned
// addresses, a pair's block header and quant bytes as 16-byte loads (A = GLOBAL16); IQ4_XS
// at 8-byte aligned ones, as 8-byte loads (A = GLOBAL8).
template <typename B, int A = GLOBAL16>
struct InPlace {
    typedef B Q;
    static constexpr int QK = B::QK;
    static __device__ __forceinline__ void load2(const char* row, int, int s, typename Q::W& wa, typename Q::W& wb) {
        Q::template load2<A>(row + (s / Q::SUBS) * Q::BYTES, s % Q::SUBS, wa, wb);
    }
};

// Rows of a K-quant read in place by R (InPlace, or SplitQ5_K / SplitQ6_K for frozen weights):
// lane t takes the pairs of sub-blocks 2t and 2t + 1, 2t + 64 and 2t + 65, ... (the pairs
// and the order of mmvq's chunk_pairs, so the same sums) straight from global memory,
// nothing staged. The first pair is loaded before the wait when nothing in the plan
// writes the weights. U: pairs a lane in flight after the first.
template <typename R, int NC, int U>
__device__ void mmvq_direct(const QGemvArgs& p) {
    typedef typename R::Q Q;
    pdl_launch_dependents();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 row = blockIdx.x * (i64)GEMV_WARPS + warp;
    if (row >= p.m) return;  // the whole warp
    const char* a = p.a + row * p.a_nb1;
    const int nsub = (int)(p.k / 32), nb = (int)(p.k / R::QK);
    const auto load = [&](int s, typename Q::W& wa, typename Q::W& wb) { R::load2(a, nb, s, wa, wb); };
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    const int s0 = 2 * lane;
    {
        typename Q::W wa, wb;
        if (!p.prefetch) pdl_wait();
        if (s0 < nsub) load(s0, wa, wb);
        if (p.prefetch) pdl_wait();
        if (s0 < nsub) dot_pairs<Q, NC>(p, wa, wb, 0, s0, acc);
    }
#pragma unroll U
    for (int s = s0 + 2 * WARP_SIZE; s < nsub; s += 2 * WARP_SIZE) {
        typename Q::W wa, wb;
        load(s, wa, wb);
        dot_pairs<Q, NC>(p, wa, wb, 0, s, acc);
    }
    write_row<NC>(p, row, acc, lane);
}

// S: the split-row reader (Split in quant.cuh). PRE > 0 (the qsp kernels,
// for grids the GPU holds at once): the lane's first PRE blocks are loaded before the
// wait when nothing in the plan writes the weights. U: blocks a lane in flight.
template <typename S, int NC, int PRE, int U>
__device__ void mmvq_split(const QGemvArgs& p) {
    pdl_launch_dependents();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 row = blockIdx.x * (i64)GEMV_WARPS + warp;
    if (row >= p.m) return;  // the whole warp
    const char* a = p.a + row * p.a_nb1;
    const int nb = (int)(p.k / S::QK);
    if constexpr (PRE == 0) pdl_wait();
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
    if constexpr (PRE > 0) {
        typename S::Q::W w[PRE];
        if (!p.prefetch) pdl_wait();
        load_first<S, PRE>(a, nb, lane, w);
        if (p.prefetch) pdl_wait();
#pragma unroll
        for (int u = 0; u < PRE; ++u) {
            if (lane + WARP_SIZE * u < nb) dot_cols<typename S::Q, NC>(p, w[u], 0, lane + WARP_SIZE * u, acc);
        }
    }
#pragma unroll U
    for (int s = lane + WARP_SIZE * PRE; s < nb; s += WARP_SIZE) {
        typename S::Q::W w;
        S::load(a, nb, s, w);
        dot_cols<typename S::Q, NC>(p, w, 0, s, acc);
    }
    write_row<NC>(p, row, acc, lane);
}

// R: the row reader (Blocks<Q> or Split, quant.cuh).
template <typename R, int NC>
__device__ void dmmv(const QGemvArgs& p) {
    pdl_launch_dependents();
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 row = blockIdx.x * (i64)GEMV_WARPS + threadIdx.x / WARP_SIZE;
    if (row >= p.m) return;  // the whole warp
    const char* a = p.a + row * p.a_nb1;
    const i64 nb = p.k / R::QK;
    if (p.prefetch) prefetch_row(a, nb * R::BYTES, lane);
    pdl_wait();
    constexpr int GPB = R::QK / 8;  // 8-element groups per block
    const int ngroups = (int)(p.k / 8);
    const bool vec = p.vec != 0;
    float acc[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) acc[c] = 0.0f;
#pragma unroll 2
    for (int g = lane; g < ngroups; g += WARP_SIZE) {
        float v[8];
        R::deq8(a, nb, g / GPB, g % GPB, v);
#pragma unroll
        for (int c = 0; c < NC; ++c) {
            if (c < p.ncols) {
                float x[8];
                load_x8(reinterpret_cast<const float*>(p.b + c * p.b_nb1) + 8 * g, vec, x);
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[c] += v[i] * x[i];
            }
        }
    }
    write_row<NC>(p, row, acc, lane);
}

// The kernels, one per block type, column count and family, with their __launch_bounds__
// (GEMV_WARPS * 32 threads, the launcher's block, and the blocks each asks to keep resident
// per SM), are instantiated by build.rs from the table in build/instances.rs.
#include "mul_mat_q.inst.cuh"
