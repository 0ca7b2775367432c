//! Where every Llama weight lives in backend memory: one buffer for the whole model,
//! each tensor at an aligned byte offset.
//!
//! Two layouts differ from the HF checkpoint's list of tensors:
//! - `q_proj | k_proj | v_proj` are stored as adjacent rows of one tensor
//!   `attn_qkv` [n_embd, n_q + 2 * n_kv_dim], so one mul_mat computes q, k and v (the
//!   graph then takes them as strided views of the result);
//! - `gate_proj | up_proj` likewise form `ffn_gate_up` [n_embd, 2 * n_ff].
//!
//! An HF `[out, in]` matrix is row-major with `in` contiguous, which is graft's `ne`
//! `[in, out]`: stacking along `out` is concatenating the bytes, so every HF tensor is
//! uploaded as is, at its own offset. This halves the number of mul_mats per block
//! (one GEMV launch instead of three, one instead of two), the layout the CUDA GEMV
//! kernel is written for. With tied embeddings the output projection is the embedding
//! table (same bytes).

use crate::backend::Backend;
use crate::error::Result;
use crate::graph::alloc::ALIGN;
use crate::graph::{BufferId, BufferRef, DType, Graph, TensorId};

use super::config::Config;

/// Byte offsets of one block's weights inside the weight buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerWeights {
    /// `input_layernorm` `[n_embd]`.
    pub attn_norm: usize,
    /// `q_proj | k_proj | v_proj` [n_embd, n_q + 2 * n_kv_dim].
    pub attn_qkv: usize,
    /// `o_proj` [n_q, n_embd].
    pub attn_out: usize,
    /// `post_attention_layernorm` `[n_embd]`.
    pub ffn_norm: usize,
    /// `gate_proj | up_proj` [n_embd, 2 * n_ff].
    pub ffn_gate_up: usize,
    /// `down_proj` [n_ff, n_embd].
    pub ffn_down: usize,
}

/// One tensor of the HF checkpoint and where it goes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slot {
    /// The HF name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// The HF shape, outermost first (`[out, in]` for a matrix).
    pub shape: Vec<usize>,
    /// Byte offset in the weight buffer.
    pub offset: usize,
    /// Whether this is a norm weight (a vector), not a matrix.
    pub is_norm: bool,
}

impl Slot {
    /// Elements of the tensor.
    pub fn nelements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// The weights of a Llama model in one backend buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Weights {
    /// The buffer holding every weight.
    pub buffer: BufferId,
    /// The dtype of every weight.
    pub dtype: DType,
    /// Size of the buffer.
    pub bytes: usize,
    /// `embed_tokens` [n_embd, vocab].
    pub tok_embd: usize,
    /// `lm_head` [n_embd, vocab] (equal to `tok_embd` when tied).
    pub output: usize,
    /// `norm` `[n_embd]`.
    pub out_norm: usize,
    /// Per-block offsets.
    pub layers: Vec<LayerWeights>,
}

/// The weight leaves of one block in a graph.
pub(crate) struct LayerLeaves {
    pub attn_norm: TensorId,
    pub attn_qkv: TensorId,
    pub attn_out: TensorId,
    pub ffn_norm: TensorId,
    pub ffn_gate_up: TensorId,
    pub ffn_down: TensorId,
}

/// The weight leaves of one graph.
pub(crate) struct Leaves {
    pub tok_embd: TensorId,
    pub output: TensorId,
    pub out_norm: TensorId,
    pub layers: Vec<LayerLeaves>,
}

/// Hands out aligned offsets in a growing buffer.
struct Cursor {
    end: usize,
    es: usize,
}

impl Cursor {
    fn take(&mut self, elements: usize) -> usize {
        let off = self.end;
        self.end = (off + elements * self.es).div_ceil(ALIGN) * ALIGN;
        off
    }
}

