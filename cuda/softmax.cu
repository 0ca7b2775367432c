// Attention row ops.
//   diag_mask_inf_T: x[i0, i1] = -inf where i0 > n_past + i1 (elementwise).
//   soft_max_T[_mM]: softmax over each row of x * scale (+ mask), one row per block, f32
//     throughout: a max pass, an exp-sum pass, then a pass that writes exp(v - max) / sum.
//     The optional mask (F32 or F16) has the row length and is broadcast over rows and
//     batches (mask.ne[i] divides src.ne[i]). A row that is all -inf becomes zeros, a row
//     holding a NaN becomes NaN (the max keeps a NaN: fmax_nan, block_max). Each
//     element is read and written by one thread and the reductions complete before the
//     writing pass, so in place is safe.
#include "common.cuh"

#include <type_traits>

template <typename T>
__device__ void diag_mask_inf(const DiagMaskArgs& p) {
    pdl_enter();
    for_each_row(p.dst.ne, [&](i64 i1, i64 i2, i64 i3) {
        const char* x = at(p.src, 0, i1, i2, i3);
        char* y = at(p.dst, 0, i1, i2, i3);
        const i64 last = p.n_past + i1;  // the last unmasked column
        return [=, &p](i64 i0) {
            store<T>(y + i0 * p.dst.nb[0], i0 > last ? -INFINITY : load<T>(x + i0 * p.src.nb[0]));
        };
    });
}

struct NoMask {};

template <typename T, typename M>
__device__ void soft_max(const SoftMaxArgs& p) {
    pdl_enter();
    __shared__ float scratch[32];
    const RowIndex r = row_index(p.src.ne, blockIdx.x);
    const char* x = at(p.src, 0, r.i1, r.i2, r.i3);
    char* y = at(p.dst, 0, r.i1, r.i2, r.i3);
    const char* m = nullptr;
    if constexpr (!std::is_same<M, NoMask>::value) {
        m = at(p.mask, 0, r.i1 % p.mask.ne[1], r.i2 % p.mask.ne[2], r.i3 % p.mask.ne[3]);
    }
    const i64 ne0 = p.src.ne[0];
    // The scaled and masked value of element i0, rounded like the CPU reference.
    auto value = [&](i64 i0) {
        float v = __fmul_rn(load<T>(x + i0 * p.src.nb[0]), p.scale);
        if constexpr (!std::is_same<M, NoMask>::value) {
            v = __fadd_rn(v, load<M>(m + i0 * p.mask.nb[0]));
        }
        return v;
    };
    float mx = -INFINITY;
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) mx = fmax_nan(mx, value(i0));
    mx = block_max(mx, scratch);
    if (mx == -INFINITY) {  // the same in every thread of the block
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) store<T>(y + i0 * p.dst.nb[0], 0.0f);
        return;
    }
    float sum = 0.0f;
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) sum += expf(value(i0) - mx);
    sum = block_sum(sum, scratch);
    const float inv = 1.0f / sum;
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        store<T>(y + i0 * p.dst.nb[0], expf(value(i0) - mx) * inv);
    }
}

extern "C" __global__ void diag_mask_inf_f32(const DiagMaskArgs p) { diag_mask_inf<float>(p); }
extern "C" __global__ void diag_mask_inf_f16(const DiagMaskArgs p) { diag_mask_inf<f16>(p); }
extern "C" __global__ void diag_mask_inf_bf16(const DiagMaskArgs p) { diag_mask_inf<bf16>(p); }

extern "C" __global__ void soft_max_f32(const SoftMaxArgs p) { soft_max<float, NoMask>(p); }
extern "C" __global__ void soft_max_f16(const SoftMaxArgs p) { soft_max<f16, NoMask>(p); }
extern "C" __global__ void soft_max_bf16(const SoftMaxArgs p) { soft_max<bf16, NoMask>(p); }
extern "C" __global__ void soft_max_mask_f32_f32(const SoftMaxArgs p) { soft_max<float, float>(p); }
extern "C" __global__ void soft_max_mask_f16_f32(const SoftMaxArgs p) { soft_max<f16, float>(p); }
extern "C" __global__ void soft_max_mask_bf16_f32(const SoftMaxArgs p) { soft_max<bf16, float>(p); }
extern "C" __global__ void soft_max_mask_f32_f16(const SoftMaxArgs p) { soft_max<float, f16>(p); }
extern "C" __global__ void soft_max_mask_f16_f16(const SoftMaxArgs p) { soft_max<f16, f16>(p); }
extern "C" __global__ void soft_max_mask_bf16_f16(const SoftMaxArgs p) { soft_max<bf16, f16>(p); }
