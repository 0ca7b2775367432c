// Row normalizations, one row per block: a single warp for short rows,
// a larger block with a shared-memory reduction for longer rows (the launcher picks
// blockDim.x, a multiple of 32). Each thread handles elements tid, tid + blockDim.x, ...
// in every pass, and the reduction completes before the writing pass, so in place is safe.
//   rms_norm: x / sqrt(mean(x^2) + eps)
//   norm:     (x - mean) / sqrt(var + eps), mean and variance by Welford's method, per
//             thread and then merged across the warp and the block.
#include "quant.cuh"

#include <type_traits>

// No weight: rms_norm alone.
struct NoWeight {};

// Weight elements a thread fetches into registers before the row's sum is known.
#define NORM_EARLY_W 4

// Row blockIdx.x of src, normalized into dst, times w[i0] (of type W) unless W is
// NoWeight. x and dst of type T. When q8 is not null, the row is also written as split
// Q8_1 activations at q8 + blockIdx.x * q8_nb1 (store_act: every warp quantizes whole
// 32-element blocks, which needs ne0 % 32 == 0, as the launcher ensures). The caller has
// let its successor launch; this waits for its predecessor, after fetching the weight
// into registers first when w_early says the weight is read-only and the row short
// enough (NORM_EARLY_W elements a thread): that read then overlaps the previous kernel.
template <typename T, typename W>
__device__ void rms_rows(const Tensor4& src, const Tensor4& dst, const Tensor4& w, float eps,
                         char* q8 = nullptr, i64 q8_nb1 = 0, i64 q8_layout = 0, bool w_early = false) {
    __shared__ float scratch[32];
    constexpr bool weighted = !std::is_same<W, NoWeight>::value;
    const i64 ne0 = src.ne[0];
    const bool early = weighted && w_early && ne0 <= NORM_EARLY_W * (i64)blockDim.x;
    float wv[NORM_EARLY_W];
    if constexpr (weighted) {
        if (early) {
#pragma unroll
            for (int k = 0; k < NORM_EARLY_W; ++k) {
                const i64 i0 = threadIdx.x + k * (i64)blockDim.x;
                wv[k] = i0 < ne0 ? load<W>(w.data + i0 * w.nb[0]) : 0.0f;
            }
        }
    }
    pdl_wait();
    const RowIndex r = row_index(src.ne, blockIdx.x);
    const char* x = at(src, 0, r.i1, r.i2, r.i3);
    char* y = at(dst, 0, r.i1, r.i2, r.i3);
    float ss = 0.0f;
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        const float v = load<T>(x + i0 * src.nb[0]);
        ss += v * v;
    }
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)ne0 + eps);
    // element i0 times its weight wt (ignored for NoWeight)
    auto emit = [&](i64 i0, float wt) {
        float v = load<T>(x + i0 * src.nb[0]) * scale;
        if constexpr (weighted) v *= wt;
        store<T>(y + i0 * dst.nb[0], v);
        if (q8 != nullptr) store_act(v, q8 + blockIdx.x * q8_nb1, ne0, i0 / 32, i0 % 32, q8_layout);
    };
    if (early) {
#pragma unroll
        for (int k = 0; k < NORM_EARLY_W; ++k) {
            const i64 i0 = threadIdx.x + k * (i64)blockDim.x;
            if (i0 < ne0) emit(i0, wv[k]);
        }
        return;
    }
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        float wt = 1.0f;
        if constexpr (weighted) wt = load<W>(w.data + i0 * w.nb[0]);
        emit(i0, wt);
    }
}

// 4 consecutive weights (16-byte aligned for float, 8-byte for the 16-bit types).
template <typename W>
__device__ __forceinline__ float4 load4(const char* p);
template <>
__device__ __forceinline__ float4 load4<float>(const char* p) { return *reinterpret_cast<const float4*>(p); }
template <>
__device__ __forceinline__ float4 load4<f16>(const char* p) {
    const __half2* h = reinterpret_cast<const __half2*>(p);
    const float2 a = __half22float2(h[0]), b = __half22float2(h[1]);
    return make_float4(a.x, a.y, b.x, b.y);
}
template <>
__device__ __forceinline__ float4 load4<bf16>(const char* p) {
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(p);
    const float2 a = __bfloat1622float2(h[0]), b = __bfloat1622float2(h[1]);
    return make_float4(a.x, a.y, b.x, b.y);
}

