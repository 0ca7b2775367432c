//! The paged attention cases of `graft bench-ops`, each next to `flash_attn_ext` over the
//! same lengths in a contiguous cache: decode of 1, 8, 32 and 64 sequences of 512 and 4,096
//! positions (32 query heads of 128 over 32 KV heads, Llama-2-7B, and over 8, Llama-3-8B;
//! F16 K/V), and a prefill chunk of 512 tokens over 3,000 cached positions (Llama-2-7B).
//! The pool holds each sequence's blocks of 16 positions in a shuffled order. Bandwidth is
//! that of the K/V rows read; a node larger than the L2 many times over shares its buffers
//! with the other nodes of the case (so that a case of 64 sequences of 4,096 positions, 4.3
//! GB a node, fits the GPU), smaller ones get buffers of their own.

use std::cell::RefCell;

use rand::seq::SliceRandom;
use rand::SeedableRng;

use super::{reps_for, Case};
use crate::backend::Backend;
use crate::error::Result;
use crate::graph::{BufferId, BufferRef, DType, FlashAttnParams, Graph, PagedAttnParams, TensorId};

/// Head dim and query heads of the cases.
const HD: usize = 128;
const HEADS: usize = 32;
/// Positions per block of the pool.
const BS: usize = 16;
/// Bytes of one node from which the nodes of a case share their buffers.
const SHARED_FROM: f64 = 256e6;

/// Nodes per case and distinct buffer sets among them for nodes of `bytes` each.
fn reps_and_sets(bytes: f64) -> (usize, usize) {
    if bytes > SHARED_FROM {
        (8, 1)
    } else {
        let reps = reps_for(bytes);
        (reps, reps)
    }
}

/// Set `r % sets` of a case's buffers, made by `make` on first use.
fn buffers<const N: usize>(
    made: &RefCell<Vec<[BufferId; N]>>,
    r: usize,
    sets: usize,
    make: impl FnOnce() -> Result<[BufferId; N]>,
) -> Result<[BufferId; N]> {
    let i = r % sets;
    if made.borrow().len() <= i {
        let set = make()?;
        made.borrow_mut().push(set);
    }
    Ok(made.borrow()[i])
}

/// A buffer holding `bytes`.
fn filled(be: &mut dyn Backend, bytes: &[u8]) -> Result<BufferId> {
    let buf = be.alloc_buffer(bytes.len())?;
    be.write_buffer(buf, 0, bytes)?;
    Ok(buf)
}

/// A buffer of `n` seeded random F16 values.
fn random_f16(be: &mut dyn Backend, n: usize, seed: u64) -> Result<BufferId> {
    let buf = be.alloc_buffer(n * 2)?;
    be.fill_random(buf, 0, DType::F16, n, seed, 0.5)?;
    Ok(buf)
}

fn at(buffer: BufferId) -> BufferRef {
    BufferRef { buffer, offset: 0 }
}

fn i32_bytes(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The block table of `batch` sequences of `blocks` blocks each: sequence s owns blocks
/// s * blocks .. (s + 1) * blocks in a shuffled order (`[blocks, batch]`).
fn table(batch: usize, blocks: usize) -> Vec<i32> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    (0..batch)
        .flat_map(|s| {
            let mut ids: Vec<i32> = (0..blocks).map(|b| (s * blocks + b) as i32).collect();
            ids.shuffle(&mut rng);
            ids
        })
        .collect()
}

/// A paged K or V pool of `slots` positions of `heads_kv` heads, viewed as
/// `[HD, slots, heads_kv]`.
fn pool(
    g: &mut Graph,
    name: &str,
    buf: BufferId,
    slots: usize,
    heads_kv: usize,
) -> Result<TensorId> {
    let rows = g.state(name, DType::F16, &[HD * heads_kv, slots], at(buf))?;
    g.view_3d(rows, HD, slots, heads_kv, HD * heads_kv * 2, HD * 2, 0)
}

/// `paged_attn` over a pool holding `batch` sequences of `n_kv` positions whose tokens
/// `seqs` (`[2, n_tokens]`) see `visible` keys in all; `flops` counts them.
fn paged_case<'a>(
    name: String,
    batch: usize,
    n_kv: usize,
    heads_kv: usize,
    seqs: Vec<i32>,
) -> Case<'a> {
    let n_tokens = seqs.len() / 2;
    let visible: usize = seqs.chunks(2).map(|t| t[1] as usize + 1).sum();
    let blocks = n_kv.div_ceil(BS);
    let kv_bytes = (2 * visible.min(batch * n_kv) * HD * heads_kv * 2) as f64;
    let bytes = kv_bytes + (2 * n_tokens * HD * HEADS * 4) as f64;
    let (reps, sets) = reps_and_sets(bytes);
    let made = RefCell::new(Vec::new());
    let p = PagedAttnParams {
        scale: 1.0 / (HD as f32).sqrt(),
        softcap: 0.0,
        block_size: BS,
        window: 0,
    };
    Case {
        name,
        reps,
        bytes,
        flops: 4.0 * (visible * HD * HEADS) as f64,
        build: Box::new(move |be, g, r| {
            let slots = batch * blocks * BS;
            let [kb, vb, tb, sb] = buffers(&made, r, sets, || {
                let n = HD * heads_kv * slots;
                Ok([
                    random_f16(be, n, 2 * r as u64)?,
                    random_f16(be, n, 2 * r as u64 + 1)?,
                    filled(be, &i32_bytes(&table(batch, blocks)))?,
                    filled(be, &i32_bytes(&seqs))?,
                ])
            })?;
            let k = pool(g, &format!("k{r}"), kb, slots, heads_kv)?;
            let v = pool(g, &format!("v{r}"), vb, slots, heads_kv)?;
            let t = g.weight(&format!("table{r}"), DType::I32, &[blocks, batch], at(tb))?;
            let s = g.weight(&format!("seqs{r}"), DType::I32, &[2, n_tokens], at(sb))?;
            let q = g.input(&format!("q{r}"), DType::F32, &[HD, HEADS, n_tokens])?;
            g.paged_attn(q, (k, v), t, s, p)
        }),
    }
}

