//! `graft bench`: prompt-processing and generation speed of one sequence on the batched
//! engine, for a preset model with seeded random weights made on the device (no download,
//! no host copy) or a model file.
//!
//! Prompt processing: one request of `-p` tokens to build and load the plan (and let a
//! capturing backend capture it), then `--reps` timed requests that replay it, each
//! prompt computed in one step (the prefix cache off), timed to its first token.
//! Generation: a short request builds the decode plan, then `-n` timed greedy decode
//! steps after a prompt of `-d` tokens (one at least: by default the steps run from an
//! almost empty context, as llama-bench's tg), as `graft generate` runs them (each step's
//! argmax fed to the next on the device, the host a step behind). The
//! memory-bandwidth roofline fraction is `weight bytes read per token x gen tokens/s /
//! copy bandwidth`. With `--profile`, one more prefill and decode step run with step
//! profiling on, and a table says where their time goes.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use graft::backend::{profile_table, Backend, Stats, StepTime};
use graft::engine::{max_kv_size, Engine, Event, Request, DEFAULT_BLOCK_SIZE};
use graft::models::QuantPlan;
use graft::Result;

use super::dump::{preset, preset_help};
use super::engine_args::{bench_context, EngineArgs};
use super::{print_out, ModelArgs};

/// Arguments of `graft bench`.
#[derive(clap::Args)]
pub struct Args {
    #[arg(
        long,
        required_unless_present = "model",
        conflicts_with = "model",
        help = preset_help(
            "Model shape instead of --model, with seeded random weights of --quantize (f16 when absent)"
        )
    )]
    preset: Option<String>,
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens per prefill.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    p: usize,
    /// Decode steps.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n: usize,
    /// Tokens in the context before the timed decode steps (llama-bench's -d): they
    /// follow a prompt of this many tokens, one at least (0: from an empty context but
    /// for that token, as llama-bench's tg).
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    depth: usize,
    /// Timed prefills (after one untimed).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Seed of the weights and of the prompt's token ids.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Device copy bandwidth in GB/s, for the roofline fraction (measured on the device
    /// when the backend is CUDA and this is absent; unknown on the CPU).
    #[arg(long)]
    copy_bw: Option<f64>,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also time every step of one prefill and one decode step (eagerly) and print
    /// where the time goes.
    #[arg(long)]
    profile: bool,
}

/// The backend, and the copy bandwidth to compare with: the one given, else measured on
/// a CUDA device.
fn open_backend(
    m: &ModelArgs,
    given: Option<f64>,
) -> Result<(Box<dyn graft::backend::Backend>, Option<f64>)> {
    #[cfg(feature = "cuda")]
    if m.backend == super::BackendKind::Cuda {
        // GPU 0's copy bandwidth: with --tp each GPU reads its own share of the weights at
        // its own bandwidth, and the roofline compares per-device bytes with it.
        let mut be = graft::backend::cuda::CudaBackend::new(0)?;
        let bw = match given {
            Some(bw) => bw,
            None => graft::backend::cuda::bench::copy_bandwidth(&mut be)?,
        };
        if m.tp == 1 {
            return Ok((Box::new(be), Some(bw)));
        }
        drop(be);
        return Ok((m.open_backend()?, Some(bw)));
    }
    Ok((m.open_backend()?, given))
}

/// Runs `graft bench`.
pub fn run(a: Args) -> Result<()> {
    for (flag, v) in [("-p", a.p), ("-n", a.n), ("--reps", a.reps)] {
        if v == 0 {
            return Err(graft::Error::model(format!("{flag} 0: give at least 1")));
        }
    }
    if let Some(bw) = a.copy_bw.filter(|bw| !(bw.is_finite() && *bw > 0.0)) {
        return Err(graft::Error::model(format!(
            "--copy-bw {bw}: the copy bandwidth must be a positive number of GB/s"
        )));
    }
    let most = max_kv_size(DEFAULT_BLOCK_SIZE);
    let before = match a.depth > a.p {
        true => ("-d", a.depth),
        false => ("-p", a.p),
    };
    let ctx = bench_context([before, ("-n", a.n)], a.model.ctx, most)?;
    let (be, copy_bw) = open_backend(&a.model, a.copy_bw)?;
    let (mut engine, label, dtype) = open_engine(&a, be, ctx)?;
    let run = measure(&a, &mut engine, copy_bw, label, dtype);
    let released = engine.release();
    let f = run?;
    released?;
    print_out(&match a.json {
        true => f.json(&a),
        false => f.text(&a),
    })
}

