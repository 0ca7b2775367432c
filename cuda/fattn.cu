// Flash attention (flash_attn_ext): softmax(scale * q k^T (+ slope * mask)) v per query
// row and head, with the online softmax of FlashAttention and no score tensor in memory.
// K and V have one dtype (F32, F16, BF16, Q8_0, Q4_0, dequantized in registers; see
// fattn_common.cuh) and the head dim D is a template parameter (16, 32, 64, 80, 96, 112, 128, 256).
//
//   fattn_vec_d<D>_<kv>  (decode, flash-decoding) grid (split, n_head_kv,
//     batch * ceil(group * n_q / FATTN_VEC_ROWS)), block FATTN_VEC_WARPS * 32. A block
//     takes one chunk of keys of one KV head and up to FATTN_VEC_ROWS query rows of the
//     heads sharing that KV head (GQA: each K/V row is read once for all of them). Lanes
//     work in groups of L = D/8 rounded up to a power of two, each lane owning 8 elements
//     of the row, one group per key; a step takes FATTN_VEC_UNROLL keys per group, all
//     their K/V loads (16 bytes per lane for F16) and mask reads issued before the first
//     use, and rescales the running state once per step. Each group keeps its own running
//     (max, sum, acc) per row, merged at the end by shuffles across groups and shared
//     memory across warps. fattn_vec1_d<D>_<kv> is the same kernel for one row per block
//     (MHA decode: one accumulator in registers instead of FATTN_VEC_ROWS). With split == 1 the block writes the normalized result, otherwise the
//     partial (max, sum, acc[D]) of its chunk into p.part for fattn_combine.
//   fattn_combine  grid (n_head * n_q * batch), block FATTN_COMBINE_THREADS: merges the
//     split partials of one row, rescaling each by exp(max_i - max).
//   fattn_mma_d<D>_<kv>  (prefill) grid (ceil(n_q / BQ), n_head, batch), block BQ / 16
//     warps, BQ = FATTN_MMA_ROWS (FATTN_MMA_ROWS_D256 for D = 256). Q of the block's rows
//     goes to shared memory as F16; the K and V tiles of FATTN_MMA_KEYS keys (half as
//     many for D = 256) go to shared memory together as F16 rows (copied as is from F16
//     caches, converted otherwise); each warp computes its 16 rows' scores with
//     mma.sync m16n8k16 (F16 in, F32 accumulation), runs the online softmax on them in
//     registers (the accumulator layout of mma is fixed, so the rows of the output
//     accumulator can be rescaled in place), and multiplies the probabilities, reused as
//     the A operand straight from registers, by the V tile (its B fragments transposed
//     by ldmatrix). The mask tile is read into shared memory first, through row pointers
//     found once per block; a tile whose entries are all -inf is skipped (causal masks).
//
// A row whose keys are all masked gives zeros. Every kernel waits for its predecessor
// before reading anything (pdl_enter), allocates nothing and never synchronizes with the
// host, so all are capturable.
#include <type_traits>

#include "fattn_common.cuh"

// Lanes per key group of fattn_vec: D / 8 rounded up to a power of two.
template <int D>
__host__ __device__ constexpr int vec_lanes() {
    return D <= 16 ? 2 : D <= 32 ? 4 : D <= 64 ? 8 : D <= 128 ? 16 : 32;
}

// The running softmax state of one row merged with another (m, l, acc).
__device__ __forceinline__ void merge_state(float& m, float& l, float acc[8], float m2, float l2,
                                            const float acc2[8]) {
    const float mx = fmaxf(m, m2);
    if (mx == -INFINITY) return;
    const float c1 = m == -INFINITY ? 0.0f : expf(m - mx);
    const float c2 = m2 == -INFINITY ? 0.0f : expf(m2 - mx);
    l = l * c1 + l2 * c2;
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = acc[i] * c1 + acc2[i] * c2;
    m = mx;
}

// 8 elements of a K/V row as loaded: F16 and BF16 stay packed in one 16-byte register
// quad until used (so a lane can hold several keys' rows in flight), the other types are
// converted at load.
template <typename T>
struct Piece {
    float f[8];
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = 0.0f;
    }
    __device__ __forceinline__ void load(const char* row, int e0, bool vec) { load8<T>(row, e0, vec, f); }
    __device__ __forceinline__ float get(int i) const { return f[i]; }
};