// rms_rows for rows the launcher found vectorizable (NormMulArgs::vec): dense F32 rows of
// ne0 % 4 == 0 elements in 16-byte aligned words, a dense aligned weight of type W, and at
// most NORM_VEC groups of 4 a thread. Each thread loads its groups with 16-byte loads, all
// in flight together, and keeps them in registers through the reduction (no second read
// of the row); with q8, 8 lanes quantize a 32-element block together (store_act4).
template <typename W, int LAYOUT>
__device__ void rms_rows_vec(const NormMulArgs& p) {
    __shared__ float scratch[32];
    const int ng = (int)(p.src.ne[0] / 4);
    const int stride = (int)blockDim.x;
    float4 wv[NORM_VEC], xv[NORM_VEC];
    auto load_w = [&]() {
#pragma unroll
        for (int k = 0; k < NORM_VEC; ++k) {
            const int g = threadIdx.x + k * stride;
            wv[k] = g < ng ? load4<W>(p.w.data + 4 * (i64)g * sizeof(W)) : make_float4(0.f, 0.f, 0.f, 0.f);
        }
    };
    if (p.w_early) load_w();
    pdl_wait();
    if (!p.w_early) load_w();
    const RowIndex r = row_index(p.src.ne, blockIdx.x);
    const float4* x = reinterpret_cast<const float4*>(at(p.src, 0, r.i1, r.i2, r.i3));
    float4* y = reinterpret_cast<float4*>(at(p.dst, 0, r.i1, r.i2, r.i3));
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < NORM_VEC; ++k) {
        const int g = threadIdx.x + k * stride;
        xv[k] = g < ng ? x[g] : make_float4(0.f, 0.f, 0.f, 0.f);
        ss += xv[k].x * xv[k].x + xv[k].y * xv[k].y + xv[k].z * xv[k].z + xv[k].w * xv[k].w;
    }
    ss = block_sum(ss, scratch);
    const float scale = 1.0f / sqrtf(ss / (float)p.src.ne[0] + p.eps);
    char* col = p.q8 != nullptr ? p.q8 + blockIdx.x * p.q8_nb1 : nullptr;
#pragma unroll
    for (int k = 0; k < NORM_VEC; ++k) {
        if (k * stride + (int)(threadIdx.x & ~(WARP_SIZE - 1)) >= ng) break;  // the whole warp
        const int g = threadIdx.x + k * stride;
        const float4 v = make_float4(xv[k].x * scale * wv[k].x, xv[k].y * scale * wv[k].y,
                                     xv[k].z * scale * wv[k].z, xv[k].w * scale * wv[k].w);
        if (g < ng) y[g] = v;
        if (col != nullptr) store_act4(v, col, p.src.ne[0], g, g < ng, LAYOUT);
    }
}

template <typename T>
__device__ void rms_norm(const NormArgs& p) {
    pdl_launch_dependents();
    rms_rows<T, NoWeight>(p.src, p.dst, p.src, p.eps);
}

struct Welford {
    float n, mean, m2;
};

// Chan et al.'s merge of two partial (count, mean, sum of squared deviations) states.
__device__ __forceinline__ Welford welford_merge(Welford a, Welford b) {
    const float n = a.n + b.n;
    if (b.n == 0.0f) return a;
    if (a.n == 0.0f) return b;
    const float d = b.mean - a.mean;
    const float fb = b.n / n;
    Welford w;
    w.n = n;
    w.mean = a.mean + d * fb;
    w.m2 = a.m2 + b.m2 + d * d * a.n * fb;
    return w;
}

