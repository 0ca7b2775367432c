//! `graft batched-bench`: the engine's throughput over many sequences, in two modes.
//!
//! - **Batches** (llama.cpp's llama-batched-bench, same flags and columns): for each
//!   prompt length PP, generation length TG and batch size B, B requests of PP random
//!   tokens are added at once; the prompts are computed first (chunks of `--ubatch`
//!   tokens, several sequences a step), then TG decode steps over the B sequences. T_PP is
//!   the time until every prompt gave its first token, T_TG the time of the TG steps after
//!   it; S_PP = B * PP / T_PP, S_TG = B * TG / T_TG, N_KV = B * (PP + TG) (with `--pps`,
//!   one shared prompt: PP + B * TG). Each configuration runs once untimed first (the
//!   plans of its shapes are built and captured), then timed.
//! - **Arrivals** (`--requests N`): N requests arrive at random (a Poisson process of
//!   `--rate` requests per second; all at once without it), each a prompt of the first PP
//!   and TG tokens; the engine schedules them as a server would (decode tokens first,
//!   prompt chunks mixed in). Reports the aggregate generation speed and the time to first
//!   token and per output token at p50 and p99, and the host's resident memory (and the
//!   device's free memory) after the first tenth of the requests and at the end, which
//!   shows whether memory stays flat.
//!
//! With `--profile`, one decode step at each batch size (after prompts of the first PP)
//! runs again eagerly, each kernel timed on its own: the table of where the step's time
//! goes, beside the wall time of the same step replayed from its CUDA graph (kernels timed
//! one at a time do not overlap, so their sum can exceed the replayed step).
//!
//! Requests are greedy unless sampling flags are given (`--temperature 0.8 --top-k 40`:
//! the same flags as `generate`, one seed for all), which measures sampled decode against
//! greedy on the same batches.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use graft::backend::{profile_table, StepTime};
use graft::engine::{max_kv_size, Engine, Event, Request, RequestId};
use graft::models::SamplingParams;
use graft::{Error, Result};

use super::dump::{preset, preset_help};
use super::engine_args::{bench_context, EngineArgs};
use super::sampling_args::SamplingArgs;
use super::{print_out, ModelArgs};

/// Arguments of `graft batched-bench`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    #[arg(
        long,
        conflicts_with = "model",
        help = preset_help(
            "Model shape instead of --model, with seeded random weights of --quantize (f16 when absent)"
        )
    )]
    preset: Option<String>,
    /// Prompt lengths, comma-separated (llama-batched-bench's -npp).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    npp: Vec<usize>,
    /// Generation lengths (-ntg).
    #[arg(long, value_delimiter = ',', default_value = "128")]
    ntg: Vec<usize>,
    /// Batch sizes: sequences at once (-npl).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32")]
    npl: Vec<usize>,
    /// One prompt shared by the batch's sequences (-pps): computed once, then taken from
    /// the prefix cache.
    #[arg(long)]
    pps: bool,
    /// Arrivals mode: this many requests (see the module docs).
    #[arg(long)]
    requests: Option<usize>,
    /// Arrivals per second (Poisson); all at once when absent.
    #[arg(long, requires = "requests")]
    rate: Option<f64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// After the table, one decode step of each batch size (the first PP) profiled
    /// kernel by kernel, against the wall time of the same step replayed.
    #[arg(long, conflicts_with = "requests")]
    profile: bool,
}