template <typename H>
struct Piece16 {
    uint4 u;
    __device__ __forceinline__ void zero() { u = make_uint4(0, 0, 0, 0); }
    __device__ __forceinline__ void load(const char* row, int e0, bool vec) {
        const H* p = reinterpret_cast<const H*>(row) + e0;
        if (vec) {
            u = *reinterpret_cast<const uint4*>(p);
        } else {
            H* h = reinterpret_cast<H*>(&u);
#pragma unroll
            for (int i = 0; i < 8; ++i) h[i] = p[i];
        }
    }
    __device__ __forceinline__ float get(int i) const { return to_f32(reinterpret_cast<const H*>(&u)[i]); }
};
template <>
struct Piece<f16> : Piece16<f16> {};
template <>
struct Piece<bf16> : Piece16<bf16> {};

// R: query rows per block (1 for one query of one head per KV head, else FATTN_VEC_ROWS).
template <int D, int R, typename T>
__device__ void fattn_vec(const FattnArgs& p) {
    constexpr int L = vec_lanes<D>();
    constexpr int KPW = WARP_SIZE / L;  // keys per warp per unrolled key
    constexpr int NW = FATTN_VEC_WARPS;
    constexpr int U = FATTN_VEC_UNROLL;  // keys per lane group per step, loaded together
    constexpr int DP = L * 8;  // D padded to whole lane groups
    __shared__ __align__(16) float qs[R][DP];
    __shared__ float sacc[R][DP];
    __shared__ float sm[NW][R], sl[NW][R];
    __shared__ const char* smrow[R];
    __shared__ float sslope[R];
    __shared__ int sq[R], sh[R];  // query and head of each row

    pdl_enter();
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const i64 n_q = p.q.ne[1], n_head = p.q.ne[2], n_kv = p.k.ne[1];
    // 32-bit index math: the grid limits keep batch, rows and heads far below 2^31, and
    // a 64-bit division is a long call on the kernel's critical path
    const int batch = (int)p.q.ne[3], group = (int)p.group;
    const i64 split = blockIdx.x, hk = blockIdx.y;
    const int b = (int)blockIdx.z % batch, rb = (int)blockIdx.z / batch;
    const int first_row = rb * R;  // flat row t: query t / group, head hk * group + t % group
    const int nrows = (int)min((i64)R, p.group * n_q - first_row);

    if (tid < R) {
        const int t = first_row + tid;
        const int qi = t / group, h = (int)hk * group + t % group;
        sq[tid] = qi;
        sh[tid] = h;
        smrow[tid] = tid < nrows ? mask_row(p, qi, h, b) : nullptr;
        sslope[tid] = tid < nrows ? p.slopes[h] : 1.0f;
    }
    __syncthreads();
    for (int idx = tid; idx < R * DP; idx += blockDim.x) {
        const int r = idx / DP, e = idx % DP;
        float x = 0.0f;
        if (r < nrows && e < D) x = load<float>(at(p.q, e, sq[r], sh[r], b));
        qs[r][e] = x;
        sacc[r][e] = 0.0f;
    }
    __syncthreads();

    const int sub = lane / L, e0 = (lane % L) * 8;
    const bool active = e0 < D;
    const bool vec = p.kv_vec != 0;
    float m[R], l[R], acc[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = 0.0f;
    }
    const char* kbase = at(p.k, 0, 0, hk, b);
    const char* vbase = at(p.v, 0, 0, hk, b);
    const i64 kstride = p.k.nb[1], vstride = p.v.nb[1];

    // A step: U keys per lane group, key j0 + (u * NW + warp) * KPW + sub; every K and V
    // load and mask read of the step is issued before the first use.
    const i64 j_begin = split * p.chunk, j_end = min(n_kv, j_begin + p.chunk);
    for (i64 j0 = j_begin; j0 < j_end; j0 += U * NW * KPW) {
        Piece<T> kp[U], vp[U];
        float bias[U][R];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const i64 j = j0 + (u * NW + warp) * KPW + sub;
            const bool valid = j < j_end;
            kp[u].zero();
            vp[u].zero();
            if (valid && active) {
                kp[u].load(kbase + j * kstride, e0, vec);
                vp[u].load(vbase + j * vstride, e0, vec);
            }
#pragma unroll
            for (int r = 0; r < R; ++r) {
                bias[u][r] = -INFINITY;
                if (r < nrows && valid) bias[u][r] = mask_bias(p, smrow[r], sslope[r], j);
            }
        }
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= nrows) break;  // uniform over the block
            const float4 qa = *reinterpret_cast<const float4*>(&qs[r][e0]);
            const float4 qb = *reinterpret_cast<const float4*>(&qs[r][e0 + 4]);
            float s[U];
            float mx = m[r];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float dot = qa.x * kp[u].get(0) + qa.y * kp[u].get(1) + qa.z * kp[u].get(2) +
                            qa.w * kp[u].get(3) + qb.x * kp[u].get(4) + qb.y * kp[u].get(5) +
                            qb.z * kp[u].get(6) + qb.w * kp[u].get(7);
