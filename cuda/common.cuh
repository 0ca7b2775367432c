// Shared device helpers of every kernel module: the kernel argument structs (args.cuh, the
// one definition that build.rs also turns into Rust), element loads and stores for float /
// half / nv_bfloat16 with f32 arithmetic, warp and block reductions, and the index-error
// record of get_rows / set_rows / paged_attn.
//
// Conventions: every tensor is a Tensor4 (first element, ne[4] element counts, nb[4] byte
// strides, like ggml); indices and strides are 64-bit; kernels that handle a row with a
// whole warp or block read every element of the row they need before any thread writes
// it, so a plan may run them in place (dst == src0 with the same layout).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#include <type_traits>

#include "args.cuh"

typedef __half f16;
typedef __nv_bfloat16 bf16;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------
// Element access.

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(f16 x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(bf16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_f32(float x);
template <>
__device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <>
__device__ __forceinline__ f16 from_f32<f16>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float x) { return __float2bfloat16_rn(x); }

// Converts between element types (through f32 for floats; I32 copies as is).
template <typename D, typename S>
__device__ __forceinline__ D convert(S x) { return from_f32<D>(to_f32(x)); }
template <>
__device__ __forceinline__ int convert<int, int>(int x) { return x; }

template <typename T>
__device__ __forceinline__ float load(const char* p) { return to_f32(*reinterpret_cast<const T*>(p)); }

template <typename T>
__device__ __forceinline__ void store(char* p, float v) { *reinterpret_cast<T*>(p) = from_f32<T>(v); }

__device__ __forceinline__ char* at(const Tensor4& t, i64 i0, i64 i1, i64 i2, i64 i3) {
    return t.data + i0 * t.nb[0] + i1 * t.nb[1] + i2 * t.nb[2] + i3 * t.nb[3];
}

// The row (i1, i2, i3) of flat row number r of shape ne.
struct RowIndex {
    i64 i1, i2, i3;
};
// 32-bit divisions when r and the dims fit (a 64-bit division is several times the
// instructions, and the elementwise kernels find a row per thread).
__device__ __forceinline__ RowIndex row_index(const i64 ne[4], i64 r) {
    RowIndex ri;
    if (r <= UINT32_MAX && ne[1] <= UINT32_MAX && ne[2] <= UINT32_MAX) {
        const unsigned n1 = (unsigned)ne[1], n2 = (unsigned)ne[2], q = (unsigned)r / n1;
        ri.i1 = (unsigned)r - q * n1;
        ri.i2 = q % n2;
        ri.i3 = q / n2;
        return ri;
    }
    ri.i1 = r % ne[1];
    const i64 q = r / ne[1];
    ri.i2 = q % ne[2];
    ri.i3 = q / ne[2];
    return ri;
}

// Visits every element of shape ne: rows on grid.y (strided), dim 0 on grid.x * block.x
// (strided); each element is visited by exactly one thread. row(i1, i2, i3) is called
// once per row and returns the element function e(i0), so that a row's addresses (and any
// broadcast index of the row) are found once, not per element.
template <typename R>
__device__ __forceinline__ void for_each_row(const i64 ne[4], R row) {
    const i64 rows = ne[1] * ne[2] * ne[3];
    const i64 first = blockIdx.x * (i64)blockDim.x + threadIdx.x, step = (i64)gridDim.x * blockDim.x;
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const RowIndex ri = row_index(ne, r);
        const auto e = row(ri.i1, ri.i2, ri.i3);
        for (i64 i0 = first; i0 < ne[0]; i0 += step) e(i0);
    }
}

// 8 consecutive elements of type T of a row at `row` (the element at e0 is out[0]), as
// f32: 16-byte loads when vec (the 8 elements 16-byte aligned), element loads otherwise.
// fattn_common.cuh specializes it for the quantized cache types.
template <typename T>
__device__ __forceinline__ void load8(const char* row, int e0, bool vec, float out[8]) {
    const T* p = reinterpret_cast<const T*>(row) + e0;
    if (vec) {
        if constexpr (sizeof(T) == 4) {
            const float4 a = *reinterpret_cast<const float4*>(p);
            const float4 b = *reinterpret_cast<const float4*>(p + 4);
            out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
            out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
        } else {
            const uint4 raw = *reinterpret_cast<const uint4*>(p);
            const T* h = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int i = 0; i < 8; ++i) out[i] = to_f32(h[i]);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = to_f32(p[i]);
    }
}

