//! Writing an output file without losing data: [`write_output`].

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// Writes a file through `write`, so that a failure never leaves a half-written file in
/// place of a good one.
///
/// - an absent path, or a regular file: written to a temporary file in the same folder,
///   then renamed over the target only once complete (a regular file keeps its
///   permissions); on failure the temporary file is removed and the target is untouched;
/// - a symlink: the file it points to is treated as the target (the link stays a link);
/// - a device or FIFO: written in place, never replaced;
/// - a directory: an error.
pub fn write_output(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let target = resolve(path)?;
    match fs::metadata(&target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => replace(&target, None, write),
        Err(e) => Err(Error::io(path, e)),
        Ok(m) if m.is_file() => replace(&target, Some(m.permissions()), write),
        Ok(m) if m.is_dir() => Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory"),
        )),
        Ok(_) => in_place(&target, write),
    }
}

/// The path itself, or the file a symlink points to.
fn resolve(path: &Path) -> Result<PathBuf> {
    match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => fs::canonicalize(path).map_err(|e| {
            Error::io(
                path,
                std::io::Error::new(e.kind(), format!("cannot follow the symlink: {e}")),
            )
        }),
        Ok(_) | Err(_) => Ok(path.to_path_buf()),
    }
}

/// Writes into a fresh temporary file next to `target`, then renames it over `target`.
fn replace(
    target: &Path,
    perms: Option<Permissions>,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let (tmp, file) = temp_next_to(target)?;
    let done = (|| {
        // The mode first, so that the data is never readable more widely than before.
        if let Some(p) = perms {
            file.set_permissions(p)?;
        }
        let mut w = BufWriter::new(file);
        write(&mut w)?;
        let file = w.into_inner().map_err(|e| e.into_error())?;
        file.sync_all()?;
        fs::rename(&tmp, target)
    })();
    done.map_err(|e| {
        // Best effort: the temporary file is ours and of no use now.
        let _ = fs::remove_file(&tmp);
        Error::io(target, e)
    })
}

/// A new, empty temporary file in `target`'s folder.
fn temp_next_to(target: &Path) -> Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        Some(_) | None => Path::new("."),
    };
    let name = target
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.tmp-{}-{n}", std::process::id()));
        match OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(Error::io(&tmp, e)),
        }
    }
}

/// Writes into `target` as it is (a device or FIFO), without creating or replacing it.
fn in_place(
    target: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    let file = OpenOptions::new()
        .write(true)
        .open(target)
        .map_err(|e| Error::io(target, e))?;
    let mut w = BufWriter::new(file);
    write(&mut w)
        .and_then(|()| w.flush())
        .map_err(|e| Error::io(target, e))
}
