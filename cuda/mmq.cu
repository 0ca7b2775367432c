// Products of block-quantized weights with a batch of activation columns on int8 tensor
// cores, for the widths between the decode kernels (mul_mat_q.cu, a few columns) and the
// weights dequantized to F16 for cuBLAS (src/backend/cuda/lower/mmq.rs picks):
// dst[r, c] = sum_l a[l, r] * b[l, c], F32 results.
//
//   mmq_c<BN>_<q>: weights of type q in ggml's layout; b the activations quantized to Q8_1
//     (quantize_q8_1_f32, or the fused step before the product) in the layout the decode
//     products of the same type read (act_at in quant.cuh: ACT_PAIRS for the K-quants,
//     ACT_BLOCKS for the 32-element types). A block takes MMQ_ROWS = 64 weight rows, 16 a
//     warp, by BN = 8, 16, 32 or 64 columns (grid.x: column tiles, so that the blocks of
//     one weight tile run side by side and all but the first read it from L2; grid.y:
//     row tiles; grid.z: parts of K, below) and walks K in chunks of MMQ_K = 128 elements
//     (4 sub-blocks of 32), one barrier a chunk:
//       - each thread loads its units of the chunk's weights (a 32-element block, or a
//         K-quant's pair of sub-blocks) into registers a chunk ahead, and unpacks them
//         into shared memory after the current chunk's products: int8 quants, rows of 128
//         bytes padded to 144 so that the 8 rows of a fragment load fall on different
//         banks, and one scale slot per sub-block (the Mmq* traits below);
//       - the chunk's activation quants are copied into shared memory asynchronously, a
//         chunk ahead (cp.async), and their (d, d * sum) pairs loaded into registers a
//         chunk ahead and stored as floats;
//       - each warp multiplies its 16 rows by the BN columns one sub-block at a time:
//         mma.sync m16n8k32 (s8 x s8 -> s32; Q6_K, whose scales cover 16 elements, two
//         m16n8k16) gives the exact integer sum of each (row, column) pair, which the
//         type's Slot::term scales in f32 as its decode product's dot does (quant.cuh; the
//         CPU oracle is src/quant/dot.rs), into F32 accumulators in registers.
//     The integer sums become floats by an integer add of 1.5 * 2^23 and a float subtract
//     (exact below 2^22 in magnitude, which every sub-block's sum is: at most 32 * 127 *
//     128) instead of I2F, which issues at a fraction of the rate of the f32 arithmetic
//     that dominates the kernel from a few dozen columns on.
//   mmq_split_c<BN>_<q>: the same for frozen weights in split rows (src/quant/split.rs): a
//     unit's quants are 16-byte loads, its header one or a few small loads.
//   mmq_reduce: a grid of too few blocks for the GPU (a small product, or few columns)
//     splits K into gridDim.z parts of `chunks` chunks each; part z writes its partial sums
//     to dst + z * m * n, and mmq_reduce adds the parts up in order. The same sums in the
//     same order on every run, whatever the layout of the weights: results are
//     deterministic and frozen weights give the bytes unfrozen ones give.
//
// The weight units (Mmq* traits, fetch and unpack) are in mmq_units.cuh.
#include "mmq_units.cuh"

constexpr int MMQ_THREADS = MMQ_WARPS * WARP_SIZE;
constexpr int MMQ_SUBS = MMQ_K / 32;  // sub-blocks of a chunk
constexpr int MMQ_LD = MMQ_K + 16;    // bytes of a weight row or activation column in shared memory
static_assert(MMQ_ROWS == 16 * MMQ_WARPS, "a warp takes 16 rows");
static_assert(MMQ_SUBS == 4, "a chunk's (d, d * sum) pairs of a column are one 16-byte copy");

__device__ __forceinline__ int lds32(const char* p) { return *reinterpret_cast<const int*>(p); }

// ---------------------------------------------------------------------------------------
// Tensor-core products. Fragments (g = lane / 4, t = lane % 4; word w of a row or column is
// its k elements 4w..4w+3): a = the words t of rows g and g + 8, then the words t + 4 of
// rows g and g + 8 (A row-major, 16 x 32); b0, b1 = the words t and t + 4 of column g (B
// column-major, 32 x 8); c = rows g, g, g + 8, g + 8 by columns 2t, 2t + 1, 2t, 2t + 1.

