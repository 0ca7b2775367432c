//! `graft logits`: the logits of every position of a token sequence, from one prefill,
//! written as one F32 safetensors tensor `logits` [n_tokens, vocab].

use std::path::PathBuf;

use safetensors::tensor::TensorView;
use safetensors::Dtype;

use graft::files::{check_output, write_output_guarded};
use graft::{Error, Result};

use super::ModelArgs;

/// Arguments of `graft logits`.
#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    /// Token ids, comma-separated.
    #[arg(long, value_delimiter = ',', required = true)]
    token_ids: Vec<u32>,
    /// Output safetensors file (`-` for standard output; never one of the model's files).
    #[arg(long)]
    out: PathBuf,
    /// No progress bar and no summary on stderr.
    #[arg(long)]
    quiet: bool,
}

/// Runs `graft logits`.
pub fn run(a: Args) -> Result<()> {
    let path = a.model.path()?;
    let inputs = graft::models::load::safetensors::input_files(&path);
    check_output(&a.out, &inputs)?;
    let mut be = a.model.open_backend()?;
    let be = be.as_mut();
    let n = a.token_ids.len();
    let mut model = a.model.load(&path, be, Some(n.max(1)), a.quiet)?;
    let out = model.forward(be, &a.token_ids)?;
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
