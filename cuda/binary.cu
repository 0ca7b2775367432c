// add and mul: dst = a op b with b broadcast over a by ggml's rule y[i % ky] in all four
// dims. a and dst have the same shape (and, in place, the same memory and layout); each
// element is read and written by one thread.
#include "common.cuh"

struct OpAdd {
    static __device__ __forceinline__ float apply(float x, float y) { return x + y; }
};
struct OpMul {
    static __device__ __forceinline__ float apply(float x, float y) { return x * y; }
};

template <typename Op, typename TA, typename TB>
__device__ void binary(const BinaryArgs& p) {
    pdl_enter();
    const i64 bne0 = p.b.ne[0];
    for_each_element(p.dst.ne, [&](i64 i0, i64 i1, i64 i2, i64 i3) {
        const i64 j0 = bne0 == p.dst.ne[0] ? i0 : i0 % bne0;
        const float x = load<TA>(at(p.a, i0, i1, i2, i3));
        const float y = load<TB>(at(p.b, j0, i1 % p.b.ne[1], i2 % p.b.ne[2], i3 % p.b.ne[3]));
        store<TA>(at(p.dst, i0, i1, i2, i3), Op::apply(x, y));
    });
}

extern "C" __global__ void add_f32_f32(const BinaryArgs p) { binary<OpAdd, float, float>(p); }
extern "C" __global__ void add_f32_f16(const BinaryArgs p) { binary<OpAdd, float, f16>(p); }
extern "C" __global__ void add_f32_bf16(const BinaryArgs p) { binary<OpAdd, float, bf16>(p); }
extern "C" __global__ void add_f16_f32(const BinaryArgs p) { binary<OpAdd, f16, float>(p); }
extern "C" __global__ void add_f16_f16(const BinaryArgs p) { binary<OpAdd, f16, f16>(p); }
extern "C" __global__ void add_f16_bf16(const BinaryArgs p) { binary<OpAdd, f16, bf16>(p); }
extern "C" __global__ void add_bf16_f32(const BinaryArgs p) { binary<OpAdd, bf16, float>(p); }
extern "C" __global__ void add_bf16_f16(const BinaryArgs p) { binary<OpAdd, bf16, f16>(p); }
extern "C" __global__ void add_bf16_bf16(const BinaryArgs p) { binary<OpAdd, bf16, bf16>(p); }

extern "C" __global__ void mul_f32_f32(const BinaryArgs p) { binary<OpMul, float, float>(p); }
extern "C" __global__ void mul_f32_f16(const BinaryArgs p) { binary<OpMul, float, f16>(p); }
extern "C" __global__ void mul_f32_bf16(const BinaryArgs p) { binary<OpMul, float, bf16>(p); }
extern "C" __global__ void mul_f16_f32(const BinaryArgs p) { binary<OpMul, f16, float>(p); }
extern "C" __global__ void mul_f16_f16(const BinaryArgs p) { binary<OpMul, f16, f16>(p); }
extern "C" __global__ void mul_f16_bf16(const BinaryArgs p) { binary<OpMul, f16, bf16>(p); }
extern "C" __global__ void mul_bf16_f32(const BinaryArgs p) { binary<OpMul, bf16, float>(p); }
extern "C" __global__ void mul_bf16_f16(const BinaryArgs p) { binary<OpMul, bf16, f16>(p); }
extern "C" __global__ void mul_bf16_bf16(const BinaryArgs p) { binary<OpMul, bf16, bf16>(p); }
