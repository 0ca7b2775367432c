//! Builds one Llama-style transformer block (48 nodes), runs it on the CPU with
//! random weights and inputs, prints the text dump of the plan and writes `block.dot`.
//!
//! ```text
//! cargo run --example dump_block
//! dot -Tsvg block.dot -o block.svg    # render the graph (Graphviz)
//! ```

use graft::backend::cpu::{random_uniform, CpuBackend};
use graft::backend::{Backend, BackendExt};
use graft::graph::{BufferRef, DType, Graph, TensorId};
use graft::ops::{RopeMode, RopeParams};
use graft::Result;

/// Sizes of the block.
pub struct BlockConfig {
    /// Model width.
    pub d_model: usize,
    /// Query heads.
    pub n_head: usize,
    /// Key/value heads (grouped-query attention when fewer than `n_head`).
    pub n_kv_head: usize,
    /// Hidden width of the MLP.
    pub d_ff: usize,
    /// Tokens in the batch (a prefill from position 0).
    pub n_tokens: usize,
    /// Rows of the K/V caches.
    pub n_ctx: usize,
}

impl BlockConfig {
    /// A small block that runs in milliseconds on the CPU.
    pub fn small() -> Self {
        BlockConfig {
            d_model: 32,
            n_head: 4,
            n_kv_head: 2,
            d_ff: 64,
            n_tokens: 5,
            n_ctx: 8,
        }
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.d_model / self.n_head
    }
}

/// The tensors of a built block the caller writes or reads.
pub struct Block {
    /// Input activations F32 [d_model, n_tokens].
    pub x: TensorId,
    /// Positions I32 [n_tokens].
    pub pos: TensorId,
    /// Additive causal mask F32 [n_tokens, n_tokens] (0 or -inf).
    pub mask: TensorId,
    /// The K and V cache writes (run first).
    pub cache_writes: [TensorId; 2],
    /// Output activations F32 [d_model, n_tokens].
    pub out: TensorId,
}