__device__ __forceinline__ Welford welford_warp(Welford w) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        Welford other;
        other.n = __shfl_xor_sync(FULL_MASK, w.n, o);
        other.mean = __shfl_xor_sync(FULL_MASK, w.mean, o);
        other.m2 = __shfl_xor_sync(FULL_MASK, w.m2, o);
        w = welford_merge(w, other);
    }
    // The merge is not commutative in floating point: take lane 0's result everywhere.
    w.n = __shfl_sync(FULL_MASK, w.n, 0);
    w.mean = __shfl_sync(FULL_MASK, w.mean, 0);
    w.m2 = __shfl_sync(FULL_MASK, w.m2, 0);
    return w;
}

template <typename T>
__device__ void norm(const NormArgs& p) {
    pdl_enter();
    __shared__ float s_n[32], s_mean[32], s_m2[32];
    const RowIndex r = row_index(p.src.ne, blockIdx.x);
    const char* x = at(p.src, 0, r.i1, r.i2, r.i3);
    char* y = at(p.dst, 0, r.i1, r.i2, r.i3);
    const i64 ne0 = p.src.ne[0];
    Welford w = {0.0f, 0.0f, 0.0f};
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        const float v = load<T>(x + i0 * p.src.nb[0]);
        w.n += 1.0f;
        const float d = v - w.mean;
        w.mean += d / w.n;
        w.m2 += d * (v - w.mean);
    }
    w = welford_warp(w);
    if (blockDim.x > WARP_SIZE) {
        const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
        if (lane == 0) {
            s_n[warp] = w.n;
            s_mean[warp] = w.mean;
            s_m2[warp] = w.m2;
        }
        __syncthreads();
        if (lane < (int)(blockDim.x / WARP_SIZE)) {
            w.n = s_n[lane];
            w.mean = s_mean[lane];
            w.m2 = s_m2[lane];
        } else {
            w.n = w.mean = w.m2 = 0.0f;
        }
        w = welford_warp(w);
    }
    const float scale = 1.0f / sqrtf(w.m2 / (float)ne0 + p.eps);
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        store<T>(y + i0 * p.dst.nb[0], (load<T>(x + i0 * p.src.nb[0]) - w.mean) * scale);
    }
}

// rms_norm(x) * w with w [ne0] broadcast over rows (the norm and its weight in one pass;
// the CUDA backend fuses the pair when the norm has no other reader), and its Q8_1 copy
// when the next step is a decode product that would quantize it. x and dst F32.
template <typename W>
__device__ void rms_norm_mul(const NormMulArgs& p) {
    pdl_launch_dependents();
    if (p.vec) {
        // the layout as a constant: the store's offsets without a select
        if (p.q8_layout == ACT_PAIRS) {
            rms_rows_vec<W, ACT_PAIRS>(p);
        } else if (p.q8_layout == ACT_F16) {
            rms_rows_vec<W, ACT_F16>(p);
        } else {
            rms_rows_vec<W, ACT_BLOCKS>(p);
        }
    } else {
        rms_rows<float, W>(p.src, p.dst, p.w, p.eps, p.q8, p.q8_nb1, p.q8_layout, p.w_early != 0);
    }
}

extern "C" __global__ void rms_norm_mul_f32_f32(const NormMulArgs p) { rms_norm_mul<float>(p); }
extern "C" __global__ void rms_norm_mul_f32_f16(const NormMulArgs p) { rms_norm_mul<f16>(p); }
extern "C" __global__ void rms_norm_mul_f32_bf16(const NormMulArgs p) { rms_norm_mul<bf16>(p); }
extern "C" __global__ void rms_norm_f32(const NormArgs p) { rms_norm<float>(p); }
extern "C" __global__ void rms_norm_f16(const NormArgs p) { rms_norm<f16>(p); }
extern "C" __global__ void rms_norm_bf16(const NormArgs p) { rms_norm<bf16>(p); }
extern "C" __global__ void norm_f32(const NormArgs p) { norm<float>(p); }
extern "C" __global__ void norm_f16(const NormArgs p) { norm<f16>(p); }
extern "C" __global__ void norm_bf16(const NormArgs p) { norm<bf16>(p); }
