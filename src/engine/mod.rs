//! The batched engine: many sequences decoded together, every front end's one decode
//! path (`graft generate`, `graft chat`, `graft batched-bench`, `graft serve`).
//!
//! - [`Engine::add`] takes a [`Request`] (prompt ids, sampling settings, stop conditions)
//!   and checks it; a bad request is an error for that request alone.
//! - [`Engine::step`] runs one step: the scheduler ([`scheduler`]) picks the tokens (each
//!   running sequence's next token, chunks of new prompts within a token budget), the
//!   runner ([`runner`]) computes them in one batch graph
//!   ([`build_batch`](crate::models::blocks::batch::build_batch)) over the KV pool, and
//!   every sequence that reached a sampling point gets its next token from its own
//!   sampler chain. The step returns [`Event`]s: tokens with their text, finished
//!   requests, errors of single requests.
//! - [`Engine::cancel`] drops a request at any point (waiting, mid-prompt, decoding) and
//!   frees its blocks.
//!
//! K/V live in a pool of fixed-size blocks ([`pool`]) allocated once from a memory
//! budget; each sequence holds a table of blocks; blocks are shared between sequences
//! with equal prefixes and kept, keyed by their tokens, after their sequence is gone
//! (the prefix cache). [`text`] turns tokens into text and finds stop strings.

pub mod chat;
pub mod pool;
pub mod request;
pub mod runner;
pub mod scheduler;
pub(crate) mod sequence;
pub mod text;

use std::path::Path;
use std::sync::Arc;

pub use pool::PoolStats;
pub use request::{
    EngineStats, Event, FinishReason, Request, RequestId, Stop, TokenLogprobs, Usage,
};
pub use scheduler::SchedulerConfig;
pub use text::Detokenize;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::models::arch::config::Config;
use crate::models::blocks::batch::{build_batch, BatchShape};
use crate::models::blocks::kv_cache::{KvCache, MAX_CTX};
use crate::models::load::options::{CacheTypes, LoadOptions};
use crate::models::load::quant_plan::QuantPlan;
use crate::models::runtime::memory::HEADROOM;
use crate::models::runtime::model::{load_weights, random_weights, LoadedWeights};
use crate::models::runtime::output::Logits;
use crate::models::runtime::sampling::{Row, SamplerChain};

use pool::BlockPool;
use runner::{Runner, StepOutputs};
use scheduler::{Scheduler, StepPlan};
use sequence::Sequence;
use text::{TextState, TextStep};

/// Positions per KV block unless configured otherwise.
pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Contexts the automatic KV budget holds ([`KvBudget::Auto`]).
pub const AUTO_CONTEXTS: usize = 4;

/// The most positions a KV pool of blocks of `block_size` positions can be asked for
/// ([`KvBudget::Tokens`]): with the block that serves padding, every slot of the pool
/// has a 32-bit index ([`MAX_CTX`] at most).
pub fn max_kv_size(block_size: usize) -> usize {
    (MAX_CTX / block_size.max(1)).saturating_sub(1) * block_size
}

/// How large the KV pool is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvBudget {
    /// [`AUTO_CONTEXTS`] full contexts, or what fits in the device's free memory
    /// (after the weights, the plans and [`HEADROOM`]) if that is less.
    Auto,
    /// This many positions (`--kv-size`).
    Tokens(usize),
    /// This many bytes (`--kv-mem`).
    Bytes(usize),
    /// This many whole contexts, no more: the pool of a command that runs one sequence at
    /// a time and has only `--ctx` to size it by.
    Contexts(usize),
}

impl KvBudget {
    /// What a user asks for a smaller pool with.
    fn smaller(self) -> &'static str {
        match self {
            KvBudget::Contexts(_) => "give a smaller --ctx",
            KvBudget::Auto | KvBudget::Tokens(_) | KvBudget::Bytes(_) => {
                "ask for fewer (--kv-size / --kv-mem) or a smaller --ctx"
            }
        }
    }
}

/// The engine's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// The longest sequence (prompt + generation), per sequence (`--ctx`).
    pub ctx: usize,
    /// Positions per KV block.
    pub block_size: usize,
    /// The KV pool's size.
    pub kv: KvBudget,
    /// The KV cache's types.
    pub cache: CacheTypes,
    /// Scheduling: sequence cap, token budget, prefix cache.
    pub scheduler: SchedulerConfig,
}