// 8 f32 values stored as 8 consecutive T at the 16-byte aligned p: 16-byte stores.
template <typename T>
__device__ __forceinline__ void store8(char* p, const float* v) {
    constexpr int W = 16 / sizeof(T);  // elements per 16 bytes
#pragma unroll
    for (int w = 0; w < 8 / W; ++w) {
        uint4 u;
        T* e = reinterpret_cast<T*>(&u);
#pragma unroll
        for (int i = 0; i < W; ++i) e[i] = from_f32<T>(v[w * W + i]);
        *reinterpret_cast<uint4*>(p + 16 * w) = u;
    }
}

// ---------------------------------------------------------------------------------------
// Programmatic dependent launch (sm_90+). The backend launches every plan kernel allowing
// the next one to start before it ends; each kernel first lets its own successor launch,
// then waits for its predecessor to complete (and its writes to be visible) before it
// touches any memory a previous kernel may write. Waiting on a kernel launched without
// the attribute, or on an older GPU, does nothing.

// Lets the next kernel of the stream launch (it still waits for this one to complete).
__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the previous kernel of the stream has completed and its writes are visible.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Both, at the start of a kernel that reads nothing before its predecessor is done.
__device__ __forceinline__ void pdl_enter() {
    pdl_launch_dependents();
    pdl_wait();
}

// ---------------------------------------------------------------------------------------
// Asynchronous copies to shared memory.

// 16 bytes from global src to shared dst (both 16-byte aligned): an asynchronous copy
// (cp.async, sm_80+; the caller waits with stage_wait) or a load and a store.
__device__ __forceinline__ void copy16(char* dst, const char* src) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d), "l"(src) : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = __ldg(reinterpret_cast<const uint4*>(src));
#endif
}

// Closes the group of asynchronous copies issued so far.
__device__ __forceinline__ void stage_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

// Waits until at most PENDING groups of this lane's copies are in flight.
template <int PENDING>
__device__ __forceinline__ void stage_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
#endif
}

// 16 bytes from global src to shared dst, or 16 zero bytes when !valid (src is then not
// read, but must still be a mapped address): an asynchronous copy (cp.async with a source
// size of 0 fills zeros) on sm_80+, a load and a store before.
__device__ __forceinline__ void copy16_or_zero(char* dst, const char* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
#else
    *reinterpret_cast<uint4*>(dst) = valid ? __ldg(reinterpret_cast<const uint4*>(src)) : make_uint4(0, 0, 0, 0);
#endif
}

// ---------------------------------------------------------------------------------------
// Reductions. Block versions need blockDim.x to be a multiple of 32 (at most 1024), must be
// called by every thread of the block, return the result in every thread, and may be
// called again with the same `scratch` (32 entries of shared memory).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

// max(a, b), NaN when either is NaN (IEEE 754-2019 maximum). fmaxf returns the other
// operand, so a reduction built on it would pass over a NaN and a row holding one would
// come out finite; PTX's max.NaN (sm_80 on) is the same single instruction.
__device__ __forceinline__ float fmax_nan(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
#else
    return a != a || b != b ? a + b : fmaxf(a, b);
#endif
}