// c = the 16 x 8 integer products over 32 k (m16n8k32).
__device__ __forceinline__ void mma_k32(int* c, const int* a, int b0, int b1) {
    c[0] = c[1] = c[2] = c[3] = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

// c = the 16 x 8 integer products over 16 k (m16n8k16): a0, a1 the words of rows g and g + 8,
// b0 of column g.
__device__ __forceinline__ void mma_k16(int* c, int a0, int a1, int b0) {
    c[0] = c[1] = c[2] = c[3] = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
        : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
        : "r"(a0), "r"(a1), "r"(b0));
#endif
}

// ---------------------------------------------------------------------------------------
// The kernel.

// Shared memory of a block: the weights' int8 quants and slots, the activations' quants and
// (d, d * sum) pairs (as floats, sub-block by sub-block: ys[s * BN + c]), two chunks of each.
template <typename T, int BN>
struct MmqSmem {
    char wq[2][MMQ_ROWS * MMQ_LD];
    typename T::Slot ws[2][MMQ_ROWS * MMQ_SUBS];
    char yq[2][BN * MMQ_LD];
    float2 ys[2][MMQ_SUBS * BN];
};

// The thread's units of a weight chunk (unit x of thread tid: row (tid + x MMQ_THREADS) /
// UPR of the tile, part (tid + x MMQ_THREADS) % UPR of the chunk's row), loaded a chunk
// ahead into registers and unpacked into shared memory. The rows' addresses are found at
// each load rather than kept (registers: the wide tiles of sm_80 spilled).
template <typename T>
struct WeightLoader {
    static constexpr int UPR = MMQ_SUBS / T::UNIT;             // units of a chunk's row
    static constexpr int NU = MMQ_ROWS * UPR / MMQ_THREADS;    // units of a thread
    static_assert(NU * MMQ_THREADS == MMQ_ROWS * UPR, "the threads share a chunk's units evenly");
    const MmqArgs& p;
    const char* a;  // the rows (p.a, or an expert's rows)
    i64 row0;
    typename T::Raw raw[NU];

    __device__ __forceinline__ WeightLoader(const MmqArgs& args, const char* rows, i64 first_row)
        : p(args), a(rows), row0(first_row) {}
    __device__ __forceinline__ static int tile_row(int x) { return ((int)threadIdx.x + x * MMQ_THREADS) / UPR; }
    __device__ __forceinline__ static int part(int x) { return ((int)threadIdx.x + x * MMQ_THREADS) % UPR; }
    // Unit x's index in its row for chunk ch; a unit past the row's end (the last chunk of a
    // row that is not whole chunks) reads the last unit instead (its sums are not used).
    __device__ __forceinline__ int unit(int ch, int x) const {
        return min(ch * UPR + part(x), (int)(p.k / 32) / T::UNIT - 1);
    }
    // Rows past m read row m - 1 (their results are not written).
    __device__ __forceinline__ void fetch(int ch) {
#pragma unroll
        for (int x = 0; x < NU; ++x) {
            const char* row = a + min(row0 + tile_row(x), p.m - 1) * p.a_nb1;
            T::fetch(row, (int)(p.k / T::QK), unit(ch, x), raw[x]);
        }
    }
    template <int BN>
    __device__ __forceinline__ void store(int ch, MmqSmem<T, BN>& sm, int buf) const {
#pragma unroll
        for (int x = 0; x < NU; ++x) {
            int q[8 * T::UNIT];
            typename T::Slot w[T::UNIT];
            T::unpack(raw[x], unit(ch, x), q, w);
            const int r = tile_row(x), s = T::UNIT * part(x);
            char* dq = sm.wq[buf] + r * MMQ_LD + 32 * s;
#pragma unroll
            for (int i = 0; i < 2 * T::UNIT; ++i) {
                *reinterpret_cast<int4*>(dq + 16 * i) = make_int4(q[4 * i], q[4 * i + 1], q[4 * i + 2], q[4 * i + 3]);
            }
#pragma unroll
            for (int i = 0; i < T::UNIT; ++i) sm.ws[buf][r * MMQ_SUBS + s + i] = w[i];
        }
    }
};

