//! Tensor parallelism, Megatron-style: how a model's tensors are split over the N devices
//! of a [`DeviceGroup`](crate::backend::group::DeviceGroup).
//!
//! Each device holds:
//! - a contiguous share of the attention heads: rows of `attn_q` (and its bias) for
//!   `n_head / N` query heads, rows of `attn_k` / `attn_v` for the KV heads those query
//!   heads read (`n_kv_head / N` of them; when N exceeds the KV heads, each device holds
//!   the one KV head its query heads share, replicated as in vLLM), and the matching
//!   columns of `attn_output`; its KV cache holds only its KV heads;
//! - a contiguous share of the MLP's intermediate dimension: rows of `ffn_gate`,
//!   `ffn_up` (and its bias) and the matching columns of `ffn_down`;
//! - everything else whole: embeddings, norms, q/k norms, the output head, and the
//!   biases of the two projections that end in a sum (`attn_output.bias`,
//!   `ffn_down.bias`), which are added once, after it.
//!
//! Each device's graph is the model's graph for a config of its share ([`Split::shard`]:
//! heads, KV heads and `intermediate_size` divided, `tp = N`), with an `all_reduce` after
//! the attention output projection and after the MLP's down projection, the only two
//! points where the devices' partial sums meet. The output head is replicated: every
//! device computes all logits from the same hidden state, so no gather is needed.

use std::borrow::Cow;
use std::ops::Range;

use crate::error::{Error, Result};
use crate::graph::DType;
use crate::models::arch::config::Config;
use crate::models::arch::role::Role;

/// Which part of a tensor one device holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    /// All of it.
    Whole,
    /// These rows (outer dimension) of a matrix, or these elements of a vector.
    Rows(Range<usize>),
    /// These elements of every row (the inner dimension, `ne[0]`).
    Cols(Range<usize>),
}

/// A model split over `n` devices.
#[derive(Clone, Debug)]
pub struct Split {
    /// Devices.
    pub n: usize,
    /// The whole model's config.
    full: Config,
}

impl Split {
    /// The split of `full` over `n` devices; an error names the size that does not
    /// divide.
    pub fn new(full: &Config, n: usize) -> Result<Split> {
        crate::backend::group::check_size(n)?;
        if full.tp != 1 {
            return Err(Error::model(
                "internal: splitting a config that is already split",
            ));
        }
        if full.moe.is_some() && n > 1 {
            return Err(Error::model(format!(
                "--tp {n}: a {} model (a mixture of experts) runs on one device",
                full.arch
            )));
        }
        let bad = |what: &str, v: usize| {
            Err(Error::model(format!(
                "--tp {n}: {what} ({v}) cannot be split evenly over {n} devices"
            )))
        };
        let (heads, kv) = (full.num_attention_heads, full.num_key_value_heads);
        if heads % n != 0 {
            return bad("the attention heads", heads);
        }
        if kv % n != 0 && !n.is_multiple_of(kv) {
            return Err(Error::model(format!(
                "--tp {n}: the {kv} KV heads neither divide over {n} devices nor do {n} devices divide into {kv} groups"
            )));
        }
        if !full.intermediate_size.is_multiple_of(n) {
            return bad("the MLP's intermediate_size", full.intermediate_size);
        }
        Ok(Split {
            n,
            full: full.clone(),
        })
    }

    /// The config of one device's share: heads, KV heads (at least 1) and the MLP's
    /// width divided by `n`, `tp = n`.
    pub fn shard(&self) -> Config {
        let n = self.n;
        let mut c = self.full.clone();
        c.num_attention_heads /= n;
        c.num_key_value_heads = (c.num_key_value_heads / n).max(1);
        c.intermediate_size /= n;
        c.tp = n;
        c
    }

    /// The rows of the q projection device `d` holds (its query heads' rows).
    fn q_rows(&self, d: usize) -> Range<usize> {
        let per = self.full.num_attention_heads / self.n * self.full.head_dim;
        d * per..(d + 1) * per
    }

    /// The rows of the k and v projections device `d` holds (its KV heads' rows).
    fn kv_rows(&self, d: usize) -> Range<usize> {
        let (kv, hd, n) = (self.full.num_key_value_heads, self.full.head_dim, self.n);
        match kv % n {
            0 => d * kv / n * hd..(d + 1) * kv / n * hd,
            // fewer KV heads than devices: the one KV head device d's query heads read
            _ => {
                let head = d * kv / n;
                head * hd..(head + 1) * hd
            }
        }
    }

