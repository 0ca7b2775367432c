//! `graft bench-ops`: per-kernel bandwidth and FLOP rate of the CUDA backend at Llama-7B
//! sizes as a fraction of the measured device copy bandwidth, and a graph of a few
//! hundred small nodes run eagerly vs replayed (see `graft::backend::cuda::bench`).

use graft::Result;

/// Arguments of `graft bench-ops`.
#[derive(clap::Args)]
pub struct Args {
    /// Timed runs per case (the median batch counts).
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// GPU ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Only the op cases whose name contains this text (e.g. `attn`).
    #[arg(long)]
    filter: Option<String>,
    /// Print JSON instead of markdown tables.
    #[arg(long)]
    json: bool,
    /// Also write the JSON report to this file.
    #[arg(long)]
    json_out: Option<std::path::PathBuf>,
}

/// Runs `graft bench-ops`.
#[cfg(feature = "cuda")]
pub fn run(a: Args) -> Result<()> {
    use graft::backend::cuda::bench::{run_bench_ops, BenchOptions};
    let report = run_bench_ops(&BenchOptions {
        device: a.device,
        iters: a.iters,
        filter: a.filter,
    })?;
    let json = serde_json::to_string_pretty(&report)
        .map_err(|e| graft::Error::plan(format!("bench-ops: cannot serialize the report: {e}")))?;
    if let Some(path) = &a.json_out {
        graft::files::write_output(path, |w| std::io::Write::write_all(w, json.as_bytes()))?;
    }
    super::print_out(&if a.json {
        json + "\n"
    } else {
        report.markdown()
    })
}

/// Runs `graft bench-ops`: without the CUDA backend there is nothing to measure.
#[cfg(not(feature = "cuda"))]
pub fn run(a: Args) -> Result<()> {
    let _ = (a.iters, a.device, a.filter, a.json, a.json_out);
    Err(graft::Error::NoDevice(
        "bench-ops measures the CUDA backend; rebuild with --features cuda".into(),
    ))
}
