// Paged attention (paged_attn, src/ops/attention/paged.rs): flash_attn_ext's fused attention
// for a batch that mixes sequences, each sequence's keys in fixed-size blocks of a shared
// pool. Token t names its sequence s and position pos (seqs); key position j of s lives at
// slot table[j / block_size, s] * block_size + j % block_size of the pools, and the query
// sees the positions lo..pos (lo = pos + 1 - window with a sliding window, else 0). There is
// no mask: a key is visible by its position, and nothing a token does not see is read.
//
// The plan is captured once per batch size and replayed with new tables and positions, so
// every grid is fixed by the shapes (tokens, heads, table, pool) and each block finds its
// work in the data. Three kernels share the tokens:
//
//   fattn_paged_mma_d<D>_<kv> (when the lowering launches it: batches of more than
//     DECODE_TOKENS tokens, K and V of one type, head dims 64, 128, 256) grid (ceil(n_tokens
//     / BQ), n_head; the last tile first), the prefill kernel's block (MmaShape: BQ = 64
//     rows of 16 per warp, 32 for D = 256). Its tile of BQ consecutive tokens splits into
//     runs: consecutive tokens of one sequence (a token outside the table, or padding, ends
//     a run). The block takes every run of at least p.min_run tokens of its tile, one after
//     another, for one query head: the run's rows over the keys from the least first
//     visible position of its tokens to the greatest position, in tiles of BK keys through
//     shared memory (cp.async into two buffers for aligned F16 rows, else loads converted
//     to F16; each tile's keys looked up in the table a tile ahead, 4 threads a key),
//     scores and P.V on mma.sync, each row masked to its own range lo..pos, so the run's
//     tokens may come in any order. This is the chunk of a sequence being prefilled: its
//     K/V tiles are read once for BQ tokens.
//   fattn_paged_list (one block, launched first with fattn_paged_mma): the other tokens
//     (of shorter runs, padding, outside the table) into a list in scratch, p.decoded.
//   the decode kernels take those tokens (every token when the tensor-core kernel is not
//     launched, p.min_run == 0), a block per token, KV head (and group of its query heads)
//     and chunk of its keys: grid (split, heads, z), block z taking tokens z, z + gridDim.z,
//     ... of the list (z = n_tokens without one: a token a block). So a prefill chunk does
//     not launch a decode block per token that would find nothing to do. split is fixed
//     by the lowering for the longest sequence the table holds (flash-decoding: enough
//     chunks to fill the GPU); a token's lo..pos is cut into chunks of
//     max(ceil(n / split), min_keys) keys (rounded up to `unit`), so a short sequence takes
//     fewer chunks and the blocks past them return at once.
//     - fattn_paged_dec_d<D>_f16 (F16 caches with GQA): fattn_dec's block, one warp for up
//       to 16 query heads of a KV head over its chunk in whole 32-key tiles, the same key
//       loop as the prefill kernel (paged_keys).
//     - fattn_paged_vec_d<D>_<kv>, fattn_paged_vec4_d<D>_<kv> (F16, BF16, Q8_0, Q4_0 caches
//       of head dims 64, 128, 256 with aligned rows): fattn_vec1s's streamed block of 4
//       warps for one query head (vec) or 4 of a KV head (vec4: GQA at head dims 128 and
//       256), K/V copied to shared memory by cp.async in two stages, each thread copying
//       the pieces of one key of K and V after one table look-up; copies past the last key
//       repeat it, so no table entry outside lo..pos is read.
//     - fattn_paged_any_d<D> (the rest: K and V of different types, F32 caches, other head
//       dims, unaligned rows): fattn_vec's block for one query head, K/V rows loaded in
//       8-element pieces of the type named at run time.
//     With one chunk the block writes its rows (and, when the keys are not split, the F16
//     copy of them the next product reads, p.q8); otherwise the partial (max, sum, acc[D])
//     of its chunk, and block (0, 0) of the token writes the number of chunks its keys took.
//   fattn_paged_combine grid (n_tokens * n_head), after the decode kernel when split > 1:
//     merges the chunks of the rows whose keys took more than one, and with p.q8 writes
//     every row as the Q8_1 activations of the decode product after it too.
//
// Padding tokens (sequence -1) give zero rows, written by the decode kernel. A sequence
// outside the table, a position past it, or a block id outside the pool is recorded in the
// index-error record (the backend reports it naming the op); the token's rows are then zeros
// (a bad block is read as block 0). NaN: a score that is NaN becomes +inf (paged_score), so
// the row's running state becomes NaN at its next rescale (exp(inf - inf)) and the row comes
// out NaN: the running maxima (fmaxf) would otherwise pass over it. A NaN in a visible V row
// reaches the result through its weight. In the decode kernels every key a block multiplies
// is visible to all its rows; in the prefill kernel's tiles a row multiplies the V rows of
// its run's keys past its own position by a probability of 0, so a NaN there reaches it too
// (as in fattn.cu: the cache holds finite values where nothing visible was written).
#include <climits>

#include "fattn_common.cuh"
#include "quant.cuh"

// ---------------------------------------------------------------------------------------
// Tokens, runs and slots.

// A token's sequence (a column of the table; -1: padding) and position.
struct Token {
    int seq, pos;
};

__device__ __forceinline__ Token token_at(const PagedArgs& p, int t) { return Token{p.seqs[2 * t], p.seqs[2 * t + 1]}; }

// Whether a token reads keys: a sequence of the table, a position the table holds.
__device__ __forceinline__ bool in_table(const PagedArgs& p, Token tk) {
    return tk.seq >= 0 && tk.seq < p.n_seqs && tk.pos >= 0 && tk.pos < p.max_pos;
}

