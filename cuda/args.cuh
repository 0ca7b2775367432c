// The contract between the host and the kernels: every kernel argument struct (each kernel
// takes one by value as its only parameter) and the launch constants both sides use.
//
// This header is the one definition. build.rs parses it and writes the Rust mirror
// (#[repr(C)] structs with the same fields in the same order, and the constants) into
// OUT_DIR/args.rs, included by src/backend/cuda/args.rs. The parser takes, between
// `// contract:begin` and `// contract:end`:
//   struct NAME {  // doc
//       TYPE FIELD;        // doc   (TYPE: i64, u64, int, float, Tensor4, or a pointer)
//       TYPE FIELD[N];     // doc
//   };
//   static_assert(sizeof(NAME) == BYTES, "...");   (checked against the fields: no padding)
//   constexpr TYPE NAME = VALUE;  // doc            (TYPE: i64, int)
// Anything else in that region fails the build. It also writes args_layout.cuh, included
// below: a static_assert of the offset of every field, the one the Rust mirror asserts too.
#pragma once

#include <stdint.h>

typedef long long i64;
typedef unsigned long long u64;

// contract:begin

// A strided 4-d tensor: `data` is the first element; element (i0, i1, i2, i3) lives at
// data + i0*nb[0] + i1*nb[1] + i2*nb[2] + i3*nb[3].
struct Tensor4 {
    char* data;
    i64 ne[4];
    i64 nb[4];
};
static_assert(sizeof(Tensor4) == 72, "Tensor4 layout");

// The first out-of-range index seen by get_rows / set_rows / paged_attn. `flag` is 0 while
// clear.
struct IndexError {
    int flag;
    int pad;
    i64 tag;  // which plan step (set by the host)
    i64 index;
    i64 position;
    i64 limit;
};
static_assert(sizeof(IndexError) == 40, "IndexError layout");

struct UnaryArgs {  // scale, silu, gelu
    Tensor4 src;
    Tensor4 dst;
    float scale;
    float pad;
};
static_assert(sizeof(UnaryArgs) == 152, "UnaryArgs layout");

struct BinaryArgs {  // add, mul
    Tensor4 a;
    Tensor4 b;
    Tensor4 dst;
};
static_assert(sizeof(BinaryArgs) == 216, "BinaryArgs layout");

struct MoeSumArgs {  // moe_sum: dst[e, t] = the sum over slots i, in order, of y[e, i, t] * w[0, i, t]
    Tensor4 y;       // F32 [n_embd, n_used, n_tokens]: each expert slot's output
    Tensor4 w;       // F32 [1, n_used, n_tokens]: the slots' routing weights (unused when routed)
    Tensor4 dst;     // F32 [n_embd, n_tokens]
    Tensor4 r;       // F32 [n_embd, n_tokens]: a residual added to each sum (data null: none)
    Tensor4 logits;  // F32 [1, n_expert, n_tokens]: router logits when routed (data null: w)
    Tensor4 ids;     // I32 [n_used, n_tokens]: each token's experts, in range, when routed
    i64 staged;      // 1: one block of MOE_SUM_THREADS finds all the weights (at most
                     // MOE_SUM_STAGE) in shared memory before it writes: read from w when dst
                     // overlaps it, or when routed the softmax of the logits at the ids
};
static_assert(sizeof(MoeSumArgs) == 440, "MoeSumArgs layout");

struct NormArgs {  // rms_norm, norm
    Tensor4 src;
    Tensor4 dst;
    float eps;
    float pad;
};
static_assert(sizeof(NormArgs) == 152, "NormArgs layout");

struct RopeArgs {
    Tensor4 src;
    Tensor4 dst;
    const char* pos;     // I32 positions, one per index of dim 2
    i64 pos_nb0;         // byte stride of pos
    const float* freqs;  // n_dims / 2 inverse frequencies
    i64 n_dims;
    i64 neox;            // 0: pairs (2i, 2i+1); 1: pairs (i, i + n_dims/2)
};
static_assert(sizeof(RopeArgs) == 184, "RopeArgs layout");

