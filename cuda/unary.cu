// Elementwise unary ops, F32/F16/BF16 in and out (same dtype), any strides, in place
// allowed (one thread reads and writes each element):
//   - one functor per UnaryOp, `struct Name : UnaryFunctor` with `apply(x)`, named like
//     the Rust variant; build.rs instantiates `unary<Name, T>` as `name_<dtype>` for every
//     float dtype into unary.inst.cuh (included at the end) and maps the variant to them;
//   - scale (x * s), and swiglu (silu(gate) * up), fused by the CUDA backend.
#include "quant.cuh"

#define GELU_COEF_A 0.044715f
#define SQRT_2_OVER_PI 0.7978846f

// The base of every unary functor (build.rs finds `struct Name : UnaryFunctor`).
struct UnaryFunctor {};

struct Silu : UnaryFunctor {
    static __device__ __forceinline__ float apply(float x) { return x / (1.0f + expf(-x)); }
};
// The tanh approximation, 0.5 x (1 + tanh(u)), written as x / (1 + exp(-2u)): the same
// function, without the cancellation of 1 + tanh(u) in f32 for x below about -3.
struct Gelu : UnaryFunctor {
    static __device__ __forceinline__ float apply(float x) {
        const float u = SQRT_2_OVER_PI * x * (1.0f + GELU_COEF_A * x * x);
        return x / (1.0f + expf(-2.0f * u));
    }
};
struct Tanh : UnaryFunctor {
    static __device__ __forceinline__ float apply(float x) { return tanhf(x); }
};
struct Sigmoid : UnaryFunctor {
    static __device__ __forceinline__ float apply(float x) { return 1.0f / (1.0f + expf(-x)); }
};
struct LogSigmoid : UnaryFunctor {
    static __device__ __forceinline__ float apply(float x) { return fminf(x, 0.0f) - log1pf(expf(-fabsf(x))); }
};

template <typename F, typename T>
__device__ void unary(const UnaryArgs& p) {
    pdl_enter();
    for_each_row(p.dst.ne, [&](i64 i1, i64 i2, i64 i3) {
        const char* x = at(p.src, 0, i1, i2, i3);
        char* y = at(p.dst, 0, i1, i2, i3);
        return [=, &p](i64 i0) { store<T>(y + i0 * p.dst.nb[0], F::apply(load<T>(x + i0 * p.src.nb[0]))); };
    });
}

template <typename T>
__device__ void scale(const UnaryArgs& p) {
    pdl_enter();
    for_each_row(p.dst.ne, [&](i64 i1, i64 i2, i64 i3) {
        const char* x = at(p.src, 0, i1, i2, i3);
        char* y = at(p.dst, 0, i1, i2, i3);
        return [=, &p](i64 i0) { store<T>(y + i0 * p.dst.nb[0], load<T>(x + i0 * p.src.nb[0]) * p.scale); };
    });
}

extern "C" __global__ void scale_f32(const UnaryArgs p) { scale<float>(p); }
extern "C" __global__ void scale_f16(const UnaryArgs p) { scale<f16>(p); }
extern "C" __global__ void scale_bf16(const UnaryArgs p) { scale<bf16>(p); }

// silu(gate) * up (SwiGLU), F32, any strides: the CUDA backend fuses silu with the
// multiplication that reads it when nothing else does. When q8 is not null, row r of the
// result is also written as split Q8_1 activations at q8 + r * q8_nb1 for the decode
// product that reads it (store_act; the launcher ensures ne0 % 32 == 0 and a block of a
// multiple of 32 threads, so each warp holds whole 32-element blocks). With a folded norm
// (fold_scale) gate and up are products of an unnormalized vector: both are scaled by the
// norm's factor first.
template <int LAYOUT>
__device__ void swiglu(const GluArgs& p, float scale) {
    for_each_row(p.dst.ne, [&](i64 i1, i64 i2, i64 i3) {
        const char* g = at(p.gate, 0, i1, i2, i3);
        const char* u = at(p.up, 0, i1, i2, i3);
        char* d = at(p.dst, 0, i1, i2, i3);
        char* q8 = p.q8 == nullptr ? nullptr : p.q8 + (i1 + p.dst.ne[1] * (i2 + p.dst.ne[2] * i3)) * p.q8_nb1;
        return [=, &p](i64 i0) {
            const float y = Silu::apply(load<float>(g + i0 * p.gate.nb[0]) * scale) *
                            (load<float>(u + i0 * p.up.nb[0]) * scale);
            store<float>(d + i0 * p.dst.nb[0], y);
            if (q8 != nullptr) store_act(y, q8, p.dst.ne[0], i0 / 32, i0 % 32, LAYOUT);
        };
    });
}

extern "C" __global__ void swiglu_f32(const GluArgs p) {
    pdl_enter();
    const float scale = fold_scale(p.fold_scale);
    if (p.q8_layout == ACT_PAIRS) {
        swiglu<ACT_PAIRS>(p, scale);
    } else if (p.q8_layout == ACT_F16) {
        swiglu<ACT_F16>(p, scale);
    } else {
        swiglu<ACT_BLOCKS>(p, scale);
    }
}

#include "unary.inst.cuh"
