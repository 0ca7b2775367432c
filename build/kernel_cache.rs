//! The kernel cache of build.rs: compiled fatbins kept in `graft-kernels/` of the cargo
//! target folder, each under a hash of everything its nvcc run reads or is told (the
//! `.cu`, every header it may include, the flags, nvcc's version). The dev, test and
//! release profiles and builds with other features run build.rs separately (each in its
//! own OUT_DIR); with the cache they compile a kernel file once between them, and an edit
//! recompiles only the files whose hash it changes.
//!
//! An entry is `<module>-<hash>.fatbin` with nvcc's warnings in `<module>-<hash>.log`,
//! both written under a temporary name and renamed, so a build running at the same time
//! sees a whole entry or none. The newest [`KEEP`] entries of a module stay. Any failure
//! to read or write the cache only costs a compile.

use std::hash::{DefaultHasher, Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

/// Entries kept per module (e.g. one per architecture list in use).
pub const KEEP: usize = 4;

/// The cache of one build script run.
pub struct Cache {
    /// None when OUT_DIR is not inside a cargo target folder: nothing is cached.
    dir: Option<PathBuf>,
    /// The hash of the inputs every module shares.
    shared: u64,
}

/// One module's place in the cache.
pub struct Entry {
    fatbin: PathBuf,
    log: PathBuf,
}

impl Cache {
    /// The cache of the target folder that holds `out_dir`
    /// (`TARGET/PROFILE/build/PKG-HASH/out`), with `shared` the inputs common to every
    /// module (nvcc's version, the headers).
    pub fn open(out_dir: &Path, shared: &[Vec<u8>]) -> Cache {
        let in_target = out_dir.ends_with("out")
            && out_dir
                .parent()
                .and_then(Path::parent)
                .is_some_and(|b| b.ends_with("build"));
        let dir = in_target
            .then(|| out_dir.ancestors().nth(4))
            .flatten()
            .map(|target| target.join("graft-kernels"))
            .filter(|dir| std::fs::create_dir_all(dir).is_ok());
        Cache {
            dir,
            shared: hash(0, shared),
        }
    }

    /// The entry of module `name` built from `inputs` (its source, its flags).
    pub fn entry(&self, name: &str, inputs: &[&[u8]]) -> Option<Entry> {
        let dir = self.dir.as_ref()?;
        let key = hash(self.shared, inputs);
        Some(Entry {
            fatbin: dir.join(format!("{name}-{key:016x}.fatbin")),
            log: dir.join(format!("{name}-{key:016x}.log")),
        })
    }

    /// Copies the cached fatbin of `entry` to `dest` and returns nvcc's warnings of the
    /// compile that made it; None when it is not cached.
    pub fn fetch(&self, entry: &Entry, dest: &Path) -> Option<String> {
        std::fs::copy(&entry.fatbin, dest).ok()?;
        // Mark it used, for the pruning of `store`.
        if let Ok(f) = std::fs::File::options().write(true).open(&entry.fatbin) {
            let _ = f.set_modified(SystemTime::now());
        }
        Some(std::fs::read_to_string(&entry.log).unwrap_or_default())
    }

    /// Keeps `fatbin` and its `warnings` as `entry` of module `name`, then removes all but
    /// the newest [`KEEP`] entries of the module.
    pub fn store(&self, name: &str, entry: &Entry, fatbin: &Path, warnings: &str) {
        let tmp = |p: &Path| p.with_extension(format!("tmp{}", std::process::id()));
        let (log_tmp, fatbin_tmp) = (tmp(&entry.log), tmp(&entry.fatbin));
        let stored = std::fs::write(&log_tmp, warnings)
            .and_then(|()| std::fs::rename(&log_tmp, &entry.log))
            .and_then(|()| std::fs::copy(fatbin, &fatbin_tmp))
            .and_then(|_| std::fs::rename(&fatbin_tmp, &entry.fatbin));
        if let Err(e) = stored {
            println!(
                "cargo:warning=kernel cache: cannot keep {}: {e}",
                entry.fatbin.display()
            );
            let _ = std::fs::remove_file(&log_tmp);
            let _ = std::fs::remove_file(&fatbin_tmp);
            return;
        }
        if let Some(dir) = &self.dir {
            prune(dir, name);
        }
    }
}

/// Removes all but the newest [`KEEP`] entries of module `name` in `dir`.
fn prune(dir: &Path, name: &str) {
    let Ok(read) = std::fs::read_dir(dir) else {
        return;
    };
    let mut entries: Vec<(SystemTime, PathBuf)> = read
        .filter_map(|e| {
            let path = e.ok()?.path();
            let stem = path.file_name()?.to_str()?.strip_suffix(".fatbin")?;
            let (module, key) = stem.rsplit_once('-')?;
            if module != name || key.len() != 16 {
                return None;
            }
            Some((path.metadata().ok()?.modified().ok()?, path))
        })
        .collect();
    entries.sort_by_key(|e| std::cmp::Reverse(e.0));
    for (_, old) in entries.into_iter().skip(KEEP) {
        let _ = std::fs::remove_file(old.with_extension("log"));
        let _ = std::fs::remove_file(old);
    }
}

/// A hash of `parts` (each with its length, so that the split between parts counts)
/// after `seed`. std's hasher may change between Rust releases: that costs a compile.
fn hash<P: AsRef<[u8]>>(seed: u64, parts: &[P]) -> u64 {
    let mut h = DefaultHasher::new();
    seed.hash(&mut h);
    for p in parts {
        p.as_ref().hash(&mut h);
    }
    h.finish()
}
