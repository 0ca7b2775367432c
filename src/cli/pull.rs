//! `graft pull`: download the default model into the cache (see `graft::models::pull`).

use graft::models::pull::{self, Pulled, DEFAULT_MODEL};
use graft::Result;

use super::print_out;

/// Arguments of `graft pull`.
#[derive(clap::Args)]
pub struct Args {}

/// Runs `graft pull`: messages on stderr, the model's path on stdout.
pub fn run(_a: Args) -> Result<()> {
    let dir = pull::cache_dir()?;
    let pulled = pull::pull(&DEFAULT_MODEL, &dir, &mut |m| eprintln!("{m}"))?;
    if let Pulled::Cached(path) = &pulled {
        eprintln!(
            "{} is already in the cache: {}",
            DEFAULT_MODEL.name,
            path.display()
        );
    }
    print_out(&format!("{}\n", pulled.path().display()))
}
