// nvcc-flags: -fmad=false
// Quantization on the device, byte for byte as src/quant's quantize_row (this file is
// compiled without fused multiply-adds, see the line above, so every f32 expression
// rounds like the CPU's; divisions and square roots are IEEE-rounded by default):
//   quantize_q8_1_f32: F32 rows (dense dim 0, any row strides) -> Q8_1 blocks, the
//     activation format of mul_mat_vec_q_*, split: a dst row of k elements holds the k
//     quants (interleaved in groups of blocks in the layout `mode` names, cuda/quant.cuh
//     act_at), then the (d, sum) f16 pairs of its blocks; the rows are dst.nb[1] apart.
//     One warp per 32-element block (a lane per element, warp max and sum), GEMV_WARPS
//     blocks per thread block; grid.x over the blocks of a row, grid.y over rows
//     (strided).
//   cpy_f32_<q>: F32 (any strides) -> blocks of q (dense blocks along dim 0, any row
//     strides), same shape. One thread per block running ggml's reference rules
//     (Q4_0..Q8_1) or scale searches (make_qkx2_quants for Q4_K/Q5_K, make_qx_quants for
//     Q6_K) sequentially, as the CPU does; flat grid-stride loop over the blocks.
//   set_rows_f32_<q>: set_rows into a quantized table (a quantized KV cache): row r of
//     the F32 source, quantized as cpy_f32_<q> does, into row ids[r] of dst; one thread
//     per block, flat grid-stride loop. An id outside 0..dst rows is recorded (the
//     lowering turns it into an error naming the node) and its row skipped.
#include "quant.cuh"

typedef unsigned char u8;

// ---------------------------------------------------------------------------------------
// Scalar helpers with the CPU's semantics (sat_i8 and inverse: quant.cuh).

// ggml's nearest_int: round half to even through the 1.5 * 2^23 trick.
__device__ __forceinline__ int nearest_int(float x) {
    const float v = x + 12582912.0f;
    return (__float_as_int(v) & 0x007fffff) - 0x00400000;
}

__device__ __forceinline__ void put_f16(u8* y, float v) {
    const unsigned short h = __half_as_ushort(__float2half_rn(v));
    y[0] = (u8)(h & 0xffu);
    y[1] = (u8)(h >> 8);
}

__device__ __forceinline__ float get_f16(const u8* y) {
    return __half2float(__ushort_as_half((unsigned short)(y[0] | (y[1] << 8))));
}

__device__ __forceinline__ int clampi(int v, int lo, int hi) { return v < lo ? lo : (v > hi ? hi : v); }

// ---------------------------------------------------------------------------------------
// The 32-element types (src/quant/legacy.rs).

__device__ __forceinline__ float signed_absmax(const float* x) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < 32; ++i) {
        if (amax < fabsf(x[i])) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    }
    return max;
}

__device__ __forceinline__ void min_max(const float* x, float& mn, float& mx) {
    mn = 3.40282347e38f;
    mx = -3.40282347e38f;
    for (int i = 0; i < 32; ++i) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
    }
}

__device__ __forceinline__ void pack_nibbles(const u8* q, u8* qs) {
    for (int j = 0; j < 16; ++j) qs[j] = (u8)((q[j] & 0x0f) | ((q[j + 16] & 0x0f) << 4));
}

__device__ __forceinline__ void high_bits(const u8* q, u8* qh) {
    unsigned h = 0;
    for (int i = 0; i < 32; ++i) h |= ((unsigned)(q[i] >> 4) & 1u) << i;
    for (int i = 0; i < 4; ++i) qh[i] = (u8)(h >> (8 * i));
}

__device__ __forceinline__ void symmetric_quants(const float* x, float id, float half, int hi, u8* q) {
    for (int i = 0; i < 32; ++i) {
        const int t = min(sat_i8(x[i] * id + (half + 0.5f)), hi);
        q[i] = (u8)(t & 0xff);
    }
}

