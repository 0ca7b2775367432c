// Products of block-quantized weights with a batch of activation columns on F16 tensor
// cores, for the widths where the int8 product's f32 work per sub-block (mmq.cu) costs more
// than unpacking the weights to F16 once a tile (src/backend/cuda/lower/mmq.rs picks):
// dst[r, c] = sum_l a[l, r] * b[l, c], F32 results.
//
//   mmh_c<BN>_<q>: weights of type q in ggml's blocks (mmh_split_c<BN>_<q>: frozen weights in
//     split rows), b the activations as F16 columns (column c at b + c * b_nb1, its k
//     elements dense). A block takes MMQ_ROWS = 64 weight rows, 16 a warp, by BN = 8, 16,
//     32 or 64 columns (grid.x: column tiles, so that the blocks of one weight tile run side
//     by side and all but the first read it from L2; grid.y: row tiles; grid.z: parts of K,
//     as mmq_* splits them, with mmq_reduce adding the parts up) and walks K in chunks of
//     MMH_K = 64 elements, one barrier a chunk:
//       - each thread of the first MMQ_ROWS * MMH_K / (32 UNIT) loads one unit of the
//         chunk's weights (mmq_units.cuh) into registers two chunks ahead and unpacks it
//         into shared memory one chunk ahead: its int8 quants become F16 values q * s + o
//         with the sub-block's (or Q6_K's half sub-block's) scale s and offset o in F16,
//         one rounding (fma), the value the F16 copy of the weights holds within an ulp;
//       - the chunk's activation columns are copied into shared memory asynchronously, a
//         chunk ahead (cp.async, zeros past n and past k);
//       - each warp multiplies its 16 rows by the BN columns, 16 elements of k at a time
//         (mma.sync m16n8k16, F16 x F16 -> F32, fragments by ldmatrix), into F32
//         accumulators in registers.
//     Rows of 72 halves (144 bytes) in shared memory: the 8 rows of an ldmatrix fall on
//     different banks.
#include "mmq_units.cuh"

constexpr int MMH_THREADS = MMQ_WARPS * WARP_SIZE;
constexpr int MMH_SUBS = MMH_K / 32;  // sub-blocks of a chunk
constexpr int MMH_LD = MMH_K + 8;     // halves of a weight row or activation column in shared memory
static_assert(MMQ_ROWS == 16 * MMQ_WARPS, "a warp takes 16 rows");
static_assert(MMH_K % 64 == 0, "a chunk holds whole K-quant units (64 elements)");

// Shared memory of a block: the weights as F16 rows and the activations as F16 columns, two
// chunks of each.
template <int BN>
struct MmhSmem {
    f16 wa[2][MMQ_ROWS * MMH_LD];
    f16 yb[2][BN * MMH_LD];
};

// The weight units of a chunk: thread tid < UNITS takes unit part = tid % UPR of the chunk's
// row tid / UPR of the tile (rows past m read row m - 1, whose results are not written; a
// unit past the row's end reads the row's last unit, whose sums are not used).
template <typename T>
struct HalfWeights {
    static constexpr int UPR = MMH_SUBS / T::UNIT;  // units of a chunk's row
    static constexpr int UNITS = MMQ_ROWS * UPR;
    static_assert(UNITS <= MMH_THREADS, "a thread a unit");
    const char* row;
    int nb, last, part, r;
    bool active;

    __device__ __forceinline__ HalfWeights(const MmqArgs& p, i64 row0) {
        r = (int)threadIdx.x / UPR, part = (int)threadIdx.x % UPR;
        active = (int)threadIdx.x < UNITS;
        row = p.a + min(row0 + r, p.m - 1) * p.a_nb1;
        nb = (int)(p.k / T::QK);
        last = (int)(p.k / 32) / T::UNIT - 1;
    }
    __device__ __forceinline__ int unit(int ch) const { return min(ch * UPR + part, last); }
    __device__ __forceinline__ void fetch(int ch, typename T::Raw& raw) const {
        if (active) T::fetch(row, nb, unit(ch), raw);
    }
    __device__ __forceinline__ void store(int ch, const typename T::Raw& raw, f16* wa) const {
        if (!active) return;
        int q[8 * T::UNIT];
        typename T::Slot w[T::UNIT];
        T::unpack(raw, unit(ch), q, w);
        f16* dst = wa + r * MMH_LD + 32 * T::UNIT * part;
#pragma unroll
        for (int i = 0; i < T::UNIT; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {  // halves of the sub-block (Q6_K: its two scales)
                float s, o;
                affine(w[i], T::HALVES ? h : 0, s, o);
                const __half2 s2 = __float2half2_rn(s), o2 = __float2half2_rn(o);
#pragma unroll
                for (int k = 0; k < 4; k += 2) {
                    const uint2 lo = unpack_f16x4(q[8 * i + 4 * h + k], s2, o2);
                    const uint2 hi = unpack_f16x4(q[8 * i + 4 * h + k + 1], s2, o2);
                    *reinterpret_cast<uint4*>(dst + 32 * i + 16 * h + 4 * k) = make_uint4(lo.x, lo.y, hi.x, hi.y);
                }
            }
        }
    }
};