impl EngineConfig {
    /// Defaults for a context of `ctx` positions: 16-position blocks, the automatic KV
    /// budget, F16 caches, 64 sequences, 512 tokens a step, the prefix cache on.
    pub fn new(ctx: usize) -> EngineConfig {
        EngineConfig {
            ctx,
            block_size: DEFAULT_BLOCK_SIZE,
            kv: KvBudget::Auto,
            cache: CacheTypes::default(),
            scheduler: SchedulerConfig {
                max_seqs: 64,
                step_tokens: 512,
                prefix_cache: true,
                prefill_first: false,
            },
        }
    }

    /// Checks the settings against each other.
    fn check(&self) -> Result<()> {
        let s = &self.scheduler;
        let bad = |what: String| Err(Error::model(what));
        if self.ctx == 0 || self.ctx > MAX_CTX {
            return bad(format!(
                "--ctx {}: the context length must be 1 to {MAX_CTX} (positions are 32-bit)",
                self.ctx
            ));
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return bad(format!(
                "the KV block size must be 1 to 1024, got {}",
                self.block_size
            ));
        }
        if s.max_seqs == 0 || s.step_tokens == 0 {
            return bad("--parallel and --ubatch must be at least 1".into());
        }
        if s.step_tokens < s.max_seqs {
            return bad(format!(
                "--ubatch {} is smaller than --parallel {}: a step must hold one token of every running sequence",
                s.step_tokens, s.max_seqs
            ));
        }
        Ok(())
    }
}

/// A model behind the batched engine, on its backend.
pub struct Engine {
    be: Box<dyn Backend>,
    /// The whole model's hyper-parameters.
    config: Config,
    runner: Runner,
    sched: Scheduler,
    detok: Option<Arc<dyn Detokenize>>,
    ctx: usize,
    next: u64,
    /// A step enqueued ahead (see [`Engine::step`]).
    inflight: Option<InFlight>,
    /// A step staged ahead, waiting for its tokens (see [`Engine::step`]).
    staged: Option<Staged>,
    /// Whether samplers draw from the device's top candidates when they can (else from
    /// whole rows of logits).
    candidates: bool,
}

/// Why a sequence finished, and the stop token that ended it.
type Ending = (FinishReason, Option<u32>);

/// What follows a step before its tokens are read (see [`Engine::step`]).
enum Next {
    /// Nothing: the next step is planned after this one's tokens are read.
    None,
    /// The next decode step, enqueued with its tokens forwarded on the device.
    Forwarded(InFlight),
    /// The next decode step's inputs but its tokens, on the device.
    Staged(Staged),
}

/// A decode step whose inputs but the tokens are on the device: the sequences it
/// computes (a token each), its shape, and whether it reads the logits.
struct Staged {
    slices: Vec<(RequestId, usize)>,
    shape: BatchShape,
    rows: bool,
}

/// A step on the device: the sequences it computes (and how many tokens each), and
/// whether it reads the logits.
struct InFlight {
    slices: Vec<(RequestId, usize)>,
    logits: bool,
    step: runner::Enqueued,
}

impl Engine {
    /// Loads a model (an HF folder or a GGUF file) onto `be` behind an engine.
    pub fn load(
        path: &Path,
        mut be: Box<dyn Backend>,
        opts: &LoadOptions,
        cfg: EngineConfig,
    ) -> Result<Engine> {
        cfg.check()?;
        let w = load_weights(path, be.as_mut(), opts, |_, shard| {
            cfg.cache.check(shard)?;
            check_learned_positions(shard, cfg.ctx)
        })?;
        Engine::new(w, be, cfg)
    }

    /// An engine over seeded random weights made on the device in the dtypes of `plan`
    /// (benchmarks).
    pub fn random(
        config: Config,
        plan: QuantPlan,
        seed: u64,
        mut be: Box<dyn Backend>,
        cfg: EngineConfig,
    ) -> Result<Engine> {
        cfg.check()?;
        cfg.cache.check(&config)?;
        check_learned_positions(&config, cfg.ctx)?;
        let w = random_weights(config, plan, seed, be.as_mut())?;
        Engine::new(w, be, cfg)
    }

    fn new(w: LoadedWeights, mut be: Box<dyn Backend>, cfg: EngineConfig) -> Result<Engine> {
        let slots = pool_slots(&w, be.as_mut(), &cfg)?;
        let pool = KvCache::alloc_pool(&w.shard, slots, cfg.cache, be.as_mut()).map_err(|e| {
            // the device's refusal: say which pool, and how to ask for a smaller one
            if !matches!(e, Error::Backend { .. }) {
                return e;
            }
            let n = slots - cfg.block_size;
            Error::model(format!(
                "a KV pool of {n} positions: {e}: {}",
                cfg.kv.smaller()
            ))
        })?;
        let blocks = slots / cfg.block_size;
        let runner = Runner::new(w.shard, w.weights, pool, cfg.block_size, cfg.ctx);
        Ok(Engine {
            be,
            config: w.config,
            runner,
            sched: Scheduler::new(cfg.scheduler, BlockPool::new(blocks, cfg.block_size)),
            detok: None,
            ctx: cfg.ctx,
            next: 0,
            inflight: None,
            staged: None,
            candidates: true,
        })
    }

