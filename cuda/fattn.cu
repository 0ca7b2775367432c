// Flash attention (flash_attn_ext): softmax(scale * q k^T (+ slope * mask)) v per query
// row and head, with the online softmax of FlashAttention and no score tensor in memory.
// K and V have one dtype (F32, F16, BF16, Q8_0, Q4_0, dequantized in registers; see
// fattn_common.cuh) and the head dim D is a template parameter (16, 32, 64, 80, 96, 112, 128, 256).
// The pieces below that paged attention (fattn_paged.cu) shares are in fattn_common.cuh:
// the lane groups, online softmax, block merge and streamed stage of the CUDA-core decode,
// and the tensor-core tile (mma, softmax, P.V) with the block shapes.
//
//   fattn_dec_d<D>_f16  (decode on tensor cores, F16 caches with GQA; flash-decoding)
//     grid (split, n_head_kv, batch * ceil(group * n_q / 16)), block one warp. The warp
//     takes up to 16 query rows of the heads sharing one KV head (GQA: each K/V row is
//     read once for all of them) as the 16 rows of the prefill kernel's mma tiles, and
//     runs that kernel's key loop (mma_keys) over one chunk of whole key tiles: K/V tiles
//     through shared memory (cp.async, two buffers, for aligned F16 rows), scores and
//     P.V on mma.sync, the online softmax in registers. With split == 1 it writes the
//     normalized result, otherwise the partial (max, sum, acc[D]) of its chunk per row
//     into p.part for fattn_combine.
//   fattn_vec_d<D>_<kv>  (decode on CUDA cores: F32 and BF16 caches, exact in their
//     precision, the quantized ones, and F16 without GQA as fattn_vec1; flash-decoding)
//     grid (split, n_head_kv,
//     batch * ceil(group * n_q / FATTN_VEC_ROWS)), block FATTN_VEC_WARPS * 32. A block
//     takes one chunk of keys of one KV head and up to FATTN_VEC_ROWS query rows of the
//     heads sharing that KV head (GQA: each K/V row is read once for all of them). Lanes
//     work in groups of L = D/8 rounded up to a power of two, each lane owning 8 elements
//     of the row, one group per key; a step takes FATTN_VEC_UNROLL keys per group, all
//     their K/V loads (16 bytes per lane for F16) and mask reads issued before the first
//     use, and rescales the running state once per step. Each group keeps its own running
//     (max, sum, acc) per row, merged at the end by shuffles across groups and shared
//     memory across warps. fattn_vec1_d<D>_<kv> is the same kernel for one row per block
//     (MHA decode: one accumulator in registers instead of FATTN_VEC_ROWS). With split ==
//     1 the block writes the normalized result, otherwise the partial (max, sum, acc[D])
//     of its chunk into p.part for fattn_combine.
//   fattn_vec1s_d<D>_<kv>, fattn_vec4s_d<D>_<kv>  (streamed one-query decode: vec1s for
//     MHA of F16 and BF16 caches whose rows start 16-byte aligned; for Q8_0 and Q4_0
//     caches of head dims 64, 128 and 256 whose rows start 4- or 8-byte aligned, see
//     KvRow, vec4s for GQA at head dims 128 and 256, vec1s for the rest: MHA, head dim
//     64, a mask per head) grid (split, n_head_kv * ceil(group / R), batch), R = 1 or 4:
//     a block takes up to R query heads of one KV head (R = 1: query head blockIdx.y, KV
//     head blockIdx.y / group; R = 4: the group's heads 4 at a time, each K/V row copied
//     and dequantized once for all of them; they share a mask row). fattn_vec1's lanes
//     and arithmetic, but K and V go to shared memory by cp.async in VEC1S_STAGES buffers
//     of VEC1S_UNROLL keys per lane group (quantized rows whole, dequantized from shared
//     memory), the next stage in flight while one is computed (the bytes in flight are
//     not bounded by registers), and nothing is copied past the last key of the chunk the
//     mask leaves visible (a decode graph reads a whole KV-length bucket with a masked
//     tail). When every key before that one has a zero mask entry (a causal row), the
//     loop reads no mask entry per key.
//   fattn_combine  grid (n_head * n_q * batch), block FATTN_COMBINE_THREADS: merges the
//     split partials of one row (either decode kernel's), rescaling each by exp(max_i - max);
//     with p.q8 it also writes the row as the Q8_1 activations of the decode product that
//     reads the result (each warp quantizes 32 whole elements: the lowering asks for it
//     only when d % 32 == 0), so that product needs no quantizing launch of its own.
//   fattn_mma_d<D>_<kv>  (prefill) grid (ceil(n_q / BQ), n_head, batch), block BQ / 16
//     warps, BQ = FATTN_MMA_ROWS (FATTN_MMA_ROWS_D256 for D = 256), the blocks of the
//     last query rows (the longest causal ranges) first. Q of the block's rows is staged
//     through shared memory as F16 and, for D <= 128, kept in registers as mma A
//     fragments. Key tiles of FATTN_MMA_KEYS keys (half as many for D = 256) go to shared
//     memory as F16 rows, K and V together: F16 caches with 16-byte rows by cp.async into
//     two buffers, the next tile in flight while the current one is computed; the other
//     types (and D = 256, one buffer) by loads converted to F16. Each warp computes its
//     16 rows' scores with mma.sync m16n8k16 (F16 in, F32 accumulation; K fragments by
//     ldmatrix), runs the online softmax on them in registers (the accumulator layout of
//     mma is fixed, so the rows of the output accumulator are rescaled in place, and only
//     when a row's max grew), and multiplies the probabilities, reused as the A operand
//     straight from registers, by the V tile (its B fragments transposed by ldmatrix).
//     Each lane reads the mask entries of its own score entries one tile ahead into
//     registers; a warp whose 16 rows see no key of a tile skips it.
//   fattn_kv_range  grid (ceil(n_kv / FATTN_RANGE_KEYS), ceil(n_q / FATTN_RANGE_ROWS),
//     mask heads x batches), block FATTN_RANGE_THREADS: the first and last live key of
//     every FATTN_RANGE_ROWS x FATTN_RANGE_KEYS piece of the mask, launched before a long
//     masked prefill (the lowering's threshold) so that fattn_mma loops only over the
//     tiles between its rows' first and last live key: past the diagonal of a causal
//     mask nothing is loaded.
//
// A row whose keys are all masked gives zeros. A score that is not finite (a NaN or an
// infinity in q or in a visible key's K row) is NaN (finite_or_nan), and every running
// maximum keeps a NaN (fmax_nan), so the row comes out NaN; a NaN or an infinity in a
// visible key's V row reaches the output through its weight. The V rows of masked keys are
// multiplied by a weight of 0 (tiles and key groups are shared between rows), so they must
// be finite, as in ggml (the KV cache is zero-initialised). Every kernel waits for its predecessor
// before reading anything (pdl_enter), allocates nothing and never synchronizes with the
// host, so all are capturable.
#include "fattn_common.cuh"
#include "quant.cuh"