/// Runs `graft batched-bench`.
pub fn run(a: Args) -> Result<()> {
    for (flag, v) in [("--npp", &a.npp), ("--ntg", &a.ntg), ("--npl", &a.npl)] {
        if v.is_empty() || v.contains(&0) {
            return Err(Error::model(format!("{flag}: give lengths of at least 1")));
        }
    }
    if a.profile && a.ntg[0] < 3 {
        return Err(Error::model(format!(
            "--profile times decode steps before the one it profiles: give --ntg of at least 3, got {}",
            a.ntg[0]
        )));
    }
    if let Some(r) = a.rate.filter(|r| !(r.is_finite() && *r > 0.0)) {
        return Err(Error::model(format!(
            "--rate {r}: give a positive number of requests per second"
        )));
    }
    let max = |v: &[usize]| v.iter().copied().max().unwrap_or(1);
    // every sequence's whole length fits its context; the pool holds the largest batch
    let block = a.engine.kv_block;
    let most = max_kv_size(block);
    let sizes = [("--npp", max(&a.npp)), ("--ntg", max(&a.ntg))];
    let ctx = bench_context(sizes, a.model.ctx, most.saturating_sub(block))?;
    let mut engine_args = a.engine.clone();
    let batch = max(&a.npl).min(a.requests.unwrap_or(usize::MAX));
    if a.requests.is_none() {
        engine_args.parallel = engine_args.parallel.max(batch);
        engine_args.ubatch = engine_args.ubatch.max(engine_args.parallel);
    }
    // room for every sequence that may run at once, unless a budget is given
    if engine_args.kv_size.is_none() && engine_args.kv_mem.is_none() {
        let n = engine_args.parallel;
        let pool = n.checked_mul(ctx + block).filter(|&p| p <= most);
        engine_args.kv_size = Some(pool.ok_or_else(|| {
            Error::model(format!(
                "{n} sequences at once (--npl, --parallel) of {ctx} positions are more than a KV pool holds ({most} positions): give fewer sequences (--npl, --parallel) or shorter ones (--npp, --ntg), or a pool size (--kv-size, --kv-mem)"
            ))
        })?);
    }
    // one seed (--seed, default 1) for the weights, the prompts, the arrivals and sampling
    let seed = a.sampling.seed().unwrap_or(1);
    let mut sampling = a.sampling.resolve(None, &SamplingParams::greedy())?.params;
    sampling.seed = Some(seed);
    let mut engine = match &a.preset {
        Some(name) => engine_args.random(&a.model, preset(name)?, Some(ctx), seed, a.json)?,
        None => engine_args.load(&a.model, &a.model.path()?, Some(ctx), a.json)?,
    };
    let run = match a.requests {
        Some(n) => arrivals(&a, &mut engine, &sampling, n),
        None => batches(&a, &mut engine, &sampling),
    };
    let released = engine.release();
    run.and(released)
}

/// One timed configuration of the batches mode.
#[derive(Clone, Copy, Debug)]
struct Row {
    pp: usize,
    tg: usize,
    b: usize,
    t_pp: f64,
    t_tg: f64,
}

impl Row {
    fn n_kv(&self, shared: bool) -> usize {
        match shared {
            true => self.pp + self.b * self.tg,
            false => self.b * (self.pp + self.tg),
        }
    }
}

/// The batches mode: every (PP, TG, B), untimed then timed.
fn batches(a: &Args, e: &mut Engine, sampling: &SamplingParams) -> Result<()> {
    e.set_prefill_first(true);
    e.set_prefix_cache(a.pps);
    let mut rng = StdRng::seed_from_u64(sampling.seed.unwrap_or(1));
    let mut rows = Vec::new();
    for &pp in &a.npp {
        for &tg in &a.ntg {
            for &b in &a.npl {
                let shape = Shape { pp, tg, b };
                run_batch(e, &mut rng, shape, a.pps, sampling)?;
                rows.push(run_batch(e, &mut rng, shape, a.pps, sampling)?);
            }
        }
    }
    let profiles = match a.profile {
        true => a
            .npl
            .iter()
            .map(|&b| profile_step(e, &mut rng, (a.npp[0], a.ntg[0]), b, sampling))
            .collect::<Result<Vec<_>>>()?,
        false => Vec::new(),
    };
    let s = |n: usize, t: f64| n as f64 / t;
    if a.json {
        let rows: Vec<_> = rows
            .iter()
            .map(|r| {
                let n_kv = r.n_kv(a.pps);
                json!({
                    "pp": r.pp, "tg": r.tg, "b": r.b, "n_kv": n_kv,
                    "t_pp": r.t_pp, "s_pp": s(r.b * r.pp, r.t_pp),
                    "t_tg": r.t_tg, "s_tg": s(r.b * r.tg, r.t_tg),
                    "t": r.t_pp + r.t_tg, "s": s(n_kv, r.t_pp + r.t_tg),
                })
            })
            .collect();
        let profiles: Vec<_> = profiles.iter().map(Profile::json).collect();
        return print_out(&format!(
            "{}\n",
            json!({
                "rows": rows,
                "profiles": profiles,
                "plans": e.plans().0,
                "sampled_from_candidates": e.stats().sampled_from_candidates,
                "sampled_from_rows": e.stats().sampled_from_rows,
            })
        ));
    }
    let mut out = String::from(
        "|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |\n\
         |-------|--------|------|--------|----------|----------|----------|----------|----------|----------|\n",
    );
    for r in &rows {
        let n_kv = r.n_kv(a.pps);
        let t = r.t_pp + r.t_tg;
        out += &format!(
            "| {:5} | {:6} | {:4} | {:6} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.3} | {:8.2} |\n",
            r.pp,
            r.tg,
            r.b,
            n_kv,
            r.t_pp,
            s(r.b * r.pp, r.t_pp),
            r.t_tg,
            s(r.b * r.tg, r.t_tg),
            t,
            s(n_kv, t)
        );
    }
    for p in &profiles {
        out += &p.text();
    }
    print_out(&out)
}

