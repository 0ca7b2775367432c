//! `graft logits`: the logits of every position of a token sequence, from one prefill,
//! written as one F32 safetensors tensor `logits` [n_tokens, vocab].

use std::path::PathBuf;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use graft::files::{check_output, write_output_guarded};
use graft::models::Logits;
use graft::{Error, Result};

use super::{load_model, make_backend, BackendKind, CacheArgs, DTypeArg};

/// Arguments of `graft logits`.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model folder.
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
    /// Output safetensors file (`-` for standard output; never one of the model's files).
    #[arg(long)]
    out: PathBuf,
    /// Quantize (or convert) the matrices while loading: one type for all, or ggml's
    /// q4_k_m / q5_k_m mixes (norms stay F32).
    #[arg(long, value_enum)]
    quantize: Option<DTypeArg>,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// Split the model over N devices (tensor parallelism: heads and the MLP divided,
    /// partial sums joined by all_reduce); on the CPU backend, N simulated devices.
    #[arg(long, default_value_t = 1)]
    tp: usize,
    /// No progress bar and no summary on stderr.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

/// Runs `graft logits`.
pub fn run(a: Args) -> Result<()> {
    let inputs = graft::models::load::safetensors::input_files(&a.model);
    check_output(&a.out, &inputs)?;
    let mut be = make_backend(a.backend, a.tp)?;
    let be = be.as_mut();
    let n = a.token_ids.len();
    let mut model = load_model(&a.model, be, Some(n.max(1)), a.quantize, &a.cache, a.quiet)?;
    let out = model.prefill(be, &a.token_ids, Logits::All)?;
    let vocab = model.config().vocab_size;
    let bytes: &[u8] = bytemuck::cast_slice(&out.logits);
    let view = TensorView::new(Dtype::F32, vec![n, vocab], bytes)
        .map_err(|e| Error::model(format!("logits [{n}, {vocab}]: {e}")))?;
    let meta =
        std::collections::HashMap::from([("token_ids".to_string(), format!("{:?}", a.token_ids))]);
    let bytes = safetensors::serialize([("logits", view)], Some(meta))
        .map_err(|e| Error::model(format!("{}: cannot serialize: {e}", a.out.display())))?;
    write_output_guarded(&a.out, &inputs, |w| w.write_all(&bytes))?;
    if !a.quiet {
        eprintln!(
            "wrote logits [{n}, {vocab}] F32 to {} (argmax of the last position: {})",
            a.out.display(),
            out.argmax
        );
    }
    Ok(())
}