// The writer of finish_rows for a fattn_vec or fattn_vec1s block: row r (query sq[r],
// head sh[r], batch b) normalized with split == 1, else the chunk's partial (max, sum,
// acc[D]) at chunk `split` of the row in p.part.
template <int D>
__device__ __forceinline__ auto rows_out(const FattnArgs& p, const int* sq, const int* sh, int b, i64 split) {
    return [&p, sq, sh, b, split](int r, int e, float mx, float sum, float a) {
        const i64 qi = sq[r], h = sh[r];
        if (p.split == 1) {
            store<float>(at(p.dst, e, h, qi, b), sum != 0.0f ? a / sum : 0.0f);
            return;
        }
        const i64 row = (b * p.q.ne[1] + qi) * p.q.ne[2] + h;
        float* part = p.part + (row * p.split + split) * (D + 2);
        if (e == 0) {
            part[0] = mx;
            part[1] = sum;
        }
        part[2 + e] = a;
    };
}

// The query rows of a fattn_vec or fattn_vec1s block, the nrows from flat row first_row
// (row t: query t / group, head hk * group + t % group): each row's query and head (sq,
// sh), mask row and slope, its q in qs (zero past D) and its sacc zeroed. Ends with a
// barrier.
template <int D, int R>
__device__ __forceinline__ void vec_rows(const FattnArgs& p, int first_row, int nrows, i64 hk, int b,
                                         float (*qs)[vec_lanes<D>() * 8], float (*sacc)[vec_lanes<D>() * 8],
                                         const char** smrow, float* sslope, int* sq, int* sh) {
    constexpr int DP = vec_lanes<D>() * 8;
    const int tid = threadIdx.x, group = (int)p.group;
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
}

// Row r's part of a fattn_vec step: the scores of the lane group's U keys (K pieces kp,
// the row's biases bias[u][r], -inf for a key past the chunk) and the online softmax step
// with their V pieces.
template <int L, int U, int R, typename P>
__device__ __forceinline__ void row_keys(const FattnArgs& p, float4 qa, float4 qb, const P (&kp)[U],
                                         const P (&vp)[U], const float (&bias)[U][R], int r, float& m, float& l,
                                         float (&acc)[8]) {
    float s[U];
    float mx = m;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const float dot = group_dot<L>(kp[u], qa, qb);
        s[u] = bias[u][r] == -INFINITY ? -INFINITY : score(p, dot, bias[u][r]);
        mx = fmax_nan(mx, s[u]);
    }
    if (mx == -INFINITY) return;  // every key so far masked
    online_add(mx, s, vp, m, l, acc);
}

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
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 n_kv = p.k.ne[1];
    // 32-bit index math: the grid limits keep batch, rows and heads far below 2^31, and
    // a 64-bit division is a long call on the kernel's critical path
    const int batch = (int)p.q.ne[3];
    const i64 split = blockIdx.x, hk = blockIdx.y;
    const int b = (int)blockIdx.z % batch, rb = (int)blockIdx.z / batch;
    const int first_row = rb * R;
    const int nrows = (int)min((i64)R, p.group * p.q.ne[1] - first_row);
    vec_rows<D, R>(p, first_row, nrows, hk, b, qs, sacc, smrow, sslope, sq, sh);

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
            row_keys<L, U>(p, qa, qb, kp, vp, bias, r, m[r], l[r], acc[r]);
        }
    }

    finish_rows<D, R>(m, l, acc, nrows, sacc, sm, sl, rows_out<D>(p, sq, sh, b, split));
}