#pragma unroll
                for (int o = L / 2; o > 0; o >>= 1) dot += __shfl_xor_sync(FULL_MASK, dot, o);
                s[u] = bias[u][r] == -INFINITY ? -INFINITY : score(p, dot, bias[u][r]);
                mx = fmaxf(mx, s[u]);
            }
            if (mx == -INFINITY) continue;  // every key so far masked
            const float c = expf(m[r] - mx);
            l[r] *= c;
#pragma unroll
            for (int i = 0; i < 8; ++i) acc[r][i] *= c;
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const float w = expf(s[u] - mx);  // 0 for a masked key
                l[r] += w;
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[r][i] += w * vp[u].get(i);
            }
            m[r] = mx;
        }
    }

    // Merge the key groups of the warp (a butterfly: every group ends with the sum).
#pragma unroll
    for (int r = 0; r < R; ++r) {
        if (r >= nrows) break;
#pragma unroll
        for (int o = L; o < WARP_SIZE; o <<= 1) {
            const float m2 = __shfl_xor_sync(FULL_MASK, m[r], o);
            const float l2 = __shfl_xor_sync(FULL_MASK, l[r], o);
            float acc2[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) acc2[i] = __shfl_xor_sync(FULL_MASK, acc[r][i], o);
            merge_state(m[r], l[r], acc[r], m2, l2, acc2);
        }
        if (lane == 0) {
            sm[warp][r] = m[r];
            sl[warp][r] = l[r];
        }
    }
    __syncthreads();
    // Then the warps, through shared memory: each adds its accumulator rescaled to the
    // block's maximum.
    if (sub == 0 && active) {
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (r >= nrows) break;
            float mx = -INFINITY;
            for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm[w][r]);
            if (m[r] == -INFINITY) continue;
            const float f = expf(m[r] - mx);
#pragma unroll
            for (int i = 0; i < 8; ++i) atomicAdd(&sacc[r][e0 + i], acc[r][i] * f);
        }
    }
    __syncthreads();

    for (int idx = tid; idx < nrows * D; idx += blockDim.x) {
        const int r = idx / D, e = idx % D;
        float mx = -INFINITY, sum = 0.0f;
        for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm[w][r]);
        if (mx != -INFINITY) {
            for (int w = 0; w < NW; ++w) {
                if (sm[w][r] != -INFINITY) sum += sl[w][r] * expf(sm[w][r] - mx);
            }
        }
        const i64 qi = sq[r], h = sh[r];
        if (p.split == 1) {
            store<float>(at(p.dst, e, h, qi, b), sum > 0.0f ? sacc[r][e] / sum : 0.0f);
        } else {
            const i64 row = (b * n_q + qi) * n_head + h;
            float* part = p.part + (row * p.split + split) * (D + 2);
            if (e == 0) {
                part[0] = mx;
                part[1] = sum;
            }
            part[2 + e] = sacc[r][e];
        }
    }
}