// The first key position the token at `pos` sees.
__device__ __forceinline__ int first_visible(const PagedArgs& p, int pos) {
    return p.window > 0 ? max(0, pos + 1 - p.window) : 0;
}

// The runs of the tile of n <= 64 tokens from t0: bit i is set where token t0 + i starts
// one (i = 0, a token outside the table, or after one, or of another sequence than the
// token before). A whole warp computes it; every lane gets the bits.
__device__ __forceinline__ uint64_t run_starts(const PagedArgs& p, int t0, int n) {
    const int lane = threadIdx.x % WARP_SIZE;
    const auto key = [&](int i) {
        if (i >= n) return -1;
        const Token tk = token_at(p, t0 + i);
        return in_table(p, tk) ? tk.seq : -1;
    };
    const int a = key(lane), b = key(lane + WARP_SIZE);
    const int a_up = __shfl_up_sync(FULL_MASK, a, 1), b_up = __shfl_up_sync(FULL_MASK, b, 1);
    const int a_last = __shfl_sync(FULL_MASK, a, WARP_SIZE - 1);
    const bool sa = lane == 0 || a < 0 || a != a_up;
    const bool sb = b < 0 || b != (lane == 0 ? a_last : b_up);
    return (uint64_t)__ballot_sync(FULL_MASK, sa) | (uint64_t)__ballot_sync(FULL_MASK, sb) << 32;
}

// One past the last token of the run holding token i of a tile of n with run starts s.
__device__ __forceinline__ int run_end(uint64_t s, int i, int n) {
    const uint64_t after = i + 1 < 64 ? s >> (i + 1) : 0;
    return after == 0 ? n : min(n, i + __ffsll((long long)after));
}

// The first token of the run holding token i (bit 0 of s is always set).
__device__ __forceinline__ int run_start(uint64_t s, int i) {
    const uint64_t upto = i == 63 ? s : s & ((2ull << i) - 1);
    return 63 - __clzll((long long)upto);
}

// The pool slot of key position j of the sequence whose table row is `row` (j / block_size
// by a multiply and a shift); a block id outside the pool is recorded and read as block 0.
__device__ __forceinline__ i64 slot_of(const PagedArgs& p, const int* row, int j) {
    const unsigned uj = (unsigned)j;
    const int lb = (int)((__umulhi(uj, (unsigned)p.bs_magic) + uj) >> p.bs_shift);
    const int b = row[lb];
    if ((unsigned)b >= (unsigned)p.n_blocks) {
        record_index_error(p.err, p.tag, b, lb, p.n_blocks);
        return 0;
    }
    return (i64)b * p.block_size + (j - lb * p.block_size);
}

// The score of a visible key, as the CPU reference: scale * q . k (NaN when not finite:
// an infinity would be capped to a finite score), then the softcap; a NaN becomes +inf
// (see the header).
__device__ __forceinline__ float paged_score(const PagedArgs& p, float dot) {
    float s = p.scale * finite_or_nan(dot);
    if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
    return s != s ? INFINITY : s;
}

// ---------------------------------------------------------------------------------------
// Decode blocks: one token, a few of its heads, one chunk of its keys.

// A decode block's work: the token's sequence, its chunk's keys j_begin..j_end, and the
// chunks the token's keys take (0: none for this kernel).
struct Chunk {
    int seq, j_begin, j_end, used;
};

// Element e of head h of token t's row into the F16 copy the next product reads, when the
// keys are not split (p.split == 1: no combine writes it) and the lowering asks for one.
template <int D>
__device__ __forceinline__ void store_f16_copy(const PagedArgs& p, int t, int h, int e, float x) {
    if (p.split == 1 && p.q8 != nullptr && p.q8_layout == ACT_F16) {
        reinterpret_cast<__half*>(p.q8 + (i64)t * p.q8_nb1)[(i64)h * D + e] = __float2half_rn(x);
    }
}

// Token t's chunk for block (blockIdx.x, ..) of heads h0..h0+nrows (t a token the decode
// kernels take: decode_tokens). Padding and a bad sequence or position (recorded by block
// (0, 0)) take none, and blocks x == 0 write their rows' zeros. With split > 1, block (0, 0)
// writes the chunks the token's keys took for fattn_paged_combine.
template <int D>
__device__ __forceinline__ Chunk decode_chunk(const PagedArgs& p, int t, int h0, int nrows) {
    const Token tk = token_at(p, t);
    const bool lead = blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0;
    Chunk c{tk.seq, 0, 0, 0};
    const bool in = in_table(p, tk);
    if (!in && tk.seq != -1 && lead) {
        if (tk.seq < 0 || tk.seq >= p.n_seqs) {
            record_index_error(p.err, p.tag, tk.seq, t, p.n_seqs);
        } else {
            record_index_error(p.err, p.tag, tk.pos, t, p.max_pos);
        }
    }
    if (in) {
        const int lo = first_visible(p, tk.pos), n = tk.pos + 1 - lo;
        int chunk = max((n + p.split - 1) / p.split, p.min_keys);
        chunk = (chunk + p.unit - 1) / p.unit * p.unit;
        c.used = (n + chunk - 1) / chunk;
        if ((int)blockIdx.x < c.used) {
            c.j_begin = lo + (int)blockIdx.x * chunk;
            c.j_end = min(tk.pos + 1, c.j_begin + chunk);
        }
    }
    if (lead && p.split > 1) p.chunks[t] = c.used;
    if (!in && blockIdx.x == 0) {
        for (int idx = threadIdx.x; idx < nrows * D; idx += blockDim.x) {
            store<float>(at(p.dst, idx % D, h0 + idx / D, t, 0), 0.0f);
            store_f16_copy<D>(p, t, h0 + idx / D, idx % D, 0.0f);
        }
    }
    return c;
}

