// Elementwise unary ops: scale, silu, gelu (tanh approximation), F32/F16/BF16 in and out
// (same dtype), any strides, in place allowed (one thread reads and writes each element).
#include "common.cuh"

#define GELU_COEF_A 0.044715f
#define SQRT_2_OVER_PI 0.7978846f

struct OpScale {
    static __device__ __forceinline__ float apply(float x, float s) { return x * s; }
};
struct OpSilu {
    static __device__ __forceinline__ float apply(float x, float) { return x / (1.0f + expf(-x)); }
};
struct OpGelu {
    static __device__ __forceinline__ float apply(float x, float) {
        return 0.5f * x * (1.0f + tanhf(SQRT_2_OVER_PI * x * (1.0f + GELU_COEF_A * x * x)));
    }
};

template <typename Op, typename T>
__device__ void unary(const UnaryArgs& p) {
    pdl_enter();
    for_each_element(p.dst.ne, [&](i64 i0, i64 i1, i64 i2, i64 i3) {
        const float x = load<T>(at(p.src, i0, i1, i2, i3));
        store<T>(at(p.dst, i0, i1, i2, i3), Op::apply(x, p.scale));
    });
}

extern "C" __global__ void scale_f32(const UnaryArgs p) { unary<OpScale, float>(p); }
extern "C" __global__ void scale_f16(const UnaryArgs p) { unary<OpScale, f16>(p); }
extern "C" __global__ void scale_bf16(const UnaryArgs p) { unary<OpScale, bf16>(p); }
extern "C" __global__ void silu_f32(const UnaryArgs p) { unary<OpSilu, float>(p); }
extern "C" __global__ void silu_f16(const UnaryArgs p) { unary<OpSilu, f16>(p); }
extern "C" __global__ void silu_bf16(const UnaryArgs p) { unary<OpSilu, bf16>(p); }
extern "C" __global__ void gelu_f32(const UnaryArgs p) { unary<OpGelu, float>(p); }
extern "C" __global__ void gelu_f16(const UnaryArgs p) { unary<OpGelu, f16>(p); }
extern "C" __global__ void gelu_bf16(const UnaryArgs p) { unary<OpGelu, bf16>(p); }

// silu(gate) * up (SwiGLU), F32, any strides: the CUDA backend fuses silu with the
// multiplication that reads it when nothing else does.
extern "C" __global__ void swiglu_f32(const BinaryArgs p) {
    pdl_enter();
    for_each_element(p.dst.ne, [&](i64 i0, i64 i1, i64 i2, i64 i3) {
        const float g = load<float>(at(p.a, i0, i1, i2, i3));
        const float u = load<float>(at(p.b, i0, i1, i2, i3));
        store<float>(at(p.dst, i0, i1, i2, i3), OpSilu::apply(g, 1.0f) * u);
    });
}
