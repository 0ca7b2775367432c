//! Rotary position embedding (rope): normal (adjacent pairs) and NeoX (rotate-half
//! pairs `i`, `i + n_dims/2`, as in HF Llama checkpoints) modes, positions from an I32
//! tensor, a frequency base, linear frequency scaling and the Llama 3 frequency scaling.
//! The CPU kernel remembers the sines and cosines of its last two position sets, which the
//! q and k ropes of every layer of a step share.

use std::sync::{Arc, Mutex};

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

/// The sin and cos of every frequency at every position of one rope: pair `t * half + i`
/// is frequency `i` at the position of token `t`.
struct Angles {
    freqs: Vec<u32>,
    pos: Vec<i32>,
    sin_cos: Vec<(f32, f32)>,
}

/// The angles of the last two ropes computed: a model's layers rotate q and k by the same
/// positions and frequencies, so a step computes its sines and cosines once instead of
/// once a rope (they were most of a CPU rope's time).
static ANGLES: Mutex<Vec<Arc<Angles>>> = Mutex::new(Vec::new());

/// The angles of frequencies `freqs` at the positions `pos` (I32 [n]), from [`ANGLES`]
/// when a recent rope had them, else computed (and remembered).
fn angles(freqs: &[f32], pos: HostTensor, n: usize) -> Arc<Angles> {
    // SAFETY: i < n == pos.ne[0]; the plan guarantees valid memory.
    let pos: Vec<i32> = (0..n)
        .map(|i| unsafe { pos.get_i32([i, 0, 0, 0]) })
        .collect();
    let freqs_bits: Vec<u32> = freqs.iter().map(|f| f.to_bits()).collect();
    let mut recent = ANGLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(a) = recent
        .iter()
        .find(|a| a.freqs == freqs_bits && a.pos == pos)
    {
        return Arc::clone(a);
    }
    let sin_cos = pos
        .iter()
        .flat_map(|&t| freqs.iter().map(move |&f| (t as f32 * f).sin_cos()))
        .collect();
    let a = Arc::new(Angles {
        freqs: freqs_bits,
        pos,
        sin_cos,
    });
    if recent.len() == 2 {
        recent.remove(0);
    }
    recent.push(Arc::clone(&a));
    a
}

/// CPU reference for rope.
pub(crate) fn cpu(p: &RopeParams, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let (a, pos) = (src[0], src[1]);
    let freqs = p.inv_freqs();
    let half = p.n_dims / 2;
    let angles = angles(&freqs, pos, dst.ne[2]);
    let n0 = dst.ne[0];
    par_for_each_row(
        dst.ne,
        || vec![0f32; n0],
        |row, i1, i2, i3| {
            let sin_cos = &angles.sin_cos[i2 * half..(i2 + 1) * half];
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
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::backend::cpu::CpuBackend;
    use crate::backend::{Backend, BackendExt};
    use crate::graph::{DType, Graph};
    use crate::ops::{RopeMode, RopeParams};

    /// Ropes of one plan that share positions, frequencies, both or neither, in an order
    /// that brings each back after the remembered angles moved on, each against the
    /// formula in f64.
    #[test]
    fn remembered_angles_match_their_ropes() {
        let (d, heads, n) = (8, 2, 5);
        let mut g = Graph::new();
        let x = g.input("x", DType::F32, &[d, heads, n]).unwrap();
        let pa = g.input("pa", DType::I32, &[n]).unwrap();
        let pb = g.input("pb", DType::I32, &[n]).unwrap();
        let base = |b| RopeParams::new(RopeMode::Neox, d, b);
        let cases = [
            (pa, 1e4),
            (pb, 1e4),
            (pa, 50.0),
            (pb, 50.0),
            (pa, 1e4),
            (pa, 50.0),
        ];
        let outs: Vec<_> = cases
            .iter()
            .map(|&(p, b)| g.rope(x, p, base(b)).unwrap())
            .collect();
        let plan = g.plan(&outs).unwrap();
        let mut be = CpuBackend::new();
        let e = be.load(&plan).unwrap();
        let xs: Vec<f32> = (0..d * heads * n)
            .map(|i| (i as f32 * 0.37).sin())
            .collect();
        let (a, b) = ([0, 3, 7, 1000, 2], [9, 3, 0, 40000, 11]);
        be.set_input_f32(e, x, &xs).unwrap();
        be.set_input_i32(e, pa, &a).unwrap();
        be.set_input_i32(e, pb, &b).unwrap();
        be.compute(e).unwrap();
        for (&(p, base_freq), &out) in cases.iter().zip(&outs) {
            let pos = if p == pa { a } else { b };
            let got = be.get_output_f32(e, out, d * heads * n).unwrap();
            for (r, (row, want_row)) in got.chunks(d).zip(xs.chunks(d)).enumerate() {
                let t = f64::from(pos[r / heads]);
                for i in 0..d / 2 {
                    let f = (base_freq as f64).powf(-2.0 * i as f64 / d as f64);
                    let (s, c) = (t * f).sin_cos();
                    let (x0, x1) = (f64::from(want_row[i]), f64::from(want_row[i + d / 2]));
                    let want = [x0 * c - x1 * s, x0 * s + x1 * c];
                    for (k, w) in want.into_iter().enumerate() {
                        let g = f64::from(row[i + k * d / 2]);
                        // f32 angles at positions up to 40,000: within a few 1e-3
                        assert!(
                            (g - w).abs() < 1e-2,
                            "{p:?} {base_freq} row {r} dim {i}: {g} {w}"
                        );
                    }
                }
            }
        }
    }
}
