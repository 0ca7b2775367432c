//! `graft trace`: every named intermediate of one prefill (the embedding, each block's
//! norms, q/k/v, attention, MLP and residuals, the final norm, the logits), written to a
//! safetensors file and/or compared with another trace (an HF transformers run written by
//! `scripts/hf-trace.py`, or graft on another backend) to find the first tensor where
//! the two part ways. The comparison itself lives in [`graft::models::runtime::trace`].
//!
//! Exit status: 0 when nothing crosses the threshold (or nothing was compared), 1 when a
//! divergence is found (the report says where; no `error:` line), and for an error,
//! `error: ...` on stderr and 1 as for every command.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::{json, Value};

use graft::backend::Backend;
use graft::files::{check_output, write_output_guarded};
use graft::models::load::safetensors::input_files;
use graft::models::runtime::trace::{
    check_same_tokens, compare, stats, Compared, Comparison, Stats, Trace,
};
use graft::models::text::tokenizer;
use graft::{Error, Result};

use super::model_args::make_backend;
use super::{print_out, read_prompt, BackendKind, ModelArgs};

/// The exit status of a comparison that found a divergence: an outcome, reported on
/// stdout, not an error (which also exits with 1, after `error: ...` on stderr).
const DIVERGED: u8 = 1;

/// Arguments of `graft trace`: the prompt is one of --prompt, --prompt-file, --tokens.
#[derive(clap::Args)]
#[command(
    group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "tokens"])),
    override_usage = "graft trace [--model FILE.gguf|DIR] (--prompt TEXT | -f FILE | --tokens 1,2,3) [OPTIONS]"
)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt text (needs the model's tokenizer; BOS is added as it says).
    #[arg(long, conflicts_with_all = ["prompt_file", "tokens"])]
    prompt: Option<String>,
    /// Read the prompt text from a file (`-` for standard input).
    #[arg(short = 'f', long, conflicts_with = "tokens")]
    prompt_file: Option<PathBuf>,
    /// Prompt token ids, comma-separated (works without a tokenizer).
    #[arg(long, visible_alias = "token-ids", value_delimiter = ',')]
    tokens: Option<Vec<u32>>,
    /// Write every traced tensor (F32) to this safetensors file (`-` for standard output;
    /// never one of the model's files or the --against file).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Compare with this trace file (the reference), e.g. one written by
    /// scripts/hf-trace.py over the same tokens.
    #[arg(long)]
    against: Option<PathBuf>,
    /// The largest NMSE = sum((a-b)^2)/sum(b^2) (b the reference) that is not a divergence.
    #[arg(long, default_value_t = 1e-4)]
    threshold: f64,
    /// Run on these backends instead, comma-separated; with two (`cpu,cuda`), compare the
    /// second's trace against the first's.
    #[arg(long, value_enum, value_delimiter = ',', conflicts_with = "backend")]
    backends: Option<Vec<BackendKind>>,
    /// Print one JSON object instead of the text report.
    #[arg(long)]
    json: bool,
    /// No progress bar and no summary on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Runs `graft trace`; the exit status says whether a comparison diverged.
pub fn run(a: Args) -> Result<ExitCode> {
    let backends = backends(&a)?;
    let path = a.model.path()?;
    let tokens = prompt_tokens(&a, &path)?;
    let mut inputs = input_files(&path);
    let reference = match &a.against {
        Some(path) => Some(load_reference(path, &tokens)?),
        None => None,
    };
    inputs.extend(a.against.clone());
    if let Some(out) = &a.out {
        check_output(out, &inputs)?;
    }
    // Every backend opened before any runs: a missing GPU is an error at once.
    let mut opened = Vec::with_capacity(backends.len());
    for &kind in &backends {
        opened.push(make_backend(kind, a.model.tp)?);
    }
    let mut traces = Vec::with_capacity(backends.len());
    for be in &mut opened {
        traces.push(run_trace(&a, &path, be.as_mut(), &tokens)?);
    }
    if let (Some(out), Some(ours)) = (&a.out, traces.first()) {
        write_trace(&a, out, &inputs, ours)?;
    }
    let (ours, reference) = match (&reference, traces.as_slice()) {
        (Some(r), [ours]) => (ours, r),
        (None, [r, ours]) => (ours, r),
        (None, [ours]) if a.out.is_none() => {
            return summary(ours, a.json).map(|()| ExitCode::SUCCESS)
        }
        (Some(_) | None, _) => return Ok(ExitCode::SUCCESS),
    };
    let c = compare(&ours.tensors, &reference.tensors, a.threshold);
    match a.json {
        true => print_out(&format!("{}\n", report_json(&c, ours, reference)))?,
        false => print_out(&report_text(&c, ours, reference))?,
    }
    Ok(match c.first_divergence {
        Some(_) => ExitCode::from(DIVERGED),
        None => ExitCode::SUCCESS,
    })
}

/// The backends to run, checked against the other options.
fn backends(a: &Args) -> Result<Vec<BackendKind>> {
    if !(a.threshold >= 0.0 && a.threshold.is_finite()) {
        return Err(Error::model(format!(
            "--threshold {}: give a finite NMSE >= 0",
            a.threshold
        )));
    }
    if a.model.tp != 1 {
        return Err(Error::model(format!(
            "--tp {}: trace records the intermediates of one device's whole model; run it without --tp",
            a.model.tp
        )));
    }
    let list = a.backends.clone().unwrap_or_else(|| vec![a.model.backend]);
    match (list.len(), &a.against, &a.out) {
        (0, _, _) => Err(Error::model("--backends: name one or two backends")),
        (1, Some(_), Some(out)) if out.as_os_str() == graft::files::STDOUT => Err(Error::model(
            "--out - and --against would both write to standard output; write the trace to a file",
        )),
        (1, _, _) => Ok(list),
        (2, None, None) => Ok(list),
        (2, Some(_), _) => Err(Error::model(
            "--backends with two backends compares them with each other; --against takes one backend",
        )),
        (2, None, Some(_)) => Err(Error::model(
            "--backends with two backends compares them; --out writes one backend's trace, so give one",
        )),
        (n, _, _) => Err(Error::model(format!(
            "--backends names {n} backends; give one, or two to compare (cpu,cuda)"
        ))),
    }
}

/// The prompt's token ids: `--tokens`, or `--prompt` / `--prompt-file` encoded with the
/// model's tokenizer.
fn prompt_tokens(a: &Args, path: &Path) -> Result<Vec<u32>> {
    let text = match (&a.prompt, &a.prompt_file, &a.tokens) {
        (_, _, Some(ids)) => return Ok(ids.clone()),
        (Some(text), _, None) => text.clone(),
        (None, Some(path), None) => read_prompt(path, "--prompt-file")?,
        (None, None, None) => return Err(Error::model("give --prompt, --prompt-file or --tokens")),
    };
    match tokenizer::for_model(path)? {
        Some(t) => t.tokenizer.encode(&text),
        None => Err(Error::model(format!(
            "--prompt needs a tokenizer.json in {} (or tokenizer metadata in a .gguf file); pass --tokens instead",
            path.display()
        ))),
    }
}

/// The `--against` trace, checked to be over `tokens` before any model runs.
fn load_reference(path: &Path, tokens: &[u32]) -> Result<Trace> {
    let reference = Trace::read(path)?;
    let ours = Trace {
        tensors: Vec::new(),
        tokens: tokens.to_vec(),
        source: String::new(),
    };
    check_same_tokens(&ours, &reference, &format!("--against {}", path.display()))?;
    Ok(reference)
}

/// Loads the model at `path` on `be`, traces `tokens` and frees the model's buffers.
fn run_trace(a: &Args, path: &Path, be: &mut dyn Backend, tokens: &[u32]) -> Result<Trace> {
    let ctx = Some(tokens.len().max(1));
    let mut model = a.model.load(path, be, ctx, a.quiet || a.json)?;
    let tensors = model.trace(be, tokens)?;
    model.release(be)?;
    Ok(Trace {
        tensors,
        tokens: tokens.to_vec(),
        source: format!("graft {} {}", path.display(), be.name()),
    })
}

/// Writes `trace` to `out` (never over one of `inputs`).
fn write_trace(a: &Args, out: &Path, inputs: &[PathBuf], trace: &Trace) -> Result<()> {
    let bytes = trace.to_safetensors()?;
    write_output_guarded(out, inputs, |w| w.write_all(&bytes))?;
    if !a.quiet {
        eprintln!(
            "wrote {} tensors over {} tokens ({}) to {}",
            trace.tensors.len(),
            trace.tokens.len(),
            trace.source,
            out.display()
        );
    }
    Ok(())
}

/// Prints a trace's tensors with their statistics (no comparison asked for).
fn summary(trace: &Trace, json: bool) -> Result<()> {
    if json {
        let tensors: Vec<Value> = trace
            .tensors
            .iter()
            .map(
                |t| json!({"name": t.name, "shape": t.shape, "stats": stats_json(&stats(&t.data))}),
            )
            .collect();
        let obj = json!({"source": trace.source, "tokens": trace.tokens, "tensors": tensors});
        return print_out(&format!("{obj}\n"));
    }
    let mut s = format!(
        "{}, {} tokens\n{:<20} {:<18} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        trace.source,
        trace.tokens.len(),
        "tensor",
        "shape",
        "mean",
        "std",
        "min",
        "max",
        "non-finite"
    );
    for t in &trace.tensors {
        let st = stats(&t.data);
        s += &format!(
            "{:<20} {:<18} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
            t.name,
            format!("{:?}", t.shape),
            num(st.mean),
            num(st.std),
            num(st.min),
            num(st.max),
            st.non_finite
        );
    }
    print_out(&s)
}

/// A number in the report: 3 significant digits.
fn num(x: f64) -> String {
    format!("{x:.2e}")
}

/// The text report: one line per compared tensor up to the first divergence, then that
/// tensor's details (or the largest NMSE seen), then the names only one side has.
fn report_text(c: &Comparison, ours: &Trace, reference: &Trace) -> String {
    let mut s = format!(
        "ours:      {}\nreference: {}\n{} tokens, threshold nmse {:e}\n\n{:<20} {:<18} {:>10} {:>10}\n",
        ours.source,
        reference.source,
        ours.tokens.len(),
        c.threshold,
        "tensor",
        "shape",
        "nmse",
        "max|diff|"
    );
    let shown = c.first_divergence.map_or(c.compared.len(), |i| i + 1);
    for t in &c.compared[..shown] {
        let (nmse, max) = t
            .diff
            .map_or(("-".into(), "-".into()), |d| (num(d.nmse), num(d.max_abs)));
        let mark = if t.diverged { "  <- diverges" } else { "" };
        s += &format!(
            "{:<20} {:<18} {nmse:>10} {max:>10}{mark}\n",
            t.name,
            format!("{:?}", t.shape)
        );
    }
    match c.divergence() {
        Some(t) => s += &divergence_text(c, t, shown),
        None => s += &agreement_text(c),
    }
    s + &not_compared_text(c)
}

/// The block describing the first divergent tensor.
fn divergence_text(c: &Comparison, t: &Compared, shown: usize) -> String {
    let mut s = match t.diff {
        Some(d) => format!(
            "\nfirst divergence: {} {:?}: nmse {} > {:e}\n",
            t.name,
            t.shape,
            num(d.nmse),
            c.threshold
        ),
        None => format!(
            "\nfirst divergence: {}: shape {:?} here, {:?} in the reference\n",
            t.name, t.shape, t.reference_shape
        ),
    };
    s += &format!(
        "  {:<10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
        "", "mean", "std", "min", "max", "rms", "non-finite"
    );
    for (label, st) in [("ours", t.stats), ("reference", t.reference_stats)] {
        s += &format!(
            "  {label:<10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}\n",
            num(st.mean),
            num(st.std),
            num(st.min),
            num(st.max),
            num(st.rms),
            st.non_finite
        );
    }
    if let (Some(p), Some(d)) = (t.position, t.diff) {
        s += &format!(
            "  largest |diff| {} at token {}, flat index {} (ours {}, reference {})\n",
            num(d.max_abs),
            p.token,
            p.flat,
            p.ours,
            p.reference
        );
    }
    let later = c.compared.len() - shown;
    if later > 0 {
        s += &format!("  ({later} later tensors compared but not shown; --json lists them)\n");
    }
    s
}

/// The closing line when nothing diverged: how many tensors, and the largest NMSE.
fn agreement_text(c: &Comparison) -> String {
    match c.worst().and_then(|w| w.diff.map(|d| (w, d))) {
        Some((w, d)) => format!(
            "\nno divergence: {} tensors within nmse {:e} (largest: {} at {})\n",
            c.compared.len(),
            c.threshold,
            num(d.nmse),
            w.name
        ),
        None => "\nnothing compared: the traces share no tensor name\n".into(),
    }
}

/// The names only one side has.
fn not_compared_text(c: &Comparison) -> String {
    let mut s = String::new();
    for (side, names) in [("ours", &c.only_ours), ("the reference", &c.only_reference)] {
        if !names.is_empty() {
            s += &format!("not compared (only in {side}): {}\n", names.join(", "));
        }
    }
    s
}

/// The JSON report (see the README): non-finite numbers are `null`.
fn report_json(c: &Comparison, ours: &Trace, reference: &Trace) -> Value {
    let entry = |t: &Compared| {
        json!({
            "name": t.name,
            "shape": t.shape,
            "reference_shape": t.reference_shape,
            "nmse": t.diff.map(|d| d.nmse),
            "max_abs_diff": t.diff.map(|d| d.max_abs),
            "diverged": t.diverged,
        })
    };
    let first = c.divergence().map(|t| {
        let mut v = entry(t);
        v["position"] = t.position.map_or(Value::Null, |p| {
            json!({"token": p.token, "flat_index": p.flat, "ours": p.ours, "reference": p.reference})
        });
        v["stats"] = json!({"ours": stats_json(&t.stats), "reference": stats_json(&t.reference_stats)});
        v
    });
    let not_compared: Vec<Value> = (c
        .only_ours
        .iter()
        .map(|n| json!({"name": n, "only_in": "ours"})))
    .chain(
        c.only_reference
            .iter()
            .map(|n| json!({"name": n, "only_in": "reference"})),
    )
    .collect();
    json!({
        "ours": ours.source,
        "reference": reference.source,
        "tokens": ours.tokens,
        "threshold": c.threshold,
        "first_divergence": first,
        "compared": c.compared.iter().map(entry).collect::<Vec<_>>(),
        "not_compared": not_compared,
    })
}

/// A tensor's statistics as JSON.
fn stats_json(s: &Stats) -> Value {
    json!({"mean": s.mean, "std": s.std, "min": s.min, "max": s.max, "rms": s.rms, "non_finite": s.non_finite})
}
