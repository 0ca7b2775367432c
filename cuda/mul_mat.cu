// Matrix-vector kernels of mul_mat (the GEMM cases go to cuBLAS, see
// src/backend/cuda/lower/mul_mat.rs; the decode GEMVs are lowered by
// src/backend/cuda/decode/float.rs): dst[r, ch] = sum_l a[l, r, ch / ratio] * b[l, ch] with f32
// accumulation and reductions in a fixed order (results are deterministic).
//
//   mul_mat_vec_{f16,bf16,f32}: decode GEMV, one column, one warp per row of `a`,
//     GEMV_WARPS rows per block. Each lane streams 16-byte pieces of the row (8 halves)
//     in rounds of GEMV_ROUND independent loads, double-buffered in registers: the next
//     round's loads go out before the current round is used (weights read once,
//     evict-first; the first round, for read-only weights, before the wait on the
//     previous kernel), x read through L1, then a warp shuffle reduction; an optional
//     F32 vector `add` is added to the result (a residual add fused into the product).
//     Rows of any length: a scalar tail covers k % 8 and rows not aligned for vector
//     loads (vec == 0). Chosen over one block per row on the H100 (81/94/89% of copy
//     bandwidth on 4096x4096, 11008x4096, 4096x11008 F16, against 73/91/88%; a
//     microbenchmark of 16 variants).
//   mul_mat_vec_fold_{f16,bf16,f32}: the same with the next decode RMS norm folded in
//     (NormFold in args.cuh): also y * w and each block's sum of y^2, for the product after
//     the norm and the kernel after that.
//   mul_mat_vec_total_{f16,bf16,f32}: the product after a folded norm: block 0 also adds the
//     block sums and writes the norm's factor.
//   mul_mat_vec_nc_f16_f32: the same kernel over channels (blockIdx.y) with rows of `a` at
//     any row and channel strides, e.g. a transposed V-cache view [n_kv, hd, n_kv_heads];
//     channel ch of b reads channel ch / ratio of a (GQA).
//   mul_mat_p021_f16_f32: short rows (k <= 256), e.g. a permuted K-cache view
//     [hd, n_kv, n_kv_heads]: one warp per P021_ROWS rows of one channel, 8-byte loads
//     of every row in flight together; consecutive warps take consecutive channels, so
//     the query heads sharing a KV head (GQA) read its rows while they are in L1.
#include "common.cuh"

// 16-byte pieces of its row a lane of mul_mat_vec_* pulls into L2 before the wait on the
// previous kernel (read-only weights).
#define GEMV_PREFETCH 4
// 16-byte loads a lane has in a round of the double-buffered loop. H200, Llama-2-7B F16
// decode: rounds of 2 double-buffered 228.3 -> 230.0 tok/s after 4,096 tokens and 254.9
// -> 257.8 after 512, against rounds of 4 used before the next was issued
// (2026-12-01, docs/benchmarks.md).
#define GEMV_ROUND 2

// 16 bytes of weights, read once: evict first.
__device__ __forceinline__ uint4 load16(const uint4* p) { return __ldcs(p); }

__device__ __forceinline__ float2 half2_to_float2(unsigned u) {
    return __half22float2(__halves2half2(__ushort_as_half((unsigned short)(u & 0xffffu)),
                                         __ushort_as_half((unsigned short)(u >> 16))));
}

__device__ __forceinline__ float2 bf162_to_float2(unsigned u) {
    return make_float2(__uint_as_float(u << 16), __uint_as_float(u & 0xffff0000u));
}

// 16 bytes of weights: how many elements they hold, unpacked to floats.
template <typename T>
struct Pack16;

// Eight 16-bit values, converted pairwise by CVT.
template <float2 (*CVT)(unsigned)>
__device__ __forceinline__ void unpack8(uint4 w, float* f) {
    const float2 a = CVT(w.x), b = CVT(w.y), c = CVT(w.z), d = CVT(w.w);
    f[0] = a.x, f[1] = a.y, f[2] = b.x, f[3] = b.y, f[4] = c.x, f[5] = c.y, f[6] = d.x, f[7] = d.y;
}

template <>
struct Pack16<f16> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void unpack(uint4 w, float* f) { unpack8<half2_to_float2>(w, f); }
};

template <>
struct Pack16<bf16> {
    static constexpr int N = 8;
    static __device__ __forceinline__ void unpack(uint4 w, float* f) { unpack8<bf162_to_float2>(w, f); }
};

template <>
struct Pack16<float> {
    static constexpr int N = 4;
    static __device__ __forceinline__ void unpack(uint4 w, float* f) {
        f[0] = __uint_as_float(w.x), f[1] = __uint_as_float(w.y);
        f[2] = __uint_as_float(w.z), f[3] = __uint_as_float(w.w);
    }
};

