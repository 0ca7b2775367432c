// Elementwise binary ops: dst = a op b with b broadcast over a by ggml's rule y[i % ky] in
// all four dims. a and dst have the same shape (and, in place, the same memory and
// layout); each element is read and written by one thread. One functor per BinaryOp,
// `struct Name : BinaryFunctor` with `apply(x, y)`, named like the Rust variant; build.rs
// instantiates `binary<Name, TA, TB>` as `name_<a dtype>_<b dtype>` for every pair of float
// dtypes into binary.inst.cuh (included at the end).
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

#include "binary.inst.cuh"