    /// Turns generated tokens into text with `detok` (needed for stop strings).
    pub fn set_detokenizer(&mut self, detok: Arc<dyn Detokenize>) {
        self.detok = Some(detok);
    }

    /// The whole model's hyper-parameters.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// One device's share of the model (the whole model on one device).
    pub fn shard(&self) -> &Config {
        &self.runner.shard
    }

    /// The weights' layout.
    pub fn weights(&self) -> &crate::models::Weights {
        &self.runner.weights
    }

    /// The longest sequence, prompt and generation together.
    pub fn ctx(&self) -> usize {
        self.ctx
    }

    /// Positions the KV pool holds (over every sequence).
    pub fn kv_positions(&self) -> usize {
        self.sched.pool.capacity() * self.runner.block_size
    }

    /// Bytes of the KV pool.
    pub fn kv_bytes(&self) -> usize {
        self.runner.pool.bytes()
    }

    /// The backend the engine runs on.
    pub fn backend(&mut self) -> &mut dyn Backend {
        self.be.as_mut()
    }

    /// The counters (queue lengths, blocks, prefix-cache hits, preemptions, steps).
    pub fn stats(&self) -> EngineStats {
        self.sched.stats()
    }

    /// Batch graphs built so far, and loaded now.
    pub fn plans(&self) -> (usize, usize) {
        (self.runner.built, self.runner.loaded())
    }

    /// The most sequences computed together.
    pub fn max_seqs(&self) -> usize {
        self.sched.cfg.max_seqs
    }

    /// With `on`, no decode token runs while a prompt is unfinished (what
    /// llama-batched-bench measures); off, decode tokens go first (what a server wants).
    pub fn set_prefill_first(&mut self, on: bool) {
        self.sched.cfg.prefill_first = on;
    }

    /// With `on` (the default), a sampler whose draw depends only on the largest logits
    /// ([`SamplerChain::wants`]) draws from the device's top candidates of its row; off,
    /// every sampler reads its whole row of logits. The tokens are the same either way
    /// (see docs/sampling.md); off is for comparisons.
    pub fn set_candidates(&mut self, on: bool) {
        self.candidates = on;
    }

    /// Turns the prefix cache on or off for the requests admitted from now on.
    pub fn set_prefix_cache(&mut self, on: bool) {
        self.sched.cfg.prefix_cache = on;
    }

    /// Requests that have not produced a token yet (waiting, or in their prompt).
    pub fn unstarted(&self) -> usize {
        let fresh = |s: &Sequence| s.generated() == 0;
        self.sched.running.iter().filter(|s| fresh(s)).count()
            + self.sched.waiting.values().filter(|s| fresh(s)).count()
    }

    /// Whether a request is running or waiting, or a step is on the device.
    pub fn has_work(&self) -> bool {
        self.sched.has_work() || self.inflight.is_some()
    }