// N consecutive floats at x (16-byte aligned) through L1.
template <int N>
__device__ __forceinline__ void load_x(const float* x, float* f) {
#pragma unroll
    for (int i = 0; i < N; i += 4) {
        const float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
        f[i] = v.x, f[i + 1] = v.y, f[i + 2] = v.z, f[i + 3] = v.w;
    }
}

// The folded norm's part of mul_mat_vec_fold_* (one column): y, the row's result in lane 0,
// times the norm's weight into rw, and the block's sum of y^2 (its warps' in order) into
// parts. Called by every thread of the block, rows past m included (they add nothing).
__device__ __forceinline__ void fold_rows(const GemvArgs& p, i64 row, float y) {
    __shared__ float part[GEMV_WARPS];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const NormFold* f = p.fold;
    if (lane == 0) {
        const bool live = row < p.m;
        if (live) f->rw[row] = y * f->w[row];
        part[warp] = live ? y * y : 0.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) s += part[w];
        f->parts[blockIdx.x] = s;
    }
}

// The total of mul_mat_vec_total_*, by every thread of block 0: the sum of the folded norm's
// block sums (in one order) and its factor 1 / sqrt(sum / n + eps), as rms_norm computes it.
__device__ __forceinline__ void fold_total(const GemvArgs& p) {
    __shared__ float scratch[WARP_SIZE];
    const NormFold* f = p.fold;
    float s = 0.0f;
    for (i64 i = threadIdx.x; i < f->count; i += blockDim.x) s += f->parts[i];
    s = block_sum(s, scratch);
    if (threadIdx.x == 0) *f->scale = 1.0f / sqrtf(s / f->n + f->eps);
}

// What a GEMV kernel adds to its rows: nothing, a folded norm's first part (fold_rows) or
// its total (fold_total).
enum class Fold { None, Rows, Total };

// One warp per row: row = blockIdx.x * GEMV_WARPS + warp, channel blockIdx.y (channel ch
// of b and dst, ch / ratio of a). vec requires a, a_nb1, a_nb2, b and b_nb2 multiples of
// 16 bytes.
template <typename T, Fold FOLD = Fold::None>
__device__ void gemv_rows(const GemvArgs& p) {
    pdl_launch_dependents();
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 row = blockIdx.x * (i64)GEMV_WARPS + threadIdx.x / WARP_SIZE;
    const i64 ch = blockIdx.y;
    if (row >= p.m) {  // the whole warp
        if constexpr (FOLD == Fold::Rows) fold_rows(p, row, 0.0f);
        if constexpr (FOLD == Fold::Total) {
            if (blockIdx.x == 0) fold_total(p);
        }
        return;
    }
    const char* a = p.a + row * p.a_nb1 + (ch / p.ratio) * p.a_nb2;
    const float* x = reinterpret_cast<const float*>(p.b + ch * p.b_nb2);
    constexpr int N = Pack16<T>::N;
    // 32-bit indices in the hot loop (the launcher checks k < 2^31).
    const int nv = p.vec ? (int)(p.k / N) : 0;
    const uint4* av = reinterpret_cast<const uint4*>(a);
    // Weights nothing in the plan writes: while the previous kernel finishes, pull the
    // first rounds of this row into L2 (one prefetch per 128-byte line) and load the
    // first round into registers; everything else waits for it.
    if (p.prefetch && lane % 8 == 0) {
#pragma unroll
        for (int u = 0; u < GEMV_PREFETCH; ++u) {
            const int v = lane + u * WARP_SIZE;
            if (v < nv) asm volatile("prefetch.global.L2 [%0];" ::"l"(av + v));
        }
    }
    // Rounds of GEMV_ROUND loads, double-buffered: the next round's loads are issued
    // before the current round is used.
    constexpr int U = GEMV_ROUND, STEP = GEMV_ROUND * WARP_SIZE;
    uint4 w[U];
    auto round = [&](int v0, uint4 (&r)[U]) {
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = v0 + u * WARP_SIZE;
            r[u] = v < nv ? load16(av + v) : make_uint4(0u, 0u, 0u, 0u);
        }
    };
    if (p.prefetch) round(lane, w);
    pdl_wait();
    if (!p.prefetch) round(lane, w);
    // One accumulator per load slot: U independent FMA chains.
    float acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = 0.0f;
    for (int v0 = lane; v0 < nv; v0 += STEP) {
        uint4 nx[U];
        round(v0 + STEP, nx);
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int v = v0 + u * WARP_SIZE;
            if (v < nv) {
                float wf[N], xf[N];
                Pack16<T>::unpack(w[u], wf);
                load_x<N>(x + v * N, xf);
#pragma unroll
                for (int i = 0; i < N; ++i) acc[u] += wf[i] * xf[i];
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) w[u] = nx[u];
    }
    for (i64 i = (i64)nv * N + lane; i < p.k; i += WARP_SIZE) acc[0] += load<T>(a + i * (i64)sizeof(T)) * x[i];
    float sum = 0.0f;
