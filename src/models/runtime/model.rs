//! One forward pass of one sequence on a backend, outside the engine: a [`Model`] holds
//! the weights, a KV cache and the prefill graphs of [`blocks`](crate::models::blocks),
//! and gives every position's logits of a token sequence ([`Model::forward`], `graft
//! logits`) or every named intermediate of it ([`Model::trace`], `graft trace`), with
//! either attention (the fused op or the chain of ops). Generation runs on the batched
//! engine ([`crate::engine`]), which loads the weights with [`load_weights`] and
//! [`random_weights`].

use std::path::Path;

use crate::backend::{Backend, BackendExt, ExecId};
use crate::error::{Error, Result};
use crate::gguf::GgufFile;
use crate::graph::TensorId;

use crate::models::arch::config::Config;
use crate::models::arch::tp::Split;
use crate::models::blocks::kv_cache::KvCache;
use crate::models::blocks::{
    attention_mask, build_prefill, build_trace, prefill_room, ring_mask, ModelGraph,
};
use crate::models::load::gguf;
use crate::models::load::options::LoadOptions;
use crate::models::load::quant_plan::QuantPlan;
use crate::models::load::safetensors;
use crate::models::load::weights::Weights;
use crate::models::runtime::memory;
use crate::models::runtime::output::Output;

/// The context length used when none is given: the model's own, at most 4096.
pub fn default_ctx(cfg: &Config) -> usize {
    cfg.max_position_embeddings.min(4096)
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
        })
    }
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

/// The hyper-parameters of the model at `path` (a GGUF file's metadata or a folder's
/// `config.json`), and the GGUF file when it is one.
fn open_config(path: &Path) -> Result<(Config, Option<GgufFile>)> {
    let is_gguf = gguf::is_gguf_path(path);
    if !is_gguf && !path.is_dir() {
        return Err(Error::model(format!(
            "model {} does not exist or is neither a folder nor a GGUF file",
            path.display()
        )));
    }
    if is_gguf {
        let f = gguf::open_model_file(path)?;
        Ok((gguf::config_from_gguf(&f)?, Some(f)))
    } else {
        Ok((Config::from_file(&path.join("config.json"))?, None))
    }
}

