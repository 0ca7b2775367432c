// Elementwise binary ops: dst = a op b with b broadcast over a by ggml's rule y[i % ky] in
// all four dims. a and dst have the same shape (and, in place, the same memory and
// layout); each element is read and written by one thread. One functor per BinaryOp,
// `struct Name : BinaryFunctor` with `apply(x, y)`, named like the Rust variant; build.rs
// instantiates `binary<Name, TA, TB>` as `name_<a dtype>_<b dtype>` for every pair of float
// dtypes into binary.inst.cuh (included at the end). Also moe_sum, a mixture of experts'
// weighted sum of its expert slots (a mul and a chain of adds), fused by the CUDA backend.
#include "common.cuh"

// The base of every binary functor (build.rs finds `struct Name : BinaryFunctor`).
struct BinaryFunctor {};

struct Add : BinaryFunctor {
    static __device__ __forceinline__ float apply(float x, float y) { return x + y; }
};
struct Mul : BinaryFunctor {
    static __device__ __forceinline__ float apply(float x, float y) { return x * y; }
};

template <typename F, typename TA, typename TB>
__device__ void binary(const BinaryArgs& p) {
    pdl_enter();
    const i64 bne0 = p.b.ne[0];
    const bool same0 = bne0 == p.dst.ne[0];
    for_each_row(p.dst.ne, [&](i64 i1, i64 i2, i64 i3) {
        const char* a = at(p.a, 0, i1, i2, i3);
        const char* b = at(p.b, 0, i1 % p.b.ne[1], i2 % p.b.ne[2], i3 % p.b.ne[3]);
        char* d = at(p.dst, 0, i1, i2, i3);
        return [=, &p](i64 i0) {
            const i64 j0 = same0 ? i0 : i0 % bne0;
            const float x = load<TA>(a + i0 * p.a.nb[0]);
            const float y = load<TB>(b + j0 * p.b.nb[0]);
            store<TA>(d + i0 * p.dst.nb[0], F::apply(x, y));
        };
    });
}

// The weighted sum of a mixture of experts' outputs y [n_embd, n_used, n_tokens] by their
// routing weights w [1, n_used, n_tokens], F32, any strides: the CUDA backend fuses the
// mul by the broadcast weights with the chain of adds of its expert slots (MoeSum in
// src/backend/fusion.rs) when nothing else reads the products or the partial sums.
//   dst[e, t] = ((y[e, 0, t] w[0, 0, t] + y[e, 1, t] w[0, 1, t]) + y[e, 2, t] w[0, 2, t]) + ...
// plus r[e, t] when the residual add after the sum is fused too. Each product and each sum
// is rounded to f32 in that order (__fmul_rn / __fadd_rn: never contracted into an fma), as
// the unfused mul and adds round them (f32 addition commutes exactly), so the result is
// bit-identical to theirs and to the CPU backend's. One thread per (e, t). dst never
// overlaps y; it may be r itself (in place). It may overlap w (the allocator gives the
// first add memory the weights had, free once the unfused mul was done): then (staged) the
// launch is one block, which reads all of w into shared memory before any thread writes.
// Routed (logits not null, staged, n_used <= 32): the weights are not read but made as the
// unfused get_rows of the logits at the ids and soft_max of each token's selection make
// them (soft_max_f32 on a row of n_used <= 32 runs as one warp, a lane an element: the same
// warp reductions here give the same bits), warp j taking tokens j, j + 32, ...
__device__ __forceinline__ void moe_route(const MoeSumArgs& p, float* stage) {
    const i64 n_used = p.y.ne[1];
    const int lane = threadIdx.x % WARP_SIZE;
    for (i64 t = threadIdx.x / WARP_SIZE; t < p.dst.ne[1]; t += blockDim.x / WARP_SIZE) {
        float v = -INFINITY;
        if (lane < n_used) {
            const int id = load<int>(at(p.ids, lane, t, 0, 0));
            v = load<float>(at(p.logits, 0, id, t, 0));
        }
        const float mx = warp_max(v);
        float w = 0.0f;
        if (mx != -INFINITY) {
            const float sum = warp_sum(lane < n_used ? 0.0f + expf(v - mx) : 0.0f);
            w = expf(v - mx) * (1.0f / sum);
        }
        if (lane < n_used) stage[n_used * t + lane] = w;
    }
}

extern "C" __global__ void __launch_bounds__(MOE_SUM_THREADS) moe_sum_f32(const MoeSumArgs p) {
    pdl_enter();
    __shared__ float stage[MOE_SUM_STAGE];
    const i64 n_used = p.y.ne[1];
    if (p.logits.data != nullptr) {
        moe_route(p, stage);
        __syncthreads();
    } else if (p.staged) {
        for (i64 j = threadIdx.x; j < n_used * p.dst.ne[1]; j += blockDim.x) {
            stage[j] = load<float>(at(p.w, 0, j % n_used, j / n_used, 0));
        }
        __syncthreads();
    }
    for_each_row(p.dst.ne, [&](i64 t, i64, i64) {
        const char* y = at(p.y, 0, 0, t, 0);
        const char* w = at(p.w, 0, 0, t, 0);
        const char* r = p.r.data == nullptr ? nullptr : at(p.r, 0, t, 0, 0);
        const float* ws = stage + n_used * t;
        char* d = at(p.dst, 0, t, 0, 0);
        return [=, &p](i64 e) {
            const char* ye = y + e * p.y.nb[0];
            auto weight = [&](i64 i) { return p.staged ? ws[i] : load<float>(w + i * p.w.nb[1]); };
            float acc = __fmul_rn(load<float>(ye), weight(0));
            for (i64 i = 1; i < n_used; ++i) {
                acc = __fadd_rn(acc, __fmul_rn(load<float>(ye + i * p.y.nb[1]), weight(i)));
            }
            if (r != nullptr) acc = __fadd_rn(acc, load<float>(r + e * p.r.nb[0]));
            store<float>(d + e * p.dst.nb[0], acc);
        };
    });
}

#include "binary.inst.cuh"