__device__ __forceinline__ void affine_quants(const float* x, float mn, float id, int hi, u8* q) {
    for (int i = 0; i < 32; ++i) {
        const int t = (u8)(sat_i8((x[i] - mn) * id + 0.5f) & 0xff);
        q[i] = (u8)min(t, hi);
    }
}

struct QuantQ4_0 {
    static constexpr int QK = 32, BYTES = 18;
    static __device__ void run(const float* x, u8* y) {
        const float d = signed_absmax(x) / -8.0f;
        put_f16(y, d);
        u8 q[32];
        symmetric_quants(x, inverse(d), 8.0f, 15, q);
        pack_nibbles(q, y + 2);
    }
};

struct QuantQ4_1 {
    static constexpr int QK = 32, BYTES = 20;
    static __device__ void run(const float* x, u8* y) {
        float mn, mx;
        min_max(x, mn, mx);
        const float d = (mx - mn) / 15.0f;
        put_f16(y, d);
        put_f16(y + 2, mn);
        u8 q[32];
        affine_quants(x, mn, inverse(d), 15, q);
        pack_nibbles(q, y + 4);
    }
};

struct QuantQ5_0 {
    static constexpr int QK = 32, BYTES = 22;
    static __device__ void run(const float* x, u8* y) {
        const float d = signed_absmax(x) / -16.0f;
        put_f16(y, d);
        u8 q[32];
        symmetric_quants(x, inverse(d), 16.0f, 31, q);
        high_bits(q, y + 2);
        pack_nibbles(q, y + 6);
    }
};

struct QuantQ5_1 {
    static constexpr int QK = 32, BYTES = 24;
    static __device__ void run(const float* x, u8* y) {
        float mn, mx;
        min_max(x, mn, mx);
        const float d = (mx - mn) / 31.0f;
        put_f16(y, d);
        put_f16(y + 2, mn);
        u8 q[32];
        affine_quants(x, mn, inverse(d), 31, q);
        high_bits(q, y + 4);
        pack_nibbles(q, y + 8);
    }
};

// d = amax / 127, q = roundf(x / d) (halves away from zero); returns d.
__device__ __forceinline__ float quants_8bit(const float* x, u8* qs) {
    float amax = 0.0f;
    for (int i = 0; i < 32; ++i) {
        const float a = fabsf(x[i]);
        amax = amax > a ? amax : a;
    }
    const float d = amax / 127.0f;
    const float id = inverse(d);
    for (int i = 0; i < 32; ++i) qs[i] = (u8)(sat_i8(roundf(x[i] * id)) & 0xff);
    return d;
}

struct QuantQ8_0 {
    static constexpr int QK = 32, BYTES = 34;
    static __device__ void run(const float* x, u8* y) {
        const float d = quants_8bit(x, y + 2);
        put_f16(y, d);
    }
};

struct QuantQ8_1 {
    static constexpr int QK = 32, BYTES = 36;
    static __device__ void run(const float* x, u8* y) {
        const float d = quants_8bit(x, y + 4);
        int sum = 0;
        for (int i = 0; i < 32; ++i) sum += (signed char)y[4 + i];
        put_f16(y, d);
        put_f16(y + 2, (float)sum * d);
    }
};

// ---------------------------------------------------------------------------------------
// The K-quants (src/quant/kquants.rs).

#define GROUP_MAX_EPS 1e-15f

struct Qkx2 {
    int nmax;
    float rmin, rdelta;
    int nstep;
};

__device__ __forceinline__ void affine_levels(const float* x, float iscale, float mn, int nmax, u8* l) {
    for (int i = 0; i < 32; ++i) l[i] = (u8)clampi(nearest_int(iscale * (x[i] - mn)), 0, nmax);
}

__device__ __forceinline__ float affine_error(const float* x, const float* w, const u8* l, float scale, float mn) {
    float err = 0.0f;
    for (int i = 0; i < 32; ++i) {
        const float diff = scale * (float)l[i] + mn - x[i];
        err += w[i] * (diff * diff);
    }
    return err;
}

