//! The committed model fixtures (tests/fixtures) and scratch copies of them, shared by the
//! model, loader and CLI tests (each includes this file as a module).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The fixtures folder: `GRAFT_FIXTURES` if set (a test binary run outside the source
/// tree, e.g. from the GPU bundle), else `tests/fixtures` of this crate.
pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("GRAFT_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"))
}

/// The folder of fixture `name`.
pub fn fixture(name: &str) -> PathBuf {
    fixtures_dir().join(name)
}

/// A copy of a fixture folder in a fresh temporary directory, removed on drop.
pub struct TempCopy(PathBuf);

impl TempCopy {
    /// Copies fixture `name`.
    pub fn of(name: &str) -> TempCopy {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "graft-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        for entry in std::fs::read_dir(fixture(name)).unwrap() {
            let p = entry.unwrap().path();
            std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
        }
        TempCopy(dir)
    }

    /// A file of the copy.
    pub fn path(&self, file: &str) -> PathBuf {
        self.0.join(file)
    }

    /// The copy's folder as a command-line argument.
    pub fn dir(&self) -> &str {
        self.0.to_str().unwrap()
    }
}

impl Drop for TempCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