// The one-row decode kernel for 16-bit caches whose rows start 16-byte aligned (MHA
// decode of F16 and BF16 caches): fattn_vec's lanes and arithmetic, but K and V reach
// shared memory by cp.async in NS stages of UN keys per lane group, so that the next
// stages' copies are in flight while a stage is computed and the loads in flight are not
// bounded by registers. Before the first copy the block finds the last key of its chunk
// the mask leaves visible (the decode graph reads a whole KV-length bucket whose tail is
// masked) and copies nothing past it.
// Merges the split partials of row blockIdx.x (flat over [n_head, n_q, batch]): the first
// warp loads every chunk's (max, sum) at once (split <= 2 * WARP_SIZE) and turns them into
// the chunk weights exp(max_i - max) / sum, then each thread sums its elements over the
// chunks, their loads unrolled so that several are in flight, and writes the sum (and its
// Q8_1 copy when p.q8 is set).
template <int LAYOUT>
__device__ void combine(const FattnArgs& p) {
    static_assert(FATTN_COMBINE_THREADS % WARP_SIZE == 0, "a warp's elements share a Q8_1 block");
    __shared__ float w[2 * WARP_SIZE];
    // 32-bit index math (the grid holds the rows): no 64-bit division on the critical path
    const int d = (int)p.dst.ne[0], split = (int)p.split;
    const int n_head = (int)p.dst.ne[1], n_q = (int)p.dst.ne[2], row = (int)blockIdx.x;
    const int h = row % n_head, qi = (row / n_head) % n_q, b = row / (n_head * n_q);
    const float* part = p.part + (i64)row * split * (d + 2);
    const int tid = threadIdx.x;
    if (tid < WARP_SIZE) {
        float m[2], l[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int s = tid + i * WARP_SIZE;
            m[i] = s < split ? part[s * (d + 2)] : -INFINITY;
            l[i] = s < split ? part[s * (d + 2) + 1] : 0.0f;
        }
        const float mx = warp_max(fmax_nan(m[0], m[1]));
        float e[2], sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            e[i] = m[i] == -INFINITY ? 0.0f : expf(m[i] - mx);
            sum += l[i] * e[i];
        }
        sum = warp_sum(sum);
        const float inv = sum != 0.0f ? 1.0f / sum : 0.0f;  // every key masked: zeros
#pragma unroll
        for (int i = 0; i < 2; ++i) w[tid + i * WARP_SIZE] = e[i] * inv;
    }
    __syncthreads();
    for (int e = tid; e < d; e += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 8
        for (int s = 0; s < split; ++s) acc += part[s * (d + 2) + 2 + e] * w[s];
        store<float>(at(p.dst, e, h, qi, b), acc);
        // column qi + n_q b of [d * n_head, n_q * batch]; e's warp covers its 32-element
        // sub-block (blockDim.x and d are multiples of 32)
        if (p.q8 != nullptr) {
            const i64 k = (i64)d * n_head;
            store_act(acc, p.q8 + (qi + (i64)n_q * b) * p.q8_nb1, k, (h * d + e) / 32, e % 32, LAYOUT);
        }
    }
}

extern "C" __global__ void __launch_bounds__(FATTN_COMBINE_THREADS) fattn_combine(const FattnArgs p) {
    pdl_enter();
    // the layout as a constant: the store's offsets without a select
    if (p.q8_layout == ACT_PAIRS) {
        combine<ACT_PAIRS>(p);
    } else if (p.q8_layout == ACT_F16) {
        combine<ACT_F16>(p);
    } else {
        combine<ACT_BLOCKS>(p);
    }
}

// One past the last key of j_begin..j_end that mask row `mrow` leaves visible (j_begin
// when none; j_end without a mask), found by the whole block of NW warps (`slive`: NW
// pairs of ints of shared memory). `plain` tells whether the bias of every key before it
// is 0 (no mask, or a causal row: the caller then reads no mask entry per key). Ends with
// a barrier, after which the block's earlier shared stores are visible too.
template <int NW>
__device__ __forceinline__ i64 visible_end(const FattnArgs& p, const char* mrow, float slope, i64 j_begin,
                                           i64 j_end, int (*slive)[2], bool& plain) {
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    // the last visible key, and the first key whose bias is not 0 (masked or not)
    i64 live = j_begin - 1, odd = j_end;
    if (mrow == nullptr) {
        live = j_end - 1;
    } else {
#pragma unroll 4
        for (i64 j = j_begin + tid; j < j_end; j += NW * WARP_SIZE) {
            const float bias = mask_bias(p, mrow, slope, j);
            if (bias != -INFINITY) live = j;
            if (bias != 0.0f && odd == j_end) odd = j;
        }
    }
    // key offsets within a chunk fit 32 bits (a chunk is at most n_kv keys)
    int live_off = warp_max((int)(live - j_begin));
    int odd_off = warp_min((int)(odd - j_begin));
    if (lane == 0) {
        slive[warp][0] = live_off;
        slive[warp][1] = odd_off;
    }
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NW; ++w) {
        live_off = max(live_off, slive[w][0]);
        odd_off = min(odd_off, slive[w][1]);
    }
    plain = odd_off > live_off;
    return j_begin + live_off + 1;
}

// The cp.async copies of fattn_vec1s's stages, by every thread of the block: stage t is
// the KS keys from j_begin + t * KS of K and V, into buffer t % NS. Piece c of a stage is
// row c / PIECES of K (then of V), COPY bytes at (c % PIECES) * COPY (KvRow); keys from
// `last` on copy key `last`.
template <int D, typename T, int NS, int KS>
struct Vec1sCopies {
    const char* kbase;
    const char* vbase;
    i64 kstride, vstride, j_begin;

    __device__ __forceinline__ void issue(char (*kv)[2][KS][KvRow<T, D>::BYTES], int t, i64 last) const {
        constexpr int NT = FATTN_VEC_WARPS * WARP_SIZE;
        constexpr int COPY = KvRow<T, D>::COPY;
        constexpr int PIECES = KvRow<T, D>::SRC / COPY;  // copies per K/V row
        constexpr int COPIES = 2 * KS * PIECES;
        const int tid = threadIdx.x;
        const i64 j0 = j_begin + (i64)t * KS;
#pragma unroll
        for (int c0 = 0; c0 < COPIES; c0 += NT) {
            const int c = c0 + tid;
            if (COPIES % NT == 0 || c < COPIES) {
                const int is_v = c / (KS * PIECES), rem = c % (KS * PIECES);
                const int key = rem / PIECES, piece = rem % PIECES;
                const i64 j = min(j0 + key, last);
                const char* src = is_v ? vbase + j * vstride : kbase + j * kstride;
                copy_async<COPY>(&kv[t % NS][is_v][key][piece * COPY], src + piece * COPY);
            }
        }
    }
};