    /// The rows of the MLP's intermediate dimension device `d` holds.
    fn ff_rows(&self, d: usize) -> Range<usize> {
        let per = self.full.intermediate_size / self.n;
        d * per..(d + 1) * per
    }

    /// What device `d` holds, in one line (for dumps): its query heads, KV heads and
    /// MLP rows.
    pub fn describe(&self, d: usize) -> String {
        let hd = self.full.head_dim;
        let (q, kv, ff) = (self.q_rows(d), self.kv_rows(d), self.ff_rows(d));
        format!(
            "device {d} of {}: query heads {}..{}, KV heads {}..{}, MLP rows {}..{} of {}; \
             attn_q/attn_k/attn_v/ffn_gate/ffn_up rows and attn_output/ffn_down columns \
             of those; the rest whole",
            self.n,
            q.start / hd,
            q.end / hd,
            kv.start / hd,
            kv.end / hd,
            ff.start,
            ff.end,
            self.full.intermediate_size
        )
    }

    /// The part of tensor `role` that device `d` holds.
    pub fn part(&self, role: Role, d: usize) -> Part {
        if self.n == 1 {
            return Part::Whole;
        }
        match role {
            Role::AttnQ | Role::AttnQB => Part::Rows(self.q_rows(d)),
            Role::AttnK | Role::AttnV | Role::AttnKB | Role::AttnVB => Part::Rows(self.kv_rows(d)),
            Role::AttnOut => Part::Cols(self.q_rows(d)),
            Role::FfnGate | Role::FfnUp | Role::FfnUpB => Part::Rows(self.ff_rows(d)),
            Role::FfnDown => Part::Cols(self.ff_rows(d)),
            // whole: `new` splits no mixture of experts
            Role::FfnGateInp | Role::FfnGateExps | Role::FfnUpExps | Role::FfnDownExps => {
                Part::Whole
            }
            Role::TokEmbd
            | Role::PosEmbd
            | Role::AttnNorm
            | Role::AttnNormB
            | Role::AttnQNorm
            | Role::AttnKNorm
            | Role::AttnOutB
            | Role::FfnNorm
            | Role::FfnNormB
            | Role::FfnDownB
            | Role::OutNorm
            | Role::OutNormB
            | Role::Output => Part::Whole,
        }
    }

