// Copies with conversion between F32, F16 and BF16 (and I32 to I32):
//   cpy_S_D:      dst = src on any 4-d strides. CPY_SAME_SHAPE walks one index for both;
//                 CPY_RESHAPE matches elements in row-major order (shapes differ, counts
//                 agree); CPY_CONTIGUOUS is the flat fast path for two dense tensors
//                 (8 elements a thread, 16-byte loads and stores, when both are aligned).
//   set_rows_S_D: row r of src -> row ids[r] of dst, one thread per element; an id
//                 outside 0..dst rows is recorded and its row skipped.
#include <type_traits>

#include "common.cuh"

template <typename S, typename D>
__device__ void cpy(const CpyArgs& p) {
    pdl_enter();
    // Dense float tensors, 8 elements a thread with 16-byte loads and stores (the F32 ->
    // F16 conversion of a prefill's activations before cuBLAS); the lowering sizes the
    // grid for it, and the loop below covers any other case.
    if constexpr (!std::is_same<S, int>::value) {
        if (p.mode == CPY_CONTIGUOUS && p.n % 8 == 0 && ((uintptr_t)p.src.data % 16) == 0 &&
            ((uintptr_t)p.dst.data % 16) == 0) {
            for (i64 g = blockIdx.x * (i64)blockDim.x + threadIdx.x; g < p.n / 8; g += (i64)gridDim.x * blockDim.x) {
                float f[8];
                load8<S>(p.src.data + g * 8 * (i64)sizeof(S), 0, true, f);
                store8<D>(p.dst.data + g * 8 * (i64)sizeof(D), f);
            }
            return;
        }
    }
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        const char* s;
        char* d;
        if (p.mode == CPY_CONTIGUOUS) {
            s = p.src.data + i * (i64)sizeof(S);
            d = p.dst.data + i * (i64)sizeof(D);
        } else {
            i64 is[4];
            unflatten(p.src.ne, i, is);
            s = at(p.src, is[0], is[1], is[2], is[3]);
            if (p.mode == CPY_SAME_SHAPE) {
                d = at(p.dst, is[0], is[1], is[2], is[3]);
            } else {
                i64 id[4];
                unflatten(p.dst.ne, i, id);
                d = at(p.dst, id[0], id[1], id[2], id[3]);
            }
        }
        *reinterpret_cast<D*>(d) = convert<D>(*reinterpret_cast<const S*>(s));
    }
}

// Splits src (any float type, any strides) into two BF16 tensors of dst's layout whose
// sum holds about 16 significant bits: hi = bf16(x) at dst, lo = bf16(x - hi) at
// dst + lo_offset. A BF16 GEMM of each half, summed in f32, keeps the activations nearly
// as precise as f32 while the weights stay BF16 on the tensor cores.
template <typename S>
__device__ void split_bf16(const SplitArgs& p) {
    pdl_enter();
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        i64 idx[4];
        unflatten(p.src.ne, i, idx);
        const float x = load<S>(at(p.src, idx[0], idx[1], idx[2], idx[3]));
        const bf16 hi = __float2bfloat16_rn(x);
        char* d = at(p.dst, idx[0], idx[1], idx[2], idx[3]);
        *reinterpret_cast<bf16*>(d) = hi;
        *reinterpret_cast<bf16*>(d + p.lo_offset) = __float2bfloat16_rn(x - __bfloat162float(hi));
    }
}

// ids is I32 [n, i2, i3], broadcast over dims 2 and 3 of src [ne0, n, ne2, ne3]. One
// thread per element (a decode step writes one K row of thousands of elements, or one
// element into each of thousands of rows of a transposed V cache: both are one wide
// launch). An id outside 0..dst rows is recorded and its elements skipped.
template <typename S, typename D>
__device__ void set_rows(const RowsArgs& p) {
    pdl_enter();
    const i64 n = p.src.ne[0] * p.src.ne[1] * p.src.ne[2] * p.src.ne[3];
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        set_row_element<S, D>(p.src, p.ids, p.dst, p.err, p.tag, i);
    }
}

extern "C" __global__ void cpy_f32_f32(const CpyArgs p) { cpy<float, float>(p); }
extern "C" __global__ void cpy_f32_f16(const CpyArgs p) { cpy<float, f16>(p); }
extern "C" __global__ void cpy_f32_bf16(const CpyArgs p) { cpy<float, bf16>(p); }
extern "C" __global__ void cpy_f16_f32(const CpyArgs p) { cpy<f16, float>(p); }
extern "C" __global__ void cpy_f16_f16(const CpyArgs p) { cpy<f16, f16>(p); }
extern "C" __global__ void cpy_f16_bf16(const CpyArgs p) { cpy<f16, bf16>(p); }
extern "C" __global__ void cpy_bf16_f32(const CpyArgs p) { cpy<bf16, float>(p); }
extern "C" __global__ void cpy_bf16_f16(const CpyArgs p) { cpy<bf16, f16>(p); }
extern "C" __global__ void cpy_bf16_bf16(const CpyArgs p) { cpy<bf16, bf16>(p); }
extern "C" __global__ void cpy_i32_i32(const CpyArgs p) { cpy<int, int>(p); }

extern "C" __global__ void split_f32_bf16(const SplitArgs p) { split_bf16<float>(p); }
extern "C" __global__ void split_f16_bf16(const SplitArgs p) { split_bf16<f16>(p); }

extern "C" __global__ void set_rows_f32_f32(const RowsArgs p) { set_rows<float, float>(p); }
extern "C" __global__ void set_rows_f32_f16(const RowsArgs p) { set_rows<float, f16>(p); }
extern "C" __global__ void set_rows_f32_bf16(const RowsArgs p) { set_rows<float, bf16>(p); }
extern "C" __global__ void set_rows_f16_f32(const RowsArgs p) { set_rows<f16, float>(p); }
extern "C" __global__ void set_rows_f16_f16(const RowsArgs p) { set_rows<f16, f16>(p); }
extern "C" __global__ void set_rows_f16_bf16(const RowsArgs p) { set_rows<f16, bf16>(p); }
extern "C" __global__ void set_rows_bf16_f32(const RowsArgs p) { set_rows<bf16, float>(p); }
extern "C" __global__ void set_rows_bf16_f16(const RowsArgs p) { set_rows<bf16, f16>(p); }
extern "C" __global__ void set_rows_bf16_bf16(const RowsArgs p) { set_rows<bf16, bf16>(p); }
