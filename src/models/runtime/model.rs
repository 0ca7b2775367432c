//! The inference API every architecture shares: a [`Model`] on a backend (weights, KV
//! cache, the loaded plans of [`blocks`](crate::models::blocks)' graphs), prefill and decode
//! steps, the generation loop with its stop rules and context shift, and traces of every
//! named intermediate (`graft trace`).

use std::path::Path;
use std::time::Instant;

use crate::backend::{Backend, BackendExt, ExecId, PendingRead};
use crate::error::{Error, Result};
use crate::graph::TensorId;

use crate::models::arch::config::Config;
use crate::models::arch::tp::Split;
use crate::models::blocks::kv_cache::KvCache;
use crate::models::blocks::{
    attention_mask, build_decode, build_prefill, build_trace, decode_n_kv, prefill_room, ring_mask,
    ModelGraph,
};
use crate::models::load::gguf;
use crate::models::load::options::{CacheTypes, LoadOptions};
use crate::models::load::quant_plan::QuantPlan;
use crate::models::load::safetensors;
use crate::models::load::weights::Weights;
use crate::models::runtime::memory;
use crate::models::runtime::output::{Logits, Output, TopLogits};
use crate::models::runtime::sampling::SamplerChain;

/// Prefill plans kept loaded; the least recently used one is unloaded first.
const MAX_PREFILL_PLANS: usize = 4;

/// Decode plans (one per KV-length bucket) kept loaded; the least recently used one is
/// unloaded first, so a long run holds a bounded number of captured graphs.
pub const MAX_DECODE_PLANS: usize = 8;

/// The context length used when none is given: the model's own, at most 4096.
pub fn default_ctx(cfg: &Config) -> usize {
    cfg.max_position_embeddings.min(4096)
}

/// The token of a finished read of the argmax of the decode step at `position`: an
/// [`Error::NonFinite`] when the device found its logits not finite.
fn token_of(be: &mut dyn Backend, read: PendingRead, position: usize) -> Result<u32> {
    let argmax = argmax_of(&be.finish_read(read)?)?;
    argmax_token(argmax, position, "decode")
}

/// The I32 of a finished read of the device argmax.
fn argmax_of(bytes: &[u8]) -> Result<i32> {
    words(bytes)
        .first()
        .map(|&w| w as i32)
        .ok_or_else(|| Error::plan("the argmax read back short"))
}

/// The token of a device argmax of the logits at `position`: the device gives -1 for
/// logits that are not finite, an [`Error::NonFinite`] here.
fn argmax_token(argmax: i32, position: usize, step: &'static str) -> Result<u32> {
    u32::try_from(argmax).map_err(|_| Error::NonFinite { position, step })
}

/// Little-endian 32-bit words of `bytes` (a read of I32 or F32 values).
fn words(bytes: &[u8]) -> Vec<u32> {
    bytes
        .chunks_exact(4)
        .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]))
        .collect()
}

/// The candidates [`Logits::Top`] asks for (0 for the other modes).
fn top_k(want: Logits) -> usize {
    match want {
        Logits::Top(k) => k,
        Logits::None | Logits::Last | Logits::All => 0,
    }
}

/// `mg` with the `k` sampling candidates of its last position as outputs (none for 0).
fn with_candidates(mut mg: ModelGraph, k: usize) -> Result<ModelGraph> {
    if k > 0 {
        mg.add_candidates(k)?;
    }
    Ok(mg)
}

/// A model graph loaded into a backend.
#[derive(Clone, Copy, Debug)]
struct Compiled {
    exec: ExecId,
    tokens: TensorId,
    pos: TensorId,
    kq_mask: Option<TensorId>,
    kv_idx: Option<TensorId>,
    /// Cache positions the graph attends over.
    n_kv: usize,
    logits: TensorId,
    argmax: TensorId,
    /// The sampling candidates: ids and values of the `k` largest logits.
    top: Option<(TensorId, TensorId)>,
    n_out: usize,
}