// The decode kernels' tokens, one after another: block z takes entries z, z + gridDim.z, ...
// of the list fattn_paged_list wrote (p.decoded) when fattn_paged_mma runs, else token z
// alone (a grid of n_tokens). `body(t)` runs for each with the whole block.
template <typename Body>
__device__ __forceinline__ void decode_tokens(const PagedArgs& p, Body body) {
    const int n = p.decoded != nullptr ? p.decoded[0] : p.n_tokens;
    for (int i = (int)blockIdx.z; i < n; i += (int)gridDim.z) {
        body(p.decoded != nullptr ? p.decoded[1 + i] : i);
        if (i + (int)gridDim.z < n) __syncthreads();  // the next token reuses shared memory
    }
}

// The q rows of heads h0..h0+nrows of token t into qs (zeros past nrows and D) and their
// sacc zeroed; ends with a barrier.
template <int D, int R>
__device__ __forceinline__ void head_rows(const PagedArgs& p, int t, int h0, int nrows,
                                          float (*qs)[vec_lanes<D>() * 8], float (*sacc)[vec_lanes<D>() * 8]) {
    constexpr int DP = vec_lanes<D>() * 8;
    for (int idx = threadIdx.x; idx < R * DP; idx += blockDim.x) {
        const int r = idx / DP, e = idx % DP;
        qs[r][e] = r < nrows && e < D ? load<float>(at(p.q, e, h0 + r, t, 0)) : 0.0f;
        sacc[r][e] = 0.0f;
    }
    __syncthreads();
}

// The writer of finish_rows for a decode block of token t (heads h0..): its rows normalized
// when the token's keys took one chunk (an unguarded division: a row whose every score is
// -inf is NaN, as on the CPU), else the partial (max, sum, acc[D]) of chunk blockIdx.x.
// Without a combine after it, the block also writes the F16 copy of its rows (store_f16_copy).
template <int D>
__device__ __forceinline__ auto paged_out(const PagedArgs& p, int t, int h0, int used) {
    return [&p, t, h0, used](int r, int e, float mx, float sum, float a) {
        const int h = h0 + r;
        if (used == 1) {
            const float x = a / sum;
            store<float>(at(p.dst, e, h, t, 0), x);
            store_f16_copy<D>(p, t, h, e, x);
            return;
        }
        float* part = p.part + (((i64)t * p.q.ne[1] + h) * p.split + blockIdx.x) * (D + 2);
        if (e == 0) {
            part[0] = mx;
            part[1] = sum;
        }
        part[2 + e] = a;
    };
}

// The cp.async copies of a streamed decode block's stages, by every thread: stage st is the
// KS keys from j_begin + st * KS of K and V, into buffer st % NS, keys from `last` on copying
// key `last`. A thread copies the same pieces of one key's K and V rows, after one look-up.
template <int D, typename T, int NS, int KS>
struct PagedCopies {
    const char* kbase;  // the KV head's rows at slot 0
    const char* vbase;
    const int* row;  // the sequence's table row
    int j_begin;

    __device__ __forceinline__ void issue(const PagedArgs& p, char (*kv)[2][KS][KvRow<T, D>::BYTES], int st,
                                          int last) const {
        constexpr int NT = FATTN_VEC_WARPS * WARP_SIZE;
        constexpr int COPY = KvRow<T, D>::COPY;
        constexpr int PIECES = KvRow<T, D>::SRC / COPY;  // copies per K/V row
        constexpr int COPIES = KS * PIECES;
        const int j0 = j_begin + st * KS;
#pragma unroll
        for (int c0 = 0; c0 < COPIES; c0 += NT) {
            const int c = c0 + (int)threadIdx.x;
            if (COPIES % NT == 0 || c < COPIES) {
                const int key = c / PIECES, piece = c % PIECES;
                const i64 slot = slot_of(p, row, min(j0 + key, last));
                copy_async<COPY>(&kv[st % NS][0][key][piece * COPY], kbase + slot * p.k.nb[1] + piece * COPY);
                copy_async<COPY>(&kv[st % NS][1][key][piece * COPY], vbase + slot * p.v.nb[1] + piece * COPY);
            }
        }
    }
};