// Merges the split partials of row blockIdx.x (flat over [n_head, n_q, batch]).
extern "C" __global__ void __launch_bounds__(FATTN_COMBINE_THREADS) fattn_combine(const FattnArgs p) {
    pdl_enter();
    const i64 d = p.dst.ne[0];
    // 32-bit index math (the grid holds the rows): no 64-bit division on the critical path
    const int n_head = (int)p.dst.ne[1], n_q = (int)p.dst.ne[2], row = (int)blockIdx.x;
    const int h = row % n_head, qi = (row / n_head) % n_q, b = row / (n_head * n_q);
    const float* part = p.part + (i64)row * p.split * (d + 2);
    float mx = -INFINITY;
    for (i64 s = 0; s < p.split; ++s) mx = fmaxf(mx, part[s * (d + 2)]);
    float sum = 0.0f;
    if (mx != -INFINITY) {
        for (i64 s = 0; s < p.split; ++s) {
            const float ms = part[s * (d + 2)];
            if (ms != -INFINITY) sum += part[s * (d + 2) + 1] * expf(ms - mx);
        }
    }
    for (i64 e = threadIdx.x; e < d; e += blockDim.x) {
        float acc = 0.0f;
        if (sum > 0.0f) {
            for (i64 s = 0; s < p.split; ++s) {
                const float ms = part[s * (d + 2)];
                if (ms != -INFINITY) acc += part[s * (d + 2) + 2 + e] * expf(ms - mx);
            }
            acc /= sum;
        }
        store<float>(at(p.dst, e, h, qi, b), acc);
    }
}

// ---------------------------------------------------------------------------------------
// Prefill on tensor cores.

// d += a * b for one m16n8k16 tile: F16 inputs, F32 accumulation. Fragment layout (g =
// lane / 4, t = lane % 4): a[0] rows g, cols 2t..2t+1; a[1] row g + 8; a[2] cols + 8;
// a[3] both; b[0] k rows 2t..2t+1 of col g, b[1] k rows + 8; d[0..1] row g, cols
// 2t..2t+1, d[2..3] row g + 8.
__device__ __forceinline__ void mma_16816(float d[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ uint32_t lds32(const f16* p) { return *reinterpret_cast<const uint32_t*>(p); }

// The B fragment of mma_16816 for keys k0..k0+15 and head elements n0..n0+7 of a tile
// stored [key][d] (ld halves per key): ldmatrix with transpose, lanes 0..15 giving the
// addresses of keys k0..k0+15 (16-byte aligned rows).
__device__ __forceinline__ void ldsm_b_trans(const f16* tile, int ld, int k0, int n0, int lane, uint32_t& b0,
                                             uint32_t& b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    const unsigned addr = (unsigned)__cvta_generic_to_shared(tile + (k0 + (lane & 15)) * ld + n0);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];"
                 : "=r"(b0), "=r"(b1)
                 : "r"(addr));
#else
    b0 = b1 = 0u;
#endif
}

// 8 elements of K/V row `row` at e0, as 8 halves: a 16-byte copy for F16 rows that allow
// vector loads, a conversion otherwise. The row is always a valid one (the caller clamps
// the key) and the loads are unconditional, so that a thread's loads of a tile can all be
// in flight together.
template <typename T, bool VEC>
__device__ __forceinline__ uint4 tile_piece(const char* row, int e0) {
    if constexpr (VEC && std::is_same<T, f16>::value) {
        return *reinterpret_cast<const uint4*>(reinterpret_cast<const f16*>(row) + e0);
    }
    float f[8];
    load8<T>(row, e0, VEC, f);
    uint4 packed;
    store8<f16>(reinterpret_cast<char*>(&packed), f);
    return packed;
}

// The K and V tiles of keys j0..j0+BK into ks and vs ([key][d], LDK halves per key),
// zeros past the last key (its probability is 0, but V must not hold a NaN). VEC: rows
// allow 16-byte loads (a template argument, so that no branch separates the loads).
template <typename T, bool VEC, int D, int BK, int NT, int LDK>
__device__ __forceinline__ void kv_tiles(const FattnArgs& p, const char* kbase, const char* vbase, i64 j0,
                                         i64 n_kv, f16* ks, f16* vs) {
    constexpr int PIECES = BK * (D / 8);
#pragma unroll
    for (int u = 0; u < (PIECES + NT - 1) / NT; ++u) {
        const int idx = threadIdx.x + u * NT;
        if (PIECES % NT == 0 || idx < PIECES) {
            const int c = idx / (D / 8), e0 = (idx % (D / 8)) * 8;
            const i64 j = j0 + c, jc = min(j, n_kv - 1);
            const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
            const uint4 kp = tile_piece<T, VEC>(kbase + jc * p.k.nb[1], e0);
            const uint4 vp = tile_piece<T, VEC>(vbase + jc * p.v.nb[1], e0);
            *reinterpret_cast<uint4*>(&ks[c * LDK + e0]) = j < n_kv ? kp : zero;
            *reinterpret_cast<uint4*>(&vs[c * LDK + e0]) = j < n_kv ? vp : zero;
        }
    }
}