// The warp's largest v, NaN when some lane's v is NaN.
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmax_nan(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ int warp_min(int v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = min(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

__device__ __forceinline__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    if (blockDim.x == WARP_SIZE) return v;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    __syncthreads();  // a previous reduction may still be reading scratch
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP_SIZE) ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    v = warp_max(v);
    if (blockDim.x == WARP_SIZE) return v;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP_SIZE) ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// The factor of a norm folded into the products around it (NormFold in args.cuh), or 1
// when there is none.
__device__ __forceinline__ float fold_scale(const float* scale) {
    return scale == nullptr ? 1.0f : *scale;
}

// Records the first bad index of a run (later ones are dropped until the host clears it).
__device__ __forceinline__ void record_index_error(IndexError* e, i64 tag, i64 index, i64 position,
                                                   i64 limit) {
    if (atomicCAS(&e->flag, 0, 1) == 0) {
        e->tag = tag;
        e->index = index;
        e->position = position;
        e->limit = limit;
    }
}

// The index (i0, i1, i2, i3) of element i of a row-major walk over ne: 32-bit divisions
// when i and the dims fit (row_index), since a kernel that finds every element's index
// this way spends most of its time in 64-bit divisions otherwise.
__device__ __forceinline__ void unflatten(const i64 ne[4], i64 i, i64 idx[4]) {
    if (i <= UINT32_MAX && ne[0] <= UINT32_MAX) {
        const unsigned u = (unsigned)i, n0 = (unsigned)ne[0], q = u / n0;
        idx[0] = u - q * n0;
        const RowIndex r = row_index(ne, q);
        idx[1] = r.i1;
        idx[2] = r.i2;
        idx[3] = r.i3;
        return;
    }
    idx[0] = i % ne[0];
    i /= ne[0];
    idx[1] = i % ne[1];
    i /= ne[1];
    idx[2] = i % ne[2];
    idx[3] = i / ne[2];
}

// i % n for a broadcast index (n >= 1): no division where n is 1, a 32-bit one where both fit.
__device__ __forceinline__ i64 wrap_index(i64 i, i64 n) {
    if (n == 1) return 0;
    if (i <= UINT32_MAX && n <= UINT32_MAX) return (unsigned)i % (unsigned)n;
    return i % n;
}

// The dst row of source row (i1, i2, i3) of a set_rows: ids[i1, i2 % .., i3 % ..] (ids
// I32 [n, i2, i3], broadcast over dims 2 and 3), or -1 for an id outside 0..dst.ne[1]
// (recorded when `report`: once per source row, by its first element or block).
__device__ __forceinline__ int set_row_id(const Tensor4& ids, const Tensor4& dst, IndexError* err, i64 tag,
                                          i64 i1, i64 i2, i64 i3, bool report) {
    const int id = *reinterpret_cast<const int*>(at(ids, i1, wrap_index(i2, ids.ne[1]), wrap_index(i3, ids.ne[2]), 0));
    if (id < 0 || id >= dst.ne[1]) {
        if (report) record_index_error(err, tag, id, i1, dst.ne[1]);
        return -1;
    }
    return id;
}

// Element i (row-major over src.ne = [ne0, n, ne2, ne3]) of a set_rows: src (type S; F32
// sources times `scale`) to row set_row_id of dst (type D); an element of a bad id's row is
// skipped.
template <typename S, typename D>
__device__ __forceinline__ void set_row_element(const Tensor4& src, const Tensor4& ids,
                                                const Tensor4& dst, IndexError* err, i64 tag,
                                                i64 i, float scale = 1.0f) {
    i64 ix[4];
    unflatten(src.ne, i, ix);
    const int id = set_row_id(ids, dst, err, tag, ix[1], ix[2], ix[3], ix[0] == 0);
    if (id < 0) return;
    S x = *reinterpret_cast<const S*>(at(src, ix[0], ix[1], ix[2], ix[3]));
    if constexpr (std::is_same<S, float>::value) x *= scale;
    *reinterpret_cast<D*>(at(dst, ix[0], id, ix[2], ix[3])) = convert<D>(x);
}

// ---------------------------------------------------------------------------------------
// F16 tensor cores (attention, cuda/fattn*.cu; batched products, cuda/mmh.cu).

// d += a * b for one m16n8k16 tile: F16 inputs, F32 accumulation. Fragment layout (g =
// lane / 4, t = lane % 4): a[0] rows g, cols 2t..2t+1; a[1] row g + 8; a[2] cols + 8;
// a[3] both; b[0] k rows 2t..2t+1 of col g, b[1] k rows + 8; d[0..1] row g, cols
// 2t..2t+1, d[2..3] row g + 8.
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

// Four 8x8 matrices of 16-bit elements from shared memory (ldmatrix.x4): lanes 8i..8i+7
// give the row addresses of matrix i (16-byte aligned), and each lane receives, of every
// matrix, row lane / 4, elements 2 (lane % 4) and 2 (lane % 4) + 1; with TRANS the
// matrices are transposed on the way (each lane receives column lane / 4).
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(const f16* row, uint32_t r[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned addr = (unsigned)__cvta_generic_to_shared(row);
    if constexpr (TRANS) {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    } else {
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                     : "r"(addr));
    }
#else
    r[0] = r[1] = r[2] = r[3] = 0u;
#endif
}
