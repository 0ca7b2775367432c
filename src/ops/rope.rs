//! Rotary position embedding (rope): normal (adjacent pairs) and NeoX (rotate-half
//! pairs `i`, `i + n_dims/2`, as in HF Llama checkpoints) modes, positions from an I32
//! tensor, a frequency base, linear frequency scaling and the Llama 3 frequency scaling.

use super::host::{par_for_each_row, HostTensor};
use super::{expect_dtype, Op, RopeMode, RopeParams};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, TensorId};

impl Graph {
    /// Rotates `a` [ne0, n_head, n_tokens, ne3] by the positions `pos` (I32 [n_tokens]).
    pub fn rope(&mut self, a: TensorId, pos: TensorId, p: RopeParams) -> Result<TensorId> {
        let (ta, tp) = (self.get(a)?, self.get(pos)?);
        expect_dtype("rope", &ta.name, ta.dtype, &DType::FLOATS)?;
        expect_dtype("rope", &tp.name, tp.dtype, &[DType::I32])?;
        if tp.ne[1] * tp.ne[2] * tp.ne[3] != 1 || tp.ne[0] != ta.ne[2] {
            return Err(Error::shape(
                "rope",
                format!(
                    "positions '{}' {} must be a vector of {} (dim 2 of '{}' {})",
                    tp.name,
                    fmt_ne(&tp.ne),
                    ta.ne[2],
                    ta.name,
                    fmt_ne(&ta.ne)
                ),
            ));
        }
        if p.n_dims == 0 || !p.n_dims.is_multiple_of(2) || p.n_dims > ta.ne[0] {
            return Err(Error::shape(
                "rope",
                format!(
                    "n_dims {} must be even, > 0 and <= dim 0 of '{}' {}",
                    p.n_dims,
                    ta.name,
                    fmt_ne(&ta.ne)
                ),
            ));
        }
        let positive = |x: f32| x.is_finite() && x > 0.0;
        if !(positive(p.freq_base) && positive(p.freq_scale)) {
            return Err(Error::shape(
                "rope",
                format!(
                    "freq_base {} / freq_scale {} must be finite and positive",
                    p.freq_base, p.freq_scale
                ),
            ));
        }
        if let Some(s) = p.llama3 {
            if !(s.factor > 0.0
                && s.high_freq_factor > s.low_freq_factor
                && s.low_freq_factor > 0.0
                && s.original_max_position > 0)
            {
                return Err(Error::shape(
                    "rope",
                    format!("invalid Llama 3 scaling {s:?}: need factor > 0, 0 < low_freq_factor < high_freq_factor, original_max_position > 0"),
                ));
            }
        }
        let (dtype, ne) = (ta.dtype, ta.ne);
        Ok(self.new_node(Op::Rope(p), dtype, ne, &[a, pos]))
    }
}

/// CPU reference for rope.
pub(crate) fn cpu(p: &RopeParams, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (a, pos) = (src[0], src[1]);
    let freqs = p.inv_freqs();
    let half = p.n_dims / 2;
    let (n0, freqs) = (dst.ne[0], &freqs);
    // Per thread: the row, and the sin and cos of every frequency at the position of the
    // last i2 seen (all heads of a position share them; i1, the head, varies fastest).
    let init = || (vec![0f32; n0], vec![(0f32, 0f32); freqs.len()], None);
    par_for_each_row(dst.ne, init, |(row, sin_cos, at), i1, i2, i3| {
        if *at != Some(i2) {
            // SAFETY: i2 < a.ne[2] == pos.ne[0]; the plan guarantees valid memory.
            let t = unsafe { pos.get_i32([i2, 0, 0, 0]) } as f32;
            for (sc, &f) in sin_cos.iter_mut().zip(freqs) {
                *sc = (t * f).sin_cos();
            }
            *at = Some(i2);
        }
        // SAFETY: indices come from dst.ne == a.ne.
        unsafe { a.read_row(i1, i2, i3, row) };
        for (i, &(s, c)) in sin_cos.iter().enumerate() {
            let (j0, j1) = match p.mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::Neox => (i, i + half),
            };
            let (x0, x1) = (row[j0], row[j1]);
            row[j0] = x0 * c - x1 * s;
            row[j1] = x0 * s + x1 * c;
        }
        // SAFETY: as above; this row is written by this call only.
        unsafe { dst.write_row(i1, i2, i3, row) };
    });
    Ok(())
}
