// mul_mat_id (a mixture of experts' products): dst[:, i, t] = w[:, :, ids[i, t]]^T b[:, i % b1, t]
// for weights w [k, m, n_expert] of any weight type, F32 inputs b [k, b1, n_tokens] (dense
// along dim 0) and I32 ids [n_used, n_tokens]. Two launches:
//   - group_by_expert (one block): the columns j = i + n_used * t grouped by expert into
//     scratch (offsets[e] .. offsets[e + 1] index cols); an id outside 0..n_expert is
//     recorded in the index-error buffer and its column zero-filled. With tile_bn, also the
//     list of each expert's columns in tiles of tile_bn for mmq_id_* (cuda/mmq.cu), which
//     then takes the product on int8 tensor cores from a Q8_1 copy of the inputs;
//   - mul_mat_id_<type>: a block per (tile of MMID_ROWS rows, expert, chunk z); it walks
//     its expert's columns MMID_COLS at a time (chunks z, z + chunks, ...) and each warp
//     takes a row at a time: every weight element is read and dequantized once per chunk
//     and dotted with the chunk's columns (a decode step's k experts: one chunk each, only
//     the selected experts' rows read; a prefill chunk: each expert's rows read once per
//     MMID_COLS of its tokens). A block whose expert has no columns returns at once.
// A decode step of block-quantized experts takes neither: mul_mat_vec_id_q*_<type>
// (cuda/mul_mat_q.cu) runs each column on its expert's rows, the id read in the kernel.
#include "quant.cuh"
#include "quant_lowbit.cuh"

// Elements 8g..8g+7 of a row of a block type (the ggml layout, nb0 the block's bytes).
template <typename Q>
struct QuantRow {
    static __device__ __forceinline__ void deq8(const char* row, i64 nb0, i64 g, i64, float* v) {
        Q::deq8(row + (g * 8 / Q::QK) * nb0, (int)(g % (Q::QK / 8)), v);
    }
};

// Elements 8g..8g+7 of a row of a float type (zeros past k).
template <typename T>
struct FloatRow {
    static __device__ __forceinline__ void deq8(const char* row, i64 nb0, i64 g, i64 k, float* v) {
#pragma unroll
        for (int u = 0; u < 8; ++u) v[u] = g * 8 + u < k ? load<T>(row + (g * 8 + u) * nb0) : 0.0f;
    }
};

// The tiles of tile_bn columns of each expert (mmq_id_*), in expert order: thread 0 lists
// them (a prefill chunk's few hundred), the others mark the rest of the list empty.
__device__ void expert_tiles(const MulMatIdArgs& p, const int* start, int n_expert) {
    __shared__ int listed;
    if (threadIdx.x == 0) {
        int x = 0;
        for (int e = 0; e < n_expert; ++e) {
            for (int c = start[e]; c < start[e + 1]; c += (int)p.tile_bn, ++x) {
                p.tile_expert[x] = e;
                p.tile_first[x] = c;
            }
        }
        listed = x;
    }
    __syncthreads();
    for (int x = listed + threadIdx.x; x < p.tiles; x += blockDim.x) p.tile_expert[x] = -1;
}

extern "C" __global__ void __launch_bounds__(MMID_GROUP_THREADS) group_by_expert(const MulMatIdArgs p) {
    pdl_enter();
    __shared__ int count[MMID_MAX_EXPERTS];
    __shared__ int start[MMID_MAX_EXPERTS + 1];
    const int n_expert = (int)p.w.ne[2], n_used = (int)p.ids.ne[0];
    const int n = n_used * (int)p.ids.ne[1];
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int id = *reinterpret_cast<const int*>(at(p.ids, j % n_used, j / n_used, 0, 0));
        if (id >= 0 && id < n_expert) {
            atomicAdd(&count[id], 1);
        } else {
            record_index_error(p.err, p.tag, id, j / n_used, n_expert);
            char* d = at(p.dst, 0, j % n_used, j / n_used, 0);
            for (i64 r = 0; r < p.dst.ne[0]; ++r) store<float>(d + r * p.dst.nb[0], 0.0f);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int s = 0;
        for (int e = 0; e < n_expert; ++e) {
            start[e] = s;
            s += count[e];
        }
        start[n_expert] = s;
    }
    __syncthreads();
    for (int e = threadIdx.x; e <= n_expert; e += blockDim.x) p.offsets[e] = start[e];
    if (p.tile_bn > 0) expert_tiles(p, start, n_expert);
    for (int e = threadIdx.x; e < n_expert; e += blockDim.x) count[e] = 0;
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const int id = *reinterpret_cast<const int*>(at(p.ids, j % n_used, j / n_used, 0, 0));
        if (id >= 0 && id < n_expert) p.cols[start[id] + atomicAdd(&count[id], 1)] = j;
    }
}

