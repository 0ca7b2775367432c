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

    /// A copy of the BF16 fixture `name` whose tensor `tensor` is all `bits` (0x7fc0: NaN).
    pub fn with_tensor_bits(name: &str, tensor: &str, bits: u16) -> TempCopy {
        let t = TempCopy::of(name);
        let (h, mut data) = split_safetensors(&t.path("model.safetensors"));
        let offs = &h[tensor]["data_offsets"];
        let (s, e) = (
            offs[0].as_u64().unwrap() as usize,
            offs[1].as_u64().unwrap() as usize,
        );
        for c in data[s..e].chunks_exact_mut(2) {
            c.copy_from_slice(&bits.to_le_bytes());
        }
        join_safetensors(&t.path("model.safetensors"), &h, &data);
        t
    }
}

/// The safetensors file at `path` split into its header (JSON) and data.
pub fn split_safetensors(path: &Path) -> (serde_json::Value, Vec<u8>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header, bytes[8 + n..].to_vec())
}

/// Writes a safetensors file from a header and data, the header padded to 8 bytes.
pub fn join_safetensors(path: &Path, header: &serde_json::Value, data: &[u8]) {
    let mut h = header.to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

impl Drop for TempCopy {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