struct CpyArgs {
    Tensor4 src;
    Tensor4 dst;
    i64 n;     // elements
    i64 mode;  // CPY_SAME_SHAPE, CPY_RESHAPE or CPY_CONTIGUOUS; quantize_q8_1_f32: ACT_BLOCKS
               // or ACT_PAIRS
};
static_assert(sizeof(CpyArgs) == 160, "CpyArgs layout");
constexpr i64 CPY_SAME_SHAPE = 0;  // same ne, any strides
constexpr i64 CPY_RESHAPE = 1;     // different ne, elements matched in row-major order
constexpr i64 CPY_CONTIGUOUS = 2;  // both dense: flat index
constexpr i64 ACT_BLOCKS = 0;  // Q8_1 activations for products taking one sub-block a lane
constexpr i64 ACT_PAIRS = 1;   // Q8_1 activations for products taking two sub-blocks a lane
constexpr i64 ACT_F16 = 2;     // F16 activations, element e of a column at byte 2 e (the products on
                               // F16 tensor cores and cuBLAS)

struct RowsArgs {  // get_rows, set_rows
    Tensor4 src;  // get_rows: the table; set_rows: the rows to write
    Tensor4 ids;  // I32 row ids
    Tensor4 dst;
    IndexError* err;
    i64 tag;
};
static_assert(sizeof(RowsArgs) == 232, "RowsArgs layout");

struct DiagMaskArgs {
    Tensor4 src;
    Tensor4 dst;
    i64 n_past;
};
static_assert(sizeof(DiagMaskArgs) == 152, "DiagMaskArgs layout");

struct SoftMaxArgs {
    Tensor4 src;
    Tensor4 mask;  // unused (data == nullptr) by the kernels without a mask
    Tensor4 dst;
    float scale;
    float pad;
};
static_assert(sizeof(SoftMaxArgs) == 224, "SoftMaxArgs layout");

struct ArgmaxArgs {
    Tensor4 src;
    Tensor4 dst;  // I32 [ne1, ne2, ne3]: nb[0..2] are the strides of src dims 1..3
};
static_assert(sizeof(ArgmaxArgs) == 144, "ArgmaxArgs layout");

struct TopKArgs {
    Tensor4 src;
    Tensor4 dst;  // I32 [k, ne1, ne2, ne3]: column (i1, i2, i3) holds the indices of src row (i1, i2, i3)
    i64 k;        // indices per row, 1..=TOPK_THREADS
};
static_assert(sizeof(TopKArgs) == 152, "TopKArgs layout");

struct MulMatIdArgs {  // group_by_expert, mul_mat_id_<type>
    Tensor4 w;         // the experts [k, m, n_expert]
    Tensor4 b;         // F32 inputs [k, b1, n_tokens], dense along dim 0
    Tensor4 ids;       // I32 [n_used, n_tokens]
    Tensor4 dst;       // F32 [m, n_used, n_tokens]
    int* offsets;      // scratch: n_expert + 1 starts of each expert's columns in cols
    int* cols;         // scratch: the columns (i + n_used * t), grouped by expert
    IndexError* err;
    i64 tag;
    i64 chunks;        // the grid's z: blocks take column chunks z, z + chunks, ...
    int* tile_expert;  // scratch (tile_bn > 0): each expert's columns in tiles of tile_bn,
    int* tile_first;   //   tile x's expert and first index into cols; -1 past the last
    i64 tile_bn;       //   (0: no tiles)
    i64 tiles;         // entries of tile_expert and tile_first
};
static_assert(sizeof(MulMatIdArgs) == 360, "MulMatIdArgs layout");

// A decode RMS norm folded into the kernels around the product after it (see NormFold in
// src/backend/fusion.rs and src/backend/cuda/decode/fold.rs): the product that computes
// the residual y (m rows, mul_mat_vec_fold_*) also writes rw = y * w, the vector the next
// product reads in place of the norm's result, and the sum of y^2 over each block's
// GEMV_WARPS rows; block 0 of that next product (mul_mat_vec_total_*) adds the sums and
// writes the norm's factor
// 1 / sqrt(sum / n + eps), by which the kernel that reads the product's result (rope_store,
// swiglu) scales its inputs.
struct NormFold {
    const float* w;  // F32 [m], the norm's weight
    float* rw;       // F32 [m], y * w
    float* parts;    // F32 [count], the sum of y^2 over each block's rows
    float* scale;    // F32, the norm's factor
    i64 count;       // ceil(m / GEMV_WARPS)
    float n;         // m, the elements of the normalized row
    float eps;
};
static_assert(sizeof(NormFold) == 48, "NormFold layout");

