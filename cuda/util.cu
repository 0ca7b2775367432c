// Utility kernels: spin_wait, which holds the stream while the profiler enqueues a whole
// plan between timing events (so the events time kernels, not launch gaps), and
// fill_random, the device twin of the CPU backend's seeded generator
// (src/backend/cpu.rs: splitmix64, random_uniform), bit for bit, so both backends make the
// same weights for a seed.
#include "common.cuh"

__device__ __forceinline__ u64 splitmix64(u64 x) {
    u64 z = x + 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Element i = ((bits / 2^24) * 2 - 1) * scale with 24 random bits, rounded like the CPU:
// explicit round-to-nearest operations so no multiply-add is fused.
template <typename T>
__device__ void fill_random(const FillRandomArgs& p) {
    T* dst = reinterpret_cast<T*>(p.dst);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < p.n; i += (i64)gridDim.x * blockDim.x) {
        const u64 bits = splitmix64(p.seed ^ splitmix64((u64)i)) >> 40;
        const float u = __fdiv_rn((float)bits, 16777216.0f);
        const float v = __fmul_rn(__fsub_rn(__fmul_rn(u, 2.0f), 1.0f), p.scale);
        dst[i] = from_f32<T>(v);
    }
}

extern "C" __global__ void fill_random_f32(const FillRandomArgs p) { fill_random<float>(p); }
extern "C" __global__ void fill_random_f16(const FillRandomArgs p) { fill_random<f16>(p); }
extern "C" __global__ void fill_random_bf16(const FillRandomArgs p) { fill_random<bf16>(p); }

// One thread sleeps until p.ns nanoseconds of the global timer have passed.
extern "C" __global__ void spin_wait(const SpinArgs p) {
    u64 start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    } while ((i64)(now - start) < p.ns);
}
