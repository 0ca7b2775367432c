// top_k: the indices of the k largest elements of each row as I32, largest first (ties: lower
// index first; NaN above every number, -0 equal to +0: the order of src/ops/topk.rs), one block
// of TOPK_THREADS threads per row, k <= TOPK_THREADS; short rows take top_k_warp (at the end).
//
// A radix select finds the winners without sorting the row. Each value becomes a 32-bit key in
// rank order (order_key). Round r counts, in a shared histogram, the keys whose higher bits
// match the prefix chosen so far by their next TOPK_DIGIT[r] bits, and picks the digit at which
// the count from the top reaches the winners still needed; the keys above it are winners. When
// the chosen digit holds exactly the winners still needed (the usual case after one or two
// rounds), every key on the prefix wins; after the last round the prefix is the k-th largest
// key itself and its copies are taken in index order. One more pass over the row gathers the k
// winners into shared memory, and a bitonic sort orders them by key, then index.
#include "common.cuh"

// Bits of the key each round examines, from the top: 11 + 11 + 10.
#define TOPK_ROUNDS 3
#define TOPK_MAX_BINS 2048
// Elements a thread loads per step before using them (loads in flight).
#define TOPK_LOADS 4

__constant__ int TOPK_SHIFT[TOPK_ROUNDS] = {21, 10, 0};
__constant__ int TOPK_BITS[TOPK_ROUNDS] = {11, 11, 10};