    /// Checks `req` and queues it; an error names the request field at fault and
    /// concerns this request only.
    pub fn add(&mut self, req: Request) -> Result<RequestId> {
        let vocab = self.config.vocab_size;
        let prompt_len = req.prompt.len();
        if prompt_len == 0 {
            return Err(Error::request(
                "prompt",
                "invalid_value",
                "the prompt is empty: give at least one token",
            ));
        }
        if let Some((i, t)) = req
            .prompt
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= vocab)
        {
            return Err(Error::request(
                "prompt",
                "invalid_value",
                format!("token {t} at position {i} is outside the vocabulary of {vocab} tokens"),
            ));
        }
        let max_tokens = self.max_tokens(prompt_len, req.max_tokens, req.stop.context_shift)?;
        if !req.stop.strings.is_empty() && self.detok.is_none() {
            return Err(Error::request(
                "stop",
                "invalid_value",
                "stop strings need a tokenizer, and this engine has none",
            ));
        }
        let sampler = SamplerChain::new(&req.sampling, vocab)?;
        let id = RequestId(self.next);
        self.next += 1;
        let seq = Sequence {
            id,
            order: id.0,
            tokens: req.prompt,
            prompt_len,
            computed: 0,
            blocks: Vec::new(),
            keyed: Vec::new(),
            sampler,
            max_tokens,
            text: TextState::new(self.detok.clone(), prompt_len, req.stop.strings.clone()),
            stop: req.stop,
            logprobs: req.logprobs,
            cached_tokens: None,
            dropped: 0,
        };
        self.sched.waiting.insert(seq.order, seq);
        Ok(id)
    }

    /// The token limit of a request of `prompt_len` tokens asking for `asked`: what it
    /// asked, or what the context leaves; an error when the prompt and the tokens asked
    /// exceed the context (unless it `shifts` its context) or the whole KV pool.
    fn max_tokens(&self, prompt_len: usize, asked: Option<usize>, shifts: bool) -> Result<usize> {
        let room = self.ctx.saturating_sub(prompt_len);
        if asked == Some(0) {
            return Err(Error::request(
                "max_tokens",
                "invalid_value",
                "max_tokens must be at least 1",
            ));
        }
        let max = asked.unwrap_or(room);
        if prompt_len >= self.ctx || (max > room && !shifts) {
            return Err(Error::request(
                "max_tokens",
                "context_length_exceeded",
                format!(
                    "the prompt ({prompt_len} tokens) plus the {max} tokens asked for exceeds the context of {} tokens",
                    self.ctx
                ),
            ));
        }
        let bs = self.runner.block_size;
        let need = (prompt_len + max).min(self.ctx).div_ceil(bs);
        let windowed = self.config.sliding_window.is_some();
        if !windowed && need > self.sched.pool.capacity() {
            return Err(Error::request(
                "max_tokens",
                "context_length_exceeded",
                format!(
                    "the prompt ({prompt_len} tokens) and the tokens asked for ({max}) need {} KV positions and the whole KV pool holds {} (--kv-size)",
                    need * bs,
                    self.kv_positions()
                ),
            ));
        }
        Ok(max)
    }

    /// Drops request `id` wherever it is (waiting, in its prompt, decoding) and frees its
    /// blocks at once; its token counts, or `None` for an unknown or finished request.
    pub fn cancel(&mut self, id: RequestId) -> Option<Usage> {
        self.sched.remove(id).map(|s| s.usage())
    }

    /// Runs one step (see the module docs); nothing to do is an empty step. An error is
    /// one of the backend, which leaves every request where it was.
    ///
    /// When a step only decodes, every sequence goes on and nothing waits, the next step
    /// (the same sequences, one position on) is prepared before this one's tokens are
    /// read. Greedy sequences alone: it is enqueued, its tokens copied on the device from
    /// this step's argmax, so the host works a step behind the device; a sequence that
    /// finishes in this step leaves that next step's token for it unread. Otherwise its
    /// inputs but the tokens are written to the device now, and the next call launches
    /// it with the drawn tokens when every sequence drew one and goes on (else plans
    /// afresh), so that between two sampled steps the host only draws and launches.
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let current = match self.inflight.take() {
            Some(f) => f,
            None => match self.launch_staged()? {
                Some(f) => f,
                None => {
                    let plan = self.sched.schedule();
                    if plan.slices.is_empty() {
                        return Ok(Vec::new());
                    }
                    self.enqueue(&plan)?
                }
            },
        };
        let next = match self.follow(&current) {
            Ok(next) => next,
            Err(e) => {
                self.abandon(current);
                return Err(e);
            }
        };
        match self.finish(current) {
            Ok(events) => {
                match next {
                    Next::Forwarded(f) => self.inflight = Some(f),
                    Next::Staged(st) => self.staged = Some(st),
                    Next::None => {}
                }
                Ok(events)
            }
            Err(e) => {
                if let Next::Forwarded(f) = next {
                    self.abandon(f);
                }
                Err(e)
            }
        }
    }

    /// Enqueues the planned step, with the reads its sampling points need.
    fn enqueue(&mut self, plan: &StepPlan) -> Result<InFlight> {
        let running = &self.sched.running;
        let n_tokens = plan.slices.iter().map(|s| s.n).sum();
        let points = plan
            .slices
            .iter()
            .map(|sl| (&running[sl.seq], sl.n))
            .filter(|(s, n)| s.computed + n == s.tokens.len());
        let reads = Reads::of(points.map(|(s, _)| s), self.candidates);
        let shape = self.runner.shape(n_tokens, plan.slices.len(), reads.k);
        let x = self.runner.inputs(plan, running, shape);
        self.runner.copy_blocks(self.be.as_mut(), &plan.copies)?;
        let slices = plan
            .slices
            .iter()
            .map(|sl| (running[sl.seq].id, sl.n))
            .collect();
        let step = self.runner.enqueue(self.be.as_mut(), shape, &x, None)?;
        self.sched.stats.steps += 1;
        Ok(InFlight {
            slices,
            logits: reads.rows,
            step,
        })
    }

    /// What follows `current` before its tokens are read (see [`Engine::step`]): when it
    /// decodes every running sequence, none at its token limit or the end of its
    /// context, nothing waits and the next position's blocks are free, the next step,
    /// enqueued with its tokens forwarded when every sequence is greedy without
    /// log-probabilities, else staged.
    fn follow(&mut self, current: &InFlight) -> Result<Next> {
        let sched = &self.sched;
        let bs = self.runner.block_size;
        if !sched.waiting.is_empty() || sched.running.len() != current.slices.len() {
            return Ok(Next::None);
        }
        let mut need = 0;
        let mut greedy = !current.logits;
        for (s, &(id, n)) in sched.running.iter().zip(&current.slices) {
            let decoding = s.id == id && n == 1 && s.computed + 1 == s.tokens.len();
            let goes_on = s.generated() + 1 < s.max_tokens && s.tokens.len() + 1 < self.ctx;
            if !(decoding && goes_on) {
                return Ok(Next::None);
            }
            greedy &= s.sampler.is_greedy() && s.logprobs.is_none();
            need += s.blocks_for(s.tokens.len() + 1, bs);
        }
        if need > self.sched.pool.available() {
            return Ok(Next::None);
        }
        let n = current.slices.len();
        // every sequence reaches a sampling point in the next step
        let reads = Reads::of(self.sched.running.iter(), self.candidates);
        let shape = self.runner.shape(n, n, reads.k);
        let x = self.next_inputs(shape);
        let slices = current.slices.clone();
        if !greedy {
            self.runner.stage(self.be.as_mut(), shape, &x)?;
            return Ok(Next::Staged(Staged {
                slices,
                shape,
                rows: reads.rows,
            }));
        }
        let step = self
            .runner
            .enqueue(self.be.as_mut(), shape, &x, Some(&current.step))?;
        self.sched.stats.steps += 1;
        Ok(Next::Forwarded(InFlight {
            slices,
            logits: false,
            step,
        }))
    }

    /// The inputs of the next decode step of every running sequence in `shape` but its
    /// tokens, the blocks of its position taken (the caller checked they are free).
    fn next_inputs(&mut self, shape: BatchShape) -> runner::StepInputs {
        let bs = self.runner.block_size;
        let mut x = runner::StepInputs::default();
        for (col, s) in self.sched.running.iter_mut().enumerate() {
            let grow = s.blocks_for(s.tokens.len() + 1, bs);
            for _ in 0..grow {
                let id = self
                    .sched
                    .pool
                    .allocate()
                    .expect("blocks checked available");
                s.blocks.push(id);
            }
            let p = s.tokens.len();
            x.pos.push(p as i32);
            x.slots.push(s.slot(p, bs) as i32);
            x.seqs.extend([col as i32, p as i32]);
            x.out_rows.push(col as i32);
            x.cols.push(col);
        }
        self.runner.pad(&mut x, &self.sched.running, shape);
        x
    }

    /// Launches the staged step with the tokens the last step drew, when it still fits:
    /// nothing waits and every sequence it holds is running, in its place, with one
    /// token drawn and not computed. `None` (the staged step dropped) otherwise.
    fn launch_staged(&mut self) -> Result<Option<InFlight>> {
        let Some(st) = self.staged.take() else {
            return Ok(None);
        };
        let running = &self.sched.running;
        let fits = self.sched.waiting.is_empty()
            && running.len() == st.slices.len()
            && running
                .iter()
                .zip(&st.slices)
                .all(|(s, &(id, _))| s.id == id && s.computed + 1 == s.tokens.len());
        if !fits {
            return Ok(None);
        }
        let mut tokens: Vec<i32> = running
            .iter()
            .map(|s| s.tokens[s.computed] as i32)
            .collect();
        tokens.resize(st.shape.n_tokens, 0);
        let n = st.slices.len();
        let tokens = runner::Tokens::Host(&tokens);
        let step = self.runner.launch(self.be.as_mut(), st.shape, tokens, n)?;
        self.sched.stats.steps += 1;
        Ok(Some(InFlight {
            slices: st.slices,
            logits: st.rows,
            step,
        }))
    }

    /// Waits for an enqueued step whose results are not wanted (after an error).
    fn abandon(&mut self, f: InFlight) {
        let _ = self.runner.finish(self.be.as_mut(), f.step, false);
        let _ = self.be.synchronize();
    }

    /// Reads a step's results, moves its sequences past their computed tokens, samples
    /// where a sequence reached the end of its tokens, and retires finished ones.
    /// Sequences gone since the step was enqueued (finished, cancelled) are skipped.
    fn finish(&mut self, f: InFlight) -> Result<Vec<Event>> {
        let out = self.runner.finish(self.be.as_mut(), f.step, f.logits)?;
        let points = self.advance(&f.slices);
        let mut draws = self.draw(&points, &out);
        let mut events = Vec::new();
        let mut done: Vec<(RequestId, Option<Ending>)> = Vec::new();
        for &(i, _) in &points {
            let id = self.sched.running[i].id;
            match draws[i].take().expect("a draw for every sampling point") {
                Ok(d) => {
                    let stats = &mut self.sched.stats;
                    match d.from {
                        DrawnFrom::Argmax => {}
                        DrawnFrom::Candidates => stats.sampled_from_candidates += 1,
                        DrawnFrom::Row => stats.sampled_from_rows += 1,
                    }
                    if let Some(reason) = self.accept(i, d.token, d.logprobs, &mut events)? {
                        done.push((id, Some(reason)));
                    }
                }
                Err(error) => {
                    events.push(Event::Error { id, error });
                    done.push((id, None));
                }
            }
        }
        for (id, reason) in done {
            let Some(mut s) = self.sched.remove(id) else {
                continue;
            };
            if let Some((reason, stop_token)) = reason {
                events.push(Event::Finished {
                    id,
                    reason,
                    text: s.text.finish(),
                    usage: s.usage(),
                    stop_token,
                });
            }
        }
        Ok(events)
    }

    /// Moves the sequences of a finished step's `slices` past the tokens it computed
    /// (keying their full blocks, letting go of blocks out of a sliding window). The
    /// running index and step column of each that reached a sampling point, in column
    /// order.
    fn advance(&mut self, slices: &[(RequestId, usize)]) -> Vec<(usize, usize)> {
        let window = self.config.sliding_window;
        let mut points = Vec::new();
        for (col, &(id, n)) in slices.iter().enumerate() {
            let Some(i) = self.sched.running.iter().position(|s| s.id == id) else {
                continue;
            };
            let s = &mut self.sched.running[i];
            s.computed += n;
            s.key_full_blocks(&mut self.sched.pool);
            if let Some(w) = window {
                s.drop_out_of_window(w, &mut self.sched.pool);
            }
            if s.computed == s.tokens.len() {
                points.push((i, col));
            }
        }
        points
    }

    /// The next token of each sampling point (running index, column) from the step's
    /// outputs, by running index; drawn on the thread pool when
    /// [`PARALLEL_DRAWS`] or more sequences sample.
    fn draw(&mut self, points: &[(usize, usize)], out: &StepOutputs) -> Vec<Option<Result<Draw>>> {
        let vocab = self.config.vocab_size;
        let running = &mut self.sched.running;
        let mut cols = vec![None; running.len()];
        for &(i, col) in points {
            cols[i] = Some(col);
        }
        let one = |s: &mut Sequence, col: Option<usize>| {
            col.map(|col| {
                let row = out
                    .logits
                    .as_ref()
                    .map(|l| &l[col * vocab..(col + 1) * vocab]);
                let top = out.top.as_ref().map(|t| t.row(col));
                next_token(s, out.argmax[col], row, top)
            })
        };
        let sampling = points
            .iter()
            .filter(|&&(i, _)| !running[i].sampler.is_greedy())
            .count();
        if sampling >= PARALLEL_DRAWS {
            use rayon::prelude::*;
            running
                .par_iter_mut()
                .zip(cols)
                .map(|(s, col)| one(s, col))
                .collect()
        } else {
            running
                .iter_mut()
                .zip(cols)
                .map(|(s, col)| one(s, col))
                .collect()
        }
    }

    /// Takes a sampled token for running sequence `i`: a stop token finishes it, else
    /// the token is appended and reported; then the stop strings, the token limit and
    /// the context are checked. The reason (and the stop token), when it finished.
    fn accept(
        &mut self,
        i: usize,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        events: &mut Vec<Event>,
    ) -> Result<Option<Ending>> {
        let eos = &self.config.eos_token_ids;
        let s = &mut self.sched.running[i];
        if s.stop.token_ids.contains(&token) || (!s.stop.ignore_eos && eos.contains(&token)) {
            return Ok(Some((FinishReason::Stop, Some(token))));
        }
        s.tokens.push(token);
        let (text, stopped) = match s.text.push(&s.tokens)? {
            TextStep::Emit(t) => (t, false),
            TextStep::Stop(t) => (t, true),
        };
        events.push(Event::Token {
            id: s.id,
            token,
            text,
            logprobs,
        });
        Ok(if stopped {
            Some((FinishReason::Stop, None))
        } else if s.generated() >= s.max_tokens
            || (s.tokens.len() >= self.ctx && !s.stop.context_shift)
        {
            Some((FinishReason::Length, None))
        } else {
            if s.tokens.len() >= self.ctx {
                s.shift(self.ctx / 2, &mut self.sched.pool);
            }
            None
        })
    }

    /// Stops every request and releases the engine's plans and buffers.
    pub fn release(self) -> Result<()> {
        self.into_backend().map(drop)
    }

    /// Stops every request, releases the engine's plans and buffers, and hands back the
    /// backend (for another engine, or a model).
    pub fn into_backend(mut self) -> Result<Box<dyn Backend>> {
        let ids: Vec<RequestId> = self
            .sched
            .running
            .iter()
            .map(|s| s.id)
            .chain(self.sched.waiting.values().map(|s| s.id))
            .collect();
        for id in ids {
            self.sched.remove(id);
        }
        if let Some(f) = self.inflight.take() {
            self.abandon(f);
        }
        self.staged = None;
        self.runner.release(self.be.as_mut())?;
        Ok(self.be)
    }
}

