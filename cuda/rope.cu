// Rotary position embedding. One row (i1 = head, i2 = token, i3) per threadIdx.y of a
// block (rope_<T>: blockDim.y rows per block; rope_store: one); the token's
// position is pos[i2]. Pair i (0 <= i < n_dims/2) is rotated by angle pos * freqs[i],
// where freqs is the table of RopeParams::inv_freq (linear and Llama 3 scaling included)
// made on the host, so both backends use the same frequencies. Normal mode pairs
// (2i, 2i+1), NeoX mode pairs (i, i + n_dims/2); elements from n_dims on are copied.
// Each pair is read and written by one thread, so in place is safe.
#include "common.cuh"

// One row: x (type S, element stride snb0) times `scale` (a folded norm's, else 1) rotated by
// position t into y (type D).
template <typename S, typename D>
__device__ void rope_row(const char* x, i64 snb0, char* y, i64 dnb0, i64 ne0, float t,
                         const float* freqs, i64 n_dims, i64 neox, float scale = 1.0f) {
    const i64 half = n_dims / 2;
    for (i64 i = threadIdx.x; i < half; i += blockDim.x) {
        const i64 j0 = neox ? i : 2 * i;
        const i64 j1 = neox ? i + half : 2 * i + 1;
        const float x0 = load<S>(x + j0 * snb0) * scale;
        const float x1 = load<S>(x + j1 * snb0) * scale;
        float s, c;
        sincosf(t * freqs[i], &s, &c);
        // Separate roundings, like the CPU reference.
        store<D>(y + j0 * dnb0, __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)));
        store<D>(y + j1 * dnb0, __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
    }
    for (i64 i0 = n_dims + threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        store<D>(y + i0 * dnb0, load<S>(x + i0 * snb0) * scale);
    }
}

// Pair (x0, x1) rotated by angle a, with separate roundings like the CPU reference.
__device__ __forceinline__ float2 rotate(float x0, float x1, float a) {
    float s, c;
    sincosf(a, &s, &c);
    return make_float2(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s)), __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c)));
}

// rope_row of the row's RMS norm times w (F32 [ne0], dense; q and k norms, as Qwen3 has
// them), one warp a row (blockDim.x == 32): each lane sums the squares of its elements
// lane, lane + 32, ... in order, a warp sum gives the row's, and x * (1 / sqrt(ss / ne0 +
// eps)) * w is what the rope rotates (rms_rows' arithmetic; its sums may go in another
// order). Every lane has read the whole row for the sum before any writes, and each
// element is then read and written by one lane, so in place is safe.
template <typename D>
__device__ void rope_row_normed(const char* x, i64 snb0, char* y, i64 dnb0, i64 ne0, float t, const float* freqs,
                                i64 n_dims, i64 neox, const float* w, float eps) {
    float ss = 0.0f;
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += WARP_SIZE) {
        const float v = load<float>(x + i0 * snb0);
        ss += v * v;
    }
    ss = warp_sum(ss);
    const float scale = 1.0f / sqrtf(ss / (float)ne0 + eps);
    auto normed = [&](i64 i0) { return load<float>(x + i0 * snb0) * scale * w[i0]; };
    const i64 half = n_dims / 2;
    for (i64 i = threadIdx.x; i < half; i += WARP_SIZE) {
        const i64 j0 = neox ? i : 2 * i;
        const i64 j1 = neox ? i + half : 2 * i + 1;
        const float2 r = rotate(normed(j0), normed(j1), t * freqs[i]);
        store<D>(y + j0 * dnb0, r.x);
        store<D>(y + j1 * dnb0, r.y);
    }
    for (i64 i0 = n_dims + threadIdx.x; i0 < ne0; i0 += WARP_SIZE) store<D>(y + i0 * dnb0, normed(i0));
}