// The rank key of a value (order_key in src/ops/topk.rs): a larger key ranks first; every NaN
// is 0xffffffff, -0 has the key of +0. No value has the key 0.
__device__ __forceinline__ unsigned order_key(float x) {
    if (isnan(x)) return 0xffffffffu;
    const unsigned b = x == 0.0f ? 0u : __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Calls f(i, key, valid) for every element i of the row, in rising i per thread, each thread
// the same number of times (so that f may hold barriers): step s covers the indices
// s * blockDim.x .. (s + 1) * blockDim.x, one per thread; `valid` is false past the row.
template <typename T, typename F>
__device__ __forceinline__ void for_each_key(const char* x, i64 n, i64 nb0, F f) {
    const i64 t = blockDim.x;
    for (i64 base = 0; base < n; base += TOPK_LOADS * t) {
        unsigned keys[TOPK_LOADS];
#pragma unroll
        for (int u = 0; u < TOPK_LOADS; ++u) {
            const i64 i = base + u * t + threadIdx.x;
            keys[u] = i < n ? order_key(load<T>(x + i * nb0)) : 0u;
        }
#pragma unroll
        for (int u = 0; u < TOPK_LOADS; ++u) {
            const i64 i = base + u * t + threadIdx.x;
            f(i, keys[u], i < n);
        }
    }
}

// The exclusive prefix sum of v over the threads of the block in thread order (blockDim.x a
// multiple of 32). Every thread must call it; scratch: 32 entries.
__device__ __forceinline__ unsigned block_scan(unsigned v, unsigned* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    unsigned incl = v;
#pragma unroll
    for (int o = 1; o < WARP_SIZE; o <<= 1) {
        const unsigned u = __shfl_up_sync(FULL_MASK, incl, o);
        if (lane >= o) incl += u;
    }
    __syncthreads();  // a previous scan may still be reading scratch
    if (lane == WARP_SIZE - 1) scratch[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const unsigned own = lane < (int)(blockDim.x / WARP_SIZE) ? scratch[lane] : 0u;
        unsigned w = own;
#pragma unroll
        for (int o = 1; o < WARP_SIZE; o <<= 1) {
            const unsigned u = __shfl_up_sync(FULL_MASK, w, o);
            if (lane >= o) w += u;
        }
        scratch[lane] = w - own;
    }
    __syncthreads();
    return scratch[warp] + incl - v;
}

// What a round decided: the digit whose keys hold the k-th largest, how many keys on the prefix
// lie above it, and how many lie on it.
struct Pick {
    unsigned digit, above, count;
};

// The digit of this round's histogram (bins counts, highest digit = highest keys) at which the
// count from the top reaches `need`.
__device__ __forceinline__ Pick pick_digit(const unsigned* hist, int bins, unsigned need, unsigned* scratch,
                                           Pick* s_pick) {
    // thread t holds the bins from the top: [bins - (t + 1) * per, bins - t * per)
    const int per = (bins + blockDim.x - 1) / blockDim.x;
    const int hi = bins - (int)threadIdx.x * per;  // one past this thread's highest bin
    unsigned sum = 0;
    for (int b = hi - 1; b >= hi - per && b >= 0; --b) sum += hist[b];
    unsigned before = block_scan(sum, scratch);
    for (int b = hi - 1; b >= hi - per && b >= 0; --b) {
        const unsigned h = hist[b];
        if (before < need && before + h >= need) *s_pick = Pick{(unsigned)b, before, h};
        before += h;
    }
    __syncthreads();
    return *s_pick;
}

// Sorts the TOPK_THREADS-padded winners `win[0..size)` (size a power of two) in descending order.
__device__ __forceinline__ void bitonic_desc(unsigned long long* win, int size) {
    for (int len = 2; len <= size; len <<= 1) {
        for (int stride = len / 2; stride > 0; stride >>= 1) {
            __syncthreads();
            for (int t = threadIdx.x; t < size / 2; t += blockDim.x) {
                const int i = 2 * stride * (t / stride) + t % stride, j = i + stride;
                const bool desc = (i & len) == 0;
                const unsigned long long a = win[i], b = win[j];
                if ((a < b) == desc) {
                    win[i] = b;
                    win[j] = a;
                }
            }
        }
    }
    __syncthreads();
}

template <typename T>
__device__ void top_k(const TopKArgs& p) {
    __shared__ unsigned hist[TOPK_MAX_BINS];
    __shared__ unsigned long long win[TOPK_THREADS];  // (key << 32) | ~index: larger ranks first
    __shared__ unsigned scratch[WARP_SIZE];
    __shared__ unsigned s_slots;  // winners gathered above the prefix
    __shared__ Pick s_pick;
    pdl_enter();
    const RowIndex r = row_index(p.src.ne, blockIdx.x);
    const char* x = at(p.src, 0, r.i1, r.i2, r.i3);
    const i64 n = p.src.ne[0], nb0 = p.src.nb[0];
    const unsigned k = (unsigned)p.k;
    const int lane = threadIdx.x % WARP_SIZE;

    // the radix select: the keys on `prefix` (under `mask`) hold the `need` winners not yet found
    unsigned prefix = 0, mask = 0, need = k;
    bool all_on_prefix = false;
    for (int round = 0; round < TOPK_ROUNDS && !all_on_prefix; ++round) {
        const int shift = TOPK_SHIFT[round], bins = 1 << TOPK_BITS[round];
        for (int b = threadIdx.x; b < bins; b += blockDim.x) hist[b] = 0;
        __syncthreads();
        for_each_key<T>(x, n, nb0, [&](i64, unsigned key, bool valid) {
            const bool on = valid && (key & mask) == prefix;
            const unsigned d = on ? (key >> shift) & (unsigned)(bins - 1) : 0xffffffffu;
            // one atomic per digit per warp: logits crowd into a few digits
            const unsigned peers = __match_any_sync(FULL_MASK, d);
            if (on && lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
        });
        __syncthreads();
        const Pick pick = pick_digit(hist, bins, need, scratch, &s_pick);
        need -= pick.above;
        prefix |= pick.digit << shift;
        mask |= (unsigned)(bins - 1) << shift;
        all_on_prefix = pick.count == need;
    }

    // gather: the keys above the prefix, then the first `need` keys on it by index
    for (int i = threadIdx.x; i < TOPK_THREADS; i += blockDim.x) win[i] = 0;
    if (threadIdx.x == 0) s_slots = 0;
    __syncthreads();
    const unsigned above_slots = k - need;
    unsigned taken = 0;  // keys on the prefix taken so far (the same in every thread)
    for_each_key<T>(x, n, nb0, [&](i64 i, unsigned key, bool valid) {
        const unsigned mk = key & mask;
        const unsigned long long c = ((unsigned long long)key << 32) | (unsigned)~(unsigned)i;
        if (valid && (mk > prefix || (all_on_prefix && mk == prefix))) win[atomicAdd(&s_slots, 1u)] = c;
        if (all_on_prefix) return;
        const bool tie = valid && mk == prefix;
        const unsigned ties = __syncthreads_count(tie);
        if (ties == 0 || taken >= need) return;
        const unsigned rank = taken + block_scan(tie ? 1u : 0u, scratch);
        if (tie && rank < need) win[above_slots + rank] = c;
        taken += ties;
    });
    __syncthreads();

    int size = 1;
    while (size < (int)k) size <<= 1;
    bitonic_desc(win, size);
    for (int j = threadIdx.x; j < (int)k; j += blockDim.x) {
        *reinterpret_cast<int*>(at(p.dst, j, r.i1, r.i2, r.i3)) = (int)~(unsigned)win[j];
    }
}

// The same order for short rows (a mixture of experts' router logits): rows of at most
// TOPK_WARP_MAX elements and k <= WARP_SIZE, one warp a row, TOPK_WARP_ROWS rows a block. Each
// lane holds the (key << 32) | ~index of elements lane, lane + 32, ... in registers (0 past the
// row: no element has key 0); each of k rounds takes the warp's largest, which its lane then
// drops (the indices make every entry distinct).
template <typename T>
__device__ void top_k_warp(const TopKArgs& p) {
    constexpr int PER = TOPK_WARP_MAX / WARP_SIZE;
    pdl_enter();
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 row = (i64)blockIdx.x * TOPK_WARP_ROWS + threadIdx.x / WARP_SIZE;
    if (row >= p.src.ne[1] * p.src.ne[2] * p.src.ne[3]) return;  // the whole warp
    const RowIndex r = row_index(p.src.ne, row);
    const char* x = at(p.src, 0, r.i1, r.i2, r.i3);
    const i64 n = p.src.ne[0];
    unsigned long long c[PER];
#pragma unroll
    for (int u = 0; u < PER; ++u) {
        const int i = u * WARP_SIZE + lane;
        const unsigned key = i < n ? order_key(load<T>(x + i * p.src.nb[0])) : 0u;
        c[u] = key == 0u ? 0ull : ((unsigned long long)key << 32) | (unsigned)~(unsigned)i;
    }
    for (int j = 0; j < (int)p.k; ++j) {
        unsigned long long best = c[0];
#pragma unroll
        for (int u = 1; u < PER; ++u) best = c[u] > best ? c[u] : best;
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
            const unsigned long long other = __shfl_xor_sync(FULL_MASK, best, o);
            best = other > best ? other : best;
        }
#pragma unroll
        for (int u = 0; u < PER; ++u) c[u] = c[u] == best ? 0ull : c[u];
        if (lane == 0) *reinterpret_cast<int*>(at(p.dst, j, r.i1, r.i2, r.i3)) = (int)~(unsigned)best;
    }
}

// top_k_<dtype> and top_k_warp_<dtype> for f32, f16, bf16, generated by build.rs from
// build/instances.rs.
#include "topk.inst.cuh"