// The BQ x BK bias tile of keys j0.. into bias (slope * mask, -inf past the last query row
// or key), mask entries of type M (mrows: a valid mask row for every tile row); whether
// any entry is live. Branch-free loads (clamped keys) so that they are all in flight at
// once.
template <typename M, int BQ, int BK, int NT>
__device__ __forceinline__ bool mask_tile(const FattnArgs& p, const char* const* mrows, float slope, i64 q0,
                                          i64 j0, i64 n_q, i64 n_kv, float (*bias)[BK + 1]) {
    bool live = false;
#pragma unroll
    for (int u = 0; u < BQ * BK / NT; ++u) {
        const int idx = threadIdx.x + u * NT, r = idx / BK, c = idx % BK;
        const i64 j = j0 + c;
        const bool ok = q0 + r < n_q && j < n_kv;
        const float m = to_f32(*reinterpret_cast<const M*>(mrows[r] + min(j, n_kv - 1) * p.mask.nb[0]));
        const float x = ok && m != -INFINITY ? slope * m : -INFINITY;
        bias[r][c] = x;
        live |= x != -INFINITY;
    }
    return live;
}

template <int D, typename T>
__device__ void fattn_mma(const FattnArgs& p) {
    constexpr int BQ = D > 128 ? FATTN_MMA_ROWS_D256 : FATTN_MMA_ROWS;
    // keys per tile: half for D = 256, where K, V and Q tiles of 32 would pass 48 KB
    constexpr int BK = D > 128 ? FATTN_MMA_KEYS / 2 : FATTN_MMA_KEYS;
    constexpr int NT = BQ / 16 * WARP_SIZE;
    constexpr int LDQ = D + 8, LDK = D + 8;  // padded: no bank conflicts
    __shared__ __align__(16) f16 qs[BQ * LDQ];
    __shared__ __align__(16) f16 ks[BK * LDK];  // K tile [key][d]
    __shared__ __align__(16) f16 vs[BK * LDK];  // V tile [key][d]
    // BK + 1 floats a row: the softmax reads column c of 8 rows at once (lanes g of a
    // quad group), which a row of exactly BK would put in one bank
    __shared__ float bias[BQ][BK + 1];
    __shared__ const char* mrows[BQ];

    pdl_enter();
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    const i64 n_q = p.q.ne[1], n_kv = p.k.ne[1];
    const i64 q0 = (i64)blockIdx.x * BQ, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
    const float slope = p.slopes[h];
    const bool vec = p.kv_vec != 0;
    const char* kbase = at(p.k, 0, 0, hk, b);
    const char* vbase = at(p.v, 0, 0, hk, b);

#pragma unroll 8
    for (int idx = tid; idx < BQ * D; idx += NT) {
        const int r = idx / D, e = idx % D;
        const float x = load<float>(at(p.q, e, min(q0 + r, n_q - 1), h, b));  // unconditional load
        qs[r * LDQ + e] = __float2half_rn(q0 + r < n_q ? x : 0.0f);
    }
    // The mask row of each query row, found once (rows past the last take the last's).
    for (int r = tid; r < BQ; r += NT) mrows[r] = mask_row(p, min(q0 + r, n_q - 1), h, b);
    __syncthreads();

    float o[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.0f, l_b = 0.0f;  // rows g and g + 8
    const int ra = warp * 16 + g, rb = ra + 8;

    for (i64 j0 = 0; j0 < n_kv; j0 += BK) {
        __syncthreads();  // every warp is done with the previous tile's bias, K and V
        // The loops below have fixed trip counts and are unrolled, so that a thread's
        // loads are all in flight before the first store (one round trip per loop, not
        // one per element: the kernel is latency-bound with about 8 warps per SM).
        bool live;
        if (p.mask.data == nullptr) {
            live = false;
#pragma unroll
            for (int u = 0; u < BQ * BK / NT; ++u) {
                const int idx = tid + u * NT, r = idx / BK, c = idx % BK;
                const bool ok = q0 + r < n_q && j0 + c < n_kv;
                bias[r][c] = ok ? 0.0f : -INFINITY;
                live |= ok;
            }
        } else if (p.mask_f16) {
            live = mask_tile<f16, BQ, BK, NT>(p, mrows, slope, q0, j0, n_q, n_kv, bias);
        } else {
            live = mask_tile<float, BQ, BK, NT>(p, mrows, slope, q0, j0, n_q, n_kv, bias);
        }
        // Every entry masked: skip the tile.
        if (!__syncthreads_or(live)) continue;

        if (vec) {
            kv_tiles<T, true, D, BK, NT, LDK>(p, kbase, vbase, j0, n_kv, ks, vs);
        } else {
            kv_tiles<T, false, D, BK, NT, LDK>(p, kbase, vbase, j0, n_kv, ks, vs);
        }
        __syncthreads();

        float s[BK / 8][4];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
        for (int kt = 0; kt < D / 16; ++kt) {
            uint32_t a[4];
            const f16* qa = &qs[ra * LDQ + kt * 16 + 2 * t];
            a[0] = lds32(qa);
            a[1] = lds32(qa + 8 * LDQ);
            a[2] = lds32(qa + 8);
            a[3] = lds32(qa + 8 * LDQ + 8);
#pragma unroll
            for (int n = 0; n < BK / 8; ++n) {
                const f16* kb = &ks[(n * 8 + g) * LDK + kt * 16 + 2 * t];
                mma_16816(s[n], a, lds32(kb), lds32(kb + 8));
            }
        }

        // Online softmax of rows ra (s[n][0..1]) and rb (s[n][2..3]); a row's values
        // are spread over the 4 lanes of a quad.
        float mx_a = -INFINITY, mx_b = -INFINITY;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int r = x < 2 ? ra : rb, c = n * 8 + 2 * t + (x & 1);
                const float bs = bias[r][c];
                s[n][x] = bs == -INFINITY ? -INFINITY : score(p, s[n][x], bs);
            }
            mx_a = fmaxf(mx_a, fmaxf(s[n][0], s[n][1]));
            mx_b = fmaxf(mx_b, fmaxf(s[n][2], s[n][3]));
        }
#pragma unroll
        for (int off = 1; off < 4; off <<= 1) {
            mx_a = fmaxf(mx_a, __shfl_xor_sync(FULL_MASK, mx_a, off));
            mx_b = fmaxf(mx_b, __shfl_xor_sync(FULL_MASK, mx_b, off));
        }
        const float new_a = fmaxf(m_a, mx_a), new_b = fmaxf(m_b, mx_b);
        const float c_a = new_a == -INFINITY ? 1.0f : expf(m_a - new_a);
        const float c_b = new_b == -INFINITY ? 1.0f : expf(m_b - new_b);
        m_a = new_a;
        m_b = new_b;
        l_a *= c_a;
        l_b *= c_b;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            o[n][0] *= c_a;
            o[n][1] *= c_a;
            o[n][2] *= c_b;
            o[n][3] *= c_b;
        }
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const float mref = x < 2 ? m_a : m_b;
                s[n][x] = s[n][x] == -INFINITY ? 0.0f : expf(s[n][x] - mref);
            }
            l_a += s[n][0] + s[n][1];
            l_b += s[n][2] + s[n][3];
        }
        // The probabilities as A fragments of P (16 x BK): k-tile kk is n-tiles 2kk, 2kk+1.
        uint32_t pa[BK / 16][4];