/// One decode step of a batch, timed replayed and profiled kernel by kernel.
struct Profile {
    b: usize,
    /// The step's wall time replayed (the median of a few), seconds.
    wall: f64,
    steps: Vec<StepTime>,
}

impl Profile {
    fn kernels_us(&self) -> f64 {
        self.steps.iter().map(|s| s.us).sum()
    }

    fn text(&self) -> String {
        format!(
            "\ndecode step at B = {}: {:.3} ms replayed, {:.3} ms in kernels run one at a time\n\n{}",
            self.b,
            self.wall * 1e3,
            self.kernels_us() / 1e3,
            profile_table(&self.steps)
        )
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "b": self.b,
            "wall_ms": self.wall * 1e3,
            "kernels_ms": self.kernels_us() / 1e3,
            "steps": self.steps.iter().map(|s| json!({
                "name": s.name, "op": s.op, "kernels": s.kernels, "us": s.us,
            })).collect::<Vec<_>>(),
        })
    }
}

/// Most decode steps timed replayed before the profiled one.
const PROFILE_STEPS: usize = 5;

/// `b` requests of `pp` prompt tokens and `tg` generated: the prompts, up to
/// [`PROFILE_STEPS`] decode steps timed (the median is the wall time), then one profiled;
/// then the requests are cancelled.
fn profile_step(
    e: &mut Engine,
    rng: &mut StdRng,
    (pp, tg): (usize, usize),
    b: usize,
    sampling: &SamplingParams,
) -> Result<Profile> {
    // the prompt's step gives the first token, then tg decode steps: up to tg - 2 timed
    // (run() checks tg >= 3), then one profiled with a step still to come, since a greedy
    // step is launched in the call before the one that reads its tokens
    let timed = tg.saturating_sub(2).min(PROFILE_STEPS);
    let vocab = e.config().vocab_size;
    let ids = prompts(rng, vocab, pp, b, false)
        .into_iter()
        .map(|p| e.add(bench_request(p, tg + 1, sampling)))
        .collect::<Result<Vec<_>>>()?;
    let run = (|| {
        while e.unstarted() > 0 {
            checked_step(e)?;
        }
        let mut walls = Vec::with_capacity(timed);
        for _ in 0..timed {
            let t0 = Instant::now();
            checked_step(e)?;
            walls.push(t0.elapsed().as_secs_f64());
        }
        e.backend().set_profiling(true);
        let profiled = checked_step(e);
        let steps = e.backend().take_profile();
        e.backend().set_profiling(false);
        profiled?;
        Ok(Profile {
            b,
            wall: quantile(&mut walls, 0.5),
            steps,
        })
    })();
    for id in ids {
        e.cancel(id);
    }
    run
}