/// The hyper-parameters of the model at `path` (a Hugging Face folder or a GGUF file),
/// read without its weights.
pub fn read_config(path: &Path) -> Result<Config> {
    open_config(path).map(|(c, _)| c)
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
    let (config, file) = open_config(path)?;
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

/// A model of any supported architecture on a backend, for one forward pass at a time:
/// weights and a KV cache (see the module documentation).
///
/// Every method takes the backend the model was loaded on; passing another one is an
/// error (its buffers are unknown there).
pub struct Model {
    /// The whole model's hyper-parameters.
    config: Config,
    /// One device's share ([`Split::shard`]); the whole model on one device.
    shard: Config,
    weights: Weights,
    cache: KvCache,
}

impl Model {
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
        Ok(Model {
            config: w.config,
            shard: w.shard,
            weights: w.weights,
            cache,
        })
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

    /// Releases the buffers of this model on `be`.
    pub fn release(self, be: &mut dyn Backend) -> Result<()> {
        be.free_buffer(self.weights.buffer)?;
        be.free_buffer(self.cache.buffer)
    }

    /// Checks `tokens` on the host before they reach the device: at least one, ids
    /// inside the vocabulary, no more than the context.
    fn check_tokens(&self, what: &'static str, tokens: &[u32]) -> Result<()> {
        if tokens.is_empty() {
            return Err(Error::model(format!(
                "{what} needs at least one token (empty prompt)"
            )));
        }
        let vocab = self.config.vocab_size;
        if let Some(i) = tokens.iter().position(|&t| t as usize >= vocab) {
            return Err(Error::IndexOutOfRange {
                op: what,
                node: "token ids".into(),
                index: tokens[i] as i64,
                position: i,
                limit: vocab,
            });
        }
        if tokens.len() > self.cache.ctx {
            return Err(Error::model(format!(
                "{} tokens exceed the context of {} tokens (--ctx)",
                tokens.len(),
                self.cache.ctx
            )));
        }
        Ok(())
    }

    /// Every position's logits of `tokens` from position 0 (`vocab` values per
    /// position), and the device's argmax of the last position's. One prefill graph,
    /// or with a sliding-window ring cache one per chunk the ring takes.
    pub fn forward(&mut self, be: &mut dyn Backend, tokens: &[u32]) -> Result<Output> {
        self.check_tokens("forward", tokens)?;
        let chunk = match self.cache.is_ring() {
            true => prefill_room(&self.config, &self.cache, 0),
            false => tokens.len(),
        };
        let mut logits = Vec::with_capacity(tokens.len() * self.config.vocab_size);
        let mut argmax = 0;
        for (i, part) in tokens.chunks(chunk).enumerate() {
            let start = i * chunk;
            // a ring's graphs do not depend on the position they start at
            let key_past = if self.cache.is_ring() { 0 } else { start };
            let mg = build_prefill(
                &self.shard,
                &self.weights,
                &self.cache,
                part.len(),
                key_past,
                true,
            )?;
            let c = Compiled::load(be, &mg)?;
            let run = self.run_chunk(be, &c, part, start);
            be.unload(c.exec)?;
            let (part_logits, part_argmax) = run?;
            logits.extend(part_logits);
            argmax = part_argmax;
        }
        Ok(Output { argmax, logits })
    }

    /// Runs the loaded prefill graph `c` over `tokens` at positions `start..` and reads
    /// back its logits and the argmax of the last; non-finite logits are an
    /// [`Error::NonFinite`] naming the first such position.
    fn run_chunk(
        &self,
        be: &mut dyn Backend,
        c: &Compiled,
        tokens: &[u32],
        start: usize,
    ) -> Result<(Vec<f32>, u32)> {
        self.set_inputs(be, c, tokens, start)?;
        be.compute(c.exec)?;
        let argmax = be.get_output_i32(c.exec, c.argmax, 1)?[0];
        let vocab = self.config.vocab_size;
        let logits = be.get_output_f32(c.exec, c.logits, vocab * tokens.len())?;
        if let Some(row) = logits
            .chunks(vocab.max(1))
            .position(|r| r.iter().any(|x| !x.is_finite()))
        {
            return Err(Error::NonFinite {
                position: start + row,
                step: "prefill",
            });
        }
        let last = start + tokens.len() - 1;
        let argmax = u32::try_from(argmax).map_err(|_| Error::NonFinite {
            position: last,
            step: "prefill",
        })?;
        Ok((logits, argmax))
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
        let (window, slots) = (self.config.sliding_window, self.cache.slots);
        if let Some(idx) = c.kv_idx {
            let ids: Vec<i32> = (start..end).map(|p| (p % slots) as i32).collect();
            be.set_input_i32(c.exec, idx, &ids)?;
        }
        if let Some(m) = c.kq_mask {
            let mask = match self.cache.is_ring() {
                true => ring_mask(start..end, slots, window),
                false => attention_mask(start..end, c.n_kv, window),
            };
            be.set_input_f32(c.exec, m, &mask)?;
        }
        Ok(())
    }

    /// Runs `tokens` from position 0 through the trace graph ([`build_trace`]) and reads
    /// back every named intermediate, in execution order (`graft trace`).
    pub fn trace(&mut self, be: &mut dyn Backend, tokens: &[u32]) -> Result<Vec<TraceTensor>> {
        self.check_tokens("trace", tokens)?;
        let mg = build_trace(&self.shard, &self.weights, &self.cache, tokens.len())?;
        let c = Compiled::load(be, &mg)?;
        let run = self.run_trace(be, &c, &mg, tokens);
        be.unload(c.exec)?;
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
}
