// What bounds a small decode product in a replayed graph: chains of 48 dependent nodes
// (distinct Q4_0 weights in split rows, one column, every node reading the same Q8_1
// activations, as a model's products do) captured into one CUDA graph with programmatic
// dependent launch, the way graft's plans run. Built and run by scripts/decode-chain.sh;
// the figures are in docs/benchmarks.md.
//
// Per shape [k, m] it times, µs a node and % of the copy bandwidth (the bytes are the
// quantized weights'):
//   - the tree's kernels: mul_mat_vec_qsp_c1_q4_0 (first blocks loaded before the wait)
//     and mul_mat_vec_qs_c1_q4_0, from cuda/mul_mat_q.cu itself;
//   - the floor: a node with the product's grid that only waits and writes one float a
//     row, with and without programmatic dependent launch, and with fewer blocks;
//   - variants of the product, each checked to give the tree's result bit for bit:
//     two grids resident at once (16 blocks an SM: the first blocks in registers, or the
//     whole row staged in shared memory), the next kernel's trigger later in the
//     kernel, blocks of 8 or 32 warps, and flag dependencies (each node counts its
//     finished blocks, the next polls the count instead of the grid dependency).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../cuda/mul_mat_q.cu"

#define CK(x)                                                                      \
    do {                                                                           \
        cudaError_t e_ = (x);                                                      \
        if (e_ != cudaSuccess) {                                                   \
            fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
            exit(1);                                                               \
        }                                                                          \
    } while (0)

// A Q4_0 block from its 16 quant bytes and the bits of its f16 scale, as
// BlockQ4_0::from_split gives it.
__device__ __forceinline__ BlockQ4_0::W unpack_q4_0(int4 q, unsigned short d) {
    BlockQ4_0::W w;
    int v[4] = {q.x, q.y, q.z, q.w};
    nibbles_of(v, w.q);
    w.d = __half2float(__ushort_as_half(d));
    return w;
}

// Flag dependencies in place of the grid dependency: node p.vec of a chain counts its
// finished blocks in g_done[p.vec] (after a fence), and node i > 0 waits for node i - 1's
// count to reach its grid (thread 0 polls, the block waits at a barrier) instead of
// griddepcontrol.wait; node 0 waits as the tree does. The graph clears the counts first.
constexpr int MAX_NODES = 256;
__device__ unsigned g_done[MAX_NODES];

__device__ __forceinline__ void flag_wait(const QGemvArgs& p) {
    const int i = (int)p.vec;
    if (i == 0) {
        pdl_wait();
        return;
    }
    if (threadIdx.x == 0) {
        unsigned n;
        for (;;) {
            asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(n) : "l"(&g_done[i - 1]) : "memory");
            if (n >= gridDim.x) break;
            __nanosleep(20);
        }
    }
    __syncthreads();
}

__device__ __forceinline__ void flag_done(const QGemvArgs& p) {
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        atomicAdd(&g_done[p.vec], 1u);
    }
}

// The product of mmvq_split (Q4_0 split rows, one column) with WARPS rows a block, the
// first PRE blocks of a lane loaded before the wait, and the next kernel's trigger at TRIG:
// 0 at the start (the tree's), 1 after the early loads, 2 after the wait, 3 before the
// write. RAW keeps the early blocks as loaded (16 quant bytes and the 2-byte scale) and
// unpacks them after the wait, so that they fit 32 registers.
template <int PRE, int WARPS, int TRIG, bool RAW, bool FLAG = false>
__device__ void product(const QGemvArgs& p) {
    typedef SplitQ4_0 S;
    if (TRIG == 0) pdl_launch_dependents();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 row = blockIdx.x * (i64)WARPS + warp;
    if (row >= p.m) {
        if (TRIG != 0) pdl_launch_dependents();
        return;
    }
    const char* a = p.a + row * p.a_nb1;
    const int nb = (int)(p.k / S::QK);
    float acc = 0.0f;
    int4 q[RAW ? PRE : 1];
    unsigned short h[RAW ? PRE : 1];
    typename S::Q::W w[RAW ? 1 : PRE];
    if constexpr (RAW) {
#pragma unroll
        for (int u = 0; u < PRE; ++u) {
            const int b = lane + WARP_SIZE * u;
            if (b >= nb) continue;
            q[u] = ld_stream16(a + 16 * (i64)b);
            h[u] = (unsigned short)ld_u16(a + 16 * (i64)nb + 2 * (i64)b);
        }
    } else {
        load_first<S, PRE>(a, nb, lane, w);
    }
    if (TRIG == 1) pdl_launch_dependents();
    if constexpr (FLAG) {
        flag_wait(p);
    } else {
        pdl_wait();
    }
    if (TRIG == 2) pdl_launch_dependents();
#pragma unroll
    for (int u = 0; u < PRE; ++u) {
        const int b = lane + WARP_SIZE * u;
        if (b >= nb) continue;
        if constexpr (RAW) {
            dot_cols<typename S::Q, 1>(p, unpack_q4_0(q[u], h[u]), 0, b, &acc);
        } else {
            dot_cols<typename S::Q, 1>(p, w[u], 0, b, &acc);
        }
    }
#pragma unroll 2
    for (int b = lane + WARP_SIZE * PRE; b < nb; b += WARP_SIZE) {
        typename S::Q::W x;
        S::load(a, nb, b, x);
        dot_cols<typename S::Q, 1>(p, x, 0, b, &acc);
    }
    if (TRIG == 3) pdl_launch_dependents();
    write_row<1>(p, row, &acc, lane);
    if constexpr (FLAG) flag_done(p);
}