impl Compiled {
    fn load(be: &mut dyn Backend, mg: &ModelGraph) -> Result<Compiled> {
        let exec = be.load(&mg.plan()?)?;
        Ok(Compiled {
            exec,
            tokens: mg.tokens,
            pos: mg.pos,
            kq_mask: mg.kq_mask,
            kv_idx: mg.kv_idx,
            n_kv: mg.n_kv,
            logits: mg.logits,
            argmax: mg.argmax,
            top: mg.top,
            n_out: mg.n_out,
        })
    }
}

/// Loaded plans by key, least recently used first, at most `cap` of them: the least
/// recently used one is unloaded to make room, so a long run holds a bounded number of
/// plans (and of captured CUDA graphs).
struct PlanCache<K> {
    cap: usize,
    plans: Vec<(K, Compiled)>,
}

impl<K: PartialEq> PlanCache<K> {
    fn new(cap: usize) -> Self {
        PlanCache {
            cap,
            plans: Vec::new(),
        }
    }

    /// The plan of `key`, and whether it was built now (with `build`) and loaded.
    fn get_or_load(
        &mut self,
        key: K,
        be: &mut dyn Backend,
        build: impl FnOnce() -> Result<ModelGraph>,
    ) -> Result<(Compiled, bool)> {
        if let Some(i) = self.plans.iter().position(|(k, _)| *k == key) {
            let entry = self.plans.remove(i);
            let c = entry.1;
            self.plans.push(entry);
            return Ok((c, false));
        }
        if self.plans.len() == self.cap {
            let (_, old) = self.plans.remove(0);
            be.unload(old.exec)?;
        }
        let c = Compiled::load(be, &build()?)?;
        self.plans.push((key, c));
        Ok((c, true))
    }

    /// Unloads every plan.
    fn release(&mut self, be: &mut dyn Backend) -> Result<()> {
        for (_, c) in self.plans.drain(..) {
            be.unload(c.exec)?;
        }
        Ok(())
    }
}

/// How many plans a model has built (each built plan is loaded once and replayed).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlanCounts {
    /// Prefill plans (one per `(n, n_past, all logits)` seen).
    pub prefill: usize,
    /// Decode plans (one per KV-length bucket reached).
    pub decode: usize,
}

/// One intermediate tensor of a trace ([`Model::trace`]).
#[derive(Clone, Debug, PartialEq)]
pub struct TraceTensor {
    /// Its name (`blk.0.q`, see [`TRACE_NAMES`](crate::models::blocks::TRACE_NAMES)).
    pub name: String,
    /// Its shape, outermost first (tokens first).
    pub shape: Vec<usize>,
    /// Its values, row-major.
    pub data: Vec<f32>,
}

/// Why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stop {
    /// An end-of-sequence token was sampled (not included in the output).
    Eos,
    /// The requested number of tokens was generated.
    Length,
}

/// The result of [`Model::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated tokens (without the prompt and without a final EOS).
    pub tokens: Vec<u32>,
    /// Why generation stopped.
    pub stop: Stop,
    /// Prompt tokens processed by the prefill.
    pub prompt_tokens: usize,
    /// Seconds spent in the prefill (including reading back its result).
    pub prompt_secs: f64,
    /// Decode steps run.
    pub decode_steps: usize,
    /// Seconds spent in decode steps.
    pub decode_secs: f64,
}

impl Generation {
    /// Prompt-processing speed.
    pub fn prompt_tokens_per_s(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_secs
    }

    /// Generation speed (decode steps per second), if any step ran.
    pub fn gen_tokens_per_s(&self) -> Option<f64> {
        (self.decode_steps > 0).then(|| self.decode_steps as f64 / self.decode_secs)
    }
}

/// A model's weights on a backend, frozen: the whole model's hyper-parameters, one
/// device's share of them and the weights laid out by that share.
pub struct LoadedWeights {
    /// The whole model's hyper-parameters.
    pub config: Config,
    /// One device's share ([`Split::shard`]); the whole model on one device.
    pub shard: Config,
    /// The weights.
    pub weights: Weights,
}