/// One engine step; an error event is the step's error.
fn checked_step(e: &mut Engine) -> Result<()> {
    for ev in e.step()? {
        if let Event::Error { id, error } = ev {
            return Err(Error::model(format!("{id} failed: {error}")));
        }
    }
    Ok(())
}

/// `b` random prompts of `pp` tokens (one shared prompt when `shared`).
fn prompts(rng: &mut StdRng, vocab: usize, pp: usize, b: usize, shared: bool) -> Vec<Vec<u32>> {
    let mut draw = || {
        (0..pp)
            .map(|_| rng.random_range(0..vocab as u32))
            .collect::<Vec<u32>>()
    };
    let first = draw();
    (0..b)
        .map(|i| {
            if shared || i == 0 {
                first.clone()
            } else {
                draw()
            }
        })
        .collect()
}

/// One configuration of the batches mode: `b` prompts of `pp` tokens, `tg` steps.
#[derive(Clone, Copy, Debug)]
struct Shape {
    pp: usize,
    tg: usize,
    b: usize,
}

/// Runs one configuration: the prompts, then `tg` decode steps.
fn run_batch(
    e: &mut Engine,
    rng: &mut StdRng,
    Shape { pp, tg, b }: Shape,
    shared: bool,
    sampling: &SamplingParams,
) -> Result<Row> {
    let vocab = e.config().vocab_size;
    for p in prompts(rng, vocab, pp, b, shared) {
        e.add(bench_request(p, tg + 1, sampling))?;
    }
    let t0 = Instant::now();
    let mut t_pp = None;
    while e.has_work() {
        checked_step(e)?;
        if t_pp.is_none() && e.unstarted() == 0 {
            t_pp = Some(t0.elapsed().as_secs_f64());
        }
    }
    let t = t0.elapsed().as_secs_f64();
    let t_pp = t_pp.unwrap_or(t);
    Ok(Row {
        pp,
        tg,
        b,
        t_pp,
        t_tg: t - t_pp,
    })
}

/// A request that runs to its length, end-of-sequence tokens included.
fn bench_request(prompt: Vec<u32>, max_tokens: usize, sampling: &SamplingParams) -> Request {
    let mut r = Request::greedy(prompt, max_tokens);
    r.sampling = sampling.clone();
    r.stop.ignore_eos = true;
    r
}

/// What happened to one request of the arrivals mode.
#[derive(Clone, Copy, Debug, Default)]
struct Timing {
    arrived: Option<Instant>,
    first: Option<Instant>,
    done: Option<Instant>,
    tokens: usize,
}

/// The arrivals mode (see the module docs).
fn arrivals(a: &Args, e: &mut Engine, sampling: &SamplingParams, n: usize) -> Result<()> {
    let (pp, tg) = (a.npp[0], a.ntg[0]);
    let mut rng = StdRng::seed_from_u64(sampling.seed.unwrap_or(1));
    let vocab = e.config().vocab_size;
    // arrival offsets: exponential gaps of mean 1 / rate
    let mut at = Duration::ZERO;
    let offsets: Vec<Duration> = (0..n)
        .map(|_| {
            if let Some(rate) = a.rate {
                let u: f64 = rng.random_range(f64::EPSILON..1.0);
                at += Duration::from_secs_f64(-u.ln() / rate);
            }
            at
        })
        .collect();
    let mut times: HashMap<RequestId, Timing> = HashMap::new();
    let start = Instant::now();
    let mut next = 0;
    let mut mem_warm = None;
    while next < n || e.has_work() {
        while next < n && start.elapsed() >= offsets[next] {
            let p = prompts(&mut rng, vocab, pp, 1, false).remove(0);
            let id = e.add(bench_request(p, tg, sampling))?;
            times.insert(
                id,
                Timing {
                    arrived: Some(Instant::now()),
                    ..Timing::default()
                },
            );
            next += 1;
        }
        if !e.has_work() {
            std::thread::sleep(offsets[next].saturating_sub(start.elapsed()));
            continue;
        }
        for ev in e.step()? {
            let now = Some(Instant::now());
            match ev {
                Event::Token { id, .. } => {
                    let t = times.entry(id).or_default();
                    t.first = t.first.or(now);
                    t.tokens += 1;
                }
                Event::Finished { id, .. } => times.entry(id).or_default().done = now,
                Event::Error { id, error } => {
                    return Err(Error::model(format!("{id} failed: {error}")))
                }
            }
        }
        if mem_warm.is_none()
            && times.values().filter(|t| t.done.is_some()).count() >= n.div_ceil(10)
        {
            mem_warm = Some(memory(e)?);
        }
    }
    let mem_end = memory(e)?;
    report_arrivals(a, e, &times, start, (mem_warm.unwrap_or(mem_end), mem_end))
}