/// Sequences sampling in one step from which their draws run on the thread pool (a
/// draw with the chat settings takes a few microseconds, which a decode step of many
/// sequences would otherwise wait for in turn).
const PARALLEL_DRAWS: usize = 8;

/// Where a token came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum DrawnFrom {
    /// The device's argmax (greedy).
    Argmax,
    /// A draw from the device's top candidates.
    Candidates,
    /// A draw from the whole row of logits.
    Row,
}

/// A sequence's next token, with its log-probabilities when asked for.
struct Draw {
    token: u32,
    logprobs: Option<TokenLogprobs>,
    from: DrawnFrom,
}

/// The next token of `s` from its step's argmax (greedy), or drawn by its sampler from
/// the device's candidates `top` or its whole `row` of logits; with its
/// log-probabilities (from the row) when asked for.
fn next_token(
    s: &mut Sequence,
    argmax: i32,
    row: Option<&[f32]>,
    top: Option<Row<'_>>,
) -> Result<Draw> {
    let position = s.tokens.len() - 1;
    let non_finite = || Error::NonFinite {
        position,
        step: "decode",
    };
    let (token, from) = match (s.sampler.is_greedy(), top, row) {
        (true, _, _) => (
            u32::try_from(argmax).map_err(|_| non_finite())?,
            DrawnFrom::Argmax,
        ),
        (false, Some(top), _) => (s.sampler.sample(top, &s.tokens)?, DrawnFrom::Candidates),
        (false, None, Some(r)) => (s.sampler.sample(Row::Full(r), &s.tokens)?, DrawnFrom::Row),
        (false, None, None) => {
            return Err(Error::plan(format!(
                "internal: {} samples, and its step read neither candidates nor logits",
                s.id
            )))
        }
    };
    let logprobs = match (s.logprobs, row) {
        (Some(n), Some(r)) => Some(logprobs_of(r, token, n).ok_or_else(non_finite)?),
        (Some(_), None) => {
            return Err(Error::plan(format!(
                "internal: {} asks for log-probabilities, and its step read no logits",
                s.id
            )))
        }
        (None, _) => None,
    };
    Ok(Draw {
        token,
        logprobs,
        from,
    })
}

