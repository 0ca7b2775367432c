// argmax: the index of the largest element of each row as I32, one row per block. Ties go
// to the lowest index; a row holding a NaN or an infinity gives -1 (like the CPU), so a
// caller that reads only the argmax still sees non-finite logits.
#include "common.cuh"

#define ARGMAX_LOADS 8

// Whether candidate (v, i) beats (bv, bi); an index of -1 means "nothing found yet".
__device__ __forceinline__ bool beats(float v, int i, float bv, int bi) {
    return i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi));
}

template <typename T>
__device__ void argmax(const ArgmaxArgs& p) {
    pdl_enter();
    __shared__ float s_v[32];
    __shared__ int s_i[32];
    const RowIndex r = row_index(p.src.ne, blockIdx.x);
    const char* x = at(p.src, 0, r.i1, r.i2, r.i3);
    const i64 ne0 = p.src.ne[0];
    float bv = 0.0f;
    int bi = -1;
    int bad = 0;
    // ARGMAX_LOADS elements a thread per round, all loaded before the first is compared
    // (a long row, a vocabulary of logits, is otherwise one dependent load at a time)
    const i64 stride = blockDim.x, nb0 = p.src.nb[0];
    for (i64 base = threadIdx.x; base < ne0; base += ARGMAX_LOADS * stride) {
        float vs[ARGMAX_LOADS];
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; ++u) {
            const i64 i0 = base + u * stride;
            vs[u] = i0 < ne0 ? load<T>(x + i0 * nb0) : 0.0f;
        }
#pragma unroll
        for (int u = 0; u < ARGMAX_LOADS; ++u) {
            const i64 i0 = base + u * stride;
            if (i0 >= ne0) break;
            const float v = vs[u];
            bad |= !isfinite(v);
            if (!isnan(v) && (bi < 0 || v > bv)) {  // indices rise, so ties keep the first
                bv = v;
                bi = (int)i0;
            }
        }
    }
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        const float v = __shfl_xor_sync(FULL_MASK, bv, o);
        const int i = __shfl_xor_sync(FULL_MASK, bi, o);
        if (beats(v, i, bv, bi)) {
            bv = v;
            bi = i;
        }
    }
    if (blockDim.x > WARP_SIZE) {
        const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
        if (lane == 0) {
            s_v[warp] = bv;
            s_i[warp] = bi;
        }
        __syncthreads();
        if (warp == 0) {
            const bool has = lane < (int)(blockDim.x / WARP_SIZE);
            bv = has ? s_v[lane] : 0.0f;
            bi = has ? s_i[lane] : -1;
#pragma unroll
            for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
                const float v = __shfl_xor_sync(FULL_MASK, bv, o);
                const int i = __shfl_xor_sync(FULL_MASK, bi, o);
                if (beats(v, i, bv, bi)) {
                    bv = v;
                    bi = i;
                }
            }
        }
    }
    // Every thread of the block reaches this (the branch above is uniform).
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0) {
        *reinterpret_cast<int*>(at(p.dst, r.i1, r.i2, r.i3, 0)) = bad ? -1 : (bi < 0 ? 0 : bi);
    }
}

extern "C" __global__ void argmax_f32(const ArgmaxArgs p) { argmax<float>(p); }
extern "C" __global__ void argmax_f16(const ArgmaxArgs p) { argmax<f16>(p); }
extern "C" __global__ void argmax_bf16(const ArgmaxArgs p) { argmax<bf16>(p); }