// The streamed decode block (fattn_vec1s's lanes, stages and arithmetic): R query heads of
// one KV head (R = 1: a block per query head) of token t over one chunk of its keys.
template <int D, typename T, int NS, int UN, int R>
__device__ void paged_vec_token(const PagedArgs& p, int t) {
    constexpr int L = vec_lanes<D>();
    constexpr int KPW = WARP_SIZE / L;  // keys per warp per unrolled key
    constexpr int NW = FATTN_VEC_WARPS;
    constexpr int DP = L * 8;
    constexpr int KS = UN * NW * KPW;  // keys per stage
    __shared__ __align__(16) char kv[NS][2][KS][KvRow<T, D>::BYTES];
    __shared__ __align__(16) float qs[R][DP];
    __shared__ float sacc[R][DP];
    __shared__ float sm[NW][R], sl[NW][R];

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    // grid.y: KV head hk's ceil(group / R) blocks of up to R query heads
    const int row_blocks = (p.group + R - 1) / R;
    const int hk = blockIdx.y / row_blocks, first = blockIdx.y % row_blocks * R;
    const int nrows = min(R, p.group - first), h0 = hk * p.group + first;
    const Chunk c = decode_chunk<D>(p, t, h0, nrows);
    if ((int)blockIdx.x >= c.used) return;
    const PagedCopies<D, T, NS, KS> copies{at(p.k, 0, 0, hk, 0), at(p.v, 0, 0, hk, 0),
                                           p.table + (i64)c.seq * p.max_blocks, c.j_begin};
    const int last = c.j_end - 1, stages = (c.j_end - c.j_begin + KS - 1) / KS;
    // the first stage goes out before q is read
    copies.issue(p, kv, 0, last);
    stage_commit();
    head_rows<D, R>(p, t, h0, nrows, qs, sacc);
#pragma unroll
    for (int st = 1; st < NS - 1; ++st) {
        if (st < stages) copies.issue(p, kv, st, last);
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
    // one row's q stays in registers; more rows' are read from qs at each stage
    const float4 qa = *reinterpret_cast<const float4*>(&qs[0][e0]);
    const float4 qb = *reinterpret_cast<const float4*>(&qs[0][e0 + 4]);
    for (int st = 0; st < stages; ++st) {
        if (st + NS - 1 < stages) copies.issue(p, kv, st + NS - 1, last);
        stage_commit();
        stage_wait<NS - 1>();
        __syncthreads();
        // the lane's key u of the stage is key0 + u * NW * KPW
        const int key0 = c.j_begin + st * KS + warp * KPW + sub;
        const auto score_of = [&](int, int u, float dot) {
            return key0 + u * NW * KPW < c.j_end ? paged_score(p, dot) : -INFINITY;
        };
        stream_stage<D, T, UN, R>(kv[st % NS][0], kv[st % NS][1], qa, qb, qs, nrows, score_of, m, l, acc);
    }
    stage_wait<0>();
    finish_rows<D, R>(m, l, acc, nrows, sacc, sm, sl, paged_out<D>(p, t, h0, c.used));
}

// vec takes the listed tokens of a batch with a prefill run; vec4 a token a block only (the
// lowering gives listed tokens to vec): the loop's registers spilled vec4's Q8_0 kernels
// at their 4 blocks an SM.
template <int D, typename T, int NS, int UN, int R>
__device__ void paged_vec(const PagedArgs& p) {
    pdl_enter();
    if constexpr (R == 1) {
        decode_tokens(p, [&](int t) { paged_vec_token<D, T, NS, UN, R>(p, t); });
    } else {
        paged_vec_token<D, T, NS, UN, R>(p, (int)blockIdx.z);
    }
}

// 8 elements of a K/V row of the dtype `dt` (PAGED_F32 .. PAGED_Q4_0) at e0, as load8.
__device__ __forceinline__ void load_any(int dt, const char* row, int e0, bool vec, float out[8]) {
    switch (dt) {
        case PAGED_F16: load8<f16>(row, e0, vec, out); break;
        case PAGED_BF16: load8<bf16>(row, e0, vec, out); break;
        case PAGED_Q8_0: load8<KvQ8_0>(row, e0, vec, out); break;
        case PAGED_Q4_0: load8<KvQ4_0>(row, e0, vec, out); break;
        default: load8<float>(row, e0, vec, out); break;
    }
}

// The decode block for any cache (fattn_vec's lanes and arithmetic, one query head): K and
// V of the types p.k_type and p.v_type, loaded from the pool in 8-element pieces, U keys per
// lane group a step with every load of the step issued before the first use.
template <int D>
__device__ void paged_any_token(const PagedArgs& p, int t) {
    constexpr int L = vec_lanes<D>();
    constexpr int KPW = WARP_SIZE / L;
    constexpr int NW = FATTN_VEC_WARPS;
    constexpr int U = FATTN_VEC_UNROLL;
    constexpr int DP = L * 8;
    __shared__ __align__(16) float qs[1][DP];
    __shared__ float sacc[1][DP];
    __shared__ float sm[NW][1], sl[NW][1];

    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int h = blockIdx.y, hk = h / p.group;
    const Chunk c = decode_chunk<D>(p, t, h, 1);
    if ((int)blockIdx.x >= c.used) return;
    head_rows<D, 1>(p, t, h, 1, qs, sacc);
    const int sub = lane / L, e0 = (lane % L) * 8;
    const bool active = e0 < D, vec = p.kv_vec != 0;
    const char* kbase = at(p.k, 0, 0, hk, 0);
    const char* vbase = at(p.v, 0, 0, hk, 0);
    const int* row = p.table + (i64)c.seq * p.max_blocks;
    float m[1] = {-INFINITY}, l[1] = {0.0f}, acc[1][8];
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[0][i] = 0.0f;
    const float4 qa = *reinterpret_cast<const float4*>(&qs[0][e0]);
    const float4 qb = *reinterpret_cast<const float4*>(&qs[0][e0 + 4]);
    for (int j0 = c.j_begin; j0 < c.j_end; j0 += U * NW * KPW) {
        Piece<float> kp[U], vp[U];
        bool valid[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int j = j0 + (u * NW + warp) * KPW + sub;
            valid[u] = j < c.j_end;
            kp[u].zero();
            vp[u].zero();
            if (valid[u]) {
                const i64 slot = slot_of(p, row, j);
                if (active) {
                    load_any(p.k_type, kbase + slot * p.k.nb[1], e0, vec, kp[u].f);
                    load_any(p.v_type, vbase + slot * p.v.nb[1], e0, vec, vp[u].f);
                }
            }
        }
        float s[U];
        float mx = m[0];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const float dot = group_dot<L>(kp[u], qa, qb);
            s[u] = valid[u] ? paged_score(p, dot) : -INFINITY;
            mx = fmaxf(mx, s[u]);
        }
        if (mx != -INFINITY) online_add(mx, s, vp, m[0], l[0], acc[0]);
    }
    finish_rows<D, 1>(m, l, acc, 1, sacc, sm, sl, paged_out<D>(p, t, h, c.used));
}

template <int D>
__device__ void paged_any(const PagedArgs& p) {
    pdl_enter();
    decode_tokens(p, [&](int t) { paged_any_token<D>(p, t); });
}

// ---------------------------------------------------------------------------------------
// Tensor cores: the decode block over a chunk, and the prefill block over a run.

