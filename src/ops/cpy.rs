//! Copies and conversions between F32, F16, BF16 and the quantized block types on any 4-d
//! strides (a copy into a block type quantizes each row, a copy out of one dequantizes;
//! rows are matched whole, so both sides then need the same `ne[0]`):
//! - `cpy(a, dst)`: writes `a` into `dst`, a view of a state tensor (how K/V are written
//!   into a cache at a position known when the graph is built);
//! - `cont(a)` / `cast(a, dtype)`: a fresh contiguous copy, optionally converted;
//! - `set_rows(dst, src, ids)`: writes rows of `src` into rows `ids` of `dst` (how a
//!   replayed decode graph writes K/V at a position that changes between runs).

use super::host::{for_each_row, unflatten_row, HostTensor};
use super::{expect_dtype, expect_float_or_quant, expect_quantizable, CopyOp, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Flags, Graph, Step, TensorId};

impl Graph {
    /// Fails unless `dst` is a state tensor or a view of one.
    fn check_writable(&self, op: &'static str, dst: TensorId) -> Result<()> {
        let base = self.tensor(self.base_of(dst));
        if base.flags.contains(Flags::STATE) {
            Ok(())
        } else {
            Err(Error::shape(
                op,
                format!(
                    "destination '{}' must be a state tensor or a view of one (its memory '{}' is {:?}); use cont() or cast() for a fresh copy",
                    self.tensor(dst).name,
                    base.name,
                    base.flags
                ),
            ))
        }
    }

    /// Copies `a` into `dst` (a view of a state tensor), converting dtypes. Elements are
    /// matched in row-major order, so the shapes may differ but the counts must agree.
    /// The result is a view of `dst`'s memory.
    pub fn cpy(&mut self, a: TensorId, dst: TensorId) -> Result<TensorId> {
        let (ta, td) = (self.get(a)?, self.get(dst)?);
        expect_float_or_quant("cpy", &ta.name, ta.dtype)?;
        expect_float_or_quant("cpy", &td.name, td.dtype)?;
        expect_quantizable("cpy", &td.name, td.dtype)?;
        if ta.nelements() != td.nelements() {
            return Err(Error::shape(
                "cpy",
                format!(
                    "'{}' {} has {} elements but destination '{}' {} has {}",
                    ta.name,
                    fmt_ne(&ta.ne),
                    ta.nelements(),
                    td.name,
                    fmt_ne(&td.ne),
                    td.nelements()
                ),
            ));
        }
        let blocks = ta.dtype.quant().is_some() || td.dtype.quant().is_some();
        if blocks && ta.ne[0] != td.ne[0] {
            return Err(Error::shape(
                "cpy",
                format!(
                    "'{}' {} ({}) into '{}' {} ({}): a copy from or to a block type matches whole rows, so ne[0] must agree",
                    ta.name,
                    fmt_ne(&ta.ne),
                    ta.dtype,
                    td.name,
                    fmt_ne(&td.ne),
                    td.dtype
                ),
            ));
        }
        self.check_writable("cpy", dst)?;
        let (dtype, ne, nb) = (td.dtype, td.ne, td.nb);
        Ok(self.new_view_node(Op::Copy(CopyOp::Cpy), dst, dtype, ne, nb, 0, &[a, dst]))
    }

    /// A contiguous copy of `a` (same dtype).
    pub fn cont(&mut self, a: TensorId) -> Result<TensorId> {
        let dtype = self.get(a)?.dtype;
        self.cast(a, dtype)
    }

    /// A contiguous copy of `a` converted to `dtype`: F32, F16, BF16 and the quantized
    /// types convert into each other (quantizing or dequantizing whole rows, so `ne[0]`
    /// must be a multiple of a block type's block); I32 only copies.
    pub fn cast(&mut self, a: TensorId, dtype: DType) -> Result<TensorId> {
        let t = self.get(a)?;
        if (t.dtype == DType::I32) != (dtype == DType::I32) {
            return Err(Error::DType {
                op: "cast",
                operand: t.name.clone(),
                found: t.dtype,
                expected: if dtype == DType::I32 {
                    "i32".into()
                } else {
                    "a float or quantized dtype".into()
                },
            });
        }
        expect_quantizable("cast", &t.name, dtype)?;
        crate::graph::check_blocks("cast", &t.name, dtype, &t.ne)?;
        let ne = t.ne;
        Ok(self.new_node(Op::Copy(CopyOp::Cont), dtype, ne, &[a]))
    }