// Matrix-vector products dst[r, ch] = sum_l a[l, r, ch / ratio] * b[l, ch] with rows of `a`
// dense (consecutive elements) and b, dst dense along dim 0.
struct GemvArgs {
    const char* a;
    const char* b;  // F32
    char* dst;      // F32
    i64 k;          // row length (contracted)
    i64 m;          // rows of a = elements of one dst column
    i64 channels;   // columns of b / dst (dim 2)
    i64 a_nb1;      // byte stride between rows of a
    i64 a_nb2;      // byte stride between channels of a
    i64 b_nb2;      // byte stride between columns of b
    i64 dst_nb2;    // byte stride between columns of dst
    i64 ratio;      // channels of b per channel of a (GQA)
    i64 vec;        // 1 when rows of a and b are aligned for vector loads
    const char* add;  // F32 [m] added to the result (a fused residual add), or null
    i64 prefetch;     // 1 when `a` is read-only in the plan (weights): its first loads may
                      // start before the previous kernel ends
    const NormFold* fold;  // mul_mat_vec_fold_* and mul_mat_vec_total_*: the folded norm (in
                           // the plan's constant region; one column); null otherwise
};
// Past 128 bytes ptxas schedules the unchanged mul_mat_vec_f16 worse (nvcc 13.0, sm_90,
// 2026-11-29: at 136 bytes 52 registers instead of 64, and the activation loads of a round
// issued apart from its weight loads): grow it no further.
static_assert(sizeof(GemvArgs) == 120, "GemvArgs layout");

// Quantized matrix-vector products (mul_mat_vec_q_c*_*, mul_mat_vec_dq_c*_*):
// dst[r, c] = sum_l a[l, r] * b[l, c] (+ add[r, c]) for c < ncols (at most 8), rows of
// `a` dense blocks of its type, dst (and add) dense F32 [m, ncols].
struct QGemvArgs {
    const char* a;    // weight blocks: row r at a + r * a_nb1
    const char* b;    // mul_mat_vec_q: Q8_1 blocks, mul_mat_vec_dq: F32; column c at b + c * b_nb1
    char* dst;        // F32 [m, ncols], dense
    const char* add;  // F32 [m, ncols], dense, added to the result (a fused residual add), or null
    i64 k;            // row length in elements (a multiple of the block)
    i64 m;            // rows of a
    i64 ncols;        // columns of b and dst, 1..8 (at most the kernel's column count)
    i64 a_nb1;        // byte stride between rows of a
    i64 b_nb1;        // byte stride between columns of b
    i64 vec;          // mul_mat_vec_dq: 1 when b and b_nb1 are 16-byte aligned
    i64 prefetch;     // 1 when `a` is read-only in the plan: its first loads start
                      // before the previous kernel ends
};
static_assert(sizeof(QGemvArgs) == 88, "QGemvArgs layout");

// A decode step's mul_mat_id with block-quantized experts (mul_mat_vec_id_q*_<q>): a block
// per GEMV_WARPS rows (grid.x) and column j = i + n_used * t (grid.y) computes
// dst[:, i, t] = w[:, :, ids[i, t]]^T b[:, i % b1, t] as mul_mat_vec_q_c1_<q> does; with
// a2, grid.y is twice the columns and its upper half computes the second product.
struct QGemvIdArgs {
    const char* a;    // expert 0's weight blocks: row r of expert e at a + e * a_nb2 + r * a_nb1
    const char* b;    // the Q8_1 copy of the inputs (as QGemvArgs::b): column (i % b1) + b1 * t
    const char* ids;  // I32 [n_used, n_tokens]: id (i, t) at ids + i * ids_nb0 + t * ids_nb1
    char* dst;        // F32 [m, n_used, n_tokens]: column (i, t) at dst + i * dst_nb1 + t * dst_nb2, dense
    IndexError* err;  // the first id outside 0..n_expert (its column is zero-filled)
    i64 tag;          // which plan step (set by the host)
    i64 k;            // row length in elements (a multiple of the block)
    i64 m;            // rows of an expert
    i64 a_nb1;        // byte stride between rows of an expert
    i64 a_nb2;        // byte stride between experts
    i64 b_nb1;        // byte stride between columns of b
    i64 ids_nb0;      // byte stride of ids along the used experts
    i64 ids_nb1;      // byte stride of ids along the tokens
    i64 dst_nb1;      // byte stride of dst along the used experts
    i64 dst_nb2;      // byte stride of dst along the tokens
    i64 n_used;       // experts a token uses (ids.ne[0])
    i64 b1;           // input columns per token (1: shared by its experts, or n_used)
    i64 n_expert;     // experts of the weights (w.ne[2])
    const char* a2;   // a second product's experts (as a), or null: the grid's upper half
                      // of rows (gridDim.y / 2 on) computes it with the same inputs and ids
    char* dst2;       // the second product's result (as dst)
};
static_assert(sizeof(QGemvIdArgs) == 160, "QGemvIdArgs layout");