    /// Device `d`'s part of tensor `name` (role `role`): `bytes` of `dtype` holding the
    /// whole tensor. Column parts of a block type must start and end on block
    /// boundaries, else an error names the tensor and sizes.
    pub fn slice<'a>(
        &self,
        name: &str,
        role: Role,
        d: usize,
        bytes: &'a [u8],
        dtype: DType,
    ) -> Result<Cow<'a, [u8]>> {
        let row_len = role.row_len(&self.full);
        let row_bytes = dtype.row_bytes(row_len);
        let whole_rows = bytes.len().checked_div(row_bytes).unwrap_or(0);
        let (rows, cols) = match self.part(role, d) {
            Part::Whole => return Ok(Cow::Borrowed(bytes)),
            // a vector is one row: its part is a range of elements
            Part::Rows(r) if role.is_vector() => (0..1, r),
            Part::Rows(r) => (r, 0..row_len),
            Part::Cols(c) => (0..whole_rows, c),
        };
        let block = dtype.block_size();
        if cols.start % block != 0 || cols.end % block != 0 {
            return Err(Error::model(format!(
                "--tp {}: {name} ({dtype}, rows of {row_len}) splits into rows of {} elements, not a multiple of its {block}-element blocks",
                self.n,
                cols.len()
            )));
        }
        let (c0, c1) = (dtype.row_bytes(cols.start), dtype.row_bytes(cols.end));
        let mut out = Vec::with_capacity(rows.len() * (c1 - c0));
        for r in rows.clone() {
            let row = bytes
                .get(r * row_bytes..(r + 1) * row_bytes)
                .ok_or_else(|| {
                    Error::model(format!(
                    "{name}: row {r} is past the tensor's {whole_rows} rows of {row_bytes} bytes"
                ))
                })?;
            out.extend_from_slice(&row[c0..c1]);
        }
        Ok(Cow::Owned(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::arch::presets;

    /// The shares of q, k/v and the MLP tile the whole tensors; the shard config has
    /// the shares' sizes.
    #[test]
    fn parts_tile_the_tensors() {
        let cfg = presets::preset("llama3-8b").unwrap(); // 32 heads, 8 KV heads
        for n in [1, 2, 4, 8] {
            let s = Split::new(&cfg, n).unwrap();
            let shard = s.shard();
            assert_eq!(shard.num_attention_heads * n, 32);
            assert_eq!(shard.num_key_value_heads * n, 8);
            assert_eq!(shard.intermediate_size * n, cfg.intermediate_size);
            let q: Vec<usize> = (0..n).flat_map(|d| s.q_rows(d)).collect();
            assert_eq!(q, (0..cfg.n_q()).collect::<Vec<_>>());
            let kv: Vec<usize> = (0..n).flat_map(|d| s.kv_rows(d)).collect();
            assert_eq!(kv, (0..cfg.n_kv_dim()).collect::<Vec<_>>());
        }
        // 16 devices over 8 KV heads: pairs of devices share one KV head
        let s = Split::new(&cfg, 16).unwrap();
        assert_eq!(s.shard().num_key_value_heads, 1);
        let hd = cfg.head_dim;
        assert_eq!(s.kv_rows(0), 0..hd);
        assert_eq!(s.kv_rows(1), 0..hd);
        assert_eq!(s.kv_rows(2), hd..2 * hd);
        assert_eq!(s.kv_rows(15), 7 * hd..8 * hd);
    }

    #[test]
    fn sizes_that_do_not_divide_are_named() {
        let cfg = presets::preset("llama2-7b").unwrap(); // 32 heads, 11008 ff
        let e = Split::new(&cfg, 3).unwrap_err().to_string();
        assert!(e.contains("attention heads (32)"), "{e}");
        let e = Split::new(&cfg, 64).unwrap_err().to_string();
        assert!(e.contains("attention heads"), "{e}");
        let e = Split::new(&cfg, 0).unwrap_err().to_string();
        assert!(e.contains("--tp 0"), "{e}");
        let mut odd = cfg.clone();
        odd.intermediate_size = 11007;
        let e = Split::new(&odd, 2).unwrap_err().to_string();
        assert!(e.contains("intermediate_size (11007)"), "{e}");
        let mut gqa = cfg.clone();
        gqa.num_key_value_heads = 3;
        gqa.num_attention_heads = 24;
        let e = Split::new(&gqa, 2).unwrap_err().to_string();
        assert!(e.contains("3 KV heads"), "{e}");
    }

    /// Row and column parts cut the right bytes; a column cut inside a block is refused
    /// with the tensor's name.
    #[test]
    fn slices_cut_rows_and_columns() {
        let mut cfg = presets::preset("tiny").unwrap();
        cfg.intermediate_size = 64;
        let s = Split::new(&cfg, 2).unwrap();
        // ffn_down: rows of 64 (the MLP's width) elements; device 1 holds columns 32..64
        let (rows, len) = (3, 64);
        let data: Vec<f32> = (0..rows * len).map(|i| i as f32).collect();
        let bytes: &[u8] = bytemuck::cast_slice(&data);
        let name = "blk.0.ffn_down.weight";
        let part = s.slice(name, Role::FfnDown, 1, bytes, DType::F32).unwrap();
        let got: &[f32] = bytemuck::cast_slice(&part);
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| (32..64).map(move |c| (r * len + c) as f32))
            .collect();
        assert_eq!(got, want.as_slice());
        // ffn_up: device 0 holds rows 0..32 of [64, n_embd]
        let n_embd = cfg.hidden_size;
        let up: Vec<f32> = (0..64 * n_embd).map(|i| i as f32).collect();
        let part = s
            .slice("u", Role::FfnUp, 0, bytemuck::cast_slice(&up), DType::F32)
            .unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&part), &up[..32 * n_embd]);
        // a bias is one row: device 1 holds elements 32..64
        let b: Vec<f32> = (0..64).map(|i| i as f32).collect();
        let part = s
            .slice("b", Role::FfnUpB, 1, bytemuck::cast_slice(&b), DType::F32)
            .unwrap();
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&part), &b[32..]);
        // Q4_K rows of 768 elements cannot be cut at 384 (inside a 256-element block)
        cfg.intermediate_size = 768;
        let s = Split::new(&cfg, 2).unwrap();
        let q = vec![0u8; 2 * DType::Q4_K.row_bytes(768)];
        let e = s
            .slice(name, Role::FfnDown, 0, &q, DType::Q4_K)
            .unwrap_err()
            .to_string();
        assert!(e.contains(name) && e.contains("256-element blocks"), "{e}");
    }
}