// R: query rows per block, the query heads of one KV head (1: one head, MHA decode or a
// mask per head; 4: up to 4 heads of a group, a group of more in several blocks).
template <int D, typename T, int NS, int UN, int R>
__device__ void fattn_vec1s(const FattnArgs& p) {
    constexpr int L = vec_lanes<D>();
    constexpr int KPW = WARP_SIZE / L;  // keys per warp per unrolled key
    constexpr int NW = FATTN_VEC_WARPS;
    constexpr int DP = L * 8;
    constexpr int KS = UN * NW * KPW;  // keys per stage
    __shared__ __align__(16) char kv[NS][2][KS][KvRow<T, D>::BYTES];
    __shared__ __align__(16) float qs[R][DP];
    __shared__ float sacc[R][DP];
    __shared__ float sm[NW][R], sl[NW][R];
    __shared__ int slive[NW][2];
    __shared__ const char* smrow[R];
    __shared__ float sslope[R];
    __shared__ int sq[R], sh[R];

    pdl_enter();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    // grid.y: KV head hk's ceil(group / R) blocks of up to R query heads (R = 1: query
    // head blockIdx.y); one query. The rows of a block share one mask row (the lowering
    // takes R > 1 only for a mask broadcast over heads).
    const int b = (int)blockIdx.z, row_blocks = ((int)p.group + R - 1) / R;
    const int hk = (int)blockIdx.y / row_blocks, first = (int)blockIdx.y % row_blocks * R;
    const int nrows = min(R, (int)p.group - first);
    const i64 split = blockIdx.x;
    const i64 j_begin = split * p.chunk, j_chunk_end = min(p.k.ne[1], j_begin + p.chunk);
    const Vec1sCopies<D, T, NS, KS> copies{at(p.k, 0, 0, hk, b), at(p.v, 0, 0, hk, b), p.k.nb[1], p.v.nb[1],
                                           j_begin};
    // The first stage goes out before the chunk's mask is read (its masked keys are
    // copied, and weigh nothing); the others stop at the last visible key.
    copies.issue(kv, 0, j_chunk_end - 1);
    stage_commit();

    // q, and the last visible key of the chunk
    vec_rows<D, R>(p, first, nrows, hk, b, qs, sacc, smrow, sslope, sq, sh);
    const char* mrow = smrow[0];
    float slope[R];
#pragma unroll
    for (int r = 0; r < R; ++r) slope[r] = sslope[r];
    bool plain;
    const i64 j_end = visible_end<NW>(p, mrow, slope[0], j_begin, j_chunk_end, slive, plain);
    const int stages = (int)((j_end - j_begin + KS - 1) / KS);
#pragma unroll
    for (int t = 1; t < NS - 1; ++t) {
        if (t < stages) copies.issue(kv, t, j_end - 1);
        stage_commit();
    }

    const int sub = lane / L, e0 = (lane % L) * 8;
    float m[R], l[R], acc[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[r][i] = 0.0f;
    }
    // the mask entries of the lane's keys of a stage, read a stage ahead (0 before j_end
    // when the chunk's row is plain); each row scales them by its slope
    auto biases = [&](int t, float out[UN]) {
#pragma unroll
        for (int u = 0; u < UN; ++u) {
            const i64 j = j_begin + (i64)t * KS + (u * NW + warp) * KPW + sub;
            out[u] = j < j_end ? (plain ? 0.0f : mask_bias(p, mrow, 1.0f, j)) : -INFINITY;
        }
    };
    float bias[UN], bias_next[UN];
    biases(0, bias);
    // one row's q stays in registers; more rows' are read from qs at each stage
    const float4 qa = *reinterpret_cast<const float4*>(&qs[0][e0]);
    const float4 qb = *reinterpret_cast<const float4*>(&qs[0][e0 + 4]);
    for (int t = 0; t < stages; ++t) {
        if (t + NS - 1 < stages) copies.issue(kv, t + NS - 1, j_end - 1);
        stage_commit();
        if (t + 1 < stages) biases(t + 1, bias_next);
        stage_wait<NS - 1>();
        __syncthreads();
        const auto score_of = [&](int r, int u, float dot) {
            return bias[u] == -INFINITY ? -INFINITY : score(p, dot, slope[r] * bias[u]);
        };
        stream_stage<D, T, UN, R>(kv[t % NS][0], kv[t % NS][1], qa, qb, qs, nrows, score_of, m, l, acc);
#pragma unroll
        for (int u = 0; u < UN; ++u) bias[u] = bias_next[u];
    }
    stage_wait<0>();  // a chunk with no visible key leaves its first stage in flight
    finish_rows<D, R>(m, l, acc, nrows, sacc, sm, sl, rows_out<D>(p, sq, sh, b, split));
}

// ---------------------------------------------------------------------------------------
// Prefill on tensor cores.

// The K and V tiles of keys j0..j0+BK into ks and vs ([key][d], LDK halves per key),
// zeros past the last key (its probability is 0, but V must not hold a NaN). ASYNC (F16
// rows that allow 16-byte loads): cp.async copies that the caller waits for (stage_wait),
// so that the tile arrives while the previous one is computed. Otherwise loads, a
// conversion to F16 and stores; VEC: rows allow 16-byte loads. The loops have fixed trip
// counts and branch-free loads (clamped keys), so that a thread's loads are in flight
// together, up to 8 pieces of K and V each (the one-warp decode block has 16 a tile, which
// would hold 128 registers).
template <typename T, bool ASYNC, bool VEC, int D, int BK, int NT, int LDK>
__device__ __forceinline__ void kv_tiles(const FattnArgs& p, const char* kbase, const char* vbase, i64 j0,
                                         i64 n_kv, f16* ks, f16* vs) {
    constexpr int PIECES = BK * (D / 8);
    constexpr int U = (PIECES + NT - 1) / NT;  // pieces a thread copies
    constexpr int UB = U < 8 ? U : 8;          // of which in flight together
    constexpr int BATCHES = (U + UB - 1) / UB;
    const char* kt = kbase + j0 * p.k.nb[1];
    const char* vt = vbase + j0 * p.v.nb[1];
#pragma unroll(ASYNC ? BATCHES : 1)
    for (int u0 = 0; u0 < U; u0 += UB) {
#pragma unroll
        for (int uu = 0; uu < UB; ++uu) {
            const int u = u0 + uu;
            if (U % UB != 0 && u >= U) break;
            const int idx = threadIdx.x + u * NT;
            if (PIECES % NT == 0 || idx < PIECES) {
                const int c = idx / (D / 8), e0 = (idx % (D / 8)) * 8;
                const bool in = j0 + c < n_kv;
                const int cc = in ? c : (int)(n_kv - 1 - j0);  // clamped to the last key
                const char* krow = kt + cc * p.k.nb[1];
                const char* vrow = vt + cc * p.v.nb[1];
                if constexpr (ASYNC) {
                    copy16_or_zero(reinterpret_cast<char*>(&ks[c * LDK + e0]), krow + 2 * e0, in);
                    copy16_or_zero(reinterpret_cast<char*>(&vs[c * LDK + e0]), vrow + 2 * e0, in);
                } else {
                    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
                    const uint4 kp = tile_piece<T, VEC>(krow, e0);
                    const uint4 vp = tile_piece<T, VEC>(vrow, e0);
                    *reinterpret_cast<uint4*>(&ks[c * LDK + e0]) = in ? kp : zero;
                    *reinterpret_cast<uint4*>(&vs[c * LDK + e0]) = in ? vp : zero;
                }
            }
        }
    }
}