    /// Writes row `r` of `src` [ne0, n, ne2, ne3] into row `ids[r]` of `dst`
    /// [ne0, rows, ne2, ne3] (a state tensor or a view of one), converting dtypes. `ids`
    /// is I32 [n, i2, i3] with `i2 | ne2`, `i3 | ne3` (broadcast). Ids are checked
    /// against `rows` when the graph runs. The result is a view of all of `dst`.
    pub fn set_rows(&mut self, dst: TensorId, src: TensorId, ids: TensorId) -> Result<TensorId> {
        let (td, ts, ti) = (self.get(dst)?, self.get(src)?, self.get(ids)?);
        expect_float_or_quant("set_rows", &td.name, td.dtype)?;
        expect_quantizable("set_rows", &td.name, td.dtype)?;
        expect_dtype("set_rows", &ts.name, ts.dtype, &DType::FLOATS)?;
        expect_dtype("set_rows", &ti.name, ti.dtype, &[DType::I32])?;
        let ok = ts.ne[0] == td.ne[0]
            && ts.ne[2] == td.ne[2]
            && ts.ne[3] == td.ne[3]
            && ti.ne[0] == ts.ne[1]
            && ts.ne[2] % ti.ne[1] == 0
            && ts.ne[3] % ti.ne[2] == 0
            && ti.ne[3] == 1;
        if !ok {
            return Err(Error::shape(
                "set_rows",
                format!(
                    "source '{}' {}, ids '{}' {} and destination '{}' {} do not match: need src [ne0, n, ne2, ne3], ids [n, i2 | ne2, i3 | ne3], dst [ne0, rows, ne2, ne3]",
                    ts.name,
                    fmt_ne(&ts.ne),
                    ti.name,
                    fmt_ne(&ti.ne),
                    td.name,
                    fmt_ne(&td.ne)
                ),
            ));
        }
        self.check_writable("set_rows", dst)?;
        let (dtype, ne, nb) = (td.dtype, td.ne, td.nb);
        Ok(self.new_view_node(
            Op::Copy(CopyOp::SetRows),
            dst,
            dtype,
            ne,
            nb,
            0,
            &[src, ids, dst],
        ))
    }
}

/// CPU reference for cpy and cont.
pub(crate) fn cpu_copy(dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let a = src[0];
    if a.ne != dst.ne && a.ne[0] == dst.ne[0] && a.dtype != DType::I32 {
        // Whole rows matched in row-major order (block types always take this path).
        let mut row = vec![0f32; dst.ne[0]];
        for r in 0..a.ne[1] * a.ne[2] * a.ne[3] {
            let (s1, s2, s3) = unflatten_row(a.ne, r);
            let (d1, d2, d3) = unflatten_row(dst.ne, r);
            // SAFETY: both row indices are inside their shapes (equal row counts); the
            // plan guarantees valid memory and dst is written by this step only.
            unsafe {
                a.read_row(s1, s2, s3, &mut row);
                dst.write_row(d1, d2, d3, &row);
            }
        }
        return Ok(());
    }
    if a.ne == dst.ne {
        let mut row = vec![0f32; dst.ne[0]];
        if a.dtype == DType::I32 {
            for_each_row(dst.ne, |i1, i2, i3| {
                for i0 in 0..dst.ne[0] {
                    // SAFETY: same shapes; valid memory per the plan.
                    unsafe { dst.set_i32([i0, i1, i2, i3], a.get_i32([i0, i1, i2, i3])) };
                }
            });
            return Ok(());
        }
        for_each_row(dst.ne, |i1, i2, i3| {
            // SAFETY: same shapes; valid memory per the plan; dst is written by this step only.
            unsafe {
                a.read_row(i1, i2, i3, &mut row);
                dst.write_row(i1, i2, i3, &row);
            }
        });
        return Ok(());
    }
    // Shapes differ: walk both in row-major order.
    let total = a.ne.iter().product::<usize>();
    for flat in 0..total {
        let ia = unflatten(a.ne, flat);
        let id = unflatten(dst.ne, flat);
        // SAFETY: both indices are inside their shapes (equal element counts).
        unsafe { dst.set(id, a.get(ia)) };
    }
    Ok(())
}

fn unflatten(ne: [usize; 4], flat: usize) -> [usize; 4] {
    let (i1, i2, i3) = unflatten_row(ne, flat / ne[0]);
    [flat % ne[0], i1, i2, i3]
}

/// CPU reference for set_rows.
pub(crate) fn cpu_set_rows(step: &Step, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (s, ids) = (src[0], src[1]);
    let mut row = vec![0f32; s.ne[0]];
    let rows = dst.ne[1];
    let mut err = None;
    for_each_row(s.ne, |r, i2, i3| {
        if err.is_some() {
            return;
        }
        // SAFETY: ids is broadcast over dims 2 and 3; indices are inside its shape.
        let id = unsafe { ids.get_i32([r, i2 % ids.ne[1], i3 % ids.ne[2], 0]) };
        if id < 0 || id as usize >= rows {
            err = Some(Error::IndexOutOfRange {
                op: "set_rows",
                node: step.name.clone(),
                index: id as i64,
                position: r,
                limit: rows,
            });
            return;
        }
        // SAFETY: (r, i2, i3) is inside s; (id, i2, i3) inside dst (checked above).
        unsafe {
            s.read_row(r, i2, i3, &mut row);
            dst.write_row(id as usize, i2, i3, &row);
        }
    });
    err.map_or(Ok(()), Err)
}