// The warp's whole split row copied into shared memory (cp.async, before the wait), then
// the same blocks in the same order as the tree's product, read from there.
template <int WARPS>
__device__ void staged(const QGemvArgs& p) {
    extern __shared__ __align__(16) char smem[];
    pdl_launch_dependents();
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const i64 row = blockIdx.x * (i64)WARPS + warp;
    if (row >= p.m) return;
    const int nb = (int)(p.k / 32), rb = nb * 18;  // rb % 16 == 0: the launcher checks nb % 8
    char* s = smem + warp * rb;
    const char* a = p.a + row * p.a_nb1;
    for (int o = 16 * lane; o < rb; o += 16 * WARP_SIZE) copy16(s + o, a + o);
    stage_commit();
    pdl_wait();
    stage_wait<0>();
    __syncwarp();
    float acc = 0.0f;
#pragma unroll 2
    for (int b = lane; b < nb; b += WARP_SIZE) {
        const int4 q = *reinterpret_cast<const int4*>(s + 16 * b);
        const unsigned short d = *reinterpret_cast<const unsigned short*>(s + 16 * nb + 2 * b);
        dot_cols<BlockQ4_0, 1>(p, unpack_q4_0(q, d), 0, b, &acc);
    }
    write_row<1>(p, row, &acc, lane);
}

// The floor: waits for the previous node and writes one float for each of its rows.
// p.ncols is the rows a warp stands for (a grid of fewer blocks covering the same rows).
template <bool PDL, bool FLAG = false>
__device__ void empty(const QGemvArgs& p) {
    if (PDL) pdl_launch_dependents();
    const i64 row = (blockIdx.x * (i64)GEMV_WARPS + threadIdx.x / WARP_SIZE) * p.ncols;
    if constexpr (FLAG) {
        flag_wait(p);
    } else if (PDL) {
        pdl_wait();
    }
    if (row < p.m && threadIdx.x % WARP_SIZE == 0) reinterpret_cast<float*>(p.dst)[row] = 0.0f;
    if constexpr (FLAG) flag_done(p);
}

#define LB(t, n) __launch_bounds__(t, n)
extern "C" __global__ void LB(128, 16) c_empty(const QGemvArgs p) { empty<true>(p); }
extern "C" __global__ void LB(128, 16) c_empty_nopdl(const QGemvArgs p) { empty<false>(p); }
extern "C" __global__ void LB(128, 16) c_regs16(const QGemvArgs p) { product<2, 4, 0, true>(p); }
extern "C" __global__ void LB(128, 16) c_staged16(const QGemvArgs p) { staged<4>(p); }
extern "C" __global__ void LB(512, 4) c_staged16w(const QGemvArgs p) { staged<16>(p); }
extern "C" __global__ void LB(128, 8) c_trig_loads(const QGemvArgs p) { product<4, 4, 1, false>(p); }
extern "C" __global__ void LB(128, 8) c_trig_wait(const QGemvArgs p) { product<4, 4, 2, false>(p); }
extern "C" __global__ void LB(128, 8) c_trig_end(const QGemvArgs p) { product<4, 4, 3, false>(p); }
extern "C" __global__ void LB(256, 4) c_warps8(const QGemvArgs p) { product<4, 8, 0, false>(p); }
extern "C" __global__ void LB(1024, 1) c_warps32(const QGemvArgs p) { product<4, 32, 0, false>(p); }
extern "C" __global__ void LB(128, 16) c_empty_flag(const QGemvArgs p) { empty<true, true>(p); }
extern "C" __global__ void LB(128, 8) c_flag(const QGemvArgs p) { product<4, 4, 0, false, true>(p); }

// Seeded bytes.
__global__ void fill(unsigned* p, size_t n, unsigned seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        unsigned x = (unsigned)i * 2654435761u ^ seed;
        x ^= x >> 13;
        x *= 0x5bd1e995u;
        x ^= x >> 15;
        p[i] = x;
    }
}

