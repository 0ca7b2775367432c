//! `graft bench`: prompt-processing and generation speed of a preset model with seeded
//! random weights made on the device (no download, no host copy).
//!
//! Prompt processing: one prefill of `-p` tokens to build and load the plan (and let a
//! capturing backend capture it), then `--reps` timed prefills that replay it. Generation:
//! one decode step to build the first bucket's plan, the cache rewound, then `-n` timed
//! greedy decode steps as `graft generate` runs them ([`Model::decode_greedy`]: each
//! step's argmax fed to the next on the device, the host a step behind). The
//! memory-bandwidth roofline fraction is `weight bytes read per token x gen tokens/s /
//! copy bandwidth`. With `--profile`, one more prefill and decode step run with step
//! profiling on, and a table says where their time goes.

use std::time::Instant;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use graft::backend::profile_table;
use graft::models::{Logits, Model, QuantPlan};
use graft::Result;

use super::dump::preset;
use super::{load_model, make_backend, print_out, BackendKind, CacheArgs, DTypeArg};

/// Arguments of `graft bench`.
#[derive(clap::Args)]
pub struct Args {
    /// Model shape: tiny, llama2-7b or llama3-8b (seeded random weights).
    #[arg(long, required_unless_present = "model", conflicts_with = "model")]
    preset: Option<String>,
    /// A model file or folder (a `.gguf` file or an HF folder) instead of a preset: its
    /// own weights, in the types it stores (or `--quantize`d).
    #[arg(long)]
    model: Option<std::path::PathBuf>,
    /// With --model: quantize its weights while loading.
    #[arg(long, value_enum, requires = "model")]
    quantize: Option<DTypeArg>,
    /// Weight dtype, or a quantization mix (block types are quantized on the device from
    /// F32 random values).
    #[arg(long, value_enum, default_value_t = DTypeArg::F16)]
    dtype: DTypeArg,
    /// Prompt tokens per prefill.
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    p: usize,
    /// Decode steps.
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n: usize,
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
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Split the model over N devices (tensor parallelism: heads and the MLP divided,
    /// partial sums joined by all_reduce); on the CPU backend, N simulated devices.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// Print one JSON object.
    #[arg(long)]
    json: bool,
    /// Also time every step of one prefill and one decode step (eagerly) and print
    /// where the time goes.
    #[arg(long)]
    profile: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

/// The backend, and the copy bandwidth to compare with: the one given, else measured on
/// a CUDA device.
fn open_backend(
    kind: BackendKind,
    tp: usize,
    given: Option<f64>,
) -> Result<(Box<dyn graft::backend::Backend>, Option<f64>)> {
    #[cfg(feature = "cuda")]
    if kind == BackendKind::Cuda {
        // GPU 0's copy bandwidth: with --tp each GPU reads its own share of the weights at
        // its own bandwidth, and the roofline compares per-device bytes with it.
        let mut be = graft::backend::cuda::CudaBackend::new(0)?;
        let bw = match given {
            Some(bw) => bw,
            None => graft::backend::cuda::bench::copy_bandwidth(&mut be)?,
        };
        if tp == 1 {
            return Ok((Box::new(be), Some(bw)));
        }
        drop(be);
        return Ok((make_backend(kind, tp)?, Some(bw)));
    }
    Ok((make_backend(kind, tp)?, given))
}

/// Runs `graft bench`.
pub fn run(a: Args) -> Result<()> {
    if a.p == 0 || a.n == 0 || a.reps == 0 {
        return Err(graft::Error::model("-p, -n and --reps must be at least 1"));
    }
    if let Some(bw) = a.copy_bw.filter(|bw| !(bw.is_finite() && *bw > 0.0)) {
        return Err(graft::Error::model(format!(
            "--copy-bw {bw}: the copy bandwidth must be a positive number of GB/s"
        )));
    }
    let (mut be, copy_bw) = open_backend(a.backend, a.tp, a.copy_bw)?;
    let be = be.as_mut();
    let ctx =
        a.p.checked_add(a.n)
            .ok_or_else(|| graft::Error::model("-p + -n overflows"))?;
    let (mut model, label, dtype) = match (&a.model, &a.preset) {
        (Some(path), _) => {
            let m = load_model(path, be, Some(ctx), a.quantize, &a.cache, true)?;
            let dtype = a.quantize.map_or("as stored".to_string(), |q| {
                QuantPlan::from(q).name().to_string()
            });
            (m, path.display().to_string(), dtype)
        }
        (None, Some(name)) => {
            let plan = QuantPlan::from(a.dtype);
            let m = Model::random(preset(name)?, plan, ctx, a.cache.types(), a.seed, be)?;
            (m, name.clone(), plan.name().to_string())
        }
        (None, None) => return Err(graft::Error::model("give --preset or --model")),
    };
    let cfg = model.config().clone();
    let mut rng = StdRng::seed_from_u64(a.seed);
    let prompt: Vec<u32> = (0..a.p)
        .map(|_| rng.random_range(0..cfg.vocab_size as u32))
        .collect();

    // Prompt processing: warm up, then time replays of the same plan.
    model.prefill(be, &prompt, Logits::None)?;
    let mut secs = Vec::new();
    for _ in 0..a.reps {
        model.reset();
        let t = Instant::now();
        model.prefill(be, &prompt, Logits::None)?;
        secs.push(t.elapsed().as_secs_f64());
    }
    secs.sort_by(f64::total_cmp);
    let pp = a.p as f64 / secs[secs.len() / 2];

    // Generation: warm up the first bucket's plan, rewind, time n greedy steps (the host
    // a step behind the device, as `graft generate` runs them).
    let mut tok = {
        model.reset();
        model.prefill(be, &prompt, Logits::None)?.argmax
    };
    model.decode_step(be, tok, false)?;
    model.truncate(a.p);
    let t = Instant::now();
    let first = tok;
    model.decode_greedy(be, first, a.n, &mut |t| {
        tok = t;
        Ok(true)
    })?;
    let tg = a.n as f64 / t.elapsed().as_secs_f64();

    let stats = be.stats();
    let plans = model.plan_counts();
    // Profiles after the timed runs, so they change none of the figures above.
    let profiles = if a.profile {
        be.set_profiling(true);
        model.reset();
        model.prefill(be, &prompt, Logits::None)?;
        let prefill = be.take_profile();
        model.decode_step(be, tok, false)?;
        let decode = be.take_profile();
        be.set_profiling(false);
        Some((prefill, decode))
    } else {
        None
    };
    let weight_bytes = model.weights().bytes;
    // per device: each device reads its share of the weights, at its own bandwidth
    let per_token = model.weights().bytes_per_token(model.shard());
    let devices = be.devices();
    let roofline = copy_bw.map(|bw| per_token as f64 * tg / (bw * 1e9));
    if a.json {
        let obj = json!({
            "model": label,
            "dtype": dtype,
            "backend": be.name(),
            "n_prompt": a.p,
            "n_gen": a.n,
            "reps": a.reps,
            "prompt_tokens_per_s": pp,
            "gen_tokens_per_s": tg,
            "devices": devices,
            "weight_bytes": weight_bytes,
            "weight_bytes_per_token": per_token,
            "kv_cache_bytes": model.cache().bytes(),
            "copy_bw_gbps": copy_bw,
            "roofline_fraction": roofline,
            "plans": {"prefill": plans.prefill, "decode": plans.decode},
            "captures": stats.captures,
            "replays": stats.replays,
            "eager_runs": stats.eager_runs,
            "profile": profiles.as_ref().map(|(p, d)| json!({
                "prefill_us": p.iter().map(|r| r.us).sum::<f64>(),
                "decode_us": d.iter().map(|r| r.us).sum::<f64>(),
                "prefill": p.iter().map(|r| json!({"name": r.name, "op": r.op, "kernels": r.kernels, "us": r.us})).collect::<Vec<_>>(),
                "decode": d.iter().map(|r| json!({"name": r.name, "op": r.op, "kernels": r.kernels, "us": r.us})).collect::<Vec<_>>(),
            })),
        });
        print_out(&format!("{obj}\n"))?;
    } else {
        let gb = |b: usize| b as f64 / 1e9;
        let roof = match (roofline, copy_bw) {
            (Some(f), Some(bw)) => format!("{:.1}% of {bw:.0} GB/s", f * 100.0),
            _ => "unknown (pass --copy-bw GBPS)".into(),
        };
        print_out(&format!(
            "graft bench: {} {} on {} (p={}, n={}, {} reps)\n\
             \x20 weights     {:.3} GB ({:.3} GB read per token){}\n\
             \x20 prompt      {:>10.1} tok/s\n\
             \x20 generation  {:>10.1} tok/s\n\
             \x20 roofline    {roof}\n\
             \x20 plans       {} prefill, {} decode; {} captures, {} replays, {} eager runs\n",
            label,
            dtype,
            be.name(),
            a.p,
            a.n,
            a.reps,
            gb(weight_bytes),
            gb(per_token),
            match devices {
                1 => String::new(),
                n => format!(" per device, {n} devices"),
            },
            pp,
            tg,
            plans.prefill,
            plans.decode,
            stats.captures,
            stats.replays,
            stats.eager_runs
        ))?;
        if let Some((prefill, decode)) = &profiles {
            print_out(&format!(
                "\nprefill of {} tokens, step by step (eager):\n{}\none decode step, step by step (eager):\n{}",
                a.p,
                profile_table(prefill),
                profile_table(decode)
            ))?;
        }
    }
    Ok(())
}
