//! Build script. Without the `cuda` feature it does nothing (no CUDA toolkit needed).
//!
//! With `cuda`, it compiles every `cuda/*.cu` with nvcc into a fatbin in OUT_DIR (SASS
//! for each target architecture plus PTX for the newest, one nvcc per file, in parallel)
//! and writes `OUT_DIR/kernels.rs`, which embeds each fatbin and lists the kernels of each
//! module, parsed from their `extern "C" __global__ void NAME(` declarations, as
//! constants (`k::RMS_NORM_F32`), so a misspelt kernel name fails to compile.
//!
//! Environment:
//! - `NVCC`: the nvcc to use; else `$CUDA_HOME/bin/nvcc`, nvcc on `PATH`, or the folder
//!   of `scripts/install-cuda-toolchain.sh` (`$HOME/.cache/graft-cuda-13.0/cuda`).
//! - `GRAFT_CUDA_ARCHS`: compute capabilities, e.g. `90` or `80,90` (default
//!   `80,86,89,90`); SASS for each, PTX for the last.
//! - `GRAFT_NVCC_FLAGS`: extra nvcc flags, e.g. `-lineinfo` or `-Xptxas=-v`.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda::build();
    }
}

mod cuda {
    use std::fmt::Write as _;
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    const DEFAULT_ARCHS: &str = "80,86,89,90";
    const ENV_VARS: [&str; 5] = [
        "NVCC",
        "CUDA_HOME",
        "GRAFT_CUDA_ARCHS",
        "GRAFT_NVCC_FLAGS",
        "HOME",
    ];

    fn fail(msg: &str) -> ! {
        eprintln!("\nerror: {msg}\n");
        std::process::exit(1);
    }

    /// Finds nvcc: NVCC, CUDA_HOME, PATH, then the install script's default folder.
    fn find_nvcc() -> PathBuf {
        if let Some(p) = std::env::var_os("NVCC") {
            let p = PathBuf::from(p);
            if !p.is_file() {
                fail(&format!("NVCC={} is not a file", p.display()));
            }
            return p;
        }
        if let Some(home) = std::env::var_os("CUDA_HOME") {
            let p = Path::new(&home).join("bin/nvcc");
            if p.is_file() {
                return p;
            }
            fail(&format!(
                "CUDA_HOME={} has no bin/nvcc; unset it or point it at a CUDA 13.0 toolkit",
                Path::new(&home).display()
            ));
        }
        if let Some(path) = std::env::var_os("PATH") {
            for dir in std::env::split_paths(&path) {
                let p = dir.join("nvcc");
                if p.is_file() {
                    return p;
                }
            }
        }
        if let Some(home) = std::env::var_os("HOME") {
            let p = Path::new(&home).join(".cache/graft-cuda-13.0/cuda/bin/nvcc");
            if p.is_file() {
                return p;
            }
        }
        fail(
            "the `cuda` feature needs nvcc 13.0 and none was found (NVCC, CUDA_HOME, PATH, \
             ~/.cache/graft-cuda-13.0). Install it with scripts/install-cuda-toolchain.sh and \
             set the CUDA_HOME it prints.",
        )
    }

    /// `-gencode` flags: SASS for every architecture, PTX for the last.
    fn gencode_flags() -> Vec<String> {
        let archs = std::env::var("GRAFT_CUDA_ARCHS").unwrap_or_else(|_| DEFAULT_ARCHS.into());
        let archs: Vec<&str> = archs
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .collect();
        if archs.is_empty() {
            fail("GRAFT_CUDA_ARCHS is empty; give compute capabilities such as `90` or `80,90`");
        }
        for a in &archs {
            let digits = a.trim_end_matches(|c: char| c.is_ascii_lowercase());
            if digits.len() < 2 || !digits.chars().all(|c| c.is_ascii_digit()) {
                fail(&format!(
                    "GRAFT_CUDA_ARCHS: `{a}` is not a compute capability like `90` or `90a`"
                ));
            }
        }
        let mut flags = Vec::new();
        for a in &archs {
            flags.push("-gencode".to_string());
            flags.push(format!("arch=compute_{a},code=sm_{a}"));
        }
        let last = archs[archs.len() - 1];
        flags.push("-gencode".to_string());
        flags.push(format!("arch=compute_{last},code=compute_{last}"));
        flags
    }

    /// Kernel names declared as `extern "C" __global__ void NAME(` in `src`.
    fn kernel_names(file: &Path, src: &str) -> Vec<String> {
        const DECL: &str = "extern \"C\" __global__ void ";
        let mut names = Vec::new();
        for line in src.lines() {
            let Some(pos) = line.find(DECL) else { continue };
            // `extern "C" __global__ void __launch_bounds__(...) NAME(`: skip qualifiers.
            let mut rest = &line[pos + DECL.len()..];
            while let Some(r) = rest.strip_prefix("__launch_bounds__(") {
                let Some(close) = r.find(')') else { break };
                rest = r[close + 1..].trim_start();
            }
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            if name.is_empty() || !rest[end..].starts_with('(') {
                fail(&format!(
                    "{}: cannot parse the kernel declaration `{}`",
                    file.display(),
                    line.trim()
                ));
            }
            names.push(name.to_string());
        }
        names
    }

    struct Module {
        name: String,
        fatbin: PathBuf,
        kernels: Vec<String>,
    }

    fn compile(nvcc: &Path, src: &Path, out: &Path, flags: &[String]) -> Result<String, String> {
        let mut cmd = Command::new(nvcc);
        cmd.arg("--fatbin")
            .args(["-O3", "-std=c++17", "-Xptxas=-warn-spills"])
            .arg("-I")
            .arg(src.parent().expect("cuda/ file"))
            .args(flags)
            .arg("-o")
            .arg(out)
            .arg(src);
        let output = cmd
            .output()
            .map_err(|e| format!("cannot run {}: {e}", nvcc.display()))?;
        let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
        if output.status.success() {
            Ok(stderr)
        } else {
            Err(format!(
                "nvcc failed on {} ({}):\n{:?}\n{}",
                src.display(),
                output.status,
                cmd,
                stderr
            ))
        }
    }