// Finite halves in (0.0005, 0.0505) for the activations' scales and sums.
__global__ void fill_scales(__half* h, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        h[i] = __float2half(0.05f * ((float)((i * 40503u) % 65536u) / 65536.0f + 0.01f));
    }
}

struct Variant {
    const char* name;
    void (*kernel)(const QGemvArgs);
    int threads;        // a block
    int rows_a_block;   // rows of the product a block covers
    bool smem;          // a row of shared memory a warp
    bool pdl;           // launched with programmatic dependent launch
    int rows_a_warp;    // rows a warp stands for: 1, or more for an empty node of fewer blocks
    bool checked;       // a product: its result must equal the tree's
    bool flag = false;  // waits on the previous node's count of finished blocks (flag_wait)
};

// The median of `runs` timings (ms) of the work `enqueue` puts on `st`, after `warm`
// untimed ones.
template <typename F>
static float median_ms(cudaStream_t st, int warm, int runs, F enqueue) {
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < warm; ++i) enqueue();
    std::vector<float> t;
    for (int i = 0; i < runs; ++i) {
        CK(cudaEventRecord(e0, st));
        enqueue();
        CK(cudaEventRecord(e1, st));
        CK(cudaEventSynchronize(e1));
        float ms;
        CK(cudaEventElapsedTime(&ms, e0, e1));
        t.push_back(ms);
    }
    CK(cudaEventDestroy(e0));
    CK(cudaEventDestroy(e1));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

static float time_chain(cudaStream_t st, const Variant& v, const std::vector<char*>& w,
                        const std::vector<char*>& d, const char* b, long k, long m, long b_nb1) {
    const long nb = k / 32, row_bytes = nb * 18;
    const unsigned grid = (unsigned)((m + v.rows_a_block * v.rows_a_warp - 1) / (v.rows_a_block * v.rows_a_warp));
    cudaGraph_t g;
    cudaGraphExec_t ge;
    void* done;
    CK(cudaGetSymbolAddress(&done, g_done));
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    if (v.flag) CK(cudaMemsetAsync(done, 0, sizeof(g_done), st));
    for (size_t i = 0; i < w.size(); ++i) {
        QGemvArgs a{};
        a.a = w[i], a.b = b, a.dst = d[i], a.add = nullptr, a.k = k, a.m = m, a.ncols = v.rows_a_warp;
        a.a_nb1 = row_bytes, a.b_nb1 = b_nb1, a.vec = v.flag ? (long)i : 0, a.prefetch = 1;
        cudaLaunchConfig_t cfg{};
        cfg.gridDim = dim3(grid), cfg.blockDim = dim3(v.threads), cfg.stream = st;
        cfg.dynamicSmemBytes = v.smem ? (size_t)v.rows_a_block * row_bytes : 0;
        cudaLaunchAttribute at{};
        at.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        at.val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = &at, cfg.numAttrs = v.pdl ? 1 : 0;
        CK(cudaLaunchKernelEx(&cfg, v.kernel, a));
    }
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    const float ms = median_ms(st, 1, 9, [&] { CK(cudaGraphLaunch(ge, st)); });
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    return ms * 1e3f / (float)w.size();
}