// The chunks of the BN activation columns from col0: 16-byte pieces (8 elements) copied
// asynchronously, one group a chunk; zeros past n and past k.
template <int BN>
__device__ __forceinline__ void copy_columns(const MmqArgs& p, i64 col0, int ch, f16* yb) {
    constexpr int PIECES = MMH_K / 8;
    for (int i = threadIdx.x; i < BN * PIECES; i += MMH_THREADS) {
        const int c = i / PIECES, s = i % PIECES;
        const i64 e = (i64)ch * MMH_K + 8 * s;
        const bool ok = col0 + c < p.n && e < p.k;
        const char* src = ok ? p.b + (col0 + c) * p.b_nb1 + 2 * e : p.b;
        copy16_or_zero(reinterpret_cast<char*>(yb + c * MMH_LD + 8 * s), src, ok);
    }
    stage_commit();
}

// The warp's 16 rows of chunk buffer buf by the BN columns: the first nk 16-element steps,
// added into acc (n8 tile j: acc[j] as mma's d fragment).
template <int BN>
__device__ __forceinline__ void mmh_chunk(const MmhSmem<BN>& sm, int buf, int warp, int lane, int nk,
                                          float (*acc)[4]) {
    // ldmatrix row addresses: A's 16 rows at k + 0 (lanes 0-15) and k + 8 (16-31); B's
    // columns 8j..8j+7 at k + 0 and k + 8, then columns 8j + 8.. likewise (j even).
    const f16* wa = sm.wa[buf] + (16 * warp + lane % 16) * MMH_LD + 8 * (lane / 16);
    const int bc = BN == 8 ? lane % 8 : lane % 8 + 8 * (lane / 16);
    const f16* yb = sm.yb[buf] + bc * MMH_LD + 8 * ((lane / 8) % 2);
#pragma unroll 1  // unrolled, every step's fragment loads were hoisted: spills at BN = 64
    for (int s = 0; s < MMH_K / 16; ++s) {
        if (s >= nk) break;  // the same for the whole block
        uint32_t a[4];
        ldsm_x4<false>(wa + 16 * s, a);
#pragma unroll
        for (int j = 0; j < BN / 8; j += 2) {
            uint32_t b[4];
            ldsm_x4<false>(yb + 8 * j * MMH_LD + 16 * s, b);
            mma_16816(acc[j], a, b[0], b[1]);
            if (j + 1 < BN / 8) mma_16816(acc[j + 1], a, b[2], b[3]);
        }
    }
}

// One chunk of the main loop, chunk i of the block's part (buffer i % 2): its weights are in
// shared memory, the next chunk's raw units in `next`; `spare` takes the chunk after that.
template <typename T, int BN>
__device__ __forceinline__ void mmh_step(const MmqArgs& p, const HalfWeights<T>& w, MmhSmem<BN>& sm, i64 col0,
                                         int first, int i, int nch, typename T::Raw& spare,
                                         const typename T::Raw& next, float (*acc)[4]) {
    const int buf = i & 1, ch = first + i;
    stage_wait<0>();
    __syncthreads();  // chunk ch is in buf; every warp is done with buf ^ 1
    if (i + 1 < nch) copy_columns<BN>(p, col0, ch + 1, sm.yb[buf ^ 1]);
    if (i + 2 < nch) w.fetch(ch + 2, spare);
    const int nk = (int)min((i64)(MMH_K / 16), p.k / 16 - (i64)ch * (MMH_K / 16));
    mmh_chunk<BN>(sm, buf, (int)threadIdx.x / WARP_SIZE, (int)threadIdx.x % WARP_SIZE, nk, acc);
    if (i + 1 < nch) w.store(ch + 1, next, sm.wa[buf ^ 1]);
}

template <typename T, int BN>
__device__ void mmh(const MmqArgs& p) {
    static_assert(BN % 8 == 0 && BN <= 64, "column tiles of 8 to 64");
    __shared__ __align__(16) MmhSmem<BN> sm;
    pdl_launch_dependents();
    const i64 col0 = blockIdx.x * (i64)BN, row0 = blockIdx.y * (i64)MMQ_ROWS;
    const int first = (int)(blockIdx.z * p.chunks);
    const int nch = (int)min(p.chunks, (p.k + MMH_K - 1) / MMH_K - first);
    const HalfWeights<T> w(p, row0);
    typename T::Raw r0, r1;
    // Weights nothing in the plan writes: the first chunks load before the wait.
    if (p.prefetch) {
        w.fetch(first, r0);
        if (nch > 1) w.fetch(first + 1, r1);
    }
    pdl_wait();
    if (!p.prefetch) {
        w.fetch(first, r0);
        if (nch > 1) w.fetch(first + 1, r1);
    }
    copy_columns<BN>(p, col0, first, sm.yb[0]);
    w.store(first, r0, sm.wa[0]);
    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int i = 0; i < nch; i += 2) {
        mmh_step<T, BN>(p, w, sm, col0, first, i, nch, r0, r1, acc);
        if (i + 1 < nch) mmh_step<T, BN>(p, w, sm, col0, first, i + 1, nch, r1, r0, acc);
    }
    const int warp = (int)threadIdx.x / WARP_SIZE, lane = (int)threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const i64 r = row0 + 16 * warp + g + 8 * (e / 2), c = col0 + 8 * j + 2 * t + e % 2;
            if (r < p.m && c < p.n) p.dst[(blockIdx.z * p.n + c) * p.m + r] = with_res(acc[j][e], p.res, c * p.m + r);
        }
    }
}

// The instantiations (mmh_c<BN>_<q>, mmh_split_c<BN>_<q>: every weight type of mmq_* by
// every column tile) are generated by build.rs from the table in build/instances.rs.
#include "mmh.inst.cuh"