template <typename R>
__device__ void mul_mat_id(const MulMatIdArgs& p) {
    pdl_enter();
    const int e = blockIdx.y;
    const int begin = p.offsets[e], end = p.offsets[e + 1];
    const i64 k = p.w.ne[0], m = p.w.ne[1];
    const int n_used = (int)p.ids.ne[0], b1 = (int)p.b.ne[1];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const i64 row0 = (i64)blockIdx.x * MMID_ROWS;
    const i64 row_end = min(row0 + MMID_ROWS, m);
    const i64 groups = (k + 7) / 8;
    for (int c0 = begin + (int)blockIdx.z * MMID_COLS; c0 < end; c0 += (int)p.chunks * MMID_COLS) {
        const int nc = min(MMID_COLS, end - c0);
        const float* x[MMID_COLS];
        int col[MMID_COLS];
#pragma unroll
        for (int c = 0; c < MMID_COLS; ++c) {
            col[c] = p.cols[c0 + min(c, nc - 1)];
            const int i = col[c] % n_used, t = col[c] / n_used;
            x[c] = reinterpret_cast<const float*>(at(p.b, 0, i % b1, t, 0));
        }
        for (i64 r = row0 + warp; r < row_end; r += MMID_THREADS / WARP_SIZE) {
            const char* row = at(p.w, 0, r, e, 0);
            float acc[MMID_COLS] = {};
            for (i64 g = lane; g < groups; g += WARP_SIZE) {
                float v[8];
                R::deq8(row, p.w.nb[0], g, k, v);
                const int valid = (int)min((i64)8, k - g * 8);
#pragma unroll
                for (int c = 0; c < MMID_COLS; ++c) {
                    if (c < nc) {
                        const float* xc = x[c] + g * 8;
                        float s = 0.0f;
#pragma unroll
                        for (int u = 0; u < 8; ++u) {
                            if (u < valid) s += v[u] * __ldg(xc + u);
                        }
                        acc[c] += s;
                    }
                }
            }
#pragma unroll
            for (int c = 0; c < MMID_COLS; ++c) {
                const float s = warp_sum(acc[c]);
                if (c < nc && lane == 0) {
                    store<float>(at(p.dst, r, col[c] % n_used, col[c] / n_used, 0), s);
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_f32(const MulMatIdArgs p) { mul_mat_id<FloatRow<float>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_f16(const MulMatIdArgs p) { mul_mat_id<FloatRow<f16>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_bf16(const MulMatIdArgs p) { mul_mat_id<FloatRow<bf16>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q4_0(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ4_0>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q4_1(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ4_1>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q5_0(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ5_0>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q5_1(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ5_1>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q8_0(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ8_0>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q4_k(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ4_K>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q5_k(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ5_K>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q6_k(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ6_K>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q2_k(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ2_K>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_q3_k(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockQ3_K>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq4_nl(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ4_NL>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq4_xs(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ4_XS>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq2_xxs(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ2_XXS>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq2_xs(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ2_XS>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq2_s(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ2_S>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq3_xxs(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ3_XXS>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq3_s(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ3_S>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq1_s(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ1_S>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_iq1_m(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockIQ1_M>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_tq1_0(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockTQ1_0>>(p); }
extern "C" __global__ void __launch_bounds__(MMID_THREADS) mul_mat_id_tq2_0(const MulMatIdArgs p) { mul_mat_id<QuantRow<BlockTQ2_0>>(p); }