/// What a step reads back beyond the argmax: for each sequence that reaches a sampling
/// point, the device's candidates when its sampler can take them (the step's graph then
/// selects the largest need, `k`), or the whole rows of logits when one needs them
/// (log-probabilities, a sampler without top-k, candidates off), which then serve all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Reads {
    /// Candidates the graph selects per sequence (0: none).
    k: usize,
    /// The rows of logits.
    rows: bool,
}

impl Reads {
    /// The reads of a step in which `points` reach a sampling point; `candidates` off
    /// reads rows instead.
    fn of<'a>(points: impl Iterator<Item = &'a Sequence>, candidates: bool) -> Reads {
        let mut r = Reads::default();
        for s in points {
            match (s.logprobs, s.sampler.wants()) {
                (None, Logits::None) => {}
                (None, Logits::Top(k)) if candidates => r.k = r.k.max(k),
                (Some(_), _) | (None, Logits::Top(_) | Logits::Last) => r.rows = true,
            }
        }
        if r.rows {
            r.k = 0;
        }
        r
    }
}

/// The log-probability of `token` under the softmax of `row`, and the `n` most likely
/// tokens'; `None` when the row is not finite.
fn logprobs_of(row: &[f32], token: u32, n: usize) -> Option<TokenLogprobs> {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if !row.iter().all(|x| x.is_finite()) {
        return None;
    }
    let sum: f64 = row.iter().map(|&x| ((x - max) as f64).exp()).sum();
    let lse = max as f64 + sum.ln();
    let lp = |x: f32| (x as f64 - lse) as f32;
    let mut top: Vec<(u32, f32)> = row
        .iter()
        .enumerate()
        .map(|(i, &x)| (i as u32, x))
        .collect();
    let n = n.min(top.len());
    if n > 0 {
        top.select_nth_unstable_by(n - 1, |a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    }
    top.truncate(n);
    top.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    Some(TokenLogprobs {
        logprob: lp(row[token as usize]),
        top: top.into_iter().map(|(i, x)| (i, lp(x))).collect(),
    })
}

/// A context past a learned position table is an error naming `--ctx`.
fn check_learned_positions(cfg: &Config, ctx: usize) -> Result<()> {
    use crate::models::arch::Positions;
    if cfg.arch.spec().positions == Positions::Learned && ctx > cfg.max_position_embeddings {
        return Err(Error::model(format!(
            "--ctx {ctx}: {} has learned positions for {} tokens only; use --ctx {} or less",
            cfg.arch, cfg.max_position_embeddings, cfg.max_position_embeddings
        )));
    }
    Ok(())
}

/// The pool's positions for `cfg` (whole blocks, block 0 included): the budget asked
/// for, or the automatic one bounded by the device's free memory.
fn pool_slots(w: &LoadedWeights, be: &mut dyn Backend, cfg: &EngineConfig) -> Result<usize> {
    let bs = cfg.block_size;
    let per_slot = KvCache::pool_bytes(&w.shard, bs, cfg.cache)
        .ok_or_else(|| Error::model("a KV block is too large to address"))?
        / bs;
    let most = max_kv_size(bs);
    let wanted = match cfg.kv {
        KvBudget::Tokens(n) if n > most => {
            return Err(Error::model(format!(
                "--kv-size {n}: a KV pool of {bs}-position blocks holds at most {most} positions (positions are 32-bit): give a smaller --kv-size"
            )))
        }
        KvBudget::Tokens(n) => n,
        KvBudget::Bytes(b) => (b / per_slot.max(1)).min(most),
        KvBudget::Auto => cfg.ctx.saturating_mul(AUTO_CONTEXTS).min(most),
        KvBudget::Contexts(c) => match cfg.ctx.checked_mul(c).filter(|&n| n <= most) {
            Some(n) => n,
            None => {
                return Err(Error::model(format!(
                    "--ctx {}: {c} context(s) of it are more positions than a KV pool of {bs}-position blocks holds ({most}; positions are 32-bit): {}",
                    cfg.ctx,
                    cfg.kv.smaller()
                )))
            }
        },
    };
    // one more block: block 0 serves padding
    let mut slots = wanted.div_ceil(bs).saturating_add(1).saturating_mul(bs);
    if let Some(free) = be.free_memory()? {
        let arena = largest_arena(w, cfg)?;
        let room = free.saturating_sub(arena + HEADROOM) / per_slot.max(1);
        let room = room / bs * bs;
        if slots > room {
            if cfg.kv != KvBudget::Auto || room < 2 * bs {
                return Err(Error::model(format!(
                    "a KV pool of {} positions needs {} bytes and {} has {} free after the weights and plans: {}",
                    slots - bs,
                    slots.saturating_mul(per_slot),
                    be.name(),
                    free.saturating_sub(arena + HEADROOM),
                    cfg.kv.smaller()
                )));
            }
            slots = room;
        }
    }
    if slots < 2 * bs {
        return Err(Error::model(format!(
            "a KV pool of {} positions holds no block: ask for at least {bs} (--kv-size)",
            slots.saturating_sub(bs)
        )));
    }
    Ok(slots)
}

/// The arena of the largest batch graph the engine can run (the step's token budget
/// and every sequence), counted before the pool is allocated.
fn largest_arena(w: &LoadedWeights, cfg: &EngineConfig) -> Result<usize> {
    let layout = KvCache::pool(
        &w.shard,
        cfg.block_size,
        cfg.cache,
        crate::graph::BufferId(0),
    );
    let s = &cfg.scheduler;
    let shape = BatchShape {
        n_tokens: runner::bucket(s.step_tokens),
        n_seqs: runner::bucket(s.max_seqs),
        max_blocks: cfg.ctx.div_ceil(cfg.block_size),
        candidates: runner::candidate_bucket(crate::ops::topk::MAX_K, w.shard.vocab_size),
        decode: false,
    };
    Ok(
        build_batch(&w.shard, &w.weights, &layout, cfg.block_size, shape)?
            .plan()?
            .arena_bytes,
    )
}