// The keys one warp attends to: the K/V rows of its KV head at slot 0 (kbase, vbase), the
// sequence's table row, the keys loaded klo..khi (the union of the block's rows' ranges; in
// tiles of BK keys from klo), and the keys the lane's rows a and b see (alo..ahi, blo..bhi;
// empty where lo > hi).
struct PagedKeys {
    const char* kbase;
    const char* vbase;
    const int* row;
    int klo, khi, alo, ahi, blo, bhi;
};

// The pool slot of the key a thread copies of the tile of keys j0..j0+BK (G = 4 threads a
// key, NT / G keys a pass): key j0 + c0 + threadIdx.x / G, keys past kr.khi as key khi (so
// no table entry outside the rows' keys is read). Where a tile is one pass (AHEAD: the
// prefill blocks) the slot is looked up a tile ahead of the copies (paged_keys), so that
// the table's load is not waited on before them; the decode block's single warp copies a
// tile in several passes and looks each key up as it copies it (a slot held for every
// pass spilled).
template <int BK, int NT, bool AHEAD = BK == NT / 4>
struct TileSlots {
    int s;  // the pool's slots fit in 32 bits (the lowering checks)
    // The slot for tile j0, whose copies come after this.
    __device__ __forceinline__ void ahead(const PagedArgs& p, const PagedKeys& kr, int j0) {
        s = (int)slot_of(p, kr.row, min(j0 + (int)threadIdx.x / 4, kr.khi));
    }
    // The slot of key j.
    __device__ __forceinline__ i64 slot(const PagedArgs&, const PagedKeys&, int) const { return s; }
};

// Several passes a tile: each key looked up as it is copied.
template <int BK, int NT>
struct TileSlots<BK, NT, false> {
    __device__ __forceinline__ void ahead(const PagedArgs&, const PagedKeys&, int) {}
    __device__ __forceinline__ i64 slot(const PagedArgs& p, const PagedKeys& kr, int j) const {
        return slot_of(p, kr.row, min(j, kr.khi));
    }
};

// The K and V tiles of keys j0..j0+BK into ks and vs ([key][d], LDK halves a key) from the
// pool slots `sl` (TileSlots of the same tile), keys past kr.khi zeros (their probability
// is 0, and V must not hold a NaN). G = 4 threads take a key, each D / 32 pieces of 8
// elements of its K and V rows a pass. ASYNC and VEC as in fattn.cu's kv_tiles: F16 rows
// that allow 16-byte copies go by cp.async, the other types are loaded (at most 4 pieces
// of K and V in flight a thread) and converted to F16.
template <typename T, bool ASYNC, bool VEC, int D, int BK, int NT, int LDK>
__device__ __forceinline__ void paged_tiles(const PagedArgs& p, const PagedKeys& kr, int j0,
                                            const TileSlots<BK, NT>& sl, f16* ks, f16* vs) {
    constexpr int G = 4;
    constexpr int P = D / 8 / G;  // pieces a thread copies of a row
    constexpr int UB = P < 4 ? P : 4;  // of which in flight together
    constexpr int KEYS = NT / G;  // keys a pass
    static_assert(D % (8 * G) == 0 && BK % KEYS == 0, "whole keys a pass, whole pieces a thread");
    const int sub = threadIdx.x % G;
#pragma unroll(ASYNC ? BK / KEYS : 1)
    for (int c0 = 0; c0 < BK; c0 += KEYS) {
        const int c = c0 + (int)threadIdx.x / G, j = j0 + c;
        const bool in = j <= kr.khi;
        const i64 slot = sl.slot(p, kr, j);
        const char* krow = kr.kbase + slot * p.k.nb[1];
        const char* vrow = kr.vbase + slot * p.v.nb[1];
#pragma unroll
        for (int u0 = 0; u0 < P; u0 += UB) {
            uint4 kp[UB], vp[UB];
#pragma unroll
            for (int uu = 0; uu < UB; ++uu) {
                const int e0 = (sub + G * (u0 + uu)) * 8;
                if constexpr (ASYNC) {
                    copy16_or_zero(reinterpret_cast<char*>(&ks[c * LDK + e0]), krow + 2 * e0, in);
                    copy16_or_zero(reinterpret_cast<char*>(&vs[c * LDK + e0]), vrow + 2 * e0, in);
                } else {
                    kp[uu] = tile_piece<T, VEC>(krow, e0);
                    vp[uu] = tile_piece<T, VEC>(vrow, e0);
                }
            }
            if constexpr (!ASYNC) {
                const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
                for (int uu = 0; uu < UB; ++uu) {
                    const int e0 = (sub + G * (u0 + uu)) * 8;
                    *reinterpret_cast<uint4*>(&ks[c * LDK + e0]) = in ? kp[uu] : zero;
                    *reinterpret_cast<uint4*>(&vs[c * LDK + e0]) = in ? vp[uu] : zero;
                }
            }
        }
    }
}

// The scores of one warp's tile: paged_score where the entry's row sees its key
// (vis: rows a for x < 2, b for x >= 2; keys n * 8 + 2t + (x & 1)), -inf elsewhere, and each
// of the lane's two rows' maximum over the tile (over the 4 lanes of its quad).
template <int BK>
__device__ __forceinline__ void paged_tile_scores(const PagedArgs& p, const bool (&vis)[BK / 8][4],
                                                  float (&s)[BK / 8][4], float (&mx)[2]) {
    mx[0] = mx[1] = -INFINITY;
#pragma unroll
    for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            s[n][x] = vis[n][x] ? paged_score(p, s[n][x]) : -INFINITY;
            mx[x / 2] = fmaxf(mx[x / 2], s[n][x]);
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
        mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
    }
}