impl Weights {
    /// The layout of `cfg`'s weights in `dtype`, in `buffer` (which need not exist yet:
    /// a graph can be built and planned against the layout alone, e.g. for a dump).
    pub fn layout(cfg: &Config, dtype: DType, buffer: BufferId) -> Weights {
        let (n_embd, vocab, n_ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let mut c = Cursor {
            end: 0,
            es: dtype.block_bytes(),
        };
        let tok_embd = c.take(n_embd * vocab);
        let layers = (0..cfg.num_hidden_layers)
            .map(|_| LayerWeights {
                attn_norm: c.take(n_embd),
                attn_qkv: c.take(n_embd * (cfg.n_q() + 2 * cfg.n_kv_dim())),
                attn_out: c.take(cfg.n_q() * n_embd),
                ffn_norm: c.take(n_embd),
                ffn_gate_up: c.take(n_embd * 2 * n_ff),
                ffn_down: c.take(n_ff * n_embd),
            })
            .collect();
        let out_norm = c.take(n_embd);
        let output = if cfg.tie_word_embeddings {
            tok_embd
        } else {
            c.take(n_embd * vocab)
        };
        Weights {
            buffer,
            dtype,
            bytes: c.end,
            tok_embd,
            output,
            out_norm,
            layers,
        }
    }

    /// Allocates the (zero-filled) weight buffer for `cfg` in `dtype` on `be`.
    pub fn alloc(cfg: &Config, dtype: DType, be: &mut dyn Backend) -> Result<Weights> {
        let bytes = Weights::layout(cfg, dtype, BufferId(0)).bytes;
        let buffer = be.alloc_buffer(bytes)?;
        Ok(Weights::layout(cfg, dtype, buffer))
    }

    /// Every HF tensor of the checkpoint with its shape and offset, in buffer order.
    pub fn slots(&self, cfg: &Config) -> Vec<Slot> {
        let (n_embd, vocab, n_ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let (n_q, n_kv) = (cfg.n_q(), cfg.n_kv_dim());
        let es = self.dtype.block_bytes();
        let slot = |name: String, shape: Vec<usize>, offset: usize| Slot {
            is_norm: shape.len() == 1,
            name,
            shape,
            offset,
        };
        let mut v = vec![slot(
            "model.embed_tokens.weight".into(),
            vec![vocab, n_embd],
            self.tok_embd,
        )];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            v.push(slot(
                format!("{p}.input_layernorm.weight"),
                vec![n_embd],
                l.attn_norm,
            ));
            v.push(slot(
                format!("{p}.self_attn.q_proj.weight"),
                vec![n_q, n_embd],
                l.attn_qkv,
            ));
            v.push(slot(
                format!("{p}.self_attn.k_proj.weight"),
                vec![n_kv, n_embd],
                l.attn_qkv + n_q * n_embd * es,
            ));
            v.push(slot(
                format!("{p}.self_attn.v_proj.weight"),
                vec![n_kv, n_embd],
                l.attn_qkv + (n_q + n_kv) * n_embd * es,
            ));
            v.push(slot(
                format!("{p}.self_attn.o_proj.weight"),
                vec![n_embd, n_q],
                l.attn_out,
            ));
            v.push(slot(
                format!("{p}.post_attention_layernorm.weight"),
                vec![n_embd],
                l.ffn_norm,
            ));
            v.push(slot(
                format!("{p}.mlp.gate_proj.weight"),
                vec![n_ff, n_embd],
                l.ffn_gate_up,
            ));
            v.push(slot(
                format!("{p}.mlp.up_proj.weight"),
                vec![n_ff, n_embd],
                l.ffn_gate_up + n_ff * n_embd * es,
            ));
            v.push(slot(
                format!("{p}.mlp.down_proj.weight"),
                vec![n_embd, n_ff],
                l.ffn_down,
            ));
        }
        v.push(slot(
            "model.norm.weight".into(),
            vec![n_embd],
            self.out_norm,
        ));
        if !cfg.tie_word_embeddings {
            v.push(slot(
                "lm_head.weight".into(),
                vec![vocab, n_embd],
                self.output,
            ));
        }
        v
    }

    /// Fills every weight with seeded uniform values on the device (benchmarks): norm
    /// weights in [-1, 1), matrices in [-1/sqrt(in), 1/sqrt(in)).
    pub fn fill_random(&self, cfg: &Config, be: &mut dyn Backend, seed: u64) -> Result<()> {
        for (i, s) in self.slots(cfg).iter().enumerate() {
            let scale = if s.is_norm {
                1.0
            } else {
                1.0 / (s.shape[1] as f32).sqrt()
            };
            let n = s.nelements();
            be.fill_random(
                self.buffer,
                s.offset,
                self.dtype,
                n,
                seed ^ ((i as u64) << 32),
                scale,
            )?;
        }
        Ok(())
    }

    /// Bytes of weights read to decode one token: everything but the embedding table,
    /// of which one row is read (unless it is also the output projection).
    pub fn bytes_per_token(&self, cfg: &Config) -> usize {
        let es = self.dtype.block_bytes();
        let table = cfg.vocab_size * cfg.hidden_size * es;
        let total: usize = self.slots(cfg).iter().map(|s| s.nelements() * es).sum();
        if cfg.tie_word_embeddings {
            total
        } else {
            total - table + cfg.hidden_size * es
        }
    }

    /// Weight leaves of a graph (ggml-style names).
    pub(crate) fn leaves(&self, g: &mut Graph, cfg: &Config) -> Result<Leaves> {
        let (n_embd, vocab, n_ff) = (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size);
        let dt = self.dtype;
        let at = |offset| BufferRef {
            buffer: self.buffer,
            offset,
        };
        let tok_embd = g.weight("token_embd", dt, &[n_embd, vocab], at(self.tok_embd))?;
        let output = if cfg.tie_word_embeddings {
            tok_embd
        } else {
            g.weight("output", dt, &[n_embd, vocab], at(self.output))?
        };
        let out_norm = g.weight("output_norm", dt, &[n_embd], at(self.out_norm))?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for (i, l) in self.layers.iter().enumerate() {
            let qkv_rows = cfg.n_q() + 2 * cfg.n_kv_dim();
            layers.push(LayerLeaves {
                attn_norm: g.weight(
                    &format!("blk.{i}.attn_norm"),
                    dt,
                    &[n_embd],
                    at(l.attn_norm),
                )?,
                attn_qkv: g.weight(
                    &format!("blk.{i}.attn_qkv"),
                    dt,
                    &[n_embd, qkv_rows],
                    at(l.attn_qkv),
                )?,
                attn_out: g.weight(
                    &format!("blk.{i}.attn_output"),
                    dt,
                    &[cfg.n_q(), n_embd],
                    at(l.attn_out),
                )?,
                ffn_norm: g.weight(&format!("blk.{i}.ffn_norm"), dt, &[n_embd], at(l.ffn_norm))?,
                ffn_gate_up: g.weight(
                    &format!("blk.{i}.ffn_gate_up"),
                    dt,
                    &[n_embd, 2 * n_ff],
                    at(l.ffn_gate_up),
                )?,
                ffn_down: g.weight(
                    &format!("blk.{i}.ffn_down"),
                    dt,
                    &[n_ff, n_embd],
                    at(l.ffn_down),
                )?,
            });
        }
        Ok(Leaves {
            tok_embd,
            output,
            out_norm,
            layers,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::CpuBackend;
    use crate::models::presets;

    #[test]
    fn slots_tile_the_buffer_without_overlap() {
        for name in presets::NAMES {
            let cfg = presets::preset(name).unwrap();
            for dt in DType::FLOATS {
                let w = Weights::layout(&cfg, dt, BufferId(0));
                let mut spans: Vec<(usize, usize)> = w
                    .slots(&cfg)
                    .iter()
                    .map(|s| (s.offset, s.offset + s.nelements() * dt.block_bytes()))
                    .collect();
                spans.sort();
                for pair in spans.windows(2) {
                    assert!(pair[0].1 <= pair[1].0, "{name} {dt}: {pair:?} overlap");
                }
                assert!(spans.last().unwrap().1 <= w.bytes);
                // q|k|v and gate|up are adjacent rows of one tensor.
                let s = w.slots(&cfg);
                let es = dt.block_bytes();
                assert_eq!(s[3].offset, s[2].offset + s[2].nelements() * es);
                assert_eq!(s[4].offset, s[3].offset + s[3].nelements() * es);
                assert_eq!(s[8].offset, s[7].offset + s[7].nelements() * es);
            }
        }
    }

    #[test]
    fn fill_random_writes_every_slot() {
        let cfg = presets::preset("tiny").unwrap();
        let mut be = CpuBackend::new();
        let w = Weights::alloc(&cfg, DType::F32, &mut be).unwrap();
        w.fill_random(&cfg, &mut be, 7).unwrap();
        for s in w.slots(&cfg) {
            let mut out = vec![0u8; s.nelements() * 4];
            be.read_buffer(w.buffer, s.offset, &mut out).unwrap();
            let vals: &[f32] = bytemuck::cast_slice(&out);
            let bound = if s.is_norm {
                1.0
            } else {
                1.0 / (s.shape[1] as f32).sqrt()
            };
            assert!(vals.iter().all(|v| v.abs() <= bound), "{}", s.name);
            assert!(
                vals.iter().filter(|v| **v != 0.0).count() > vals.len() / 2,
                "{}",
                s.name
            );
        }
    }
}
