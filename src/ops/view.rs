//! Views: view_1d..view_4d, reshape, permute, transpose and after. They share their
//! source's memory and copy nothing; no backend runs a kernel for them.

use crate::error::{Error, Result};
use crate::graph::{check_blocks, fmt_ne, nbytes, shape4, Graph, TensorId};
use crate::ops::{Op, ViewOp};

impl Graph {
    /// Checks that a view of `a` with this layout at byte offset `offs` stays inside the
    /// memory of `a`'s base tensor.
    fn check_view_bounds(
        &self,
        op: &'static str,
        a: TensorId,
        ne: &[usize; 4],
        nb: &[usize; 4],
        offs: usize,
    ) -> Result<()> {
        let t = self.get(a)?;
        let (base, base_offs) = match t.view_src {
            Some(b) => (self.tensor(b), t.view_offs),
            None => (t, 0),
        };
        // A layout whose extent does not even fit in usize is out of bounds too (and
        // must not overflow the arithmetic below).
        let fits = base_offs.checked_add(offs).and_then(|start| {
            (0..4).try_fold(start, |acc: usize, i| {
                acc.checked_add(ne[i].checked_mul(nb[i])?)
            })
        });
        let need = fits.map(|_| base_offs + offs + nbytes(t.dtype, ne, nb));
        if need.is_none_or(|n| n > base.nbytes()) {
            return Err(Error::shape(
                op,
                format!(
                    "view {} with strides {:?} at offset {} of '{}' {} needs {} bytes, its memory has {}",
                    fmt_ne(ne),
                    nb,
                    offs,
                    t.name,
                    fmt_ne(&t.ne),
                    need.map_or("more than usize::MAX".to_string(), |n| n.to_string()),
                    base.nbytes()
                ),
            ));
        }
        if ne.contains(&0) {
            return Err(Error::shape(
                op,
                format!("view {} has an empty dimension", fmt_ne(ne)),
            ));
        }
        check_blocks(op, &t.name, t.dtype, ne)
    }

    /// A general strided view: `ne` elements with byte strides `nb` from byte `offs` of
    /// `a` (`nb[0]` is the element size of `a`'s dtype).
    pub fn view(
        &mut self,
        a: TensorId,
        ne: [usize; 4],
        nb: [usize; 4],
        offs: usize,
    ) -> Result<TensorId> {
        self.check_view_bounds("view", a, &ne, &nb, offs)?;
        let dtype = self.tensor(a).dtype;
        Ok(self.new_view_node(Op::View(ViewOp::View), a, dtype, ne, nb, offs, &[a]))
    }

    /// A 1-d view of `ne0` elements from byte `offs`.
    pub fn view_1d(&mut self, a: TensorId, ne0: usize, offs: usize) -> Result<TensorId> {
        let dtype = self.get(a)?.dtype;
        let es = dtype.block_bytes();
        // A row too long to measure saturates; the bounds check then rejects it.
        let row = ne0
            .checked_mul(es)
            .map_or(usize::MAX, |_| dtype.row_bytes(ne0));
        self.view(a, [ne0, 1, 1, 1], [es, row, row, row], offs)
    }

    /// A 2-d view: rows of `ne0` elements, `nb1` bytes apart.
    pub fn view_2d(
        &mut self,
        a: TensorId,
        ne0: usize,
        ne1: usize,
        nb1: usize,
        offs: usize,
    ) -> Result<TensorId> {
        let es = self.get(a)?.dtype.block_bytes();
        let nb2 = nb1.saturating_mul(ne1);
        self.view(a, [ne0, ne1, 1, 1], [es, nb1, nb2, nb2], offs)
    }

    /// A 3-d view with row stride `nb1` and matrix stride `nb2`.
    #[allow(clippy::too_many_arguments)]
    pub fn view_3d(
        &mut self,
        a: TensorId,
        ne0: usize,
        ne1: usize,
        ne2: usize,
        nb1: usize,
        nb2: usize,
        offs: usize,
    ) -> Result<TensorId> {
        let es = self.get(a)?.dtype.block_bytes();
        self.view(
            a,
            [ne0, ne1, ne2, 1],
            [es, nb1, nb2, nb2.saturating_mul(ne2)],
            offs,
        )
    }