// The key loop of a warp's 16 rows over the tiles of `kr`, into `st` (fattn.cu's mma_keys
// with paged tiles and positional visibility): the first tile is issued, then stage_q()
// writes the block's Q rows into qs while it is in flight. NT threads (the block) load
// every tile together, so every warp of the block runs the same tiles; a warp whose rows
// see no key of a tile skips its compute.
template <int D, typename T, bool ASYNC, bool VEC, int NT, typename StageQ>
__device__ __forceinline__ void paged_keys(const PagedArgs& p, const PagedKeys& kr,
                                           f16 (*kv)[2][MmaShape<D>::BK * MmaShape<D>::LD], const f16* qs,
                                           StageQ stage_q, MmaState<D>& st) {
    using S = MmaShape<D>;
    constexpr int BK = S::BK, LD = S::LD;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, t4 = lane % 4;
    const int tiles = kr.khi >= kr.klo ? (kr.khi - kr.klo) / BK + 1 : 0;
    // nxt: the slots of the next tile to copy, looked up a tile before its copies
    TileSlots<BK, NT> nxt;
    if (tiles > 0) {
        nxt.ahead(p, kr, kr.klo);
        paged_tiles<T, ASYNC, VEC, D, BK, NT, LD>(p, kr, kr.klo, nxt, kv[0][0], kv[0][1]);
        if (tiles > 1) nxt.ahead(p, kr, kr.klo + BK);
    }
    if constexpr (ASYNC) stage_commit();
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

    for (int it = 0; it < tiles; ++it) {
        const int cur = ASYNC ? (it & 1) : 0;  // loads converted: one buffer
        const int j0 = kr.klo + it * BK;
        if constexpr (ASYNC) {
            stage_wait<0>();
            __syncthreads();  // tile it is in; every warp is done with the other buffer
            if (it + 1 < tiles) {
                paged_tiles<T, true, VEC, D, BK, NT, LD>(p, kr, j0 + BK, nxt, kv[cur ^ 1][0], kv[cur ^ 1][1]);
                if (it + 2 < tiles) nxt.ahead(p, kr, j0 + 2 * BK);
            }
            stage_commit();
        } else {
            if (it > 0) {
                __syncthreads();  // every warp is done with the previous tile
                paged_tiles<T, false, VEC, D, BK, NT, LD>(p, kr, j0, nxt, kv[0][0], kv[0][1]);
                if (it + 1 < tiles) nxt.ahead(p, kr, j0 + BK);
            }
            __syncthreads();
        }
        bool vis[BK / 8][4];
        bool live = false;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                const int j = j0 + n * 8 + 2 * t4 + (x & 1);
                vis[n][x] = x < 2 ? kr.alo <= j && j <= kr.ahi : kr.blo <= j && j <= kr.bhi;
                live |= vis[n][x];
            }
        }
        if (!__any_sync(FULL_MASK, live)) continue;
        const auto scores = [&](float (&s)[BK / 8][4], float (&mx)[2]) { paged_tile_scores<BK>(p, vis, s, mx); };
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

// ROWS rows of Q into qs as F16 (LD halves a row) by NT threads: row r is the F32 row at
// src(r) (q's rows are strided by p.q.nb[0] along d), zeros where src(r) is null. A
// thread's 8 loads of a piece are issued before its store.
template <int D, int LD, int ROWS, int NT, typename Src>
__device__ __forceinline__ void q_tile_f16(const PagedArgs& p, Src src, f16* qs) {
#pragma unroll 2
    for (int idx = threadIdx.x; idx < ROWS * D / 8; idx += NT) {
        const int r = idx / (D / 8), e0 = idx % (D / 8) * 8;
        const char* row = src(r);
        float x[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) x[i] = row != nullptr ? load<float>(row + (e0 + i) * p.q.nb[0]) : 0.0f;
        store8<f16>(reinterpret_cast<char*>(&qs[r * LD + e0]), x);
    }
}

// The tensor-core decode block: one warp, up to 16 query heads of KV head hk of token t
// (grid.y: hk's ceil(group / 16) blocks) over chunk blockIdx.x of the token's keys in whole
// tiles. Its rows are written with one chunk, else the chunk's partials.
template <int D, typename T, bool ASYNC, bool VEC>
__device__ void paged_dec_rows(const PagedArgs& p, int t, f16* qs, f16 (*kv)[2][MmaShape<D>::BK * MmaShape<D>::LD]) {
    constexpr int LD = MmaShape<D>::LD;
    const int lane = threadIdx.x, t4 = lane % 4;
    const int row_blocks = (p.group + 15) / 16;
    const int hk = blockIdx.y / row_blocks, first = blockIdx.y % row_blocks * 16;
    const int nrows = min(16, p.group - first), h0 = hk * p.group + first;
    const Chunk c = decode_chunk<D>(p, t, h0, nrows);
    if ((int)blockIdx.x >= c.used) return;
    const int last = c.j_end - 1;
    const PagedKeys kr{at(p.k, 0, 0, hk, 0), at(p.v, 0, 0, hk, 0), p.table + (i64)c.seq * p.max_blocks,
                       c.j_begin, last, c.j_begin, last, c.j_begin, last};
    const auto src = [&](int r) { return r < nrows ? at(p.q, 0, h0 + r, t, 0) : nullptr; };
    MmaState<D> st;
    paged_keys<D, T, ASYNC, VEC, WARP_SIZE>(p, kr, kv, qs, [&] { q_tile_f16<D, LD, 16, WARP_SIZE>(p, src, qs); },
                                            st);

    float l[2];
    quad_sums<D>(st, l);
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int rr = lane / 4 + 8 * r;
        if (rr >= nrows) continue;
        const int h = h0 + rr;
        if (c.used == 1) {
            const float inv = 1.0f / l[r];  // 0: every score -inf, a NaN row as on the CPU
#pragma unroll
            for (int n = 0; n < D / 8; ++n) {
                const int e = n * 8 + 2 * t4;
                store<float>(at(p.dst, e, h, t, 0), st.o[n][2 * r] * inv);
                store<float>(at(p.dst, e + 1, h, t, 0), st.o[n][2 * r + 1] * inv);
            }
            continue;
        }
        float* part = p.part + (((i64)t * p.q.ne[1] + h) * p.split + blockIdx.x) * (D + 2);
        if (t4 == 0) {
            part[0] = st.m[r];
            part[1] = l[r];
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int e = n * 8 + 2 * t4;
            part[2 + e] = st.o[n][2 * r];
            part[3 + e] = st.o[n][2 * r + 1];
        }
    }
}