// The mask entries of this lane's score entries of keys j0..j0+BK (rows ra: x 0, 1; rb:
// x 2, 3; keys n * 8 + 2t + (x & 1)), their bits loaded as stored (F16 or F32: a uniform
// branch, not a template argument, which would triple the kernel's instantiations) so
// that they stay in flight until tile_bias uses them: the caller loads the next tile's
// while it computes this one. Nothing without a mask.
template <typename M, int BK>
__device__ __forceinline__ void mask_bits(const FattnArgs& p, const char* mra, const char* mrb, i64 j0, i64 n_kv,
                                          int t, uint32_t raw[BK / 8][4]) {
    const i64 nb0 = p.mask.nb[0];
    if (j0 + BK <= n_kv) {  // a whole tile: no clamping, offsets fixed per (n, x)
        const char* a = mra + (j0 + 2 * t) * nb0;
        const char* b = mrb + (j0 + 2 * t) * nb0;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int x = 0; x < 4; ++x) raw[n][x] = *reinterpret_cast<const M*>((x < 2 ? a : b) + (n * 8 + (x & 1)) * nb0);
        }
        return;
    }
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const i64 j = min(j0 + n * 8 + 2 * t + (x & 1), n_kv - 1);
            raw[n][x] = *reinterpret_cast<const M*>((x < 2 ? mra : mrb) + j * nb0);
        }
    }
}

template <int BK>
__device__ __forceinline__ void mask_load(const FattnArgs& p, const char* mra, const char* mrb, i64 j0, i64 n_kv,
                                          int t, uint32_t raw[BK / 8][4]) {
    if (mra == nullptr) return;
    if (p.mask_f16) {
        mask_bits<uint16_t, BK>(p, mra, mrb, j0, n_kv, t, raw);
    } else {
        mask_bits<uint32_t, BK>(p, mra, mrb, j0, n_kv, t, raw);
    }
}

// The bias (slope * mask, -inf past the last key) of those entries, rows a and b with
// their own slopes; whether any of the warp's entries is live.
template <int BK>
__device__ __forceinline__ bool tile_bias(const FattnArgs& p, const uint32_t raw[BK / 8][4], bool masked, float sa,
                                          float sb, i64 j0, i64 n_kv, int t, float bias[BK / 8][4]) {
    const bool f16_mask = p.mask_f16 != 0;
    bool live = false;
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const bool in = j0 + n * 8 + 2 * t + (x & 1) < n_kv;
            float b = in ? 0.0f : -INFINITY;
            if (masked) {
                const float m = f16_mask ? __half2float(__ushort_as_half((unsigned short)raw[n][x]))
                                         : __uint_as_float(raw[n][x]);
                b = in && m != -INFINITY ? (x < 2 ? sa : sb) * m : -INFINITY;
            }
            bias[n][x] = b;
            live |= b != -INFINITY;
        }
    }
    return __any_sync(FULL_MASK, live);
}