/// Host resident memory (bytes) and the device's free memory, when it has one.
fn memory(e: &mut Engine) -> Result<(Option<usize>, Option<usize>)> {
    let rss = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<usize>().ok())
                .map(|kb| kb * 1024)
        });
    Ok((rss, e.backend().free_memory()?))
}

/// The `q` quantile of `v` (sorted in place).
fn quantile(v: &mut [f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

type Memory = (Option<usize>, Option<usize>);

fn report_arrivals(
    a: &Args,
    e: &Engine,
    times: &HashMap<RequestId, Timing>,
    start: Instant,
    (warm, end): (Memory, Memory),
) -> Result<()> {
    let mut ttft = Vec::new();
    let mut tpot = Vec::new();
    let mut tokens = 0;
    let mut last = start;
    for t in times.values() {
        let (Some(arr), Some(first), Some(done)) = (t.arrived, t.first, t.done) else {
            continue;
        };
        ttft.push((first - arr).as_secs_f64() * 1e3);
        if t.tokens > 1 {
            tpot.push((done - first).as_secs_f64() * 1e3 / (t.tokens - 1) as f64);
        }
        tokens += t.tokens;
        last = last.max(done);
    }
    let secs = (last - start).as_secs_f64();
    let st = e.stats();
    let mib = |b: Option<usize>| b.map_or(f64::NAN, |b| b as f64 / (1 << 20) as f64);
    let v = json!({
        "requests": times.len(),
        "prompt_tokens": a.npp[0],
        "max_tokens": a.ntg[0],
        "rate": a.rate,
        "seconds": secs,
        "generated_tokens": tokens,
        "tokens_per_s": tokens as f64 / secs,
        "ttft_ms": {"p50": quantile(&mut ttft, 0.5), "p99": quantile(&mut ttft, 0.99)},
        "tpot_ms": {"p50": quantile(&mut tpot, 0.5), "p99": quantile(&mut tpot, 0.99)},
        "host_rss_mib": {"warm": mib(warm.0), "end": mib(end.0)},
        "device_free_mib": {"warm": mib(warm.1), "end": mib(end.1)},
        "preemptions": st.preemptions,
        "steps": st.steps,
        "plans": e.plans().0,
        "sampled_from_candidates": st.sampled_from_candidates,
        "sampled_from_rows": st.sampled_from_rows,
    });
    if a.json {
        return print_out(&format!("{v}\n"));
    }
    print_out(&format!(
        "{} requests ({} prompt + {} generated tokens each, {}) in {:.2} s: {:.1} tok/s generated\n\
         time to first token  p50 {:.1} ms  p99 {:.1} ms\n\
         time per output token p50 {:.2} ms  p99 {:.2} ms\n\
         host RSS {:.1} MiB after a tenth of the requests, {:.1} MiB at the end; device free {:.1} -> {:.1} MiB\n\
         {} steps, {} preemptions, {} plans\n",
        times.len(),
        a.npp[0],
        a.ntg[0],
        a.rate.map_or("all at once".into(), |r| format!("{r} per second")),
        secs,
        tokens as f64 / secs,
        v["ttft_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
        v["ttft_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
        v["tpot_ms"]["p50"].as_f64().unwrap_or(f64::NAN),
        v["tpot_ms"]["p99"].as_f64().unwrap_or(f64::NAN),
        mib(warm.0),
        mib(end.0),
        mib(warm.1),
        mib(end.1),
        st.steps,
        st.preemptions,
        e.plans().0
    ))
}