#pragma unroll
    for (int u = 0; u < U; ++u) sum += acc[u];
    sum = warp_sum(sum);
    if (lane == 0) {
        if (p.add) sum += reinterpret_cast<const float*>(p.add)[row];
        *reinterpret_cast<float*>(p.dst + ch * p.dst_nb2 + row * 4) = sum;
    }
    if constexpr (FOLD == Fold::Rows) fold_rows(p, row, sum);
    if constexpr (FOLD == Fold::Total) {
        if (blockIdx.x == 0) fold_total(p);
    }
}

// dot of 4 halves (8 bytes) with 4 floats.
__device__ __forceinline__ float dot_half4(uint2 w, float4 x) {
    const float2 f0 = half2_to_float2(w.x), f1 = half2_to_float2(w.y);
    return f0.x * x.x + f0.y * x.y + f1.x * x.z + f1.y * x.w;
}

// One warp per (group of P021_ROWS rows, channel), channels fastest, so the warps of a
// block read the same rows for consecutive channels. vec requires: a, a_nb1, a_nb2
// multiples of 8 bytes (4 halves), b and b_nb2 multiples of 16.
__device__ void gemv_short_f16(const GemvArgs& p) {
    pdl_enter();
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 w = blockIdx.x * (i64)(blockDim.x / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    const i64 groups = (p.m + P021_ROWS - 1) / P021_ROWS;
    if (w >= groups * p.channels) return;  // the whole warp
    const i64 ch = w % p.channels;
    const i64 row0 = (w / p.channels) * P021_ROWS;
    const char* a = p.a + row0 * p.a_nb1 + (ch / p.ratio) * p.a_nb2;
    const float* x = reinterpret_cast<const float*>(p.b + ch * p.b_nb2);
    float sums[P021_ROWS];
#pragma unroll
    for (int r = 0; r < P021_ROWS; ++r) sums[r] = 0.0f;
    i64 tail = 0;
    if (p.vec) {
        const i64 nv = p.k / 4;
        for (i64 v0 = 0; v0 < nv; v0 += WARP_SIZE) {
            const i64 v = v0 + lane;
            uint2 wv[P021_ROWS];
#pragma unroll
            for (int r = 0; r < P021_ROWS; ++r) {
                wv[r] = v < nv && row0 + r < p.m ? __ldg(reinterpret_cast<const uint2*>(a + r * p.a_nb1) + v)
                                                 : make_uint2(0u, 0u);
            }
            const float4 xv = v < nv ? __ldg(reinterpret_cast<const float4*>(x) + v) : make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int r = 0; r < P021_ROWS; ++r) sums[r] += dot_half4(wv[r], xv);
        }
        tail = nv * 4;
    }
#pragma unroll
    for (int r = 0; r < P021_ROWS; ++r) {
        if (row0 + r < p.m) {
            for (i64 i = tail + lane; i < p.k; i += WARP_SIZE) sums[r] += load<f16>(a + r * p.a_nb1 + i * 2) * x[i];
        }
        sums[r] = warp_sum(sums[r]);
    }
    if (lane < P021_ROWS && row0 + lane < p.m) {
        float s = sums[0];
#pragma unroll
        for (int r = 1; r < P021_ROWS; ++r) s = lane == r ? sums[r] : s;
        *reinterpret_cast<float*>(p.dst + ch * p.dst_nb2 + (row0 + lane) * 4) = s;
    }
}

// The register cap of __launch_bounds__ (minimum 8 blocks per SM) makes ptxas issue all
// loads of a round before the first use (checked in the SASS: LDG.E.128 / LDG.E.64 in a
// row); without it ptxas interleaves them with the arithmetic and keeps one in flight.
// GEMV_WARPS * 32 and P021_THREADS are the blocks the launcher uses.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_f16(const GemvArgs p) { gemv_rows<f16>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_bf16(const GemvArgs p) { gemv_rows<bf16>(p); }
// F32 rows need more registers per 16 bytes (4 lanes of x per weight, i64 indices): a
// cap of 6 blocks per SM instead of 8 keeps them from spilling.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 6) mul_mat_vec_f32(const GemvArgs p) { gemv_rows<float>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_fold_f16(const GemvArgs p) { gemv_rows<f16, Fold::Rows>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_fold_bf16(const GemvArgs p) { gemv_rows<bf16, Fold::Rows>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 6) mul_mat_vec_fold_f32(const GemvArgs p) { gemv_rows<float, Fold::Rows>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_total_f16(const GemvArgs p) { gemv_rows<f16, Fold::Total>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_total_bf16(const GemvArgs p) { gemv_rows<bf16, Fold::Total>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 6) mul_mat_vec_total_f32(const GemvArgs p) { gemv_rows<float, Fold::Total>(p); }
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE, 8) mul_mat_vec_nc_f16_f32(const GemvArgs p) { gemv_rows<f16>(p); }
extern "C" __global__ void __launch_bounds__(P021_THREADS, 8) mul_mat_p021_f16_f32(const GemvArgs p) { gemv_short_f16(p); }