// Where a block's BN columns come from and where their results go:
//   has(c)  column c of the tile exists;
//   act(c)  its Q8_1 activations (b + column * b_nb1);
//   out(c)  its m results.
// DenseCols: columns col0 .. col0 + BN of b and of dst (part blockIdx.z of K's partial sums),
// everything read from the kernel's arguments where it is used.
struct DenseCols {
    const MmqArgs& p;
    i64 col0;
    __device__ __forceinline__ bool has(int c) const { return col0 + c < p.n; }
    __device__ __forceinline__ const char* act(int c) const { return p.b + (col0 + c) * p.b_nb1; }
    __device__ __forceinline__ float* out(int c) const { return p.dst + (blockIdx.z * p.n + col0 + c) * p.m; }
    __device__ __forceinline__ const float* res(int c) const {
        return p.res == nullptr ? nullptr : p.res + (col0 + c) * p.m;
    }
};

// ExpertCols: the nc columns of an expert's tile (mmq_id), their addresses in shared memory.
struct ExpertCols {
    const char* const* acts;
    float* const* outs;
    int nc;
    __device__ __forceinline__ bool has(int c) const { return c < nc; }
    __device__ __forceinline__ const char* act(int c) const { return acts[c]; }
    __device__ __forceinline__ float* out(int c) const { return outs[c]; }
    __device__ __forceinline__ const float* res(int) const { return nullptr; }
};

// The chunks of the BN activation columns of a tile (C: DenseCols or ExpertCols): each sub-block's 32 quants copied into
// shared memory asynchronously (two 16-byte pieces; one group a chunk), and a column's 4
// (d, d * sum) pairs of the chunk (thread c < BN: column c) loaded into registers a chunk
// ahead, then stored as floats, so that each pair is converted once a block rather than by
// every lane that reads it. Columns past n and sub-blocks past the row's end are zeros (the
// pairs past the row's end are never read).
template <typename T, int BN, typename C>
struct ActLoader {
    static_assert(BN <= MMQ_THREADS, "a thread a column's pairs");
    const MmqArgs& p;
    const C& cols;
    uint4 ds;

    __device__ __forceinline__ ActLoader(const MmqArgs& args, const C& tile) : p(args), cols(tile) {}
    __device__ __forceinline__ void copy_quants(int ch, MmqSmem<T, BN>& sm, int buf) const {
        constexpr i64 LAYOUT = T::QK == 256 ? ACT_PAIRS : ACT_BLOCKS;  // Q8Layout::of in src/backend/fusion.rs
        const int s0 = ch * MMQ_SUBS, nsub = (int)(p.k / 32);
        for (int i = threadIdx.x; i < BN * 2 * MMQ_SUBS; i += MMQ_THREADS) {
            const int c = i / (2 * MMQ_SUBS), s = (i / 2) % MMQ_SUBS, h = i % 2;
            const bool ok = cols.has(c) && s0 + s < nsub;
            const char* src = ok ? cols.act(c) + act_at(s0 + s, 16 * h, LAYOUT) : p.b;
            copy16_or_zero(sm.yq[buf] + c * MMQ_LD + 32 * s + 16 * h, src, ok);
        }
        stage_commit();
    }
    __device__ __forceinline__ void fetch_pairs(int ch) {
        const int c = threadIdx.x;
        ds = make_uint4(0u, 0u, 0u, 0u);
        if (c < BN && cols.has(c)) {
            const char* col = cols.act(c);
            ds = __ldg(reinterpret_cast<const uint4*>(col + act_quant_bytes(p.k) + 16 * (i64)ch));
        }
    }
    __device__ __forceinline__ void store_pairs(MmqSmem<T, BN>& sm, int buf) const {
        const int c = threadIdx.x;
        if (c >= BN) return;
        const unsigned h[MMQ_SUBS] = {ds.x, ds.y, ds.z, ds.w};
#pragma unroll
        for (int s = 0; s < MMQ_SUBS; ++s) {
            sm.ys[buf][s * BN + c] = __half22float2(*reinterpret_cast<const __half2*>(&h[s]));
        }
    }
};