// Batched products with block-quantized weights on int8 tensor cores (mmq_*, cuda/mmq.cu):
// dst[r, c] = sum_l a[l, r] * b[l, c] for the n columns of the Q8_1 activations b.
struct MmqArgs {
    const char* a;  // weight blocks (mmq_split_*: frozen weights in split rows): row r at a + r * a_nb1
    const char* b;  // Q8_1 activations as quantize_q8_1_f32 writes them, in the layout of the
                    // weight type (ACT_PAIRS for the K-quants, else ACT_BLOCKS); mmh_*: F16
                    // activations, k dense elements a column: column c at b + c * b_nb1
    float* dst;     // F32 [m, n] dense; with gridDim.z > 1, part z of K's partial sums at
                    // dst + z * m * n (mmq_reduce adds them up)
    i64 k;          // row length in elements (a multiple of the block)
    i64 m;          // rows of a
    i64 n;          // columns of b and dst
    i64 a_nb1;      // byte stride between rows of a
    i64 b_nb1;      // byte stride between columns of b (a multiple of 16)
    i64 chunks;     // MMQ_K-element (mmh_*: MMH_K, mmr_*: MMR_K) chunks of a row that each part of K (blockIdx.z) takes
    i64 prefetch;   // 1 when `a` is read-only in the plan: its first chunk loads before the
                    // kernel waits for its predecessor
    const float* res;  // F32 [m, n] dense added to the results (a fused residual add; may be
                       // dst itself, each element read by the thread that writes it), or
                       // null; only with gridDim.z == 1 (else mmq_reduce adds it)
};
static_assert(sizeof(MmqArgs) == 88, "MmqArgs layout");

struct MmqIdArgs {             // mmq_id_c<BN>_<q>: the experts' columns of a mul_mat_id in tiles
    const char* a;             // expert 0's weight blocks: row r of expert e at a + e * a_nb2 + r * a_nb1
    const char* b;             // the Q8_1 copy of the inputs (as MmqArgs::b): column (i % b1) + b1 * t
    const int* offsets;        // group_by_expert's: n_expert + 1 starts of each expert's columns
    const int* cols;           // group_by_expert's: the columns j = i + n_used * t, by expert
    const int* tile_expert;    // group_by_expert's: tile x's expert (-1: past the last tile)
    const int* tile_first;     // group_by_expert's: tile x's first index into cols
    char* dst;                 // F32 [m, n_used, n_tokens], dense along dim 0
    i64 k;                     // row length in elements (a multiple of the block)
    i64 m;                     // rows of an expert
    i64 a_nb1;                 // byte strides of the weights: rows, experts
    i64 a_nb2;
    i64 b_nb1;                 // byte stride between columns of b (a multiple of 16)
    i64 dst_nb1;               // byte strides of dst
    i64 dst_nb2;
    i64 n_used;
    i64 b1;                    // input columns per token (1: shared by its experts, or n_used)
};
static_assert(sizeof(MmqIdArgs) == 128, "MmqIdArgs layout");

struct MmqReduceArgs {  // mmq_reduce: dst[i] = the sum of part[z * count + i] over z < split, in order
    const float* part;
    float* dst;
    i64 count;         // elements of dst (m * n)
    i64 split;         // parts of K
    const float* res;  // added to the sum last (a fused residual add; may be dst), or null
};
static_assert(sizeof(MmqReduceArgs) == 40, "MmqReduceArgs layout");

