// Shared device helpers of every kernel module: the kernel argument structs (mirrored by
// #[repr(C)] structs in src/backend/cuda/args.rs, sizes checked on both sides), element
// loads and stores for float / half / nv_bfloat16 with f32 arithmetic, warp and block
// reductions, and the index-error record of get_rows / set_rows.
//
// Conventions: every tensor is a Tensor4 (first element, ne[4] element counts, nb[4] byte
// strides, like ggml); indices and strides are 64-bit; kernels that handle a row with a
// whole warp or block read every element of the row they need before any thread writes
// it, so a plan may run them in place (dst == src0 with the same layout).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef long long i64;
typedef unsigned long long u64;
typedef __half f16;
typedef __nv_bfloat16 bf16;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

// ---------------------------------------------------------------------------------------
// Kernel arguments. Every struct is passed by value as the kernel's only parameter.

// A strided 4-d tensor: `data` is the first element; element (i0, i1, i2, i3) lives at
// data + i0*nb[0] + i1*nb[1] + i2*nb[2] + i3*nb[3].
struct Tensor4 {
    char* data;
    i64 ne[4];
    i64 nb[4];
};
static_assert(sizeof(Tensor4) == 72, "Tensor4 layout");

// The first out-of-range index seen by get_rows / set_rows. `flag` is 0 while clear.
struct IndexError {
    int flag;
    int pad;
    i64 tag;  // which plan step (set by the host)
    i64 index;
    i64 position;
    i64 limit;
};
static_assert(sizeof(IndexError) == 40, "IndexError layout");

struct UnaryArgs {  // scale, silu, gelu
    Tensor4 src;
    Tensor4 dst;
    float scale;
    float pad;
};
static_assert(sizeof(UnaryArgs) == 152, "UnaryArgs layout");

struct BinaryArgs {  // add, mul
    Tensor4 a;
    Tensor4 b;
    Tensor4 dst;
};
static_assert(sizeof(BinaryArgs) == 216, "BinaryArgs layout");

struct NormArgs {  // rms_norm, norm
    Tensor4 src;
    Tensor4 dst;
    float eps;
    float pad;
};
static_assert(sizeof(NormArgs) == 152, "NormArgs layout");

struct RopeArgs {
    Tensor4 src;
    Tensor4 dst;
    const char* pos;     // I32 positions, one per index of dim 2
    i64 pos_nb0;         // byte stride of pos
    const float* freqs;  // n_dims / 2 inverse frequencies
    i64 n_dims;
    i64 neox;            // 0: pairs (2i, 2i+1); 1: pairs (i, i + n_dims/2)
};
static_assert(sizeof(RopeArgs) == 184, "RopeArgs layout");

struct CpyArgs {
    Tensor4 src;
    Tensor4 dst;
    i64 n;     // elements
    i64 mode;  // CPY_SAME_SHAPE, CPY_RESHAPE or CPY_CONTIGUOUS
};
static_assert(sizeof(CpyArgs) == 160, "CpyArgs layout");
#define CPY_SAME_SHAPE 0  // same ne, any strides
#define CPY_RESHAPE 1     // different ne, elements matched in row-major order
#define CPY_CONTIGUOUS 2  // both dense: flat index

struct RowsArgs {  // get_rows, set_rows
    Tensor4 src;  // get_rows: the table; set_rows: the rows to write
    Tensor4 ids;  // I32 row ids
    Tensor4 dst;
    IndexError* err;
    i64 tag;
};
static_assert(sizeof(RowsArgs) == 232, "RowsArgs layout");

struct DiagMaskArgs {
    Tensor4 src;
    Tensor4 dst;
    i64 n_past;
};
static_assert(sizeof(DiagMaskArgs) == 152, "DiagMaskArgs layout");

struct SoftMaxArgs {
    Tensor4 src;
    Tensor4 mask;  // unused (data == nullptr) by the kernels without a mask
    Tensor4 dst;
    float scale;
    float pad;
};
static_assert(sizeof(SoftMaxArgs) == 224, "SoftMaxArgs layout");

struct ArgmaxArgs {
    Tensor4 src;
    Tensor4 dst;  // I32 [ne1, ne2, ne3]: nb[0..2] are the strides of src dims 1..3
};
static_assert(sizeof(ArgmaxArgs) == 144, "ArgmaxArgs layout");

// Matrix-vector products dst[r, ch] = sum_l a[l, r, ch / ratio] * b[l, ch] with rows of `a`
// dense (consecutive elements) and b, dst dense along dim 0.
struct GemvArgs {
    const char* a;
    const char* b;  // F32
    char* dst;      // F32
    i64 k;          // row length (contracted)
    i64 m;          // rows of a = elements of one dst column
    i64 channels;   // columns of b / dst (dim 2)
    i64 a_nb1;      // byte stride between rows of a
    i64 a_nb2;      // byte stride between channels of a
    i64 b_nb2;      // byte stride between columns of b
    i64 dst_nb2;    // byte stride between columns of dst
    i64 ratio;      // channels of b per channel of a (GQA)
    i64 vec;        // 1 when rows of a and b are aligned for vector loads
    const char* add;  // F32 [m] added to the result (a fused residual add), or null
    i64 prefetch;     // 1 when `a` is read-only in the plan (weights): its first loads may
                      // start before the previous kernel ends
};
static_assert(sizeof(GemvArgs) == 112, "GemvArgs layout");

struct FillRandomArgs {
    char* dst;
    i64 n;
    u64 seed;
    float scale;
    float pad;
};
static_assert(sizeof(FillRandomArgs) == 32, "FillRandomArgs layout");

struct NormMulArgs {  // rms_norm_mul: dst = rms_norm(src) * w (w [ne0], broadcast)
    Tensor4 src;
    Tensor4 dst;
    Tensor4 w;
    float eps;
    float pad;
};
static_assert(sizeof(NormMulArgs) == 224, "NormMulArgs layout");

struct SplitArgs {  // split_*_bf16: hi at dst, lo at dst + lo_offset (same layout)
    Tensor4 src;
    Tensor4 dst;
    i64 n;
    i64 lo_offset;
};
static_assert(sizeof(SplitArgs) == 160, "SplitArgs layout");

struct SpinArgs {  // spin_wait: hold the stream for ns nanoseconds
    i64 ns;
};
static_assert(sizeof(SpinArgs) == 8, "SpinArgs layout");

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
__device__ __forceinline__ RowIndex row_index(const i64 ne[4], i64 r) {
    RowIndex ri;
    ri.i1 = r % ne[1];
    const i64 q = r / ne[1];
    ri.i2 = q % ne[2];
    ri.i3 = q / ne[2];
    return ri;
}

// Calls f(i0, i1, i2, i3) for every element of shape ne: rows on grid.y (strided), dim 0
// on grid.x * block.x (strided). Each element is visited by exactly one thread.
template <typename F>
__device__ __forceinline__ void for_each_element(const i64 ne[4], F f) {
    const i64 rows = ne[1] * ne[2] * ne[3];
    for (i64 r = blockIdx.y; r < rows; r += gridDim.y) {
        const RowIndex ri = row_index(ne, r);
        for (i64 i0 = blockIdx.x * (i64)blockDim.x + threadIdx.x; i0 < ne[0];
             i0 += (i64)gridDim.x * blockDim.x) {
            f(i0, ri.i1, ri.i2, ri.i3);
        }
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
// Reductions. Block versions need blockDim.x to be a multiple of 32 (at most 1024), must be
// called by every thread of the block, return the result in every thread, and may be
// called again with the same `scratch` (32 entries of shared memory).

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
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