/// Loads the weights of a Hugging Face folder or a GGUF file onto `be`; `check` sees
/// the whole config and one device's share before any weight is read (a context that
/// cannot fit fails before a long load).
pub fn load_weights(
    path: &Path,
    be: &mut dyn Backend,
    opts: &LoadOptions,
    check: impl FnOnce(&Config, &Config) -> Result<()>,
) -> Result<LoadedWeights> {
    let is_gguf = gguf::is_gguf_path(path);
    if !is_gguf && !path.is_dir() {
        return Err(Error::model(format!(
            "model {} does not exist or is neither a folder nor a GGUF file",
            path.display()
        )));
    }
    let (config, file) = if is_gguf {
        let f = gguf::open_model_file(path)?;
        (gguf::config_from_gguf(&f)?, Some(f))
    } else {
        (Config::from_file(&path.join("config.json"))?, None)
    };
    let shard = Split::new(&config, be.devices())?.shard();
    check(&config, &shard)?;
    let weights = match &file {
        Some(f) => gguf::load_gguf_weights(f, &config, be, opts)?,
        None => safetensors::load_weights(path, &config, be, opts)?,
    };
    weights.freeze(&shard, be)?;
    Ok(LoadedWeights {
        config,
        shard,
        weights,
    })
}

/// Seeded random weights made on the device in the dtypes of `plan` (benchmarks; block
/// types are quantized on the device from F32 values), frozen.
pub fn random_weights(
    config: Config,
    plan: QuantPlan,
    seed: u64,
    be: &mut dyn Backend,
) -> Result<LoadedWeights> {
    let shard = Split::new(&config, be.devices())?.shard();
    let pick = |role, layer| plan.pick(role, layer, &shard).dtype;
    let weights = Weights::alloc(&shard, &pick, be)?;
    weights.fill_random(&shard, be, seed)?;
    weights.freeze(&shard, be)?;
    Ok(LoadedWeights {
        config,
        shard,
        weights,
    })
}

/// A model of any supported architecture on a backend: weights, KV cache and the
/// loaded plans.
///
/// Every method takes the backend the model was created on; passing another one is an
/// error (its buffers are unknown there) or, for plans, undefined.
pub struct Model {
    /// The whole model's hyper-parameters.
    config: Config,
    /// One device's share ([`Split::shard`]); the whole model on one device.
    shard: Config,
    weights: Weights,
    cache: KvCache,
    n_past: usize,
    /// Loaded prefill plans by `(n, n_past, all logits, candidates)`.
    prefill: PlanCache<(usize, usize, bool, usize)>,
    /// Loaded decode plans by KV-length bucket and candidates.
    decode: PlanCache<(usize, usize)>,
    counts: PlanCounts,
    /// Whether [`Model::generate`] goes on past a full context (see
    /// [`Model::set_context_shift`]).
    context_shift: bool,
    /// Whether [`Model::generate`] goes on past end-of-sequence tokens.
    ignore_eos: bool,
}

impl Model {
    /// A model from its parts (weights uploaded, cache allocated on the same backend).
    pub fn new(config: Config, weights: Weights, cache: KvCache) -> Model {
        Model::new_split(config.clone(), config, weights, cache)
    }

    /// A model split over the devices of a group: the whole model's `config`, one
    /// device's share `shard` ([`Split::shard`]), whose layout the weights and cache have.
    pub fn new_split(config: Config, shard: Config, weights: Weights, cache: KvCache) -> Model {
        Model {
            config,
            shard,
            weights,
            cache,
            n_past: 0,
            prefill: PlanCache::new(MAX_PREFILL_PLANS),
            decode: PlanCache::new(MAX_DECODE_PLANS),
            counts: PlanCounts::default(),
            context_shift: false,
            ignore_eos: false,
        }
    }

    /// With `on`, [`Model::generate`] treats end-of-sequence tokens as any other and runs
    /// to its length (benchmarks and long runs).
    pub fn set_ignore_eos(&mut self, on: bool) {
        self.ignore_eos = on;
    }

    /// With `on`, [`Model::generate`] may run past the context: when the cache is full it
    /// keeps the last half of the context's tokens (prompt and generated), prefills them
    /// again from an empty cache and goes on, so a generation of any length runs in the
    /// memory of one context (llama.cpp's context shift, by recomputation). Off (the
    /// default), prompt plus generation must fit the context.
    pub fn set_context_shift(&mut self, on: bool) {
        self.context_shift = on;
    }