struct FillRandomArgs {
    char* dst;
    i64 n;
    u64 seed;
    float scale;
    float pad;
};
static_assert(sizeof(FillRandomArgs) == 32, "FillRandomArgs layout");

struct NormMulArgs {  // rms_norm_mul: dst = rms_norm(src) * w (w [ne0], broadcast)
    Tensor4 src;
    Tensor4 dst;
    Tensor4 w;
    float eps;
    int vec;      // 1: rows of 4-element groups in 16-byte words (rms_rows_vec in norm.cu)
    char* q8;     // when not null: row r of dst also as split Q8_1 at q8 + r * q8_nb1
    i64 q8_nb1;   // (cuda/quant.cuh, store_act), for the decode product that reads it
    i64 q8_layout;  // ACT_BLOCKS or ACT_PAIRS, the order that product takes sub-blocks in; ACT_F16
    i64 w_early;  // 1: w is read-only (a weight) and read before waiting on the previous kernel
};
static_assert(sizeof(NormMulArgs) == 256, "NormMulArgs layout");

struct GluArgs {  // swiglu: dst = silu(gate) * up; q8 as in NormMulArgs
    Tensor4 gate;
    Tensor4 up;
    Tensor4 dst;
    char* q8;
    i64 q8_nb1;
    i64 q8_layout;
    const float* fold_scale;  // a folded norm's factor (NormFold::scale) that scales the
                              // inputs; null: none
};
static_assert(sizeof(GluArgs) == 248, "GluArgs layout");

struct RopeStoreArgs {  // rope_store: a decode step's rope of q and k and its K/V cache writes
    Tensor4 q_src;   // q rows roped into q_dst (q_rows of them; 0: no q)
    Tensor4 q_dst;
    Tensor4 k_src;   // k rows [hd, heads, n] roped into the cache: element (i0, i1, i2)
    Tensor4 k_dst;   //   at k_dst.data + i0 nb0 + i1 nb1 + ids[i2] nb2
    Tensor4 v_src;   // v [a, n, b] into the cache as set_rows does: element (i0, i1, i2)
    Tensor4 v_dst;   //   at v_dst.data + i0 nb0 + ids[i1] nb1 + i2 nb2 (v_blocks blocks; 0: no v)
    Tensor4 ids;     // I32 [n]: the cache row (slot) of each token
    const char* pos; // I32 positions, one per token
    i64 pos_nb0;
    const float* freqs;
    i64 n_dims;
    i64 neox;
    i64 q_rows;
    i64 k_rows;
    i64 v_blocks;
    i64 slots;       // K cache rows: an id outside 0..slots is recorded, its row skipped
                     // (v_dst.ne[1] for V)
    IndexError* err;
    i64 tag;
    const float* fold_scale;  // a folded norm's factor (NormFold::scale) that scales the
                              // inputs; null: none
    i64 vec;         // 1: every row dense and 16-byte aligned, n_dims a multiple of 4 and
                     // v's rows a multiple of 8 elements (rope_row_vec, set_row_chunk)
    const float* q_norm;  // F32 [head dim]: each q row is RMS-normed and times this before
                          // its rope (rope_row_normed, a warp a row); null: none
    const float* k_norm;  // likewise for the k rows
    float q_eps;          // the norms' epsilons
    float k_eps;
};
static_assert(sizeof(RopeStoreArgs) == 632, "RopeStoreArgs layout");

struct SplitArgs {  // split_*_bf16: hi at dst, lo at dst + lo_offset (same layout)
    Tensor4 src;
    Tensor4 dst;
    i64 n;
    i64 lo_offset;
};
static_assert(sizeof(SplitArgs) == 160, "SplitArgs layout");

struct SpinArgs {  // spin_wait: hold the stream for ns nanoseconds
    i64 ns;
};
static_assert(sizeof(SpinArgs) == 8, "SpinArgs layout");