/// Builds the block. `buffer` places a weight or state tensor of the given name and
/// shape in a backend buffer.
pub fn build_block(
    g: &mut Graph,
    c: &BlockConfig,
    mut buffer: impl FnMut(&str, &[usize]) -> Result<BufferRef>,
) -> Result<Block> {
    let (d, hd, t) = (c.d_model, c.head_dim(), c.n_tokens);
    let kv = hd * c.n_kv_head;
    let mut weight = |g: &mut Graph, name: &str, shape: &[usize]| -> Result<TensorId> {
        let r = buffer(name, shape)?;
        g.weight(name, DType::F32, shape, r)
    };
    let attn_norm = weight(g, "attn_norm", &[d])?;
    let wq = weight(g, "wq", &[d, d])?;
    let wk = weight(g, "wk", &[d, kv])?;
    let wv = weight(g, "wv", &[d, kv])?;
    let wo = weight(g, "wo", &[d, d])?;
    let ffn_norm = weight(g, "ffn_norm", &[d])?;
    let w_gate = weight(g, "w_gate", &[d, c.d_ff])?;
    let w_up = weight(g, "w_up", &[d, c.d_ff])?;
    let w_down = weight(g, "w_down", &[c.d_ff, d])?;
    let k_cache_ref = buffer("k_cache", &[kv, c.n_ctx])?;
    let k_cache = g.state("k_cache", DType::F32, &[kv, c.n_ctx], k_cache_ref)?;
    let v_cache_ref = buffer("v_cache", &[kv, c.n_ctx])?;
    let v_cache = g.state("v_cache", DType::F32, &[kv, c.n_ctx], v_cache_ref)?;

    let x = g.input("x", DType::F32, &[d, t])?;
    let pos = g.input("pos", DType::I32, &[t])?;
    let mask = g.input("mask", DType::F32, &[t, t])?;
    let rope = RopeParams::new(RopeMode::Neox, hd, 10000.0);

    // Attention.
    let h = g.rms_norm(x, 1e-5)?; // [d, t]
    let h = g.mul(h, attn_norm)?; // [d, t] * [d]
    let h = g.set_name(h, "attn_in")?;
    let q = g.mul_mat(wq, h)?; // [d, t]
    let q = g.reshape(q, &[hd, c.n_head, t])?; // [hd, H, t]
    let q = g.rope(q, pos, rope)?;
    let k = g.mul_mat(wk, h)?; // [kv, t]
    let k = g.reshape(k, &[hd, c.n_kv_head, t])?; // [hd, Hkv, t]
    let k = g.rope(k, pos, rope)?;
    let v = g.mul_mat(wv, h)?; // [kv, t]
    let v = g.reshape(v, &[hd, c.n_kv_head, t])?; // [hd, Hkv, t]
                                                  // Write K and V into rows 0..t of the caches.
    let k_rows = g.view_2d(k_cache, kv, t, kv * 4, 0)?; // [kv, t] of [kv, n_ctx]
    let k_write = g.cpy(k, k_rows)?;
    let v_rows = g.view_2d(v_cache, kv, t, kv * 4, 0)?;
    let v_write = g.cpy(v, v_rows)?;
    let q = g.permute(q, [0, 2, 1, 3])?; // [hd, t, H]
    let k = g.permute(k, [0, 2, 1, 3])?; // [hd, t, Hkv]
    let kq = g.mul_mat(k, q)?; // [t_k, t_q, H], K shared by H / Hkv query heads
    let scale = 1.0 / (hd as f32).sqrt();
    let kq = g.soft_max_ext(kq, Some(mask), scale)?; // [t_k, t_q, H]
    let vt = g.permute(v, [1, 2, 0, 3])?; // [t, hd, Hkv]
    let vt = g.cont(vt)?;
    let kqv = g.mul_mat(vt, kq)?; // [hd, t_q, H]
    let merged = g.permute(kqv, [0, 2, 1, 3])?; // [hd, H, t]
    let merged = g.cont(merged)?;
    let merged = g.reshape(merged, &[d, t])?; // [d, t]
    let attn = g.mul_mat(wo, merged)?; // [d, t]
    let x1 = g.add(x, attn)?; // residual
    let x1 = g.set_name(x1, "resid_attn")?;

    // MLP (SwiGLU).
    let h = g.rms_norm(x1, 1e-5)?; // [d, t]
    let h = g.mul(h, ffn_norm)?;
    let gate = g.mul_mat(w_gate, h)?; // [d_ff, t]
    let gate = g.silu(gate)?;
    let up = g.mul_mat(w_up, h)?; // [d_ff, t]
    let gu = g.mul(gate, up)?; // [d_ff, t]
    let down = g.mul_mat(w_down, gu)?; // [d, t]
    let out = g.add(x1, down)?; // residual
    let out = g.set_name(out, "block_out")?;
    Ok(Block {
        x,
        pos,
        mask,
        cache_writes: [k_write, v_write],
        out,
    })
}

fn main() -> Result<()> {
    let c = BlockConfig::small();
    let mut be = CpuBackend::new();
    let mut g = Graph::new();
    let mut seed = 0;
    let block = build_block(&mut g, &c, |_, shape| {
        let n: usize = shape.iter().product();
        let buffer = be.alloc_buffer(n * 4)?;
        seed += 1;
        be.fill_random(buffer, 0, DType::F32, n, seed, 0.2)?;
        Ok(BufferRef { buffer, offset: 0 })
    })?;
    let [kw, vw] = block.cache_writes;
    let plan = g.plan(&[kw, vw, block.out])?;

    let e = be.load(&plan)?;
    let t = c.n_tokens;
    let x: Vec<f32> = (0..c.d_model * t)
        .map(|i| random_uniform(99, i as u64, 1.0))
        .collect();
    let pos: Vec<i32> = (0..t as i32).collect();
    // mask[k, q] = 0 where key k <= query q, -inf after it.
    let mask: Vec<f32> = (0..t * t)
        .map(|i| {
            if i % t <= i / t {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    be.set_input_f32(e, block.x, &x)?;
    be.set_input_i32(e, block.pos, &pos)?;
    be.set_input_f32(e, block.mask, &mask)?;
    be.compute(e)?;
    let out = be.get_output_f32(e, block.out, c.d_model * t)?;

    print!("{}", graft::graph::dump::text(&g, &plan));
    println!("out[0..8] = {:?}", &out[..8]);
    let path = "block.dot";
    let dot = graft::graph::dump::dot(&g, &plan);
    graft::files::write_output(path.as_ref(), |w| w.write_all(dot.as_bytes()))?;
    println!("wrote {path}; render it with: dot -Tsvg {path} -o block.svg");
    Ok(())
}