#pragma unroll
        for (int kk = 0; kk < BK / 16; ++kk) {
            pa[kk][0] = pack_half2(s[2 * kk][0], s[2 * kk][1]);
            pa[kk][1] = pack_half2(s[2 * kk][2], s[2 * kk][3]);
            pa[kk][2] = pack_half2(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[kk][3] = pack_half2(s[2 * kk + 1][2], s[2 * kk + 1][3]);
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
#pragma unroll
            for (int kk = 0; kk < BK / 16; ++kk) {
                uint32_t b0, b1;
                ldsm_b_trans(vs, LDK, kk * 16, n * 8, lane, b0, b1);
                mma_16816(o[n], pa[kk], b0, b1);
            }
        }
    }

#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
        l_a += __shfl_xor_sync(FULL_MASK, l_a, off);
        l_b += __shfl_xor_sync(FULL_MASK, l_b, off);
    }
    const float inv_a = l_a > 0.0f ? 1.0f / l_a : 0.0f, inv_b = l_b > 0.0f ? 1.0f / l_b : 0.0f;
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
        const int e = n * 8 + 2 * t;
        if (q0 + ra < n_q) {
            store<float>(at(p.dst, e, h, q0 + ra, b), o[n][0] * inv_a);
            store<float>(at(p.dst, e + 1, h, q0 + ra, b), o[n][1] * inv_a);
        }
        if (q0 + rb < n_q) {
            store<float>(at(p.dst, e, h, q0 + rb, b), o[n][2] * inv_b);
            store<float>(at(p.dst, e + 1, h, q0 + rb, b), o[n][3] * inv_b);
        }
    }
}