struct FattnArgs {  // flash_attn_ext: fattn_vec_*, fattn_combine, fattn_mma_*
    Tensor4 q;             // F32 [d, n_q, n_head, batch]
    Tensor4 k;             // [d, n_kv, n_head_kv, batch], any strides
    Tensor4 v;             // [d, n_kv, n_head_kv, batch], as k
    Tensor4 mask;          // F32 or F16 [n_kv, >= n_q, m2, m3]; data == nullptr: no mask
    Tensor4 dst;           // F32 [d, n_head, n_q, batch], dense rows
    float* part;           // fattn_vec with split > 1: (max, sum, acc[d]) per row and chunk
    int* range;            // fattn_kv_range out, fattn_mma in: (first live key, last + 1) of every
                           // FATTN_RANGE_ROWS query rows x FATTN_RANGE_KEYS keys per mask head
                           // (n_kv, 0: none); nullptr: every key is visited
    const float* slopes;   // the mask factor of each query head (ALiBi slope, else 1)
    float scale;           // factor of q . k
    float softcap;         // c of c * tanh(s / c); 0: none
    int mask_f16;          // 1: the mask is F16, 0: F32
    int kv_vec;            // 1: every K/V row starts 16-byte aligned (vector loads)
    i64 group;             // query heads per KV head (GQA)
    i64 split;             // fattn_vec: KV chunks (gridDim.x)
    i64 chunk;             // fattn_vec: keys per chunk
    char* q8;              // fattn_combine: also the result as Q8_1 activations [d * n_head,
                           // n_q * batch] for the decode product that reads it (d % 32 == 0);
                           // nullptr: none
    i64 q8_nb1;            // bytes per column of q8
    i64 q8_layout;         // ACT_BLOCKS or ACT_PAIRS (cuda/quant.cuh, act_at)
};
static_assert(sizeof(FattnArgs) == 448, "FattnArgs layout");

struct PagedArgs {  // paged_attn: fattn_paged_* (cuda/fattn_paged.cu)
    Tensor4 q;            // F32 [d, n_head, n_tokens]
    Tensor4 k;            // [d, n_slots, n_head_kv]: the K pool's rows (dense along dim 0)
    Tensor4 v;            // [d, n_slots, n_head_kv]: the V pool's rows
    Tensor4 dst;          // F32 [d, n_head, n_tokens]
    const int* table;     // I32 [max_blocks, n_seqs], contiguous: each sequence's blocks
    const int* seqs;      // I32 [2, n_tokens], contiguous: each token's sequence and position
    float* part;          // split > 1: (max, sum, acc[d]) of each token, head and chunk
    int* chunks;          // split > 1: the chunks each token's keys took (0: none to merge)
    int* decoded;         // min_run > 0: the count of the tokens the decode kernels take, then
                          // those tokens (fattn_paged_list); nullptr: every token, one a block
    char* q8;             // fattn_paged_combine: also the result as Q8_1 activations [d * n_head,
                          // n_tokens] for the decode product that reads it; nullptr: none
    IndexError* err;      // a bad sequence, position or block id
    i64 tag;
    i64 q8_nb1;           // bytes per column of q8
    i64 q8_layout;        // ACT_BLOCKS or ACT_PAIRS (cuda/quant.cuh, act_at)
    int n_tokens;
    int n_seqs;           // columns of table
    int max_blocks;       // rows of table
    int max_pos;          // max_blocks * block_size: the positions a sequence can hold
    int n_blocks;         // blocks of the pool (n_slots / block_size)
    int block_size;
    int bs_magic;         // j / block_size = (umulhi(j, (unsigned)bs_magic) + j) >> bs_shift
    int bs_shift;
    int window;           // a sliding window of this many positions; 0: none
    int group;            // query heads per KV head
    float scale;          // factor of q . k
    float softcap;        // c of c * tanh(s / c); 0: none
    int split;            // decode kernels: chunks a token's keys take at most (gridDim.x)
    int min_keys;         // decode kernels: fewest keys a chunk
    int unit;             // decode kernels: a chunk's keys are a multiple of it
    int tile;             // tokens a block of fattn_paged_mma takes (the runs' tiles)
    int min_run;          // 0: no fattn_paged_mma; else the run length from which it takes tokens
    int kv_vec;           // 1: every K/V row starts 16-byte aligned (vector loads)
    int k_type;           // fattn_paged_any: the K dtype, PAGED_F32 .. PAGED_Q4_0
    int v_type;           // fattn_paged_any: the V dtype
};
static_assert(sizeof(PagedArgs) == 448, "PagedArgs layout");
constexpr int PAGED_F32 = 0;   // fattn_paged_any's K/V dtype codes: F32
constexpr int PAGED_F16 = 1;   // F16
constexpr int PAGED_BF16 = 2;  // BF16
constexpr int PAGED_Q8_0 = 3;  // Q8_0
constexpr int PAGED_Q4_0 = 4;  // Q4_0

