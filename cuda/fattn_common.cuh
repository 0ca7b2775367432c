// Shared pieces of the flash attention kernels (cuda/fattn.cu): loading 8 consecutive
// elements of a K/V row as f32 for every cache type (common.cuh's load8, specialized here
// for Q8_0 and Q4_0), the per-row mask and slope, and the key's score from q . k.
//
// A K/V row is `d` elements starting at at(t, 0, j, hk, b). Every head dim the kernels
// take (16, 32, 64, 80, 96, 112, 128, 256) is a multiple of 16, so a row splits into whole
// 8-element pieces; the quantized types need d % 32 == 0 (whole blocks per row), which the
// lowering checks. Piece `e0` (a multiple of 8) of a row:
//   F32, F16, BF16: 32 or 16 bytes at e0 (16-byte vector loads when `vec`, which the
//     lowering sets when every row start is 16-byte aligned; element loads otherwise);
//   Q8_0 (34-byte blocks: f16 d, i8 qs[32]): d * qs[e0 % 32 ..][0..8];
//   Q4_0 (18-byte blocks: f16 d, u8 qs[16], element i < 16 the low nibble of qs[i], i + 16
//     the high one): d * (nibble - 8).
// Block reads are 16-bit (blocks are only 2-byte aligned).
#pragma once

#include "common.cuh"

struct KvQ8_0 {};
struct KvQ4_0 {};

// load8 (common.cuh) for the quantized cache types:
template <>
__device__ __forceinline__ void load8<KvQ8_0>(const char* row, int e0, bool, float out[8]) {
    const char* blk = row + (e0 / 32) * 34;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(blk);
    const float d = __half2float(__ushort_as_half(w[0]));
    const uint16_t* qs = w + 1 + (e0 % 32) / 2;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint16_t two = qs[i];
        out[2 * i] = d * (float)(int8_t)(two & 0xff);
        out[2 * i + 1] = d * (float)(int8_t)(two >> 8);
    }
}

template <>
__device__ __forceinline__ void load8<KvQ4_0>(const char* row, int e0, bool, float out[8]) {
    const char* blk = row + (e0 / 32) * 18;
    const uint16_t* w = reinterpret_cast<const uint16_t*>(blk);
    const float d = __half2float(__ushort_as_half(w[0]));
    const int within = e0 % 32;
    const uint16_t* qs = w + 1 + (within % 16) / 2;
    const int shift = within >= 16 ? 4 : 0;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const uint16_t two = qs[i];
        out[2 * i] = d * (float)((int)((two >> shift) & 0xf) - 8);
        out[2 * i + 1] = d * (float)((int)((two >> (8 + shift)) & 0xf) - 8);
    }
}

// The mask row of query i for head h in batch b (nullptr without a mask).
__device__ __forceinline__ const char* mask_row(const FattnArgs& p, i64 i, i64 h, i64 b) {
    if (p.mask.data == nullptr) return nullptr;
    return at(p.mask, 0, i, h % p.mask.ne[2], b % p.mask.ne[3]);
}

// slope * mask[j] of a mask row (0 without a mask): -inf hides key j.
__device__ __forceinline__ float mask_bias(const FattnArgs& p, const char* mrow, float slope, i64 j) {
    if (mrow == nullptr) return 0.0f;
    const char* e = mrow + j * p.mask.nb[0];
    const float m = p.mask_f16 ? __half2float(*reinterpret_cast<const f16*>(e))
                               : *reinterpret_cast<const float*>(e);
    return m == -INFINITY ? -INFINITY : slope * m;
}

// The score of a key from its q . k dot product and its mask bias, as the CPU reference:
// scale, then softcap, then the bias.
__device__ __forceinline__ float score(const FattnArgs& p, float dot, float bias) {
    float s = p.scale * dot;
    if (p.softcap > 0.0f) s = p.softcap * tanhf(s / p.softcap);
    return s + bias;
}