// make_qkx2_quants for 32 values (use_mad = false); returns (scale, -min).
__device__ void make_qkx2_quants(const float* x, const float* w, u8* l, const Qkx2 p, float& out_scale,
                                 float& out_min) {
    float mn = x[0], mx = x[0];
    float sum_w = w[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < 32; ++i) {
        if (x[i] < mn) mn = x[i];
        if (x[i] > mx) mx = x[i];
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if (mn > 0.0f) mn = 0.0f;
    if (mx == mn) {
        for (int i = 0; i < 32; ++i) l[i] = 0;
        out_scale = 0.0f;
        out_min = -mn;
        return;
    }
    const float nmax = (float)p.nmax;
    float iscale = nmax / (mx - mn);
    float scale = 1.0f / iscale;
    affine_levels(x, iscale, mn, p.nmax, l);
    float best_error = affine_error(x, w, l, scale, mn);
    u8 laux[32];
    for (int is = 0; is <= p.nstep; ++is) {
        iscale = (p.rmin + p.rdelta * (float)is + nmax) / (mx - mn);
        affine_levels(x, iscale, mn, p.nmax, laux);
        float sum_l = 0.0f, sum_l2 = 0.0f, sum_xl = 0.0f;
        for (int i = 0; i < 32; ++i) {
            const float li = (float)laux[i];
            sum_l += w[i] * li;
            sum_l2 += w[i] * li * li;
            sum_xl += w[i] * li * x[i];
        }
        const float det = sum_w * sum_l2 - sum_l * sum_l;
        if (det > 0.0f) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if (this_min > 0.0f) {
                this_min = 0.0f;
                this_scale = sum_xl / sum_l2;
            }
            const float cur_error = affine_error(x, w, laux, this_scale, this_min);
            if (cur_error < best_error) {
                for (int i = 0; i < 32; ++i) l[i] = laux[i];
                best_error = cur_error;
                scale = this_scale;
                mn = this_min;
            }
        }
    }
    out_scale = scale;
    out_min = -mn;
}

