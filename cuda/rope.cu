// Rotary position embedding. One block per row (i1 = head, i2 = token, i3); the token's
// position is pos[i2]. Pair i (0 <= i < n_dims/2) is rotated by angle pos * freqs[i],
// where freqs is the table of RopeParams::inv_freq (linear and Llama 3 scaling included)
// made on the host, so both backends use the same frequencies. Normal mode pairs
// (2i, 2i+1), NeoX mode pairs (i, i + n_dims/2); elements from n_dims on are copied.
// Each pair is read and written by one thread, so in place is safe.
#include "common.cuh"

template <typename T>
__device__ void rope(const RopeArgs& p) {
    pdl_enter();
    const RowIndex r = row_index(p.src.ne, blockIdx.x);
    const char* x = at(p.src, 0, r.i1, r.i2, r.i3);
    char* y = at(p.dst, 0, r.i1, r.i2, r.i3);
    const i64 snb0 = p.src.nb[0], dnb0 = p.dst.nb[0];
    const float t = (float)*reinterpret_cast<const int*>(p.pos + r.i2 * p.pos_nb0);
    const i64 half = p.n_dims / 2;
    for (i64 i = threadIdx.x; i < half; i += blockDim.x) {
        const i64 j0 = p.neox ? i : 2 * i;
        const i64 j1 = p.neox ? i + half : 2 * i + 1;
        const float x0 = load<T>(x + j0 * snb0);
        const float x1 = load<T>(x + j1 * snb0);
        float s, c;
        sincosf(t * p.freqs[i], &s, &c);
        // Separate roundings, like the CPU reference.
        store<T>(y + j0 * dnb0, __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
        store<T>(y + j1 * dnb0, __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
    }
    for (i64 i0 = p.n_dims + threadIdx.x; i0 < p.src.ne[0]; i0 += blockDim.x) {
        store<T>(y + i0 * dnb0, load<T>(x + i0 * snb0));
    }
}

extern "C" __global__ void rope_f32(const RopeArgs p) { rope<float>(p); }
extern "C" __global__ void rope_f16(const RopeArgs p) { rope<f16>(p); }
extern "C" __global__ void rope_bf16(const RopeArgs p) { rope<bf16>(p); }
