//! get_rows: gathers rows of a table by I32 ids (the embedding lookup). Every id is
//! checked against the table's row count when the graph runs.

use super::host::{for_each_row, HostTensor};
use super::{expect_dtype, expect_float_or_quant, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, Step, TensorId};

impl Graph {
    /// Rows of `table` [ne0, rows, t2, t3] picked by `ids` I32 [n, t2, t3]; the result is
    /// F32 [ne0, n, t2, t3].
    pub fn get_rows(&mut self, table: TensorId, ids: TensorId) -> Result<TensorId> {
        let (tt, ti) = (self.get(table)?, self.get(ids)?);
        expect_float_or_quant("get_rows", &tt.name, tt.dtype)?;
        expect_dtype("get_rows", &ti.name, ti.dtype, &[DType::I32])?;
        if ti.ne[1] != tt.ne[2] || ti.ne[2] != tt.ne[3] || ti.ne[3] != 1 {
            return Err(Error::shape(
                "get_rows",
                format!(
                    "ids '{}' {} must be [n, {}, {}] to index table '{}' {}",
                    ti.name,
                    fmt_ne(&ti.ne),
                    tt.ne[2],
                    tt.ne[3],
                    tt.name,
                    fmt_ne(&tt.ne)
                ),
            ));
        }
        let ne = [tt.ne[0], ti.ne[0], ti.ne[1], ti.ne[2]];
        Ok(self.new_node(Op::GetRows, DType::F32, ne, &[table, ids]))
    }
}

/// CPU reference for get_rows.
pub(crate) fn cpu(step: &Step, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (table, ids) = (src[0], src[1]);
    let rows = table.ne[1];
    let mut row = vec![0f32; dst.ne[0]];
    let mut err = None;
    for_each_row(dst.ne, |i1, i2, i3| {
        if err.is_some() {
            return;
        }
        // SAFETY: (i1, i2, i3) is inside ids' shape [n, t2, t3].
        let id = unsafe { ids.get_i32([i1, i2, i3, 0]) };
        if id < 0 || id as usize >= rows {
            err = Some(Error::IndexOutOfRange {
                op: "get_rows",
                node: step.name.clone(),
                index: id as i64,
                position: i1,
                limit: rows,
            });
            return;
        }
        // SAFETY: id was checked against the table's rows; dst is written by this step only.
        unsafe {
            table.read_row(id as usize, i2, i3, &mut row);
            dst.write_row(i1, i2, i3, &row);
        }
    });
    err.map_or(Ok(()), Err)
}