// Launch geometry of the mul_mat_vec_*, mul_mat_p021 and rms_norm_mul kernels.

constexpr int GEMV_WARPS = 4;      // rows (one per warp) per block of mul_mat_vec_*
constexpr int NORM_VEC = 4;       // groups of 4 elements a thread holds in rms_norm_mul's vector path
constexpr int P021_ROWS = 4;       // rows per warp of mul_mat_p021
constexpr int P021_THREADS = 128;  // block of mul_mat_p021

// Launch geometry of the batched quantized products (cuda/mmq.cu).

constexpr int MMQ_WARPS = 4;   // warps per block of mmq_*, 16 weight rows each
constexpr int MMQ_ROWS = 64;   // weight rows per block of mmq_* (MMQ_WARPS * 16)
constexpr int MMQ_K = 128;     // elements of a row per step of mmq_* (4 sub-blocks of 32)
constexpr int MMQ_REDUCE_THREADS = 256;  // block of mmq_reduce
constexpr int MMH_K = 64;      // elements of a row per step of mmh_* (blocks of MMQ_WARPS warps, MMQ_ROWS rows)
constexpr int MMR_WARPS = 8;   // warps per block of mmr_*, 16 weight rows each
constexpr int MMR_ROWS = 128;  // weight rows per block of mmr_* (MMR_WARPS * 16)
constexpr int MMR_K = 128;     // elements of a row per step of mmr_* (a 32-element block per lane of a quad)

// Launch geometry of top_k (cuda/topk.cu).

constexpr int MMID_THREADS = 256;       // block of mul_mat_id_<type>: 8 warps, a row each at a time
constexpr int MMID_ROWS = 32;           // rows of one expert per block of mul_mat_id_<type>
constexpr int MMID_COLS = 8;            // columns of one expert per chunk (accumulators per lane)
constexpr int MMID_MAX_EXPERTS = 4096;  // experts group_by_expert takes (its counts in shared memory)
constexpr int MMID_GROUP_THREADS = 1024;  // block of group_by_expert (one block)
constexpr int MOE_SUM_THREADS = 1024;  // block of moe_sum_f32 when staged (one block)
constexpr int MOE_SUM_STAGE = 64;       // most weights (n_used x n_tokens) moe_sum_f32 stages
constexpr int TOPK_THREADS = 1024;  // block of top_k_* (one row per block), and the largest k
constexpr int TOPK_WARP_MAX = 256;  // longest row of top_k_warp_* (a warp a row, k <= 32)
constexpr int TOPK_WARP_ROWS = 4;   // rows (warps) per block of top_k_warp_*

// Launch geometry of the flash attention kernels (cuda/fattn.cu).

constexpr int FATTN_VEC_WARPS = 4;          // warps per block of fattn_vec_*
constexpr int FATTN_VEC_ROWS = 8;           // query rows (heads x queries of one KV head) per block
constexpr int FATTN_VEC_UNROLL = 4;         // keys per lane group per step of fattn_vec_* (loads in flight)
constexpr int FATTN_COMBINE_THREADS = 128;  // block of fattn_combine
constexpr int FATTN_LIST_THREADS = 256;     // block of fattn_paged_list
constexpr int FATTN_LIST_MAX_TILES = 2048;  // tiles of fattn_paged_list: 65,535 tokens in 32s
constexpr int FATTN_MMA_ROWS = 64;          // query rows per block of fattn_mma_* (head dims <= 128)
constexpr int FATTN_MMA_ROWS_D256 = 32;     // query rows per block of fattn_mma_d256_*
constexpr int FATTN_MMA_KEYS = 32;          // keys per shared-memory tile of fattn_mma_*
constexpr int FATTN_RANGE_ROWS = 32;        // query rows per entry of fattn_kv_range
constexpr int FATTN_RANGE_KEYS = 256;       // keys per entry of fattn_kv_range
constexpr int FATTN_RANGE_THREADS = 256;    // block of fattn_kv_range

// contract:end

// Every field at the offset the Rust mirror has it (generated by build.rs).
#include "args_layout.cuh"