int main(int argc, char** argv) {
    const int nodes = argc > 1 ? atoi(argv[1]) : 48;
    if (nodes < 1 || nodes > MAX_NODES) {
        fprintf(stderr, "chains of 1 to %d nodes\n", MAX_NODES);
        return 2;
    }
    CK(cudaSetDevice(0));
    cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    cudaStream_t st;
    CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

    // The copy bandwidth as bench-ops measures it: bytes read + written by a 512 MiB copy.
    const size_t cb = 512ull << 20;
    char *c0, *c1;
    CK(cudaMalloc(&c0, cb));
    CK(cudaMalloc(&c1, cb));
    const float copy_ms = median_ms(st, 3, 5, [&] { CK(cudaMemcpyAsync(c1, c0, cb, cudaMemcpyDeviceToDevice, st)); });
    const double copy_gbs = 2.0 * cb / (copy_ms * 1e-3) / 1e9;
    CK(cudaFree(c0));
    CK(cudaFree(c1));
    printf("%s, %d SMs; copy bandwidth %.0f GB/s; chains of %d nodes\n", prop.name, prop.multiProcessorCount,
           copy_gbs, nodes);

    const Variant vars[] = {
        {"tree: mul_mat_vec_qsp_c1_q4_0", mul_mat_vec_qsp_c1_q4_0, 128, 4, false, true, 1, true},
        {"tree: mul_mat_vec_qs_c1_q4_0", mul_mat_vec_qs_c1_q4_0, 128, 4, false, true, 1, true},
        {"empty node, the product's grid", c_empty, 128, 4, false, true, 1, false},
        {"empty node, the product's grid, no PDL", c_empty_nopdl, 128, 4, false, false, 1, false},
        {"empty node, 1/2 of the blocks", c_empty, 128, 4, false, true, 2, false},
        {"empty node, 1/4 of the blocks", c_empty, 128, 4, false, true, 4, false},
        {"empty node, 1/8 of the blocks", c_empty, 128, 4, false, true, 8, false},
        {"two grids resident: 2 blocks a lane early, 16 blocks an SM", c_regs16, 128, 4, false, true, 1, true},
        {"two grids resident: row staged in shared memory, 16 blocks an SM", c_staged16, 128, 4, true, true, 1, true},
        {"two grids resident: staged, 16 warps a block, 4 blocks an SM", c_staged16w, 512, 16, true, true, 1, true},
        {"trigger after the early loads", c_trig_loads, 128, 4, false, true, 1, true},
        {"trigger after the wait", c_trig_wait, 128, 4, false, true, 1, true},
        {"trigger before the write", c_trig_end, 128, 4, false, true, 1, true},
        {"8 warps a block", c_warps8, 256, 8, false, true, 1, true},
        {"32 warps a block", c_warps32, 1024, 32, false, true, 1, true},
        {"empty node, flag dependencies", c_empty_flag, 128, 4, false, true, 1, false, true},
        {"empty node, 1/8 of the blocks, flag dependencies", c_empty_flag, 128, 4, false, true, 8, false, true},
        {"flag dependencies (the tree's qsp otherwise)", c_flag, 128, 4, false, true, 1, true, true},
    };
    for (const Variant& v : vars) {
        CK(cudaFuncSetAttribute((const void*)v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 160 * 1024));
    }
    const long shapes[][2] = {{4096, 4096}, {11008, 4096}, {4096, 11008}};
    int failed = 0;
    for (const auto& sh : shapes) {
        const long k = sh[0], m = sh[1], nb = k / 32, row_bytes = nb * 18;
        if (nb % 8 != 0) { fprintf(stderr, "rows must be whole 16-byte words\n"); return 2; }
        const size_t wbytes = (size_t)row_bytes * m;
        std::vector<char*> w(nodes), d(nodes);
        // Split rows: 16 quant bytes a block, then a 2-byte scale a block.
        std::vector<__half> scales((size_t)nb * m);
        for (size_t i = 0; i < scales.size(); ++i) scales[i] = __float2half(0.001f * (float)(1 + (i * 7919) % 97));
        for (int i = 0; i < nodes; ++i) {
            CK(cudaMalloc(&w[i], wbytes));
            CK(cudaMalloc(&d[i], m * 4));
            fill<<<1024, 256, 0, st>>>((unsigned*)w[i], wbytes / 4, 77u + (unsigned)i);
            CK(cudaGetLastError());
            CK(cudaMemcpy2DAsync(w[i] + 16 * nb, row_bytes, scales.data(), nb * 2, nb * 2, m, cudaMemcpyHostToDevice, st));
        }
        // Q8_1 activations in the ACT_BLOCKS layout: quants, then (d, sum) halves.
        const long qb = (k + 511) & ~511L, b_nb1 = qb + 4 * nb;
        char* b;
        CK(cudaMalloc(&b, b_nb1));
        fill<<<64, 256, 0, st>>>((unsigned*)b, qb / 4, 5u);
        fill_scales<<<8, 256, 0, st>>>((__half*)(b + qb), 2 * nb);
        CK(cudaGetLastError());
        CK(cudaStreamSynchronize(st));
        printf("\n[%ld, %ld]: %.2f MB a node, %.2f us at the copy bandwidth\n\n", k, m, wbytes / 1e6,
               wbytes / (copy_gbs * 1e3));
        printf("| node | us a node | of copy | result |\n| --- | ---: | ---: | --- |\n");
        std::vector<float> ref(m), out(m);
        for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); ++i) {
            const Variant& v = vars[i];
            const float us = time_chain(st, v, w, d, b, k, m, b_nb1);
            const char* check = "";
            if (v.checked) {
                CK(cudaMemcpy(out.data(), d[nodes - 1], m * 4, cudaMemcpyDeviceToHost));
                if (i == 0) {
                    ref = out;
                    check = "reference";
                } else if (memcmp(ref.data(), out.data(), m * 4) == 0) {
                    check = "same bits";
                } else {
                    check = "DIFFERS";
                    failed = 1;
                }
            }
            printf("| %s | %.2f | %.1f%% | %s |\n", v.name, us, 100.0 * wbytes / (us * 1e3) / copy_gbs, check);
        }
        for (int i = 0; i < nodes; ++i) {
            CK(cudaFree(w[i]));
            CK(cudaFree(d[i]));
        }
        CK(cudaFree(b));
    }
    if (failed) printf("\nA variant's result differs from the tree's kernel.\n");
    return failed;
}