/// Runs the measurements of `a` on `e`.
fn measure(
    a: &Args,
    e: &mut Engine,
    copy_bw: Option<f64>,
    label: String,
    dtype: String,
) -> Result<Figures> {
    let mut rng = StdRng::seed_from_u64(a.seed);
    let vocab = e.config().vocab_size as u32;
    let tokens: Vec<u32> = (0..a.p.max(a.depth))
        .map(|_| rng.random_range(0..vocab))
        .collect();
    let prompt = &tokens[..a.p];
    let pp = time_prefill(e, prompt, a.reps)?;
    let tg = time_generation(e, &tokens[..a.depth.max(1)], a.n)?;
    let stats = e.backend().stats();
    // Profiles after the timed runs, so they change none of the figures above.
    let profiles = match a.profile {
        true => Some(profile(e, prompt)?),
        false => None,
    };
    Ok(Figures {
        label,
        dtype,
        backend: e.backend().name().to_string(),
        pp,
        tg,
        weight_bytes: e.weights().bytes,
        // per device: each device reads its share of the weights, at its own bandwidth
        per_token: e.weights().bytes_per_token(e.shard()),
        devices: e.backend().devices(),
        kv_cache_bytes: e.kv_bytes(),
        copy_bw,
        plans: e.plans().0,
        stats,
        profiles,
    })
}

/// The engine over the model `a` names (its file or folder, else the preset with seeded
/// random weights) on `be`, for one sequence of `ctx` positions whose prompt is one step;
/// with its label and weight type for the report.
fn open_engine(a: &Args, be: Box<dyn Backend>, ctx: usize) -> Result<(Engine, String, String)> {
    let mut args = EngineArgs::single_sequence();
    args.ubatch = args.ubatch.max(a.p);
    args.no_prefix_cache = true;
    args.contexts = Some(1);
    match (&a.model.location, &a.preset) {
        (Some(path), _) => {
            let e = args.load_on(&a.model, path, Some(ctx), true, be)?;
            let dtype = a.model.quantize.map_or("as stored".to_string(), |q| {
                QuantPlan::from(q).name().to_string()
            });
            Ok((e, path.display().to_string(), dtype))
        }
        (None, Some(name)) => {
            let e = args.random_on(&a.model, preset(name)?, Some(ctx), a.seed, true, be)?;
            Ok((e, name.clone(), a.model.plan().name().to_string()))
        }
        (None, None) => Err(graft::Error::model("give --preset or --model")),
    }
}

/// Runs `req` to its end; the time its first token came and the time it finished.
fn run_request(e: &mut Engine, req: Request) -> Result<(Instant, Instant)> {
    e.add(req)?;
    let mut first = None;
    loop {
        for ev in e.step()? {
            match ev {
                Event::Token { .. } => {
                    first.get_or_insert_with(Instant::now);
                }
                Event::Finished { .. } => {
                    let now = Instant::now();
                    return Ok((first.unwrap_or(now), now));
                }
                Event::Error { error, .. } => return Err(error),
            }
        }
    }
}

/// A greedy request of `prompt` for `n` tokens, end-of-sequence tokens included.
fn greedy(prompt: &[u32], n: usize) -> Request {
    let mut r = Request::greedy(prompt.to_vec(), n);
    r.stop.ignore_eos = true;
    r
}

/// Prompt processing in tokens/s: one prefill of `prompt` to build and load the plan, then
/// the median of `reps` timed prefills that replay it.
fn time_prefill(e: &mut Engine, prompt: &[u32], reps: usize) -> Result<f64> {
    run_request(e, greedy(prompt, 1))?;
    let mut secs = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        let (first, _) = run_request(e, greedy(prompt, 1))?;
        secs.push((first - t).as_secs_f64());
    }
    secs.sort_by(f64::total_cmp);
    Ok(prompt.len() as f64 / secs[secs.len() / 2])
}

/// Generation in tokens/s after `prompt` (the depth): a short run first builds the decode
/// plan, then `n` timed greedy steps (the host a step behind the device, as `graft
/// generate` runs them).
fn time_generation(e: &mut Engine, prompt: &[u32], n: usize) -> Result<f64> {
    run_request(e, greedy(&prompt[..1], 3))?;
    let (first, end) = run_request(e, greedy(prompt, n + 1))?;
    Ok(n as f64 / (end - first).as_secs_f64())
}

