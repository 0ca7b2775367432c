//! Files in and out, without losing data and without hanging.
//!
//! - Outputs go through [`write_output`] (or [`write_output_guarded`], which also refuses
//!   to overwrite a run's own inputs): a regular file is replaced only once the new one is
//!   complete, a device, FIFO or `-` (standard output) is written in place, a symlink is
//!   written through.
//! - Inputs are opened with [`open_regular`] / [`read_regular`]: only regular files, so a
//!   FIFO or a device named as a model file is an error at once, not a hang.
//! - Paths named inside a model folder (the shards of a safetensors index) are resolved
//!   with [`join_inside`], which refuses any that would leave the folder.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{BufWriter, Read, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use crate::{Error, Result};

/// The output path that means standard output.
pub const STDOUT: &str = "-";

/// Writes a file through `write`, so that a failure never leaves a half-written file in
/// place of a good one.
///
/// - `-`: standard output;
/// - an absent path, or a regular file: written to a temporary file in the same folder,
///   then renamed over the target only once complete (a regular file keeps its
///   permissions); on failure the temporary file is removed and the target is untouched;
/// - a symlink: the file it points to is treated as the target (the link stays a link);
///   a dangling link is an error;
/// - a device or FIFO: written in place, never replaced;
/// - a directory: an error.
///
/// Every error names the path.
pub fn write_output(
    path: &Path,
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    write_output_guarded(path, &[], write)
}

/// [`write_output`], refusing a target that is one of `inputs` (the same file, compared
/// by device and inode, so another spelling, a symlink or a hard link is caught too):
/// the error names the target and the input.
pub fn write_output_guarded(
    path: &Path,
    inputs: &[PathBuf],
    write: impl FnOnce(&mut dyn Write) -> std::io::Result<()>,
) -> Result<()> {
    if path.as_os_str() == STDOUT {
        let mut out = std::io::stdout().lock();
        return write(&mut out)
            .and_then(|()| out.flush())
            .map_err(|e| Error::io("standard output", e));
    }
    let (target, meta) = check_output(path, inputs)?;
    match meta {
        None => replace(&target, None, write),
        Some(m) if m.is_file() => replace(&target, Some(m.permissions()), write),
        Some(_) => in_place(&target, write),
    }
}

/// Checks, before any work is done, that [`write_output_guarded`] can write `path`: not
/// a directory, not a dangling symlink, not one of `inputs`. Returns the file to write
/// (a symlink resolved) and its metadata (`None` when it does not exist yet).
pub fn check_output(path: &Path, inputs: &[PathBuf]) -> Result<(PathBuf, Option<fs::Metadata>)> {
    if path.as_os_str() == STDOUT {
        return Ok((path.to_path_buf(), None));
    }
    let target = resolve(path)?;
    match fs::metadata(&target) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            check_folder(path, &target)?;
            Ok((target, None))
        }
        Err(e) => Err(Error::io(path, e)),
        Ok(m) if m.is_dir() => Err(Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::IsADirectory, "is a directory"),
        )),
        Ok(m) => {
            refuse_inputs(path, &m, inputs)?;
            Ok((target, Some(m)))
        }
    }
}

/// The folder a new file `target` goes into (`.` for a bare file name).
fn folder_of(target: &Path) -> &Path {
    match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        Some(_) | None => Path::new("."),
    }
}

/// Fails, naming `path` (the output the user gave), when the folder a new file `target`
/// would go into does not exist or is not a folder.
fn check_folder(path: &Path, target: &Path) -> Result<()> {
    let dir = folder_of(target);
    let why = match fs::metadata(dir) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(m) => format!("{} is {}, not a folder", dir.display(), file_kind(&m)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            format!(
                "the folder {} does not exist; create it first",
                dir.display()
            )
        }
        Err(e) => format!("cannot reach the folder {}: {e}", dir.display()),
    };
    Err(Error::io(
        path,
        std::io::Error::new(std::io::ErrorKind::NotFound, why),
    ))
}

/// Fails when the file of `meta` (the target, `path`) is one of `inputs`.
fn refuse_inputs(path: &Path, meta: &fs::Metadata, inputs: &[PathBuf]) -> Result<()> {
    if !meta.is_file() {
        return Ok(());
    }
    for input in inputs {
        if fs::metadata(input).is_ok_and(|m| same_file(meta, &m)) {
            return Err(Error::io(
                path,
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    format!(
                        "refusing to overwrite {}, an input of this run",
                        input.display()
                    ),
                ),
            ));
        }
    }
    Ok(())
}