template <int D, typename T>
__device__ void paged_dec(const PagedArgs& p) {
    using S = MmaShape<D>;
    static_assert(S::BQ >= 16, "the 16 decode rows fit the Q staging");
    __shared__ __align__(16) f16 kv[S::STAGES][2][S::BK * S::LD];  // [buffer][K, V][key][d]
    __shared__ __align__(16) f16 qsep[S::QREG ? 1 : 16 * S::LD];
    f16* qs = S::QREG ? kv[S::STAGES - 1][0] : qsep;
    pdl_enter();
    with_tile_loads<D, T>(p.kv_vec != 0, [&](auto async, auto vec) {
        decode_tokens(p, [&](int t) { paged_dec_rows<D, T, decltype(async)::value, decltype(vec)::value>(p, t, qs, kv); });
    });
}

// Rows a..e of the block's tile (tokens t0 + a .. t0 + e, one run of sequence `seq`) for
// query head h: the lane's rows see their own tokens' keys, the block loads the keys from
// the least first visible position of the run to its greatest position, and the rows of the
// run are written normalized.
template <int D, typename T, bool ASYNC, bool VEC>
__device__ __forceinline__ void paged_mma_run(const PagedArgs& p, int t0, int a, int e, int seq, int h, f16* qs,
                              f16 (*kv)[2][MmaShape<D>::BK * MmaShape<D>::LD]) {
    using S = MmaShape<D>;
    constexpr int BQ = S::BQ, NT = S::NT, LD = S::LD;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, t4 = lane % 4;
    const int hk = h / p.group;
    // the keys row r sees (none outside the run)
    const auto range = [&](int r, int& lo, int& hi) {
        lo = 1;
        hi = 0;
        if (r < a || r >= e) return;
        hi = token_at(p, t0 + r).pos;
        lo = first_visible(p, hi);
    };
    const int ra = warp * 16 + lane / 4, rb = ra + 8;
    PagedKeys kr{at(p.k, 0, 0, hk, 0), at(p.v, 0, 0, hk, 0), p.table + (i64)seq * p.max_blocks, 0, 0, 0, 0, 0, 0};
    range(ra, kr.alo, kr.ahi);
    range(rb, kr.blo, kr.bhi);
    // the run's keys, reduced by every warp (the same, so that the loop bounds are uniform)
    int klo = INT_MAX, khi = -1;
    for (int r = a + lane; r < e; r += WARP_SIZE) {
        int lo, hi;
        range(r, lo, hi);
        klo = min(klo, lo);
        khi = max(khi, hi);
    }
    kr.klo = warp_min(klo);
    kr.khi = warp_max(khi);
    const auto src = [&](int r) { return r >= a && r < e ? at(p.q, 0, h, t0 + r, 0) : nullptr; };
    __syncthreads();  // the block is done with the shared memory of its previous run
    MmaState<D> st;
    paged_keys<D, T, ASYNC, VEC, NT>(p, kr, kv, qs, [&] { q_tile_f16<D, LD, BQ, NT>(p, src, qs); }, st);

    float l[2];
    quad_sums<D>(st, l);
    const int rows[2] = {ra, rb};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (rows[r] < a || rows[r] >= e) continue;
        const float inv = 1.0f / l[r];
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
            const int el = n * 8 + 2 * t4;
            store<float>(at(p.dst, el, h, t0 + rows[r], 0), st.o[n][2 * r] * inv);
            store<float>(at(p.dst, el + 1, h, t0 + rows[r], 0), st.o[n][2 * r + 1] * inv);
        }
    }
}

// The prefill block: the runs of at least p.min_run tokens of a tile, for query head
// blockIdx.y. The last tile goes first (blockIdx.x 0): in a prompt's chunk the later
// tokens see the most keys, and the heavy blocks starting first leave no long tail.
template <int D, typename T>
__device__ void paged_mma(const PagedArgs& p) {
    using S = MmaShape<D>;
    __shared__ __align__(16) f16 kv[S::STAGES][2][S::BK * S::LD];  // [buffer][K, V][key][d]
    __shared__ __align__(16) f16 qsep[S::QREG ? 1 : S::BQ * S::LD];
    f16* qs = S::QREG ? kv[S::STAGES - 1][0] : qsep;
    pdl_enter();
    const int t0 = (gridDim.x - 1 - blockIdx.x) * S::BQ, n = min(S::BQ, p.n_tokens - t0), h = blockIdx.y;
    const uint64_t starts = run_starts(p, t0, n);
    with_tile_loads<D, T>(p.kv_vec != 0, [&](auto async, auto vec) {
        for (int a = 0; a < n;) {
            const int e = run_end(starts, a, n);
            const Token tk = token_at(p, t0 + a);
            if (e - a >= p.min_run && in_table(p, tk)) {
                paged_mma_run<D, T, decltype(async)::value, decltype(vec)::value>(p, t0, a, e, tk.seq, h, qs, kv);
            }
            a = e;
        }
    });
}