/// The step times of one eager prefill of `prompt` and of one decode step after it.
fn profile(e: &mut Engine, prompt: &[u32]) -> Result<(Vec<StepTime>, Vec<StepTime>)> {
    e.backend().set_profiling(true);
    e.add(greedy(prompt, 2))?;
    let run = (|| {
        e.step()?;
        let prefill = e.backend().take_profile();
        e.step()?;
        Ok((prefill, e.backend().take_profile()))
    })();
    e.backend().set_profiling(false);
    run
}

/// What one `graft bench` run measured.
struct Figures {
    /// The model's preset name or path, and its weight type.
    label: String,
    dtype: String,
    backend: String,
    /// Prompt processing and generation, tokens/s.
    pp: f64,
    tg: f64,
    weight_bytes: usize,
    /// Weight bytes each device reads per token.
    per_token: usize,
    devices: usize,
    kv_cache_bytes: usize,
    /// The copy bandwidth the roofline compares with, GB/s.
    copy_bw: Option<f64>,
    /// Batch graphs built.
    plans: usize,
    stats: Stats,
    /// `--profile`: one eager prefill's and one decode step's step times.
    profiles: Option<(Vec<StepTime>, Vec<StepTime>)>,
}

impl Figures {
    /// The fraction of the copy bandwidth that generation reads the weights at.
    fn roofline(&self) -> Option<f64> {
        self.copy_bw
            .map(|bw| self.per_token as f64 * self.tg / (bw * 1e9))
    }

    /// The report as one JSON object (a line).
    fn json(&self, a: &Args) -> String {
        let rows = |rows: &[StepTime]| {
            rows.iter()
                .map(|r| json!({"name": r.name, "op": r.op, "kernels": r.kernels, "us": r.us}))
                .collect::<Vec<_>>()
        };
        let total = |rows: &[StepTime]| rows.iter().map(|r| r.us).sum::<f64>();
        let obj = json!({
            "model": self.label,
            "dtype": self.dtype,
            "backend": self.backend,
            "n_prompt": a.p,
            "n_gen": a.n,
            "n_depth": a.depth,
            "reps": a.reps,
            "prompt_tokens_per_s": self.pp,
            "gen_tokens_per_s": self.tg,
            "devices": self.devices,
            "weight_bytes": self.weight_bytes,
            "weight_bytes_per_token": self.per_token,
            "kv_cache_bytes": self.kv_cache_bytes,
            "copy_bw_gbps": self.copy_bw,
            "roofline_fraction": self.roofline(),
            "plans": self.plans,
            "captures": self.stats.captures,
            "replays": self.stats.replays,
            "eager_runs": self.stats.eager_runs,
            "profile": self.profiles.as_ref().map(|(p, d)| json!({
                "prefill_us": total(p),
                "decode_us": total(d),
                "prefill": rows(p),
                "decode": rows(d),
            })),
        });
        format!("{obj}\n")
    }

    /// The report as text, with the profile tables after it.
    fn text(&self, a: &Args) -> String {
        let gb = |b: usize| b as f64 / 1e9;
        let roof = match (self.roofline(), self.copy_bw) {
            (Some(f), Some(bw)) => format!("{:.1}% of {bw:.0} GB/s", f * 100.0),
            _ => "unknown (pass --copy-bw GBPS)".into(),
        };
        let devices = match self.devices {
            1 => String::new(),
            n => format!(" per device, {n} devices"),
        };
        let mut out = format!(
            "graft bench: {} {} on {} (p={}, n={}, d={}, {} reps)\n\
             \x20 weights     {:.3} GB ({:.3} GB read per token){devices}\n\
             \x20 prompt      {:>10.1} tok/s\n\
             \x20 generation  {:>10.1} tok/s\n\
             \x20 roofline    {roof}\n\
             \x20 plans       {} batch graphs; {} captures, {} replays, {} eager runs\n",
            self.label,
            self.dtype,
            self.backend,
            a.p,
            a.n,
            a.depth,
            a.reps,
            gb(self.weight_bytes),
            gb(self.per_token),
            self.pp,
            self.tg,
            self.plans,
            self.stats.captures,
            self.stats.replays,
            self.stats.eager_runs
        );
        if let Some((prefill, decode)) = &self.profiles {
            out += &format!(
                "\nprefill of {} tokens, step by step (eager):\n{}\none decode step, step by step (eager):\n{}",
                a.p,
                profile_table(prefill),
                profile_table(decode)
            );
        }
        out
    }
}