    pub fn build() {
        for var in ENV_VARS {
            println!("cargo:rerun-if-env-changed={var}");
        }
        let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
        let out_dir = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it"));
        let cuda_dir = manifest.join("cuda");
        println!("cargo:rerun-if-changed={}", cuda_dir.display());
        let mut sources = Vec::new();
        let entries = std::fs::read_dir(&cuda_dir)
            .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", cuda_dir.display())));
        for entry in entries {
            let path = entry.expect("directory entry").path();
            match path.extension().and_then(|e| e.to_str()) {
                Some("cu") => {
                    println!("cargo:rerun-if-changed={}", path.display());
                    sources.push(path);
                }
                Some("cuh") => println!("cargo:rerun-if-changed={}", path.display()),
                _ => {}
            }
        }
        sources.sort();
        if sources.is_empty() {
            fail(&format!("no .cu files in {}", cuda_dir.display()));
        }

        let nvcc = find_nvcc();
        let mut flags = gencode_flags();
        if let Ok(extra) = std::env::var("GRAFT_NVCC_FLAGS") {
            flags.extend(extra.split_whitespace().map(String::from));
        }

        let mut modules: Vec<Module> = sources
            .iter()
            .map(|src| {
                let name = src
                    .file_stem()
                    .expect("file")
                    .to_string_lossy()
                    .into_owned();
                let text = std::fs::read_to_string(src)
                    .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", src.display())));
                let kernels = kernel_names(src, &text);
                if kernels.is_empty() {
                    fail(&format!(
                        "{} declares no extern \"C\" __global__ kernel",
                        src.display()
                    ));
                }
                Module {
                    fatbin: out_dir.join(format!("{name}.fatbin")),
                    name,
                    kernels,
                }
            })
            .collect();

        // One nvcc per .cu, as many at once as cargo allows jobs.
        let jobs = std::env::var("NUM_JOBS")
            .ok()
            .and_then(|j| j.parse::<usize>().ok())
            .unwrap_or(1)
            .clamp(1, sources.len());
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<(usize, Result<String, String>)>> = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..jobs {
                s.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= sources.len() {
                        break;
                    }
                    let r = compile(&nvcc, &sources[i], &modules[i].fatbin, &flags);
                    results.lock().expect("no panics while held").push((i, r));
                });
            }
        });
        let mut failed = false;
        for (i, r) in results.into_inner().expect("threads joined") {
            match r {
                Ok(warnings) => {
                    for line in warnings.lines().filter(|l| !l.trim().is_empty()) {
                        println!("cargo:warning={}: {line}", sources[i].display());
                    }
                }
                Err(e) => {
                    eprintln!("{e}");
                    failed = true;
                }
            }
        }
        if failed {
            fail("compiling the CUDA kernels failed (see above)");
        }

        let mut seen = std::collections::HashMap::new();
        for m in &modules {
            for k in &m.kernels {
                if let Some(other) = seen.insert(k.clone(), m.name.clone()) {
                    fail(&format!(
                        "kernel {k} is declared in both {other}.cu and {}.cu",
                        m.name
                    ));
                }
            }
        }
        modules.sort_by(|a, b| a.name.cmp(&b.name));
        let code = generate(&modules);
        std::fs::write(out_dir.join("kernels.rs"), code)
            .unwrap_or_else(|e| fail(&format!("cannot write kernels.rs: {e}")));
    }

    /// The Rust source embedding the fatbins and naming every kernel.
    fn generate(modules: &[Module]) -> String {
        let mut s = String::new();
        s.push_str("// Generated by build.rs from cuda/*.cu. Do not edit.\n\n");
        for m in modules {
            let size = std::fs::metadata(&m.fatbin)
                .unwrap_or_else(|e| fail(&format!("{}: {e}", m.fatbin.display())))
                .len();
            writeln!(
                s,
                "static IMAGE_{}: Aligned<[u8; {size}]> = Aligned(*include_bytes!({:?}));",
                m.name.to_uppercase(),
                m.fatbin.display().to_string()
            )
            .expect("write to string");
        }
        s.push_str("\n/// Every compiled module, in the order of [`Kernel::module`].\n");
        s.push_str("pub static MODULES: &[ModuleImage] = &[\n");
        for m in modules {
            writeln!(
                s,
                "    ModuleImage {{ name: {:?}, image: &IMAGE_{}.0 }},",
                m.name,
                m.name.to_uppercase()
            )
            .expect("write to string");
        }
        s.push_str("];\n\n/// One constant per kernel, named after it.\npub mod k {\n    use super::Kernel;\n");
        let mut all = Vec::new();
        let mut index = 0usize;
        for (mi, m) in modules.iter().enumerate() {
            writeln!(s, "    // {}.cu", m.name).expect("write to string");
            for k in &m.kernels {
                let c = k.to_uppercase();
                writeln!(
                    s,
                    "    /// `{k}` in `cuda/{}.cu`.\n    pub const {c}: Kernel = Kernel {{ index: {index}, module: {mi}, name: {k:?} }};",
                    m.name
                )
                .expect("write to string");
                all.push(c);
                index += 1;
            }
        }
        s.push_str("}\n\n/// Every kernel of every module, in index order.\npub const ALL: &[Kernel] = &[\n");
        for c in &all {
            writeln!(s, "    k::{c},").expect("write to string");
        }
        s.push_str("];\n");
        s
    }
}