// N (2 or 4) f32 values as N consecutive T at p, one store (p aligned to N * sizeof(T)).
template <typename T, int N>
__device__ __forceinline__ void store_n(char* p, const float* v) {
    if constexpr (sizeof(T) == 4 && N == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else if constexpr (sizeof(T) == 4) {
        *reinterpret_cast<float2*>(p) = make_float2(v[0], v[1]);
    } else {
        static_assert(sizeof(T) == 2, "32- or 16-bit elements");
        T e[N];
#pragma unroll
        for (int i = 0; i < N; ++i) e[i] = from_f32<T>(v[i]);
        if constexpr (N == 4) {
            *reinterpret_cast<uint2*>(p) = *reinterpret_cast<const uint2*>(e);
        } else {
            *reinterpret_cast<unsigned*>(p) = *reinterpret_cast<const unsigned*>(e);
        }
    }
}

// rope_row for dense rows (F32 x, 16-byte aligned; y of type D, 16-byte aligned) and
// n_dims a multiple of 4: thread g takes pairs 2g and 2g + 1 (normal: elements 4g..4g+3,
// one 16-byte load and one store; NeoX: elements 2g, 2g + 1 and half + 2g, half + 2g + 1,
// two 8-byte loads and two stores), so each thread has twice the bytes in flight. The
// same arithmetic per pair as rope_row.
template <typename D>
__device__ void rope_row_vec(const char* x, char* y, i64 ne0, float t, const float* freqs, i64 n_dims, i64 neox,
                             float scale) {
    const int half = (int)n_dims / 2;
    for (int g = threadIdx.x; g < half / 2; g += blockDim.x) {
        const int i = 2 * g;
        const float f0 = t * freqs[i], f1 = t * freqs[i + 1];
        if (neox) {
            const float2 a = *reinterpret_cast<const float2*>(x + 4 * i);
            const float2 b = *reinterpret_cast<const float2*>(x + 4 * (i + half));
            const float2 r0 = rotate(a.x * scale, b.x * scale, f0), r1 = rotate(a.y * scale, b.y * scale, f1);
            const float lo[2] = {r0.x, r1.x}, hi[2] = {r0.y, r1.y};
            store_n<D, 2>(y + i * sizeof(D), lo);
            store_n<D, 2>(y + (i + half) * sizeof(D), hi);
        } else {
            const float4 a = *reinterpret_cast<const float4*>(x + 8 * i);
            const float2 r0 = rotate(a.x * scale, a.y * scale, f0), r1 = rotate(a.z * scale, a.w * scale, f1);
            const float v[4] = {r0.x, r0.y, r1.x, r1.y};
            store_n<D, 4>(y + 2 * i * sizeof(D), v);
        }
    }
    for (i64 i0 = n_dims + threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        store<D>(y + i0 * sizeof(D), load<float>(x + i0 * 4) * scale);
    }
}

// Chunk c of 8 elements of a set_rows of dense F32 rows of a multiple of 8 elements
// (16-byte aligned) into rows of type D (16-byte aligned): the row's id once, two 16-byte
// loads and 16 or 32 bytes of stores, where set_row_element takes an element a thread.
template <typename D>
__device__ __forceinline__ void set_row_chunk(const Tensor4& src, const Tensor4& ids, const Tensor4& dst,
                                              IndexError* err, i64 tag, i64 c, float scale) {
    i64 ix[4];
    unflatten(src.ne, 8 * c, ix);
    const int id = set_row_id(ids, dst, err, tag, ix[1], ix[2], ix[3], ix[0] == 0);
    if (id < 0) return;
    float v[8];
    load8<float>(at(src, 0, ix[1], ix[2], ix[3]), (int)ix[0], true, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] *= scale;
    store8<D>(at(dst, ix[0], id, ix[2], ix[3]), v);
}

__device__ __forceinline__ float position(const char* pos, i64 pos_nb0, i64 token) {
    return (float)*reinterpret_cast<const int*>(pos + token * pos_nb0);
}

template <typename T>
__device__ void rope(const RopeArgs& p) {
    pdl_enter();
    // blockDim.y rows per block (several for a prefill's many short rows)
    const i64 row = blockIdx.x * (i64)blockDim.y + threadIdx.y;
    if (row >= p.src.ne[1] * p.src.ne[2] * p.src.ne[3]) return;
    const RowIndex r = row_index(p.src.ne, row);
    rope_row<T, T>(at(p.src, 0, r.i1, r.i2, r.i3), p.src.nb[0], at(p.dst, 0, r.i1, r.i2, r.i3),
                   p.dst.nb[0], p.src.ne[0], position(p.pos, p.pos_nb0, r.i2), p.freqs, p.n_dims,
                   p.neox);
}

// rope_store_<D>: a step's rope of q and k and its K/V cache writes (D the cache type), one
// launch for what would be two ropes and two set_rows: the first ceil(q_rows / blockDim.y)
// blocks rope rows of q (F32) into q_dst, a row per threadIdx.y; the next
// ceil(k_rows / blockDim.y) rope rows of k (F32) straight into their cache rows ids[token];
// the last v_blocks copy v's elements into theirs (set_rows' element loop over the block's
// threads). With p.vec (dense, 16-byte aligned rows; the lowering checks) the rows go by
// rope_row_vec and v by chunks of 8 elements (set_row_chunk). The CUDA backend fuses the
// steps when k's rope is read by its cache write alone.
// With a folded norm (fold_scale) q, k and v are the product of an unnormalized vector:
// each is scaled by the norm's factor first (rope is linear, so this is the rope of the
// normalized). With q_norm / k_norm (never with fold_scale) each q / k row is RMS-normed
// and weighted first (rope_row_normed; the lowering gives rows a warp).
template <typename D>
__device__ void rope_store(const RopeStoreArgs& p) {
    pdl_enter();
    const float scale = fold_scale(p.fold_scale);
    const i64 per = blockDim.y;
    const i64 q_blocks = (p.q_rows + per - 1) / per, k_blocks = (p.k_rows + per - 1) / per;
    i64 b = blockIdx.x;
    if (b < q_blocks) {
        const i64 row = b * per + threadIdx.y;
        if (row >= p.q_rows) return;
        const RowIndex r = row_index(p.q_src.ne, row);
        const char* x = at(p.q_src, 0, r.i1, r.i2, r.i3);
        char* y = at(p.q_dst, 0, r.i1, r.i2, r.i3);
        const float t = position(p.pos, p.pos_nb0, r.i2);
        if (p.q_norm != nullptr) {
            rope_row_normed<float>(x, p.q_src.nb[0], y, p.q_dst.nb[0], p.q_src.ne[0], t, p.freqs, p.n_dims, p.neox,
                                   p.q_norm, p.q_eps);
        } else if (p.vec) {
            rope_row_vec<float>(x, y, p.q_src.ne[0], t, p.freqs, p.n_dims, p.neox, scale);
        } else {
            rope_row<float, float>(x, p.q_src.nb[0], y, p.q_dst.nb[0], p.q_src.ne[0], t, p.freqs, p.n_dims, p.neox,
                                   scale);
        }
        return;
    }
    b -= q_blocks;
    if (b < k_blocks) {
        const i64 row = b * per + threadIdx.y;
        if (row >= p.k_rows) return;
        const RowIndex r = row_index(p.k_src.ne, row);
        const int id = *reinterpret_cast<const int*>(p.ids.data + r.i2 * p.ids.nb[0]);
        if (id < 0 || id >= p.slots) {
            if (threadIdx.x == 0) record_index_error(p.err, p.tag, id, r.i2, p.slots);
            return;
        }
        const char* x = at(p.k_src, 0, r.i1, r.i2, r.i3);
        char* y = at(p.k_dst, 0, r.i1, id, r.i3);
        const float t = position(p.pos, p.pos_nb0, r.i2);
        if (p.k_norm != nullptr) {
            rope_row_normed<D>(x, p.k_src.nb[0], y, p.k_dst.nb[0], p.k_src.ne[0], t, p.freqs, p.n_dims, p.neox,
                               p.k_norm, p.k_eps);
        } else if (p.vec) {
            rope_row_vec<D>(x, y, p.k_src.ne[0], t, p.freqs, p.n_dims, p.neox, scale);
        } else {
            rope_row<float, D>(x, p.k_src.nb[0], y, p.k_dst.nb[0], p.k_src.ne[0], t, p.freqs, p.n_dims, p.neox, scale);
        }
        return;
    }
    b -= k_blocks;
    const i64 threads = (i64)blockDim.x * blockDim.y;
    const i64 n = p.v_src.ne[0] * p.v_src.ne[1] * p.v_src.ne[2] * p.v_src.ne[3];
    const i64 first = b * threads + threadIdx.y * blockDim.x + threadIdx.x, stride = p.v_blocks * threads;
    if (p.vec) {
        for (i64 c = first; c < n / 8; c += stride) set_row_chunk<D>(p.v_src, p.ids, p.v_dst, p.err, p.tag, c, scale);
        return;
    }
    for (i64 i = first; i < n; i += stride) {
        set_row_element<float, D>(p.v_src, p.ids, p.v_dst, p.err, p.tag, i, scale);
    }
}

extern "C" __global__ void rope_f32(const RopeArgs p) { rope<float>(p); }
extern "C" __global__ void rope_f16(const RopeArgs p) { rope<f16>(p); }
extern "C" __global__ void rope_bf16(const RopeArgs p) { rope<bf16>(p); }
extern "C" __global__ void rope_store_f32(const RopeStoreArgs p) { rope_store<float>(p); }
extern "C" __global__ void rope_store_f16(const RopeStoreArgs p) { rope_store<f16>(p); }
extern "C" __global__ void rope_store_bf16(const RopeStoreArgs p) { rope_store<bf16>(p); }