// The tokens the decode kernels take when fattn_paged_mma runs (p.min_run > 0): those not
// in a run of at least p.min_run tokens of its tile of p.tile (padding and tokens outside
// the table among them), into p.decoded: their count, then the tokens in order. With
// split > 1 the other tokens' chunk counts are zeroed, so fattn_paged_combine leaves their
// rows to fattn_paged_mma. One block: each warp marks the tokens of its tiles, thread 0
// adds up the tiles' offsets, and the warps write their tiles' tokens.
extern "C" __global__ void __launch_bounds__(FATTN_LIST_THREADS) fattn_paged_list(const PagedArgs p) {
    constexpr int NW = FATTN_LIST_THREADS / WARP_SIZE;
    __shared__ uint64_t marks[FATTN_LIST_MAX_TILES];
    __shared__ int offsets[FATTN_LIST_MAX_TILES];
    pdl_enter();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int tiles = (p.n_tokens + p.tile - 1) / p.tile;
    for (int b = warp; b < tiles; b += NW) {
        const int t0 = b * p.tile, n = min(p.tile, p.n_tokens - t0);
        const uint64_t s = run_starts(p, t0, n);
        const auto decoded = [&](int i) {
            return i < n && !(in_table(p, token_at(p, t0 + i)) && run_end(s, i, n) - run_start(s, i) >= p.min_run);
        };
        const uint64_t lo = __ballot_sync(FULL_MASK, decoded(lane));
        const uint64_t hi = __ballot_sync(FULL_MASK, decoded(lane + WARP_SIZE));
        if (lane == 0) marks[b] = lo | hi << 32;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int total = 0;
        for (int b = 0; b < tiles; ++b) {
            offsets[b] = total;
            total += __popcll(marks[b]);
        }
        p.decoded[0] = total;
    }
    __syncthreads();
    for (int b = warp; b < tiles; b += NW) {
        const int t0 = b * p.tile, n = min(p.tile, p.n_tokens - t0);
        const uint64_t m = marks[b];
        for (int i = lane; i < n; i += WARP_SIZE) {
            if (m >> i & 1) {
                p.decoded[1 + offsets[b] + __popcll(m & ((1ull << i) - 1))] = t0 + i;
            } else if (p.chunks != nullptr) {
                p.chunks[t0 + i] = 0;
            }
        }
    }
}

// Merges the chunks of row blockIdx.x (token t = row / n_head, head row % n_head) whose
// keys took more than one (p.chunks[t]): the first warp turns the chunks' (max, sum) into
// weights exp(max_i - max) / sum (split <= 2 * WARP_SIZE), then each thread sums its
// elements over the chunks. With p.q8 every row is also written as the Q8_1 activations of
// the decode product that reads it: the merged rows, and the rows a decode block wrote
// whole (one chunk, or zeros) as they are.
template <int LAYOUT>
__device__ void paged_combine(const PagedArgs& p) {
    static_assert(FATTN_COMBINE_THREADS % WARP_SIZE == 0, "a warp's elements share a Q8_1 block");
    __shared__ float w[2 * WARP_SIZE];
    const int d = (int)p.dst.ne[0], n_head = (int)p.dst.ne[1], row = blockIdx.x;
    const int t = row / n_head, h = row % n_head, used = p.chunks[t];
    const int tid = threadIdx.x;
    // column t of [d * n_head, n_tokens]; a warp's elements are one 32-element sub-block
    // (blockDim.x and d are multiples of 32)
    const auto q8_store = [&](int el, float x) {
        if (p.q8 != nullptr) store_act(x, p.q8 + (i64)t * p.q8_nb1, (i64)d * n_head, (h * d + el) / 32, el % 32, LAYOUT);
    };
    if (used <= 1) {  // written by a decode block (or by fattn_paged_mma, without p.q8)
        if (p.q8 == nullptr) return;
        for (int el = tid; el < d; el += blockDim.x) q8_store(el, load<float>(at(p.dst, el, h, t, 0)));
        return;
    }
    const float* part = p.part + (i64)row * p.split * (d + 2);
    if (tid < WARP_SIZE) {
        float m[2], l[2];
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int s = tid + i * WARP_SIZE;
            m[i] = s < used ? part[s * (d + 2)] : -INFINITY;
            l[i] = s < used ? part[s * (d + 2) + 1] : 0.0f;
        }
        const float mx = warp_max(fmaxf(m[0], m[1]));
        float e[2], sum = 0.0f;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            e[i] = m[i] == -INFINITY ? 0.0f : expf(m[i] - mx);
            sum += l[i] * e[i];
        }
        const float inv = 1.0f / warp_sum(sum);  // 0: every score -inf, a NaN row as on the CPU
#pragma unroll
        for (int i = 0; i < 2; ++i) w[tid + i * WARP_SIZE] = e[i] * inv;
    }
    __syncthreads();
    for (int el = tid; el < d; el += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 8
        for (int s = 0; s < used; ++s) acc += part[s * (d + 2) + 2 + el] * w[s];
        store<float>(at(p.dst, el, h, t, 0), acc);
        q8_store(el, acc);
    }
}

extern "C" __global__ void __launch_bounds__(FATTN_COMBINE_THREADS) fattn_paged_combine(const PagedArgs p) {
    pdl_enter();
    // the layout as a constant: the store's offsets without a select
    if (p.q8_layout == ACT_PAIRS) {
        paged_combine<ACT_PAIRS>(p);
    } else if (p.q8_layout == ACT_F16) {
        paged_combine<ACT_F16>(p);
    } else {
        paged_combine<ACT_BLOCKS>(p);
    }
}

// The kernels (fattn_paged_vec_*, fattn_paged_vec4_*, fattn_paged_any_*, fattn_paged_dec_*,
// fattn_paged_mma_*), generated by build.rs from build/instances.rs.
#include "fattn_paged.inst.cuh"