/// `flash_attn_ext` of `n_q` queries of each of `batch` sequences over a contiguous F16
/// cache of `n_kv` positions (`[HD * heads_kv, n_kv]` a sequence, as a model keeps it), with
/// a causal mask when `n_q > 1` (query i sees keys up to n_kv - n_q + i).
fn contiguous_case<'a>(
    name: String,
    batch: usize,
    n_kv: usize,
    heads_kv: usize,
    n_q: usize,
) -> Case<'a> {
    let visible = batch * (n_q * (n_kv - n_q) + n_q * (n_q + 1) / 2);
    let kv_bytes = (2 * batch * n_kv * HD * heads_kv * 2) as f64;
    let bytes = kv_bytes + (2 * batch * n_q * HD * HEADS * 4) as f64;
    let (reps, sets) = reps_and_sets(bytes);
    let made = RefCell::new(Vec::new());
    let p = FlashAttnParams {
        scale: 1.0 / (HD as f32).sqrt(),
        max_bias: 0.0,
        softcap: 0.0,
    };
    Case {
        name,
        reps,
        bytes,
        flops: 4.0 * (visible * HD * HEADS) as f64,
        build: Box::new(move |be, g, r| {
            let n = HD * heads_kv * n_kv * batch;
            let [kb, vb, mb] = buffers(&made, r, sets, || {
                let mask: Vec<u8> = (0..n_q * n_kv)
                    .flat_map(|e| {
                        let (i, j) = (e / n_kv, e % n_kv);
                        let x = if j > n_kv - n_q + i {
                            f32::NEG_INFINITY
                        } else {
                            0.0
                        };
                        half::f16::from_f32(x).to_le_bytes()
                    })
                    .collect();
                Ok([
                    random_f16(be, n, 2 * r as u64)?,
                    random_f16(be, n, 2 * r as u64 + 1)?,
                    filled(be, &mask)?,
                ])
            })?;
            let cache = |g: &mut Graph, name: &str, buf| {
                let rows = g.state(name, DType::F16, &[HD * heads_kv, n_kv, batch], at(buf))?;
                let row = HD * heads_kv * 2;
                g.view_4d(
                    rows,
                    [HD, n_kv, heads_kv, batch],
                    row,
                    HD * 2,
                    row * n_kv,
                    0,
                )
            };
            let k = cache(g, &format!("k{r}"), kb)?;
            let v = cache(g, &format!("v{r}"), vb)?;
            let q = g.input(&format!("q{r}"), DType::F32, &[HD, n_q, HEADS, batch])?;
            let mask = if n_q > 1 {
                Some(g.weight(&format!("mask{r}"), DType::F16, &[n_kv, n_q], at(mb))?)
            } else {
                None
            };
            g.flash_attn_ext(q, k, v, mask, p)
        }),
    }
}

/// Every paged case, each after its contiguous counterpart.
pub(super) fn paged_attn_cases<'a>() -> Vec<Case<'a>> {
    let mut cases = Vec::new();
    for heads_kv in [32, 8] {
        for n_kv in [512, 4096] {
            for batch in [1, 8, 32, 64] {
                let what = format!(
                    "{batch} x {n_kv} positions, f16 K/V [{HD}, {heads_kv}], {HEADS} heads"
                );
                cases.push(contiguous_case(
                    format!("flash_attn_ext {what} (decode)"),
                    batch,
                    n_kv,
                    heads_kv,
                    1,
                ));
                let seqs = (0..batch)
                    .flat_map(|s| [s as i32, n_kv as i32 - 1])
                    .collect();
                cases.push(paged_case(
                    format!("paged_attn {what}, blocks of {BS} (decode)"),
                    batch,
                    n_kv,
                    heads_kv,
                    seqs,
                ));
            }
        }
    }
    const CHUNK: usize = 512;
    const CACHED: usize = 3000;
    let what =
        format!("{CHUNK} tokens over {CACHED} cached, f16 K/V [{HD}, {HEADS}], {HEADS} heads");
    cases.push(contiguous_case(
        format!("flash_attn_ext {what}, causal (prefill)"),
        1,
        CACHED + CHUNK,
        HEADS,
        CHUNK,
    ));
    let seqs = (CACHED..CACHED + CHUNK)
        .flat_map(|pos| [0, pos as i32])
        .collect();
    cases.push(paged_case(
        format!("paged_attn {what}, blocks of {BS} (prefill chunk)"),
        1,
        CACHED + CHUNK,
        HEADS,
        seqs,
    ));
    cases
}