// The scores of one warp's tile as score() computes them (scale, softcap, bias; the
// softcap branch taken once per tile), and each of the lane's two rows' maximum over the
// tile (mx: rows g and g + 8, whose values are spread over the 4 lanes of a quad).
template <int BK>
__device__ __forceinline__ void tile_scores(const FattnArgs& p, const float (*bias)[4], float (&s)[BK / 8][4],
                                            float (&mx)[2]) {
    const float scale = p.scale, cap = p.softcap;
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) s[n][x] = finite_or_nan(s[n][x]) * scale;
    }
    if (cap > 0.0f) {
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int x = 0; x < 4; ++x) s[n][x] = cap * tanhf(s[n][x] / cap);
        }
    }
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            const float bs = bias[n][x];
            s[n][x] = bs == -INFINITY ? -INFINITY : s[n][x] + bs;
            mx[x / 2] = fmax_nan(mx[x / 2], s[n][x]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmax_nan(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
        mx[r] = fmax_nan(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
    }
}

// Rows q0..q0+BQ of Q (head h, batch b) into qs as F16 (LD halves a row), zeros past the
// last row: 16-byte loads when the rows allow them, all of a thread's loads issued before
// the first store.
template <int D, int BQ, int NT, int LD>
__device__ __forceinline__ void q_tile(const FattnArgs& p, i64 q0, i64 h, i64 b, f16* qs) {
    const i64 n_q = p.q.ne[1];
    const bool vec = p.q.nb[0] == 4 && ((uintptr_t)p.q.data | (uintptr_t)p.q.nb[1] | (uintptr_t)p.q.nb[2] |
                                        (uintptr_t)p.q.nb[3]) % 16 == 0;
    if (vec) {
        constexpr int N = BQ * D / 4;
        float4 x[(N + NT - 1) / NT];
#pragma unroll
        for (int u = 0; u < (N + NT - 1) / NT; ++u) {
            const int idx = min((int)threadIdx.x + u * NT, N - 1), r = idx / (D / 4), e = idx % (D / 4) * 4;
            x[u] = *reinterpret_cast<const float4*>(at(p.q, e, min(q0 + r, n_q - 1), h, b));
        }
#pragma unroll
        for (int u = 0; u < (N + NT - 1) / NT; ++u) {
            const int idx = threadIdx.x + u * NT, r = idx / (D / 4), e = idx % (D / 4) * 4;
            if (N % NT != 0 && idx >= N) break;
            const bool in = q0 + r < n_q;
            const __half2 lo = __floats2half2_rn(in ? x[u].x : 0.0f, in ? x[u].y : 0.0f);
            const __half2 hi = __floats2half2_rn(in ? x[u].z : 0.0f, in ? x[u].w : 0.0f);
            *reinterpret_cast<__half2*>(&qs[r * LD + e]) = lo;
            *reinterpret_cast<__half2*>(&qs[r * LD + e + 2]) = hi;
        }
        return;
    }
#pragma unroll 8
    for (int idx = threadIdx.x; idx < BQ * D; idx += NT) {
        const int r = idx / D, e = idx % D;
        const float x = load<float>(at(p.q, e, min(q0 + r, n_q - 1), h, b));  // unconditional load
        qs[r * LD + e] = __float2half_rn(q0 + r < n_q ? x : 0.0f);
    }
}

// The keys one warp attends to: the K/V rows of its KV head (kbase, vbase), tiles
// t_begin..t_end of BK keys, keys from key_end on hidden (the end of the cache or of a
// decode chunk), and the mask row (nullptr: none) and slope of each of its lane's rows a
// and b.
struct KeyRange {
    const char* kbase;
    const char* vbase;
    i64 t_begin, t_end, key_end;
    const char* mra;
    const char* mrb;
    float sa, sb;
};

// The key loop of a warp's 16 rows over the tiles of `kr`, into `st`: the first tile is
// issued, then `stage_q()` writes the block's Q rows into qs (this warp's at row 16 warp)
// while it is in flight. NT threads (the block) load every tile together, so every warp
// of the block runs the same tiles.
template <int D, typename T, bool ASYNC, bool VEC, int NT, typename StageQ>
__device__ __forceinline__ void mma_keys(const FattnArgs& p, const KeyRange& kr,
                                         f16 (*kv)[2][MmaShape<D>::BK * MmaShape<D>::LD], const f16* qs,
                                         StageQ stage_q, MmaState<D>& st) {
    using S = MmaShape<D>;
    constexpr int BK = S::BK, LD = S::LD;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, t = lane % 4;
    const i64 t_begin = kr.t_begin, t_end = kr.t_end, n_kv = kr.key_end;
    if (t_begin < t_end) kv_tiles<T, ASYNC, VEC, D, BK, NT, LD>(p, kr.kbase, kr.vbase, t_begin * BK, n_kv, kv[0][0], kv[0][1]);
    if constexpr (ASYNC) stage_commit();
    uint32_t mraw[BK / 8][4];
    if (t_begin < t_end) mask_load<BK>(p, kr.mra, kr.mrb, t_begin * BK, n_kv, t, mraw);
    stage_q();
    __syncthreads();
    uint32_t qa[S::QREG ? D / 16 : 1][4];
    if constexpr (S::QREG) {
#pragma unroll
        for (int kt = 0; kt < D / 16; ++kt) q_frag<LD>(qs, warp, lane, kt, qa[kt]);
    }

#pragma unroll
    for (int n = 0; n < D / 8; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.0f;
    st.m[0] = st.m[1] = -INFINITY;
    st.l[0] = st.l[1] = 0.0f;

    for (i64 it = t_begin; it < t_end; ++it) {
        const int cur = ASYNC ? (int)((it - t_begin) & 1) : 0;  // loads converted: one buffer
        if constexpr (ASYNC) {
            stage_wait<0>();
            __syncthreads();  // tile it is in; every warp is done with the other buffer
            if (it + 1 < t_end) {
                kv_tiles<T, true, VEC, D, BK, NT, LD>(p, kr.kbase, kr.vbase, (it + 1) * BK, n_kv, kv[cur ^ 1][0],
                                                      kv[cur ^ 1][1]);
            }
            stage_commit();
        } else {
            if (it > t_begin) {
                __syncthreads();  // every warp is done with the previous tile
                kv_tiles<T, false, VEC, D, BK, NT, LD>(p, kr.kbase, kr.vbase, it * BK, n_kv, kv[0][0], kv[0][1]);
            }
            __syncthreads();
        }
        float bias[BK / 8][4];
        const bool live = tile_bias<BK>(p, mraw, kr.mra != nullptr, kr.sa, kr.sb, it * BK, n_kv, t, bias);
        if (it + 1 < t_end) mask_load<BK>(p, kr.mra, kr.mrb, (it + 1) * BK, n_kv, t, mraw);
        // a warp whose rows see no key of the tile skips it (causal masks)
        if (!live) continue;
        const auto scores = [&](float (&s)[BK / 8][4], float (&mx)[2]) { tile_scores<BK>(p, bias, s, mx); };
        if constexpr (S::QREG) {
            mma_tile<D, BK, LD>(qa, kv[cur][0], kv[cur][1], lane, st, scores);
        } else {
            uint32_t qf[D / 16][4];
#pragma unroll
            for (int kt = 0; kt < D / 16; ++kt) q_frag<LD>(qs, warp, lane, kt, qf[kt]);
            mma_tile<D, BK, LD>(qf, kv[cur][0], kv[cur][1], lane, st, scores);
        }
    }
}

// The prefill block: BQ query rows of head h over the tiles of their live keys.
template <int D, typename T, bool ASYNC, bool VEC>
__device__ void fattn_mma_loop(const FattnArgs& p, f16* qs, f16 (*kv)[2][MmaShape<D>::BK * MmaShape<D>::LD]) {
    using S = MmaShape<D>;
    constexpr int BQ = S::BQ, BK = S::BK, NT = S::NT, LD = S::LD;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, t = lane % 4;
    const i64 n_q = p.q.ne[1], n_kv = p.k.ne[1];
    // heavy blocks (late query rows, long causal ranges) first
    const i64 q0 = (i64)(gridDim.x - 1 - blockIdx.x) * BQ, h = blockIdx.y, b = blockIdx.z, hk = h / p.group;
    const float slope = p.slopes[h];
    const i64 ra = q0 + warp * 16 + lane / 4, rb = ra + 8;
    // the block's tiles: those with a live mask entry (fattn_kv_range), else all
    i64 t_begin = 0, t_end = (n_kv + BK - 1) / BK;
    if (p.range != nullptr) {
        // every warp reduces the entries of the block's rows (the same, so that the loop
        // bounds stay uniform)
        const i64 groups = (n_q + FATTN_RANGE_ROWS - 1) / FATTN_RANGE_ROWS;
        const i64 chunks = (n_kv + FATTN_RANGE_KEYS - 1) / FATTN_RANGE_KEYS;
        const i64 m23 = (b % p.mask.ne[3]) * p.mask.ne[2] + h % p.mask.ne[2];
        const i64 g0 = q0 / FATTN_RANGE_ROWS, g1 = (min(q0 + BQ, n_q) - 1) / FATTN_RANGE_ROWS;
        const int* rg = p.range + (m23 * groups + g0) * chunks * 2;
        int lo = (int)n_kv, hi = 0;
        for (i64 e = lane; e < (g1 - g0 + 1) * chunks; e += WARP_SIZE) {
            lo = min(lo, rg[2 * e]);
            hi = max(hi, rg[2 * e + 1]);
        }
        lo = warp_min(lo);
        hi = warp_max(hi);
        t_begin = lo / BK;
        t_end = hi > lo ? (hi + BK - 1) / BK : t_begin;
    }
    const KeyRange kr{at(p.k, 0, 0, hk, b),
                      at(p.v, 0, 0, hk, b),
                      t_begin,
                      t_end,
                      n_kv,
                      mask_row(p, min(ra, n_q - 1), h, b),
                      mask_row(p, min(rb, n_q - 1), h, b),
                      slope,
                      slope};
    MmaState<D> st;
    mma_keys<D, T, ASYNC, VEC, NT>(p, kr, kv, qs, [&] { q_tile<D, BQ, NT, LD>(p, q0, h, b, qs); }, st);

    const i64 rows[2] = {ra, rb};
    float l[2];
    quad_sums<D>(st, l);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float inv = l[r] != 0.0f ? 1.0f / l[r] : 0.0f;
        if (rows[r] >= n_q) continue;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int e = n * 8 + 2 * t;
            store<float>(at(p.dst, e, h, rows[r], b), st.o[n][2 * r] * inv);
            store<float>(at(p.dst, e + 1, h, rows[r], b), st.o[n][2 * r + 1] * inv);
        }
    }
}