/// Whether two metadata describe the same file.
#[cfg(unix)]
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    use std::os::unix::fs::MetadataExt;
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

/// Whether two metadata describe the same file (without inodes: size and times).
#[cfg(not(unix))]
fn same_file(a: &fs::Metadata, b: &fs::Metadata) -> bool {
    a.len() == b.len() && a.modified().ok() == b.modified().ok()
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

/// A new, empty temporary file in `target`'s folder; an error names `target` and the
/// folder (the temporary file's name means nothing to a user).
fn temp_next_to(target: &Path) -> Result<(PathBuf, File)> {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = folder_of(target);
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
            Err(e) => {
                let why = format!(
                    "cannot create a file in the folder {} ({e}); write to a folder you can write to",
                    dir.display()
                );
                return Err(Error::io(target, std::io::Error::new(e.kind(), why)));
            }
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

/// Opens `path` for reading if it is a regular file (following symlinks); anything else
/// (a FIFO, a device, a directory) is an error naming the path and what it is. The open
/// does not block (`O_NONBLOCK`), in case the path changed into a FIFO in between, and
/// the open file is checked again.
pub fn open_regular(path: &Path) -> Result<File> {
    let not_regular = |kind: &str| {
        Error::io(
            path,
            std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("not a regular file ({kind})"),
            ),
        )
    };
    let meta = fs::metadata(path).map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(file_kind(&meta)));
    }
    let mut opts = OpenOptions::new();
    opts.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.custom_flags(libc::O_NONBLOCK);
    }
    let file = opts.open(path).map_err(|e| Error::io(path, e))?;
    let meta = file.metadata().map_err(|e| Error::io(path, e))?;
    if !meta.is_file() {
        return Err(not_regular(file_kind(&meta)));
    }
    Ok(file)
}

/// The bytes of the regular file `path` (see [`open_regular`]), read with a fallible
/// allocation sized by the file's length.
pub fn read_regular(path: &Path) -> Result<Vec<u8>> {
    let mut file = open_regular(path)?;
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut bytes = Vec::new();
    usize::try_from(len)
        .ok()
        .and_then(|n| bytes.try_reserve_exact(n).ok())
        .ok_or_else(|| {
            Error::io(
                path,
                std::io::Error::new(
                    std::io::ErrorKind::OutOfMemory,
                    format!("cannot allocate {len} bytes to read the file"),
                ),
            )
        })?;
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io(path, e))?;
    Ok(bytes)
}

/// The text of the regular file `path` (see [`read_regular`]); not UTF-8 is an error.
pub fn read_regular_to_string(path: &Path) -> Result<String> {
    String::from_utf8(read_regular(path)?).map_err(|e| {
        Error::io(
            path,
            std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not UTF-8: {e}")),
        )
    })
}

/// A word for the kind of a file that is not regular.
pub fn file_kind(meta: &fs::Metadata) -> &'static str {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        let t = meta.file_type();
        if t.is_fifo() {
            return "a FIFO";
        }
        if t.is_char_device() || t.is_block_device() {
            return "a device";
        }
        if t.is_socket() {
            return "a socket";
        }
    }
    if meta.is_dir() {
        "a directory"
    } else {
        "not a plain file"
    }
}

/// `dir/entry` for a relative path `entry` that stays inside `dir`: no `..`, no absolute
/// path, and (when it exists) no symlink leading out of `dir`. `what` names the entry in
/// the error (such as `weight_map entry 'x'`).
pub fn join_inside(dir: &Path, entry: &str, what: &str) -> Result<PathBuf> {
    let escape = |why: &str| {
        Error::model(format!(
            "{}: {what} names '{entry}', {why}; files must stay inside the model folder",
            dir.display()
        ))
    };
    let rel = Path::new(entry);
    if entry.is_empty() {
        return Err(escape("an empty path"));
    }
    for c in rel.components() {
        match c {
            Component::Normal(_) | Component::CurDir => {}
            Component::ParentDir => return Err(escape("which goes up with '..'")),
            Component::RootDir | Component::Prefix(_) => return Err(escape("an absolute path")),
        }
    }
    let path = dir.join(rel);
    if let (Ok(real), Ok(root)) = (fs::canonicalize(&path), fs::canonicalize(dir)) {
        if !real.starts_with(&root) {
            return Err(escape(&format!(
                "a symlink to {} outside the folder",
                real.display()
            )));
        }
    }
    Ok(path)
}