// The warp's 16 rows (from `row`) of chunk buffer buf by the BN columns: the first nsc
// sub-blocks' products, added into acc (n8 tile j: acc[j] as mma's c fragment).
template <typename T, int BN>
__device__ __forceinline__ void mma_chunk(const MmqSmem<T, BN>& sm, int buf, int row, int nsc, int lane,
                                          float (*acc)[4]) {
    const int g = lane / 4, t = lane % 4;
    const char* wa = sm.wq[buf] + (row + g) * MMQ_LD + 4 * t;
    const typename T::Slot* wsl = sm.ws[buf] + (row + g) * MMQ_SUBS;
#pragma unroll 1  // unrolled, the loads of every sub-block were hoisted: 168 registers at BN = 64
    for (int s = 0; s < MMQ_SUBS; ++s) {
        if (s >= nsc) break;  // the same for the whole block
        const int a[4] = {lds32(wa + 32 * s), lds32(wa + 8 * MMQ_LD + 32 * s), lds32(wa + 32 * s + 16),
                          lds32(wa + 8 * MMQ_LD + 32 * s + 16)};
        const typename T::Slot lo = wsl[s], hi = wsl[8 * MMQ_SUBS + s];
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) {
            const char* yb = sm.yq[buf] + (8 * j + g) * MMQ_LD + 32 * s + 4 * t;
            const int b0 = lds32(yb), b1 = lds32(yb + 16);
            int c0[4], c1[4] = {0, 0, 0, 0};
            if constexpr (T::HALVES) {
                mma_k16(c0, a[0], a[1], b0);
                mma_k16(c1, a[2], a[3], b1);
            } else {
                mma_k32(c0, a, b0, b1);
            }
            // the (d, d * sum) pairs of columns 2t and 2t + 1 of the tile
            const float4 yy = *reinterpret_cast<const float4*>(&sm.ys[buf][s * BN + 8 * j + 2 * t]);
            const float2 y0 = make_float2(yy.x, yy.y), y1 = make_float2(yy.z, yy.w);
            typedef typename T::Slot S;
            acc[j][0] += S::term(lo, c0[0], c1[0], y0);
            acc[j][1] += S::term(lo, c0[1], c1[1], y1);
            acc[j][2] += S::term(hi, c0[2], c1[2], y0);
            acc[j][3] += S::term(hi, c0[3], c1[3], y1);
        }
    }
}

// The block's tile after the wait for its predecessor, its first weight chunk fetched:
// chunks first .. first + nch of the 64 rows from row0 by the BN columns of `cols`.
template <typename T, int BN, typename C>
__device__ __forceinline__ void mmq_tile(const MmqArgs& p, WeightLoader<T>& w, const C& cols, MmqSmem<T, BN>& sm,
                                         int first, int nch) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int nsub = (int)(p.k / 32);
    ActLoader<T, BN, C> y(p, cols);
    y.copy_quants(first, sm, 0);
    y.fetch_pairs(first);
    w.store(first, sm, 0);
    y.store_pairs(sm, 0);
    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int i = 0; i < nch; ++i) {
        const int buf = i & 1, ch = first + i;
        stage_wait<0>();
        __syncthreads();  // chunk ch is in buf; every warp is done with buf ^ 1
        if (i + 1 < nch) {
            y.copy_quants(ch + 1, sm, buf ^ 1);
            y.fetch_pairs(ch + 1);
            w.fetch(ch + 1);
        }
        mma_chunk<T, BN>(sm, buf, 16 * warp, min(MMQ_SUBS, nsub - ch * MMQ_SUBS), lane, acc);
        if (i + 1 < nch) {
            w.store(ch + 1, sm, buf ^ 1);
            y.store_pairs(sm, buf ^ 1);
        }
    }
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const i64 r = w.row0 + 16 * warp + g + 8 * (e / 2);
            const int c = 8 * j + 2 * t + e % 2;
            if (r < p.m && cols.has(c)) cols.out(c)[r] = with_res(acc[j][e], cols.res(c), r);
        }
    }
}