template <int D, typename T>
__device__ void fattn_mma(const FattnArgs& p) {
    using S = MmaShape<D>;
    __shared__ __align__(16) f16 kv[S::STAGES][2][S::BK * S::LD];  // [buffer][K, V][key][d]
    __shared__ __align__(16) f16 qsep[S::QREG ? 1 : S::BQ * S::LD];
    f16* qs = S::QREG ? kv[S::STAGES - 1][0] : qsep;
    pdl_enter();
    with_tile_loads<D, T>(p.kv_vec != 0, [&](auto async, auto vec) {
        fattn_mma_loop<D, T, decltype(async)::value, decltype(vec)::value>(p, qs, kv);
    });
}

// ---------------------------------------------------------------------------------------
// Decode on tensor cores.

// The block's 16 query rows into qs as F16 (LD halves a row): row r is flat row first + r
// of KV head hk (query t / group, head hk * group + t % group, t = first + r), zeros from
// row nrows on. A lane's loads of 8 elements are issued before their stores.
template <int D, int LD>
__device__ __forceinline__ void q_rows(const FattnArgs& p, int first, int nrows, int hk, int b, f16* qs) {
    const int group = (int)p.group;
#pragma unroll 2
    for (int idx = threadIdx.x; idx < 16 * D / 8; idx += WARP_SIZE) {
        const int r = idx / (D / 8), e0 = idx % (D / 8) * 8;
        float x[8];
        if (r < nrows) {
            const int t = first + r;
            const char* row = at(p.q, e0, t / group, hk * group + t % group, b);
#pragma unroll
            for (int i = 0; i < 8; ++i) x[i] = *reinterpret_cast<const float*>(row + i * p.q.nb[0]);
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) x[i] = 0.0f;
        }
        store8<f16>(reinterpret_cast<char*>(&qs[r * LD + e0]), x);
    }
}

