//! Rotary position embedding (rope): normal (adjacent pairs) and NeoX (rotate-half
//! pairs `i`, `i + n_dims/2`, as in HF Llama checkpoints) modes, positions from an I32
//! tensor, a frequency base, linear frequency scaling and the Llama 3 frequency scaling.

use std::fmt;

use super::host::{for_each_row, HostTensor};
use super::{expect_dtype, Op};
use crate::error::{Error, Result};
use crate::graph::{fmt_ne, DType, Graph, Step, TensorId};

/// Which dimensions are rotated together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeMode {
    /// Pairs `(2i, 2i + 1)` (GPT-J, ggml's default).
    Normal,
    /// Pairs `(i, i + n_dims / 2)` (GPT-NeoX, HF "rotate_half").
    Neox,
}

/// Llama 3 frequency scaling (HF `rope_type: "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// Overall scaling of low frequencies.
    pub factor: f32,
    /// Wavelength threshold (as a fraction of the original context) for low frequencies.
    pub low_freq_factor: f32,
    /// Wavelength threshold for high frequencies.
    pub high_freq_factor: f32,
    /// The context length the model was trained with.
    pub original_max_position: usize,
}

/// Parameters of a rope op.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Pairing of dimensions.
    pub mode: RopeMode,
    /// Rotated dimensions (the first `n_dims` of each row; the rest pass through).
    pub n_dims: usize,
    /// Frequency base (`rope_theta`).
    pub freq_base: f32,
    /// Linear scaling of positions (1.0 for none).
    pub freq_scale: f32,
    /// Llama 3 frequency scaling, if any.
    pub llama3: Option<Llama3Scaling>,
}

impl RopeParams {
    /// Plain rope in `mode` over `n_dims` dims with base `freq_base`.
    pub fn new(mode: RopeMode, n_dims: usize, freq_base: f32) -> Self {
        RopeParams {
            mode,
            n_dims,
            freq_base,
            freq_scale: 1.0,
            llama3: None,
        }
    }

    /// The inverse frequency of pair `i` (0 <= i < n_dims / 2), including linear and
    /// Llama 3 scaling. Computed in f32 like the HF reference.
    pub fn inv_freq(&self, i: usize) -> f32 {
        let base = self.freq_base.powf(-((2 * i) as f32) / self.n_dims as f32);
        let f = match self.llama3 {
            None => base,
            Some(s) => {
                let old = s.original_max_position as f32;
                let low_wavelen = old / s.low_freq_factor;
                let high_wavelen = old / s.high_freq_factor;
                let wavelen = 2.0 * std::f32::consts::PI / base;
                if wavelen < high_wavelen {
                    base
                } else if wavelen > low_wavelen {
                    base / s.factor
                } else {
                    let smooth = (old / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * base / s.factor + smooth * base
                }
            }
        };
        f * self.freq_scale
    }

    /// The table of inverse frequencies, one per rotated pair.
    pub fn inv_freqs(&self) -> Vec<f32> {
        (0..self.n_dims / 2).map(|i| self.inv_freq(i)).collect()
    }
}

impl fmt::Display for RopeParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mode = match self.mode {
            RopeMode::Normal => "normal",
            RopeMode::Neox => "neox",
        };
        write!(
            f,
            "mode={mode} n_dims={} base={}",
            self.n_dims, self.freq_base
        )?;
        if self.freq_scale != 1.0 {
            write!(f, " scale={}", self.freq_scale)?;
        }
        if let Some(s) = self.llama3 {
            write!(
                f,
                " llama3(factor={} low={} high={} orig={})",
                s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position
            )?;
        }
        Ok(())
    }
}

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
        if p.n_dims == 0 || p.n_dims % 2 != 0 || p.n_dims > ta.ne[0] {
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
pub(crate) fn cpu(step: &Step, dst: HostTensor, src: &[HostTensor]) -> Result<()> {
    let Op::Rope(p) = step.op else {
        unreachable!("rope::cpu called for {}", step.op.name())
    };
    let (a, pos) = (src[0], src[1]);
    let freqs = p.inv_freqs();
    let half = p.n_dims / 2;
    let mut row = vec![0f32; dst.ne[0]];
    for_each_row(dst.ne, |i1, i2, i3| {
        // SAFETY: i2 < a.ne[2] == pos.ne[0]; the plan guarantees valid memory.
        let t = unsafe { pos.get_i32([i2, 0, 0, 0]) } as f32;
        // SAFETY: indices come from dst.ne == a.ne.
        unsafe { a.read_row(i1, i2, i3, &mut row) };
        for (i, &f) in freqs.iter().enumerate() {
            let (s, c) = (t * f).sin_cos();
            let (j0, j1) = match p.mode {
                RopeMode::Normal => (2 * i, 2 * i + 1),
                RopeMode::Neox => (i, i + half),
            };
            let (x0, x1) = (row[j0], row[j1]);
            row[j0] = x0 * c - x1 * s;
            row[j1] = x0 * s + x1 * c;
        }
        // SAFETY: as above; this step is the only writer of dst.
        unsafe { dst.write_row(i1, i2, i3, &row) };
    });
    Ok(())
}