template <typename T, int BN>
__device__ void mmq(const MmqArgs& p) {
    static_assert(BN % 8 == 0 && BN <= 64, "column tiles of 8 to 64");
    __shared__ __align__(16) MmqSmem<T, BN> sm;
    pdl_launch_dependents();
    const i64 col0 = blockIdx.x * (i64)BN, row0 = blockIdx.y * (i64)MMQ_ROWS;
    const int nsub = (int)(p.k / 32);
    const int first = (int)(blockIdx.z * p.chunks);
    const int nch = (int)min(p.chunks, (i64)((nsub + MMQ_SUBS - 1) / MMQ_SUBS - first));
    WeightLoader<T> w(p, p.a, row0);
    // Weights nothing in the plan writes: the first chunk loads before the wait.
    if (p.prefetch) w.fetch(first);
    pdl_wait();
    if (!p.prefetch) w.fetch(first);
    const DenseCols cols{p, col0};
    mmq_tile<T, BN>(p, w, cols, sm, first, nch);
}

// mmq_id_c<BN>_<q>: the tile blockIdx.x of the experts' column tiles (tile_expert,
// tile_first: group_by_expert's list; an expert of -1 is past the last tile) by the rows
// blockIdx.y * MMQ_ROWS ..: the expert's weights at a + e * a_nb2, its columns j = i +
// n_used * t (cols[first ..], at most BN and up to the expert's end) read from Q8_1
// column (i % b1) + b1 * t of b, their results written to dst + i * dst_nb1 + t * dst_nb2.
// The whole of K in one part.
template <typename T, int BN>
__device__ void mmq_id(const MmqIdArgs& q) {
    static_assert(BN % 8 == 0 && BN <= 64, "column tiles of 8 to 64");
    __shared__ __align__(16) MmqSmem<T, BN> sm;
    __shared__ const char* acts[BN];
    __shared__ float* outs[BN];
    pdl_launch_dependents();
    pdl_wait();
    const MmqArgs p{q.a, q.b, nullptr, q.k, q.m, 0, q.a_nb1, q.b_nb1, 0, 0};
    const int e = q.tile_expert[blockIdx.x];
    if (e < 0) return;  // the same for the whole block
    const int first = q.tile_first[blockIdx.x];
    const int nc = min(BN, q.offsets[e + 1] - first);
    if ((int)threadIdx.x < nc) {
        const int j = q.cols[first + threadIdx.x];
        const i64 i = j % q.n_used, t = j / q.n_used;
        acts[threadIdx.x] = p.b + (i % q.b1 + q.b1 * t) * p.b_nb1;
        outs[threadIdx.x] = reinterpret_cast<float*>(q.dst + i * q.dst_nb1 + t * q.dst_nb2);
    }
    __syncthreads();
    const int nch = (int)((p.k / 32 + MMQ_SUBS - 1) / MMQ_SUBS);
    WeightLoader<T> w(p, p.a + e * q.a_nb2, blockIdx.y * (i64)MMQ_ROWS);
    w.fetch(0);
    const ExpertCols cols{acts, outs, nc};
    mmq_tile<T, BN>(p, w, cols, sm, 0, nch);
}

// The sum of the parts of K, in order.
__device__ void mmq_reduce_parts(const MmqReduceArgs& p) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.count; i += (i64)gridDim.x * blockDim.x) {
        float s = p.part[i];
        for (i64 z = 1; z < p.split; ++z) s += p.part[z * p.count + i];
        if (p.res != nullptr) s += p.res[i];
        p.dst[i] = s;
    }
}

extern "C" __global__ void __launch_bounds__(MMQ_REDUCE_THREADS) mmq_reduce(const MmqReduceArgs p) { mmq_reduce_parts(p); }

// The instantiations (mmq_c<BN>_<q>, mmq_split_c<BN>_<q>: every weight type by every column
// tile, in ggml's blocks and in split rows for the types that have them) are generated by
// build.rs from the table in build/instances.rs.
#include "mmq.inst.cuh"
