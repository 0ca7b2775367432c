//! The real default model (SmolLM2-135M-Instruct Q4_1) from graft's cache, for the tests
//! that run it. Included as a module by the tests that need it.

use std::path::PathBuf;

use graft::models::pull;

/// The verified cached default model, or `None` after saying why the caller skips: the
/// model is not in the cache (`graft pull` puts it there; CI pulls it before the tests).
pub fn cached_default_model() -> Option<PathBuf> {
    let Ok(dir) = pull::cache_dir() else {
        eprintln!("skipped: no cache folder");
        return None;
    };
    match pull::cached(&pull::DEFAULT_MODEL, &dir, &mut |_| {}) {
        Ok(Some(path)) => Some(path),
        Ok(None) | Err(_) => {
            let path = pull::cached_path(&pull::DEFAULT_MODEL, &dir);
            eprintln!(
                "skipped: {} is not in the cache (run `cargo run --release -- pull`)",
                path.display()
            );
            None
        }
    }
}