// The 6-bit scale and min of sub-block j from scales[12] (get_scale_min_k4).
__device__ __forceinline__ void scale_min(int j, const u8* q, int& sc, int& m) {
    if (j < 4) {
        sc = q[j] & 63;
        m = q[j + 4] & 63;
    } else {
        sc = (q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4);
        m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Q4_K / Q5_K: the sub-block searches, the 6-bit scales and mins, d and dmin into
// y[0..16], and the final quants 0..nmax in l.
__device__ void quantize_k4_scales(const float* x, u8* y, const Qkx2 p, u8* l) {
    float scales[8], mins[8];
    float max_scale = 0.0f, max_min = 0.0f;
    for (int j = 0; j < 8; ++j) {
        const float* xs = x + 32 * j;
        float sum_x2 = 0.0f;
        for (int i = 0; i < 32; ++i) sum_x2 = sum_x2 + xs[i] * xs[i];
        const float av_x = sqrtf(sum_x2 / 32.0f);
        float w[32];
        for (int i = 0; i < 32; ++i) w[i] = av_x + fabsf(xs[i]);
        make_qkx2_quants(xs, w, l + 32 * j, p, scales[j], mins[j]);
        if (scales[j] > max_scale) max_scale = scales[j];
        if (mins[j] > max_min) max_min = mins[j];
    }
    const float inv_scale = max_scale > 0.0f ? 63.0f / max_scale : 0.0f;
    const float inv_min = max_min > 0.0f ? 63.0f / max_min : 0.0f;
    u8* sc = y + 4;
    for (int i = 0; i < 12; ++i) sc[i] = 0;
    for (int j = 0; j < 8; ++j) {
        // Rust: `nearest_int(..) as u8` then `.min(63)`.
        const u8 ls = (u8)min((int)(u8)(nearest_int(inv_scale * scales[j]) & 0xff), 63);
        const u8 lm = (u8)min((int)(u8)(nearest_int(inv_min * mins[j]) & 0xff), 63);
        if (j < 4) {
            sc[j] = ls;
            sc[j + 4] = lm;
        } else {
            sc[j + 4] = (u8)((ls & 0x0f) | ((lm & 0x0f) << 4));
            sc[j - 4] |= (u8)((ls >> 4) << 6);
            sc[j] |= (u8)((lm >> 4) << 6);
        }
    }
    put_f16(y, max_scale / 63.0f);
    put_f16(y + 2, max_min / 63.0f);
    const float d = get_f16(y), dmin = get_f16(y + 2);
    for (int j = 0; j < 8; ++j) {
        int s, m;
        scale_min(j, sc, s, m);
        const float dj = d * (float)s;
        if (dj == 0.0f) continue;
        const float dm = dmin * (float)m;
        for (int i = 32 * j; i < 32 * j + 32; ++i) l[i] = (u8)clampi(nearest_int((x[i] + dm) / dj), 0, p.nmax);
    }
}

__device__ __forceinline__ void pack_k_nibbles(const u8* l, u8* qs) {
    for (int c = 0; c < 4; ++c)
        for (int i = 0; i < 32; ++i) qs[32 * c + i] = (u8)((l[64 * c + i] & 0x0f) | ((l[64 * c + i + 32] & 0x0f) << 4));
}

struct QuantQ4_K {
    static constexpr int QK = 256, BYTES = 144;
    static __device__ void run(const float* x, u8* y) {
        u8 l[256];
        quantize_k4_scales(x, y, Qkx2{15, -1.0f, 0.1f, 20}, l);
        pack_k_nibbles(l, y + 16);
    }
};

struct QuantQ5_K {
    static constexpr int QK = 256, BYTES = 176;
    static __device__ void run(const float* x, u8* y) {
        u8 l[256];
        quantize_k4_scales(x, y, Qkx2{31, -0.5f, 0.1f, 15}, l);
        u8* qh = y + 16;
        for (int i = 0; i < 32; ++i) qh[i] = 0;
        for (int i = 0; i < 256; ++i) qh[i % 32] |= (u8)((l[i] >> 4) << (i / 32));
        pack_k_nibbles(l, y + 48);
    }
};

// qx_sums: symmetric quants for iscale, clamped to -nmax..nmax-1; x^2-weighted sums.
__device__ __forceinline__ void qx_sums(const float* x, float iscale, int nmax, u8* out, float& sumlx, float& suml2) {
    sumlx = 0.0f;
    suml2 = 0.0f;
    for (int i = 0; i < 16; ++i) {
        const int l = clampi(nearest_int(iscale * x[i]), -nmax, nmax - 1);
        if (out) out[i] = (u8)(l + nmax);
        const float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
}

// make_qx_quants for 16 values (rmse_type 1, no importance weights); returns the scale.
__device__ float make_qx_quants(const float* x, int nmax, u8* l) {
    float amax = 0.0f, max = 0.0f;
    for (int i = 0; i < 16; ++i) {
        if (fabsf(x[i]) > amax) {
            amax = fabsf(x[i]);
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < 16; ++i) l[i] = 0;
        return 0.0f;
    }
    float iscale = -(float)nmax / max;
    float sumlx, suml2;
    qx_sums(x, iscale, nmax, l, sumlx, suml2);
    float scale = suml2 != 0.0f ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0) continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        qx_sums(x, iscale, nmax, nullptr, sumlx, suml2);
        if (suml2 > 0.0f && sumlx * sumlx > best * suml2) {
            qx_sums(x, iscale, nmax, l, sumlx, suml2);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

struct QuantQ6_K {
    static constexpr int QK = 256, BYTES = 210;
    static __device__ void run(const float* x, u8* y) {
        u8 l[256];
        float scales[16];
        for (int ib = 0; ib < 16; ++ib) scales[ib] = make_qx_quants(x + 16 * ib, 32, l + 16 * ib);
        float max_scale = 0.0f, max_abs_scale = 0.0f;
        for (int ib = 0; ib < 16; ++ib) {
            if (fabsf(scales[ib]) > max_abs_scale) {
                max_abs_scale = fabsf(scales[ib]);
                max_scale = scales[ib];
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            for (int i = 0; i < 210; ++i) y[i] = 0;
            return;
        }
        const float iscale = -128.0f / max_scale;
        put_f16(y + 208, 1.0f / iscale);
        for (int ib = 0; ib < 16; ++ib) y[192 + ib] = (u8)(min(nearest_int(iscale * scales[ib]), 127) & 0xff);
        const float d = get_f16(y + 208);
        for (int j = 0; j < 16; ++j) {
            const float dj = d * (float)(signed char)y[192 + j];
            if (dj == 0.0f) continue;
            for (int i = 16 * j; i < 16 * j + 16; ++i) l[i] = (u8)(clampi(nearest_int(x[i] / dj), -32, 31) + 32);
        }
        for (int c = 0; c < 2; ++c) {
            const u8* lc = l + 128 * c;
            for (int i = 0; i < 32; ++i) {
                const u8 a = lc[i], b = lc[i + 32], e = lc[i + 64], f = lc[i + 96];
                y[64 * c + i] = (u8)((a & 0x0f) | ((e & 0x0f) << 4));
                y[64 * c + i + 32] = (u8)((b & 0x0f) | ((f & 0x0f) << 4));
                y[128 + 32 * c + i] = (u8)((a >> 4) | ((b >> 4) << 2) | ((e >> 4) << 4) | ((f >> 4) << 6));
            }
        }
    }
};

// ---------------------------------------------------------------------------------------
// Kernels.

// The QK source floats at element i0 of row r, quantized into y; a block holding a NaN or
// an infinity becomes zeros with a NaN scale d, so that all of it dequantizes to NaN (as
// src/quant's mark_non_finite: the rules above would store finite quants for a NaN).
template <typename Q>
__device__ __forceinline__ void quantize_block(const Tensor4& src, const RowIndex& r, i64 i0, u8* y) {
    float x[Q::QK];
    bool finite = true;
    for (int i = 0; i < Q::QK; ++i) {
        x[i] = load<float>(at(src, i0 + i, r.i1, r.i2, r.i3));
        finite &= isfinite(x[i]);
    }
    Q::run(x, y);
    if (!finite) {
        for (int i = 0; i < Q::BYTES; ++i) y[i] = 0;
        // d: the f16 quiet NaN 0x7e00, the CPU's bytes
        y[(std::is_same<Q, QuantQ6_K>::value ? 208 : 0) + 1] = 0x7e;
    }
}

// The BYTES of a block to d (2-byte aligned) in 16-bit pieces.
template <typename Q>
__device__ __forceinline__ void put_block(char* d, const u8* y) {
    for (int i = 0; i < Q::BYTES; i += 2) {
        *reinterpret_cast<unsigned short*>(d + i) = (unsigned short)(y[i] | (y[i + 1] << 8));
    }
}

// One thread per block: gathers the block's QK floats, quantizes them in local memory,
// writes the bytes out in 16-bit pieces (blocks are 2-byte aligned).
template <typename Q>
__device__ void cpy_quant(const CpyArgs& p) {
    pdl_enter();
    const i64 per_row = p.dst.ne[0] / Q::QK;
    for (i64 b = blockIdx.x * (i64)blockDim.x + threadIdx.x; b < p.n; b += (i64)gridDim.x * blockDim.x) {
        const RowIndex r = row_index(p.src.ne, b / per_row);
        const i64 i0 = (b % per_row) * Q::QK;
        u8 y[Q::BYTES];
        quantize_block<Q>(p.src, r, i0, y);
        put_block<Q>(at(p.dst, 0, r.i1, r.i2, r.i3) + (i0 / Q::QK) * p.dst.nb[0], y);
    }
}

// ids is I32 [n, i2, i3], broadcast over dims 2 and 3 of src [ne0, n, ne2, ne3]
// (set_row_id in common.cuh, as set_row_element).
template <typename Q>
__device__ void set_rows_quant(const RowsArgs& p) {
    pdl_enter();
    const i64 per_row = p.src.ne[0] / Q::QK;
    const i64 n = per_row * p.src.ne[1] * p.src.ne[2] * p.src.ne[3];
    for (i64 b = blockIdx.x * (i64)blockDim.x + threadIdx.x; b < n; b += (i64)gridDim.x * blockDim.x) {
        const RowIndex r = row_index(p.src.ne, b / per_row);
        const i64 i0 = (b % per_row) * Q::QK;
        const int id = set_row_id(p.ids, p.dst, p.err, p.tag, r.i1, r.i2, r.i3, i0 == 0);
        if (id < 0) continue;
        u8 y[Q::BYTES];
        quantize_block<Q>(p.src, r, i0, y);
        put_block<Q>(at(p.dst, 0, id, r.i2, r.i3) + (i0 / Q::QK) * p.dst.nb[0], y);
    }
}

// One warp per Q8_1 block (lane = element); warp w of the thread block takes block
// blockIdx.x * GEMV_WARPS + w of row blockIdx.y (+ multiples of gridDim.y).
__device__ void quantize_q8_1(const CpyArgs& p) {
    pdl_enter();
    const int lane = threadIdx.x % WARP_SIZE;
    const i64 blk = blockIdx.x * (i64)GEMV_WARPS + threadIdx.x / WARP_SIZE;
    if (blk * 32 >= p.src.ne[0]) return;
    const i64 rows = p.src.ne[1] * p.src.ne[2] * p.src.ne[3];
    for (i64 row = blockIdx.y; row < rows; row += gridDim.y) {
        const RowIndex r = row_index(p.src.ne, row);
        const float x = load<float>(at(p.src, blk * 32 + lane, r.i1, r.i2, r.i3));
        store_act(x, at(p.dst, 0, r.i1, r.i2, r.i3), p.src.ne[0], blk, lane, p.mode);
    }
}

extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP_SIZE) quantize_q8_1_f32(const CpyArgs p) { quantize_q8_1(p); }

extern "C" __global__ void cpy_f32_q4_0(const CpyArgs p) { cpy_quant<QuantQ4_0>(p); }
extern "C" __global__ void cpy_f32_q4_1(const CpyArgs p) { cpy_quant<QuantQ4_1>(p); }
extern "C" __global__ void cpy_f32_q5_0(const CpyArgs p) { cpy_quant<QuantQ5_0>(p); }
extern "C" __global__ void cpy_f32_q5_1(const CpyArgs p) { cpy_quant<QuantQ5_1>(p); }
extern "C" __global__ void cpy_f32_q8_0(const CpyArgs p) { cpy_quant<QuantQ8_0>(p); }
extern "C" __global__ void cpy_f32_q8_1(const CpyArgs p) { cpy_quant<QuantQ8_1>(p); }
extern "C" __global__ void cpy_f32_q4_k(const CpyArgs p) { cpy_quant<QuantQ4_K>(p); }
extern "C" __global__ void cpy_f32_q5_k(const CpyArgs p) { cpy_quant<QuantQ5_K>(p); }
extern "C" __global__ void cpy_f32_q6_k(const CpyArgs p) { cpy_quant<QuantQ6_K>(p); }

extern "C" __global__ void set_rows_f32_q4_0(const RowsArgs p) { set_rows_quant<QuantQ4_0>(p); }
extern "C" __global__ void set_rows_f32_q4_1(const RowsArgs p) { set_rows_quant<QuantQ4_1>(p); }
extern "C" __global__ void set_rows_f32_q5_0(const RowsArgs p) { set_rows_quant<QuantQ5_0>(p); }
extern "C" __global__ void set_rows_f32_q5_1(const RowsArgs p) { set_rows_quant<QuantQ5_1>(p); }
extern "C" __global__ void set_rows_f32_q8_0(const RowsArgs p) { set_rows_quant<QuantQ8_0>(p); }
extern "C" __global__ void set_rows_f32_q4_k(const RowsArgs p) { set_rows_quant<QuantQ4_K>(p); }
extern "C" __global__ void set_rows_f32_q5_k(const RowsArgs p) { set_rows_quant<QuantQ5_K>(p); }
extern "C" __global__ void set_rows_f32_q6_k(const RowsArgs p) { set_rows_quant<QuantQ6_K>(p); }