    /// Loads a model onto `be`: a Hugging Face folder (config.json and safetensors
    /// weights) or a GGUF file (see [`gguf`]), with a KV cache of `opts.ctx` positions.
    pub fn load(path: &Path, be: &mut dyn Backend, opts: &LoadOptions) -> Result<Model> {
        let mut ctx = 0;
        let w = load_weights(path, be, opts, |config, shard| {
            ctx = opts.ctx.unwrap_or_else(|| default_ctx(config));
            KvCache::check_ctx(shard, ctx, opts.cache).map(|_| ())
        })?;
        opts.cache.check(&w.shard)?;
        memory::check_backend(&w.shard, &w.weights, ctx, opts.cache, be)?;
        let cache = KvCache::alloc(&w.shard, ctx, opts.cache, be)?;
        Ok(Model::new_split(w.config, w.shard, w.weights, cache))
    }

    /// A model with seeded random weights made on the device (benchmarks), in the
    /// dtypes of `plan` (block types are quantized on the device from F32 values).
    pub fn random(
        config: Config,
        plan: QuantPlan,
        ctx: usize,
        cache: CacheTypes,
        seed: u64,
        be: &mut dyn Backend,
    ) -> Result<Model> {
        cache.check(&config)?;
        let w = random_weights(config, plan, seed, be)?;
        memory::check_backend(&w.shard, &w.weights, ctx, cache, be)?;
        let cache = KvCache::alloc(&w.shard, ctx, cache, be)?;
        Ok(Model::new_split(w.config, w.shard, w.weights, cache))
    }

    /// The whole model's hyper-parameters.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// One device's share of the model (its head counts and MLP width; the whole
    /// model on one device), the config its weights, cache and graphs are laid out by.
    pub fn shard(&self) -> &Config {
        &self.shard
    }

    /// The weight layout.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// The KV cache.
    pub fn cache(&self) -> &KvCache {
        &self.cache
    }

    /// Positions held in the KV cache.
    pub fn n_past(&self) -> usize {
        self.n_past
    }

    /// Plans built so far.
    pub fn plan_counts(&self) -> PlanCounts {
        self.counts
    }

    /// Plans loaded now: (prefill, decode), each bounded ([`MAX_DECODE_PLANS`]).
    pub fn loaded_plans(&self) -> (usize, usize) {
        (self.prefill.plans.len(), self.decode.plans.len())
    }

    /// Forgets the cached positions (the next prefill starts at position 0).
    pub fn reset(&mut self) {
        self.n_past = 0;
    }

    /// Rewinds the cache to its first `n` positions (no effect if it holds fewer).
    pub fn truncate(&mut self, n: usize) {
        self.n_past = self.n_past.min(n);
    }

    /// Releases the plans and buffers of this model on `be`.
    pub fn release(mut self, be: &mut dyn Backend) -> Result<()> {
        self.prefill.release(be)?;
        self.decode.release(be)?;
        be.free_buffer(self.weights.buffer)?;
        be.free_buffer(self.cache.buffer)
    }