// The kernels: every head dim with every K/V dtype (K and V of one dtype); fattn_vec1_*
// is fattn_vec for one query row per KV head (R = 1).
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d16_f32(const FattnArgs p) { fattn_vec<16, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d16_f16(const FattnArgs p) { fattn_vec<16, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d16_bf16(const FattnArgs p) { fattn_vec<16, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d32_f32(const FattnArgs p) { fattn_vec<32, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d32_f16(const FattnArgs p) { fattn_vec<32, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d32_bf16(const FattnArgs p) { fattn_vec<32, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d32_q8_0(const FattnArgs p) { fattn_vec<32, FATTN_VEC_ROWS, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d32_q4_0(const FattnArgs p) { fattn_vec<32, FATTN_VEC_ROWS, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d64_f32(const FattnArgs p) { fattn_vec<64, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d64_f16(const FattnArgs p) { fattn_vec<64, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d64_bf16(const FattnArgs p) { fattn_vec<64, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d64_q8_0(const FattnArgs p) { fattn_vec<64, FATTN_VEC_ROWS, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d64_q4_0(const FattnArgs p) { fattn_vec<64, FATTN_VEC_ROWS, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d80_f32(const FattnArgs p) { fattn_vec<80, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d80_f16(const FattnArgs p) { fattn_vec<80, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d80_bf16(const FattnArgs p) { fattn_vec<80, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d96_f32(const FattnArgs p) { fattn_vec<96, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d96_f16(const FattnArgs p) { fattn_vec<96, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d96_bf16(const FattnArgs p) { fattn_vec<96, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d96_q8_0(const FattnArgs p) { fattn_vec<96, FATTN_VEC_ROWS, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d96_q4_0(const FattnArgs p) { fattn_vec<96, FATTN_VEC_ROWS, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d112_f32(const FattnArgs p) { fattn_vec<112, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d112_f16(const FattnArgs p) { fattn_vec<112, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d112_bf16(const FattnArgs p) { fattn_vec<112, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d128_f32(const FattnArgs p) { fattn_vec<128, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d128_f16(const FattnArgs p) { fattn_vec<128, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d128_bf16(const FattnArgs p) { fattn_vec<128, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d128_q8_0(const FattnArgs p) { fattn_vec<128, FATTN_VEC_ROWS, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d128_q4_0(const FattnArgs p) { fattn_vec<128, FATTN_VEC_ROWS, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d256_f32(const FattnArgs p) { fattn_vec<256, FATTN_VEC_ROWS, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d256_f16(const FattnArgs p) { fattn_vec<256, FATTN_VEC_ROWS, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d256_bf16(const FattnArgs p) { fattn_vec<256, FATTN_VEC_ROWS, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d256_q8_0(const FattnArgs p) { fattn_vec<256, FATTN_VEC_ROWS, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec_d256_q4_0(const FattnArgs p) { fattn_vec<256, FATTN_VEC_ROWS, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d16_f32(const FattnArgs p) { fattn_vec<16, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d16_f16(const FattnArgs p) { fattn_vec<16, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d16_bf16(const FattnArgs p) { fattn_vec<16, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d32_f32(const FattnArgs p) { fattn_vec<32, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d32_f16(const FattnArgs p) { fattn_vec<32, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d32_bf16(const FattnArgs p) { fattn_vec<32, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d32_q8_0(const FattnArgs p) { fattn_vec<32, 1, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d32_q4_0(const FattnArgs p) { fattn_vec<32, 1, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d64_f32(const FattnArgs p) { fattn_vec<64, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d64_f16(const FattnArgs p) { fattn_vec<64, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d64_bf16(const FattnArgs p) { fattn_vec<64, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d64_q8_0(const FattnArgs p) { fattn_vec<64, 1, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d64_q4_0(const FattnArgs p) { fattn_vec<64, 1, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d80_f32(const FattnArgs p) { fattn_vec<80, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d80_f16(const FattnArgs p) { fattn_vec<80, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d80_bf16(const FattnArgs p) { fattn_vec<80, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d96_f32(const FattnArgs p) { fattn_vec<96, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d96_f16(const FattnArgs p) { fattn_vec<96, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d96_bf16(const FattnArgs p) { fattn_vec<96, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d96_q8_0(const FattnArgs p) { fattn_vec<96, 1, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d96_q4_0(const FattnArgs p) { fattn_vec<96, 1, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d112_f32(const FattnArgs p) { fattn_vec<112, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d112_f16(const FattnArgs p) { fattn_vec<112, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d112_bf16(const FattnArgs p) { fattn_vec<112, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d128_f32(const FattnArgs p) { fattn_vec<128, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d128_f16(const FattnArgs p) { fattn_vec<128, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d128_bf16(const FattnArgs p) { fattn_vec<128, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d128_q8_0(const FattnArgs p) { fattn_vec<128, 1, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d128_q4_0(const FattnArgs p) { fattn_vec<128, 1, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d256_f32(const FattnArgs p) { fattn_vec<256, 1, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d256_f16(const FattnArgs p) { fattn_vec<256, 1, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d256_bf16(const FattnArgs p) { fattn_vec<256, 1, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d256_q8_0(const FattnArgs p) { fattn_vec<256, 1, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_VEC_WARPS * WARP_SIZE) fattn_vec1_d256_q4_0(const FattnArgs p) { fattn_vec<256, 1, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d16_f32(const FattnArgs p) { fattn_mma<16, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d16_f16(const FattnArgs p) { fattn_mma<16, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d16_bf16(const FattnArgs p) { fattn_mma<16, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d32_f32(const FattnArgs p) { fattn_mma<32, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d32_f16(const FattnArgs p) { fattn_mma<32, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d32_bf16(const FattnArgs p) { fattn_mma<32, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d32_q8_0(const FattnArgs p) { fattn_mma<32, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d32_q4_0(const FattnArgs p) { fattn_mma<32, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d64_f32(const FattnArgs p) { fattn_mma<64, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d64_f16(const FattnArgs p) { fattn_mma<64, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d64_bf16(const FattnArgs p) { fattn_mma<64, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d64_q8_0(const FattnArgs p) { fattn_mma<64, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d64_q4_0(const FattnArgs p) { fattn_mma<64, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d80_f32(const FattnArgs p) { fattn_mma<80, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d80_f16(const FattnArgs p) { fattn_mma<80, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d80_bf16(const FattnArgs p) { fattn_mma<80, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d96_f32(const FattnArgs p) { fattn_mma<96, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d96_f16(const FattnArgs p) { fattn_mma<96, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d96_bf16(const FattnArgs p) { fattn_mma<96, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d96_q8_0(const FattnArgs p) { fattn_mma<96, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d96_q4_0(const FattnArgs p) { fattn_mma<96, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d112_f32(const FattnArgs p) { fattn_mma<112, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d112_f16(const FattnArgs p) { fattn_mma<112, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d112_bf16(const FattnArgs p) { fattn_mma<112, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d128_f32(const FattnArgs p) { fattn_mma<128, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d128_f16(const FattnArgs p) { fattn_mma<128, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d128_bf16(const FattnArgs p) { fattn_mma<128, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d128_q8_0(const FattnArgs p) { fattn_mma<128, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS * 2) fattn_mma_d128_q4_0(const FattnArgs p) { fattn_mma<128, KvQ4_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS_D256 * 2) fattn_mma_d256_f32(const FattnArgs p) { fattn_mma<256, float>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS_D256 * 2) fattn_mma_d256_f16(const FattnArgs p) { fattn_mma<256, f16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS_D256 * 2) fattn_mma_d256_bf16(const FattnArgs p) { fattn_mma<256, bf16>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS_D256 * 2) fattn_mma_d256_q8_0(const FattnArgs p) { fattn_mma<256, KvQ8_0>(p); }
extern "C" __global__ void __launch_bounds__(FATTN_MMA_ROWS_D256 * 2) fattn_mma_d256_q4_0(const FattnArgs p) { fattn_mma<256, KvQ4_0>(p); }