    /// A 4-d view with strides `nb1`, `nb2`, `nb3`.
    #[allow(clippy::too_many_arguments)]
    pub fn view_4d(
        &mut self,
        a: TensorId,
        ne: [usize; 4],
        nb1: usize,
        nb2: usize,
        nb3: usize,
        offs: usize,
    ) -> Result<TensorId> {
        let es = self.get(a)?.dtype.block_bytes();
        self.view(a, ne, [es, nb1, nb2, nb3], offs)
    }

    /// The same (contiguous) memory with another shape of as many elements.
    pub fn reshape(&mut self, a: TensorId, shape: &[usize]) -> Result<TensorId> {
        let ne = shape4("reshape", shape)?;
        let t = self.get(a)?;
        if !t.is_contiguous() {
            return Err(Error::shape(
                "reshape",
                format!(
                    "'{}' {} with strides {:?} is not contiguous; use cont() first",
                    t.name,
                    fmt_ne(&t.ne),
                    t.nb
                ),
            ));
        }
        check_blocks("reshape", &t.name, t.dtype, &ne)?;
        let n: usize = ne.iter().product();
        if n != t.nelements() {
            return Err(Error::shape(
                "reshape",
                format!(
                    "cannot reshape '{}' {} ({} elements) to {} ({} elements)",
                    t.name,
                    fmt_ne(&t.ne),
                    t.nelements(),
                    fmt_ne(&ne),
                    n
                ),
            ));
        }
        let dtype = t.dtype;
        let nb = crate::graph::contiguous_strides(dtype, &ne);
        Ok(self.new_view_node(Op::View(ViewOp::Reshape), a, dtype, ne, nb, 0, &[a]))
    }

    /// Reorders dimensions like ggml_permute: source dim `i` becomes result dim
    /// `axes[i]`. `axes` must be a permutation of 0..4.
    pub fn permute(&mut self, a: TensorId, axes: [usize; 4]) -> Result<TensorId> {
        let t = self.get(a)?;
        let mut seen = [false; 4];
        for &ax in &axes {
            if ax >= 4 || seen[ax] {
                return Err(Error::shape(
                    "permute",
                    format!("axes {axes:?} are not a permutation of 0..4"),
                ));
            }
            seen[ax] = true;
        }
        if t.dtype.quant().is_some() && axes[0] != 0 {
            return Err(Error::shape(
                "permute",
                format!(
                    "'{}' is {}: its blocks run along dim 0, which must stay dim 0 (axes {axes:?})",
                    t.name, t.dtype
                ),
            ));
        }
        let mut ne = [0; 4];
        let mut nb = [0; 4];
        for i in 0..4 {
            ne[axes[i]] = t.ne[i];
            nb[axes[i]] = t.nb[i];
        }
        let dtype = t.dtype;
        Ok(self.new_view_node(
            Op::View(ViewOp::Permute { axes }),
            a,
            dtype,
            ne,
            nb,
            0,
            &[a],
        ))
    }

    /// Swaps dims 0 and 1.
    pub fn transpose(&mut self, a: TensorId) -> Result<TensorId> {
        let t = self.get(a)?;
        if t.dtype.quant().is_some() {
            return Err(Error::shape(
                "transpose",
                format!(
                    "'{}' is {}: its blocks run along dim 0, which cannot be transposed",
                    t.name, t.dtype
                ),
            ));
        }
        let mut ne = t.ne;
        let mut nb = t.nb;
        ne.swap(0, 1);
        nb.swap(0, 1);
        let dtype = t.dtype;
        Ok(self.new_view_node(Op::View(ViewOp::Transpose), a, dtype, ne, nb, 0, &[a]))
    }

    /// `a` unchanged (same memory and layout), but ordered after every node of `deps`:
    /// how a graph reads a KV cache after writing into it.
    pub fn after(&mut self, a: TensorId, deps: &[TensorId]) -> Result<TensorId> {
        let t = self.get(a)?;
        self.check_ids(deps)?;
        let (dtype, ne, nb) = (t.dtype, t.ne, t.nb);
        let mut src = vec![a];
        src.extend_from_slice(deps);
        Ok(self.new_view_node(Op::View(ViewOp::After), a, dtype, ne, nb, 0, &src))
    }
}