// One warp: up to 16 rows (the query heads of KV head blockIdx.y times the queries,
// from row 16 * (blockIdx.z / batch)) over the keys of chunk blockIdx.x. With one chunk
// the result is written, else the chunk's partial (max, sum, acc[D]) per row.
template <int D, typename T, bool ASYNC, bool VEC>
__device__ void fattn_dec_rows(const FattnArgs& p, f16* qs, f16 (*kv)[2][MmaShape<D>::BK * MmaShape<D>::LD]) {
    using S = MmaShape<D>;
    constexpr int BK = S::BK, LD = S::LD;
    const int lane = threadIdx.x, t = lane % 4;
    // 32-bit index math: the grid limits keep rows, heads and batches far below 2^31
    const int n_q = (int)p.q.ne[1], n_head = (int)p.q.ne[2], batch = (int)p.q.ne[3], group = (int)p.group;
    const int hk = (int)blockIdx.y, b = (int)blockIdx.z % batch, first = (int)blockIdx.z / batch * 16;
    const int nrows = min(16, group * n_q - first);
    // a lane's rows a and b (rows past nrows stand in for the last one; their results are
    // dropped): query t / group, head hk * group + t % group
    const int ta = first + min(lane / 4, nrows - 1), tb = first + min(lane / 4 + 8, nrows - 1);
    const int ha = hk * group + ta % group, hb = hk * group + tb % group;
    const i64 j_begin = (i64)blockIdx.x * p.chunk, j_end = min(p.k.ne[1], j_begin + p.chunk);
    const KeyRange kr{at(p.k, 0, 0, hk, b),
                      at(p.v, 0, 0, hk, b),
                      j_begin / BK,
                      (j_end + BK - 1) / BK,
                      j_end,
                      mask_row(p, ta / group, ha, b),
                      mask_row(p, tb / group, hb, b),
                      p.slopes[ha],
                      p.slopes[hb]};
    MmaState<D> st;
    mma_keys<D, T, ASYNC, VEC, WARP_SIZE>(p, kr, kv, qs, [&] { q_rows<D, LD>(p, first, nrows, hk, b, qs); }, st);

    float l[2];
    quad_sums<D>(st, l);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int rr = lane / 4 + 8 * r;
        if (rr >= nrows) continue;
        const int tq = first + rr, qi = tq / group, h = hk * group + tq % group;
        if (p.split == 1) {
            const float inv = l[r] != 0.0f ? 1.0f / l[r] : 0.0f;
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                const int e = n * 8 + 2 * t;
                store<float>(at(p.dst, e, h, qi, b), st.o[n][2 * r] * inv);
                store<float>(at(p.dst, e + 1, h, qi, b), st.o[n][2 * r + 1] * inv);
            }
            continue;
        }
        const i64 row = ((i64)b * n_q + qi) * n_head + h;
        float* part = p.part + (row * p.split + blockIdx.x) * (D + 2);
        if (t == 0) {
            part[0] = st.m[r];
            part[1] = l[r];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int e = n * 8 + 2 * t;
            part[2 + e] = st.o[n][2 * r];
            part[3 + e] = st.o[n][2 * r + 1];
        }
    }
}

template <int D, typename T>
__device__ void fattn_dec(const FattnArgs& p) {
    using S = MmaShape<D>;
    static_assert(S::BQ >= 16, "the 16 decode rows fit the Q staging");
    __shared__ __align__(16) f16 kv[S::STAGES][2][S::BK * S::LD];  // [buffer][K, V][key][d]
    __shared__ __align__(16) f16 qsep[S::QREG ? 1 : 16 * S::LD];
    f16* qs = S::QREG ? kv[S::STAGES - 1][0] : qsep;
    pdl_enter();
    with_tile_loads<D, T>(p.kv_vec != 0, [&](auto async, auto vec) {
        fattn_dec_rows<D, T, decltype(async)::value, decltype(vec)::value>(p, qs, kv);
    });
}

// The live keys of the mask: for FATTN_RANGE_ROWS query rows (blockIdx.y) and
// FATTN_RANGE_KEYS keys (blockIdx.x) of mask head and batch blockIdx.z (m2 + m3 * ne2),
// the first key whose mask entry is not -inf and the last one + 1 (n_kv, 0 when there is
// none), so that fattn_mma visits only the tiles in between (causal masks: the tiles past
// the diagonal are never loaded). A thread's loads are all issued before the first use.
template <typename M>
__device__ __forceinline__ void live_keys(const FattnArgs& p, int& lo, int& hi) {
    // thread x takes key j0 + x of every row: rows FATTN_RANGE_ROWS loads down a column
    static_assert(FATTN_RANGE_THREADS == FATTN_RANGE_KEYS, "one key per thread");
    const i64 n_q = p.q.ne[1], n_kv = p.k.ne[1];
    const i64 j = (i64)blockIdx.x * FATTN_RANGE_KEYS + threadIdx.x, r0 = (i64)blockIdx.y * FATTN_RANGE_ROWS;
    const i64 m2 = blockIdx.z % p.mask.ne[2], m3 = blockIdx.z / p.mask.ne[2];
    const char* col = at(p.mask, min(j, n_kv - 1), 0, m2, m3);
    M v[FATTN_RANGE_ROWS];
#pragma unroll
    for (int r = 0; r < FATTN_RANGE_ROWS; ++r) {
        v[r] = *reinterpret_cast<const M*>(col + min(r0 + r, n_q - 1) * p.mask.nb[1]);
    }
    if (j >= n_kv) return;
#pragma unroll
    for (int r = 0; r < FATTN_RANGE_ROWS; ++r) {
        if (r0 + r < n_q && to_f32(v[r]) != -INFINITY) {
            lo = min(lo, (int)j);
            hi = (int)j + 1;
        }
    }
}

extern "C" __global__ void __launch_bounds__(FATTN_RANGE_THREADS) fattn_kv_range(const FattnArgs p) {
    constexpr int NW = FATTN_RANGE_THREADS / WARP_SIZE;
    __shared__ int lo_w[NW], hi_w[NW];
    pdl_enter();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    int lo = (int)p.k.ne[1], hi = 0;
    if (p.mask_f16) {
        live_keys<f16>(p, lo, hi);
    } else {
        live_keys<float>(p, lo, hi);
    }
    lo = warp_min(lo);
    hi = warp_max(hi);
    if (lane == 0) {
        lo_w[warp] = lo;
        hi_w[warp] = hi;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < NW; ++w) {
            lo = min(lo, lo_w[w]);
            hi = max(hi, hi_w[w]);
        }
        int* out = p.range + (((i64)blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * 2;
        out[0] = lo;
        out[1] = hi;
    }
}

// The kernels, one per head dim, K/V dtype and family, are instantiated by build.rs from
// the table in build/instances.rs.
#include "fattn.inst.cuh"
