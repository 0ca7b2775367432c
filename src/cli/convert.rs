//! `graft convert`: a Hugging Face model folder written as a GGUF file llama.cpp reads,
//! its matrices in one type or one of ggml's K-quant mixes.

use std::path::PathBuf;

use graft::models::convert::convert;
use graft::models::QuantPlan;
use graft::Result;

use super::DTypeArg;

/// Arguments of `graft convert`.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model folder (config.json, safetensors weights, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Type of the matrices (norms stay F32): f32, f16, bf16, q8_0, q4_0, q4_1, q5_0,
    /// q5_1, q4_k, q5_k, q6_k, or ggml's mixes q4_k_m, q5_k_m, q2_k, q3_k_s, q3_k_m,
    /// q3_k_l, iq4_nl and iq4_xs.
    #[arg(long = "type", value_enum)]
    ty: DTypeArg,
    /// Output GGUF file (written to a temporary file, then renamed into place).
    #[arg(long)]
    out: PathBuf,
    /// general.name (default: the folder's name).
    #[arg(long)]
    name: Option<String>,
    /// No summary on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Runs `graft convert`.
pub fn run(a: Args) -> Result<()> {
    let plan = QuantPlan::from(a.ty);
    graft::files::check_output(
        &a.out,
        &graft::models::load::safetensors::input_files(&a.model),
    )?;
    let done = convert(&a.model, plan, &a.out, a.name.as_deref())?;
    if !a.quiet {
        for note in &done.notes {
            eprintln!("{note}");
        }
        if !done.tokenizer {
            eprintln!(
                "warning: no tokenizer.json in {}: the GGUF has no tokenizer metadata",
                a.model.display()
            );
        }
        eprintln!(
            "wrote {} ({plan}, {} tensors, {:.1} MB of tensor data)",
            a.out.display(),
            done.tensors,
            done.data_bytes as f64 / 1e6
        );
    }
    Ok(())
}
