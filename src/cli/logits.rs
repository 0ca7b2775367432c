//! `graft logits`: the logits of every position of a token sequence, from one prefill,
//! written as one F32 safetensors tensor `logits` [n_tokens, vocab].

use std::path::PathBuf;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use graft::models::Logits;
use graft::{Error, Result};

use super::{load_model, make_backend, BackendKind, CacheArgs};

/// Arguments of `graft logits`.
#[derive(clap::Args)]
pub struct Args {
    /// Hugging Face model folder.
    #[arg(long)]
    model: PathBuf,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
    /// Output safetensors file.
    #[arg(long)]
    out: PathBuf,
    /// Backend to run on.
    #[arg(long, value_enum, default_value_t = BackendKind::Cpu)]
    backend: BackendKind,
    /// No progress bar and no summary on stderr.
    #[arg(long)]
    quiet: bool,
    #[command(flatten)]
    cache: CacheArgs,
}

/// Runs `graft logits`.
pub fn run(a: Args) -> Result<()> {
    let mut be = make_backend(a.backend)?;
    let be = be.as_mut();
    let n = a.token_ids.len();
    let mut model = load_model(&a.model, be, Some(n.max(1)), &a.cache, a.quiet)?;
    let out = model.prefill(be, &a.token_ids, Logits::All)?;
    let vocab = model.config().vocab_size;
    let bytes: &[u8] = bytemuck::cast_slice(&out.logits);
    let view = TensorView::new(Dtype::F32, vec![n, vocab], bytes)
        .map_err(|e| Error::model(format!("logits [{n}, {vocab}]: {e}")))?;
    let meta =
        std::collections::HashMap::from([("token_ids".to_string(), format!("{:?}", a.token_ids))]);
    safetensors::serialize_to_file([("logits", view)], Some(meta), &a.out)
        .map_err(|e| Error::model(format!("{}: cannot write: {e}", a.out.display())))?;
    if !a.quiet {
        eprintln!(
            "wrote logits [{n}, {vocab}] F32 to {} (argmax of the last position: {})",
            a.out.display(),
            out.argmax
        );
    }
    Ok(())
}
