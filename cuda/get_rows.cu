// get_rows: dst row (i1, i2, i3) = table row ids[i1, i2, i3] of matrix (i2, i3), as F32.
// One block per dst row. An id outside 0..rows is recorded in the index-error buffer and
// its dst row is zero-filled; nothing outside the table is read.
#include "common.cuh"

template <typename T>
__device__ void get_rows(const RowsArgs& p) {
    pdl_enter();
    const RowIndex r = row_index(p.dst.ne, blockIdx.x);
    const int id = *reinterpret_cast<const int*>(at(p.ids, r.i1, r.i2, r.i3, 0));
    const i64 rows = p.src.ne[1];
    char* d = at(p.dst, 0, r.i1, r.i2, r.i3);
    const i64 ne0 = p.dst.ne[0];
    if (id < 0 || id >= rows) {
        if (threadIdx.x == 0) record_index_error(p.err, p.tag, id, r.i1, rows);
        for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) store<float>(d + i0 * p.dst.nb[0], 0.0f);
        return;
    }
    const char* s = at(p.src, 0, id, r.i2, r.i3);
    for (i64 i0 = threadIdx.x; i0 < ne0; i0 += blockDim.x) {
        store<float>(d + i0 * p.dst.nb[0], load<T>(s + i0 * p.src.nb[0]));
    }
}

extern "C" __global__ void get_rows_f32(const RowsArgs p) { get_rows<float>(p); }
extern "C" __global__ void get_rows_f16(const RowsArgs p) { get_rows<f16>(p); }
extern "C" __global__ void get_rows_bf16(const RowsArgs p) { get_rows<bf16>(p); }