    /// Checks token ids on the host before they reach the device.
    fn check_tokens(&self, what: &'static str, tokens: &[u32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        match tokens.iter().position(|&t| t as usize >= vocab) {
            None => Ok(()),
            Some(i) => Err(Error::IndexOutOfRange {
                op: what,
                node: "token ids".into(),
                index: tokens[i] as i64,
                position: i,
                limit: vocab,
            }),
        }
    }

    /// Checks that `n` more positions fit in the cache.
    fn check_room(&self, n: usize) -> Result<()> {
        if self
            .n_past
            .checked_add(n)
            .is_none_or(|t| t > self.cache.ctx)
        {
            return Err(Error::model(format!(
                "context full: {} cached + {n} new tokens exceed the context of {} tokens (--ctx)",
                self.n_past, self.cache.ctx
            )));
        }
        Ok(())
    }

    /// Runs `tokens` through the model at positions `n_past..`, appending them to the
    /// cache. Returns the argmax of the last position and the logits asked for.
    pub fn prefill(
        &mut self,
        be: &mut dyn Backend,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Output> {
        if tokens.is_empty() {
            return Err(Error::model(
                "prefill needs at least one token (empty prompt)",
            ));
        }
        self.check_tokens("prefill", tokens)?;
        self.check_room(tokens.len())?;
        if !self.cache.is_ring() {
            return self.prefill_chunk(be, tokens, logits);
        }
        // a ring cache takes at most one chunk per graph
        let chunk = prefill_room(&self.config, &self.cache, self.n_past);
        let mut all = Vec::new();
        let mut last = None;
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let final_part = (i + 1) * chunk >= tokens.len();
            let want = match (logits, final_part) {
                (Logits::All, _) => Logits::All,
                (Logits::Last | Logits::Top(_), true) => logits,
                (Logits::Last | Logits::Top(_) | Logits::None, _) => Logits::None,
            };
            let out = self.prefill_chunk(be, part, want)?;
            all.extend_from_slice(&out.logits);
            last = Some(out);
        }
        let out = last.ok_or_else(|| Error::model("prefill needs at least one token"))?;
        Ok(Output { logits: all, ..out })
    }

    /// One prefill graph over `tokens` (the whole prompt, or a ring cache's chunk).
    fn prefill_chunk(
        &mut self,
        be: &mut dyn Backend,
        tokens: &[u32],
        logits: Logits,
    ) -> Result<Output> {
        let (n, p) = (tokens.len(), self.n_past);
        let key_past = if self.cache.is_ring() { 0 } else { p };
        let c = self.prefill_plan(be, (n, key_past, logits == Logits::All), top_k(logits))?;
        self.set_inputs(be, &c, tokens, p)?;
        be.compute(c.exec)?;
        self.n_past += n;
        self.read(be, &c, logits, "prefill")
    }

    /// Sets the inputs of a graph run over `tokens` at positions `start..`: ids,
    /// positions, the mask and a ring cache's slots.
    fn set_inputs(
        &self,
        be: &mut dyn Backend,
        c: &Compiled,
        tokens: &[u32],
        start: usize,
    ) -> Result<()> {
        let end = start + tokens.len();
        let ids: Vec<i32> = tokens.iter().map(|&t| t as i32).collect();
        let pos: Vec<i32> = (start..end).map(|i| i as i32).collect();
        be.set_input_i32(c.exec, c.tokens, &ids)?;
        be.set_input_i32(c.exec, c.pos, &pos)?;
        self.set_kv_inputs(be, c, start..end)
    }

    /// Sets the mask (and a ring cache's slots) of a graph run over the positions
    /// `queries`.
    fn set_kv_inputs(
        &self,
        be: &mut dyn Backend,
        c: &Compiled,
        queries: std::ops::Range<usize>,
    ) -> Result<()> {
        let (window, slots) = (self.config.sliding_window, self.cache.slots);
        if let Some(idx) = c.kv_idx {
            let ids: Vec<i32> = queries.clone().map(|p| (p % slots) as i32).collect();
            be.set_input_i32(c.exec, idx, &ids)?;
        }
        if let Some(m) = c.kq_mask {
            let mask = match self.cache.is_ring() {
                true => ring_mask(queries, slots, window),
                false => attention_mask(queries.clone(), c.n_kv, window),
            };
            be.set_input_f32(c.exec, m, &mask)?;
        }
        Ok(())
    }

    /// Runs one token at position `n_past` with the decode plan of its bucket, reading
    /// back the argmax and, with `logits`, the logits.
    pub fn decode_step(
        &mut self,
        be: &mut dyn Backend,
        token: u32,
        logits: bool,
    ) -> Result<Output> {
        let want = if logits { Logits::Last } else { Logits::None };
        self.decode(be, token, want)
    }

    /// Runs one token at position `n_past` with the decode plan of its bucket (and of the
    /// candidates for [`Logits::Top`]), reading back the argmax and what `want` asks for
    /// ([`Logits::All`] is the one position's logits).
    pub fn decode(&mut self, be: &mut dyn Backend, token: u32, want: Logits) -> Result<Output> {
        self.check_tokens("decode", &[token])?;
        self.check_room(1)?;
        let (c, _) = self.enqueue_decode(be, None, token, top_k(want))?;
        self.read(be, &c, want, "decode")
    }

    /// Greedy decoding of up to `steps` tokens from `first` at position `n_past`, each
    /// step's on-device argmax copied on the device into the next step's input: the
    /// host enqueues step i + 1 before it reads step i's token, so the GPU does not
    /// wait on the host between steps. `on_token` gets the tokens in order; when it
    /// answers false the run stops there and the step enqueued after it is undone
    /// (`n_past` as if it never ran; positions past `n_past` are never attended).
    /// Returns the steps whose tokens were handed over. With a ring cache (a sliding
    /// window shorter than the context) the steps run one at a time: undoing one there
    /// could lose a position the ring evicted.
    pub fn decode_greedy(
        &mut self,
        be: &mut dyn Backend,
        first: u32,
        steps: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<usize> {
        self.check_tokens("decode", &[first])?;
        self.check_room(steps)?;
        if self.cache.is_ring() {
            let mut token = first;
            for done in 1..=steps {
                token = self.decode_step(be, token, false)?.argmax;
                if !on_token(token)? {
                    return Ok(done);
                }
            }
            return Ok(steps);
        }
        let run = self.decode_pipelined(be, first, steps, on_token);
        if run.is_err() {
            // Let the steps still enqueued finish, so that nothing they record (a bad
            // index from a token that was never valid) is blamed on a later call.
            let _ = be.synchronize();
        }
        run
    }

    /// [`Model::decode_greedy`] on a linear cache: the host one step behind the device.
    fn decode_pipelined(
        &mut self,
        be: &mut dyn Backend,
        first: u32,
        steps: usize,
        on_token: &mut dyn FnMut(u32) -> Result<bool>,
    ) -> Result<usize> {
        // The step enqueued last, its position and the read of its token.
        let mut pending: Option<(Compiled, usize, PendingRead)> = None;
        let mut done = 0;
        for _ in 0..steps {
            let prev = pending.as_ref().map(|p| p.0);
            let (c, pos) = self.enqueue_decode(be, prev, first, 0)?;
            let read = be.begin_read(c.exec, c.argmax, 4)?;
            if let Some((_, p, read)) = pending.replace((c, pos, read)) {
                done += 1;
                if !on_token(token_of(be, read, p)?)? {
                    // The step just enqueued took a token the run stops at: undo it.
                    if let Some((_, _, read)) = pending.take() {
                        be.finish_read(read)?;
                    }
                    self.n_past -= 1;
                    return Ok(done);
                }
            }
        }
        if let Some((_, p, read)) = pending {
            done += 1;
            // The run ends with this token whatever the answer.
            on_token(token_of(be, read, p)?)?;
        }
        Ok(done)
    }

    /// Enqueues the decode step at position `n_past` (with `k` sampling candidates, 0 for
    /// none) and advances it: the step's token is `first`, or `prev`'s argmax copied on
    /// the device. Returns the plan and position.
    fn enqueue_decode(
        &mut self,
        be: &mut dyn Backend,
        prev: Option<Compiled>,
        first: u32,
        k: usize,
    ) -> Result<(Compiled, usize)> {
        let pos = self.n_past;
        let c = self.decode_plan(be, decode_n_kv(&self.cache, pos), k)?;
        match prev {
            None => be.set_input_i32(c.exec, c.tokens, &[first as i32])?,
            Some(p) => be.forward_output(p.exec, p.argmax, c.exec, c.tokens, 4)?,
        }
        be.set_input_i32(c.exec, c.pos, &[pos as i32])?;
        self.set_kv_inputs(be, &c, pos..pos + 1)?;
        be.compute(c.exec)?;
        self.n_past += 1;
        Ok((c, pos))
    }

    /// The decode plan of the bucket `n_kv` with `k` sampling candidates (0: none),
    /// built and loaded on first use.
    fn decode_plan(&mut self, be: &mut dyn Backend, n_kv: usize, k: usize) -> Result<Compiled> {
        let (cfg, w, kv) = (&self.shard, &self.weights, &self.cache);
        let (c, built) = self.decode.get_or_load((n_kv, k), be, || {
            with_candidates(build_decode(cfg, w, kv, n_kv)?, k)
        })?;
        self.counts.decode += usize::from(built);
        Ok(c)
    }

    /// The prefill plan for `(n, n_past, all)` with `k` sampling candidates (0: none),
    /// built and loaded on first use.
    fn prefill_plan(
        &mut self,
        be: &mut dyn Backend,
        (n, n_past, all): (usize, usize, bool),
        k: usize,
    ) -> Result<Compiled> {
        let (cfg, w, kv) = (&self.shard, &self.weights, &self.cache);
        let (c, built) = self.prefill.get_or_load((n, n_past, all, k), be, || {
            with_candidates(build_prefill(cfg, w, kv, n, n_past, all)?, k)
        })?;
        self.counts.prefill += usize::from(built);
        Ok(c)
    }

    /// Reads back the argmax and what `want` asks for of a run of `step` that ended at
    /// position `n_past - 1`; non-finite logits are an [`Error::NonFinite`] naming the
    /// first such position (the device argmax says so for the last one, which is all
    /// greedy decoding and the candidates read).
    fn read(
        &self,
        be: &mut dyn Backend,
        c: &Compiled,
        want: Logits,
        step: &'static str,
    ) -> Result<Output> {
        let last = self.n_past - 1;
        // the argmax and the candidates copied back together: one wait for the three
        let argmax = be.begin_read(c.exec, c.argmax, 4)?;
        let top = match (want, c.top) {
            (Logits::Top(k), Some((ids, vals))) => Some((
                be.begin_read(c.exec, ids, 4 * k)?,
                be.begin_read(c.exec, vals, 4 * k)?,
            )),
            _ => None,
        };
        let argmax = argmax_of(&be.finish_read(argmax)?)?;
        let top = match top {
            Some((ids, vals)) => Some(TopLogits {
                ids: words(&be.finish_read(ids)?),
                logits: words(&be.finish_read(vals)?)
                    .into_iter()
                    .map(f32::from_bits)
                    .collect(),
            }),
            None => None,
        };
        let logits = if matches!(want, Logits::Last | Logits::All) {
            let v = be.get_output_f32(c.exec, c.logits, self.config.vocab_size * c.n_out)?;
            let mut rows = v.chunks(self.config.vocab_size.max(1));
            if let Some(row) = rows.position(|r| r.iter().any(|x| !x.is_finite())) {
                let position = last + 1 - c.n_out + row;
                return Err(Error::NonFinite { position, step });
            }
            v
        } else {
            Vec::new()
        };
        let argmax = argmax_token(argmax, last, step)?;
        Ok(Output {
            argmax,
            logits,
            top,
        })
    }

    /// Runs `tokens` from an empty cache through the trace graph
    /// ([`build_trace`]) and reads back every named intermediate, in execution order
    /// (`graft trace`). The cache then holds the tokens, as after a prefill.
    pub fn trace(&mut self, be: &mut dyn Backend, tokens: &[u32]) -> Result<Vec<TraceTensor>> {
        if tokens.is_empty() {
            return Err(Error::model(
                "trace needs at least one token (empty prompt)",
            ));
        }
        self.check_tokens("trace", tokens)?;
        self.reset();
        self.check_room(tokens.len())?;
        let n = tokens.len();
        let mg = build_trace(&self.shard, &self.weights, &self.cache, n)?;
        let c = Compiled::load(be, &mg)?;
        let run = self.run_trace(be, &c, &mg, tokens);
        be.unload(c.exec)?;
        self.n_past = n;
        run
    }

    /// Runs the loaded trace graph `c` (of `mg`) over `tokens` from position 0 and reads
    /// back its traced tensors.
    fn run_trace(
        &self,
        be: &mut dyn Backend,
        c: &Compiled,
        mg: &ModelGraph,
        tokens: &[u32],
    ) -> Result<Vec<TraceTensor>> {
        self.set_inputs(be, c, tokens, 0)?;
        be.compute(c.exec)?;
        mg.traced
            .iter()
            .map(|t| {
                let len = t.shape.iter().product();
                Ok(TraceTensor {
                    name: t.name.clone(),
                    shape: t.shape.clone(),
                    data: be.get_output_f32(c.exec, t.id, len)?,
                })
            })
            .collect()
    }

    /// Checks, without running anything, that [`Model::generate`] can take `prompt` and
    /// `n` new tokens: a non-empty prompt of ids inside the vocabulary, and prompt plus
    /// generation within the context.
    pub fn check_generation(&self, prompt: &[u32], n: usize) -> Result<()> {
        if prompt.is_empty() {
            return Err(Error::model("empty prompt: give at least one token"));
        }
        if self.context_shift && prompt.len() < self.cache.ctx {
            return self.check_tokens("prompt", prompt);
        }
        if prompt
            .len()
            .checked_add(n)
            .is_none_or(|t| t > self.cache.ctx)
        {
            return Err(Error::model(format!(
                "prompt ({} tokens) + generation ({n} tokens, -n) exceeds the context of {} tokens (--ctx)",
                prompt.len(),
                self.cache.ctx
            )));
        }
        self.check_tokens("prompt", prompt)
    }

    /// The context shift of [`Model::set_context_shift`]: the last half of the context's
    /// tokens of `prompt` + `tokens` (whose last one is about to be decoded) prefilled
    /// again into an empty cache, all but that last one.
    fn shift(&mut self, be: &mut dyn Backend, prompt: &[u32], tokens: &[u32]) -> Result<()> {
        let keep = (self.cache.ctx / 2).max(1);
        let total = prompt.len() + tokens.len();
        let from = total - keep.min(total);
        let kept: Vec<u32> = prompt.iter().chain(tokens).skip(from).copied().collect();
        self.reset();
        if kept.len() > 1 {
            self.prefill(be, &kept[..kept.len() - 1], Logits::None)?;
        }
        Ok(())
    }

    /// Generates up to `n` tokens after `prompt` (from an empty cache) with `sampler`,
    /// calling `on_token` with each one as soon as it is known; stops early at an EOS
    /// token. Greedy sampling reads back only the on-device argmax (each step's token fed
    /// to the next on the device); other samplers read what [`SamplerChain::wants`]: the
    /// device's top candidates when they suffice, else the last logits.
    pub fn generate(
        &mut self,
        be: &mut dyn Backend,
        prompt: &[u32],
        n: usize,
        sampler: &mut SamplerChain,
        on_token: &mut dyn FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        self.check_generation(prompt, n)?;
        self.reset();
        let greedy = sampler.is_greedy();
        let mode = sampler.wants();
        let t0 = Instant::now();
        let out = self.prefill(be, prompt, mode)?;
        let mut g = Generation {
            tokens: Vec::new(),
            stop: Stop::Length,
            prompt_tokens: prompt.len(),
            prompt_secs: t0.elapsed().as_secs_f64(),
            decode_steps: 0,
            decode_secs: 0.0,
        };
        let eos = match self.ignore_eos {
            true => Vec::new(),
            false => self.config.eos_token_ids.clone(),
        };
        // Takes a generated token; false once generation stops (EOS, or n tokens).
        let mut accept = |g: &mut Generation, t: u32| -> Result<bool> {
            if eos.contains(&t) {
                g.stop = Stop::Eos;
                return Ok(false);
            }
            g.tokens.push(t);
            on_token(t)?;
            Ok(g.tokens.len() < n)
        };
        // the sequence so far, for the penalties
        let mut seq = prompt.to_vec();
        let mut next = sampler.pick(&out, &seq)?;
        let mut go = n > 0 && accept(&mut g, next)?;
        while go {
            let t = Instant::now();
            if self.n_past == self.cache.ctx {
                self.shift(be, prompt, &g.tokens)?;
            }
            if greedy {
                // The tokens still wanted, or up to the end of the context.
                let steps = (n - g.tokens.len()).min(self.cache.ctx - self.n_past);
                let first = next;
                let mut took = |tok: u32| {
                    next = tok;
                    go = accept(&mut g, tok)?;
                    Ok(go)
                };
                let done = self.decode_greedy(be, first, steps, &mut took)?;
                g.decode_steps += done;
                g.decode_secs += t.elapsed().as_secs_f64();
            } else {
                let out = self.decode(be, next, mode)?;
                seq.push(next);
                next = sampler.pick(&out, &seq)?;
                g.decode_secs += t.elapsed().as_secs_f64();
                g.decode_steps += 1;
                go = accept(&mut g, next)?;
            }
        }
        Ok(g)
    }
}
