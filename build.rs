//! Build script. Without the `cuda` feature it does nothing (no CUDA toolkit needed).
//!
//! With `cuda`, it
//! 1. parses `cuda/args.cuh`, the one definition of the kernel argument structs and launch
//!    constants, and writes their Rust mirror to `OUT_DIR/args.rs` ([`contract`]);
//! 2. instantiates the templated kernels into `OUT_DIR/cuda-gen/<file>.inst.cuh`, which
//!    the `.cu` includes: every functor `struct Name : UnaryFunctor` of `cuda/unary.cu` (and
//!    `: BinaryFunctor` of `cuda/binary.cu`) becomes one kernel per float dtype (pair)
//!    ([`elementwise`]); the decode products of `cuda/mul_mat_q.cu`, the batched ones of
//!    `cuda/mmq.cu`, `cuda/mmh.cu` and `cuda/mmr.cu`, the attention kernels of
//!    `cuda/fattn.cu` and `cuda/fattn_paged.cu` and the top-k kernels of `cuda/topk.cu`
//!    come from the tables of `build/instances.rs`; and it
//!    writes `OUT_DIR/cuda-gen/args_layout.cuh`, the offset of every field of every
//!    argument struct as the Rust mirror has it, checked by `static_assert`s where
//!    `cuda/args.cuh` includes it;
//! 3. compiles every `cuda/*.cu` with nvcc into a fatbin in OUT_DIR (SASS for each target
//!    architecture plus PTX for the newest, one nvcc per file, in parallel);
//! 4. writes `OUT_DIR/kernels.rs`, which embeds each fatbin, names every kernel (parsed from
//!    the `extern "C" __global__ void NAME(const ARGS p)` declarations) as a constant typed
//!    by its argument struct (`k::RMS_NORM_F32: Kernel<NormArgs>`), groups kernels into
//!    sets keyed by the dtypes their names end in (`by::ADD`, keyed by `[DType; 2]`), and
//!    those sets into tables keyed by a head dim or a column count (`dims::FATTN_VEC`,
//!    `cols::MUL_MAT_VEC_Q`), and maps each `UnaryOp` / `BinaryOp` variant to its
//!    functor's set, so a misspelt kernel, an op variant without a functor, or a launch
//!    with another argument struct than the kernel's fails to compile.
//!
//! Environment:
//! - `NVCC`: the nvcc to use; else `$CUDA_HOME/bin/nvcc`, nvcc on `PATH`, or the folder
//!   of `scripts/install-cuda-toolchain.sh` (`$HOME/.cache/graft-cuda-13.0/cuda`).
//! - `GRAFT_CUDA_ARCHS`: compute capabilities, e.g. `90` or `80,90` (default
//!   `80,86,89,90`); SASS for each, PTX for the last.
//! - `GRAFT_NVCC_FLAGS`: extra nvcc flags, e.g. `-lineinfo` or `-Xptxas=-v`.
//!
//! Step 3 keeps each fatbin in `graft-kernels/` of the target folder under a hash of its
//! inputs ([`kernel_cache`]): the runs of this script for other profiles and features
//! compile only the files no run compiled before.
//!
//! A `.cu` file whose first line is `// nvcc-flags: FLAGS` is compiled with those flags
//! too (`cuda/quantize.cu` turns off fused multiply-adds to round like the CPU).
//!
//! Built on its own (`rustc --edition 2021 build.rs -o gen`), `gen CUDA_DIR OUT_DIR` writes
//! the generated headers of step 2 alone, for programs that include a `.cu` of the tree
//! (`scripts/decode-chain.sh`).

#[path = "build/instances.rs"]
mod instances;

fn main() {
    if let [_, cuda_dir, out_dir] = &std::env::args_os().collect::<Vec<_>>()[..] {
        cuda::write_headers(cuda_dir.as_ref(), out_dir.as_ref());
        return;
    }
    println!("cargo:rerun-if-changed=build.rs");
    git_rev();
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        cuda::build();
    }
}

/// Sets `GRAFT_GIT_REV` for the crate: the short commit the tree is built from, `unknown`
/// outside a git checkout (`graft --version` prints it, so a benchmark's figure names the
/// build that made it). The build reruns when HEAD moves.
fn git_rev() {
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .map(|s| s.trim().to_string())
    };
    let rev = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=GRAFT_GIT_REV={rev}");
    // HEAD names a branch whose ref file (or packed-refs) moves with each commit
    for path in ["HEAD", "packed-refs"] {
        if let Some(p) = git(&["rev-parse", "--git-path", path]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
    if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
        if let Some(p) = git(&["rev-parse", "--git-path", &branch]) {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}

#[path = "build/kernel_cache.rs"]
mod kernel_cache;

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

    pub fn fail(msg: &str) -> ! {
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

    /// A kernel as declared: `extern "C" __global__ void [__launch_bounds__(THREADS[,
    /// RESIDENT])] NAME(const ARGS p)`.
    pub struct Decl {
        pub name: String,
        /// The argument struct (`cuda/args.cuh`).
        pub args: String,
        /// The blocks per SM its launch bounds ask for (0: none, or not a literal).
        pub resident: u32,
    }

    /// The kernels declared in `src` (the text of `file`).
    fn kernel_decls(file: &Path, src: &str) -> Vec<Decl> {
        const DECL: &str = "extern \"C\" __global__ void ";
        let mut decls = Vec::new();
        for line in src.lines() {
            let Some(pos) = line.find(DECL) else { continue };
            let bad = || -> ! {
                fail(&format!(
                    "{}: cannot parse the kernel declaration `{}` (expected `{DECL}[__launch_bounds__(..)] NAME(const ARGS p)`)",
                    file.display(),
                    line.trim()
                ))
            };
            let mut rest = &line[pos + DECL.len()..];
            let mut resident = 0;
            while let Some(r) = rest.strip_prefix("__launch_bounds__(") {
                let Some(close) = r.find(')') else { bad() };
                resident = r[..close]
                    .split_once(',')
                    .and_then(|(_, n)| n.trim().parse().ok())
                    .unwrap_or(0);
                rest = r[close + 1..].trim_start();
            }
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            let name = &rest[..end];
            let args = rest[end..]
                .strip_prefix("(const ")
                .and_then(|r| r.split_once(" p)"))
                .map(|(ty, _)| ty.trim())
                .filter(|ty| ty.ends_with("Args"));
            let (false, Some(args)) = (name.is_empty(), args) else {
                bad()
            };
            decls.push(Decl {
                name: name.to_string(),
                args: args.to_string(),
                resident,
            });
        }
        decls
    }

    /// The header build.rs generates for `cuda/<stem>.cu` (`<stem>.inst.cuh`), if any: the
    /// elementwise kernels of its functors, or the instances of its templated kernels.
    fn generated_header(src: &Path, stem: &str, text: &str) -> Option<String> {
        elementwise::instantiate(src, stem, text).or_else(|| {
            let inst = crate::instances::header(stem)?;
            if !text.contains(&format!("#include \"{stem}.inst.cuh\"")) {
                fail(&format!(
                    "{} must `#include \"{stem}.inst.cuh\"`",
                    src.display()
                ));
            }
            Some(inst)
        })
    }

    /// Writes every header build.rs generates for the `.cu` files of `cuda_dir` (and
    /// `args_layout.cuh`) into `out`: what a program needs that includes a `.cu` of the
    /// tree outside the cargo build.
    pub fn write_headers(cuda_dir: &Path, out: &Path) {
        std::fs::create_dir_all(out)
            .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", out.display())));
        let (_, layout) = contract::generate(&cuda_dir.join("args.cuh"));
        write(&out.join("args_layout.cuh"), &layout);
        let entries = std::fs::read_dir(cuda_dir)
            .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", cuda_dir.display())));
        for entry in entries {
            let src = entry.expect("directory entry").path();
            if src.extension().is_some_and(|e| e == "cu") {
                let stem = src
                    .file_stem()
                    .expect("file")
                    .to_string_lossy()
                    .into_owned();
                let text = std::fs::read_to_string(&src)
                    .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", src.display())));
                if let Some(inst) = generated_header(&src, &stem, &text) {
                    write(&out.join(format!("{stem}.inst.cuh")), &inst);
                }
            }
        }
    }

    fn write(path: &Path, text: &str) {
        std::fs::write(path, text)
            .unwrap_or_else(|e| fail(&format!("cannot write {}: {e}", path.display())));
    }

    pub struct Module {
        pub name: String,
        fatbin: PathBuf,
        pub kernels: Vec<Decl>,
        /// Flags of the file's `// nvcc-flags:` first line.
        flags: Vec<String>,
    }

    /// The flags of a first line `// nvcc-flags: FLAGS`, if any.
    fn file_flags(src: &str) -> Vec<String> {
        src.lines()
            .next()
            .and_then(|l| l.strip_prefix("// nvcc-flags:"))
            .map(|f| f.split_whitespace().map(String::from).collect())
            .unwrap_or_default()
    }

    /// The flags of every nvcc run, before the architectures' and the file's.
    const BASE_FLAGS: [&str; 3] = ["-O3", "-std=c++17", "-Xptxas=-warn-spills"];

    fn compile(
        nvcc: &Path,
        src: &Path,
        gen: &Path,
        out: &Path,
        flags: &[String],
    ) -> Result<String, String> {
        let mut cmd = Command::new(nvcc);
        cmd.arg("--fatbin")
            .args(BASE_FLAGS)
            .arg("-I")
            .arg(src.parent().expect("cuda/ file"))
            .arg("-I")
            .arg(gen)
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

    /// Every module's fatbin, from the kernel cache ([`crate::kernel_cache`]) when the
    /// same inputs made it before, else from nvcc: one nvcc per `.cu`, as many at once as
    /// cargo allows jobs, the largest sources first. Prints nvcc's warnings and fails on
    /// any error.
    fn compile_all(
        nvcc: &Path,
        sources: &[PathBuf],
        modules: &[Module],
        flags: &[String],
        gen_dir: &Path,
        out_dir: &Path,
    ) {
        let read = |p: &Path| {
            std::fs::read(p).unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", p.display())))
        };
        let cache =
            crate::kernel_cache::Cache::open(out_dir, &shared_inputs(nvcc, sources, gen_dir));
        let mut results: Vec<(usize, Result<String, String>)> = Vec::new();
        let mut todo = Vec::new();
        for (i, m) in modules.iter().enumerate() {
            let mut all = flags.to_vec();
            all.extend(m.flags.iter().cloned());
            let source = read(&sources[i]);
            let entry = cache.entry(&m.name, &[&source, all.join(" ").as_bytes()]);
            match entry.as_ref().and_then(|e| cache.fetch(e, &m.fatbin)) {
                Some(warnings) => results.push((i, Ok(warnings))),
                None => todo.push((source.len(), i, all, entry)),
            }
        }
        println!(
            "kernel cache: {} of {} modules cached, {} to compile",
            results.len(),
            modules.len(),
            todo.len()
        );
        todo.sort_by_key(|t| std::cmp::Reverse(t.0));

        let jobs = std::env::var("NUM_JOBS")
            .ok()
            .and_then(|j| j.parse::<usize>().ok())
            .unwrap_or(1)
            .clamp(1, todo.len().max(1));
        let next = AtomicUsize::new(0);
        let compiled = Mutex::new(Vec::new());
        std::thread::scope(|s| {
            for _ in 0..jobs {
                s.spawn(|| {
                    while let Some((_, i, all, entry)) =
                        todo.get(next.fetch_add(1, Ordering::Relaxed))
                    {
                        let m = &modules[*i];
                        let r = compile(nvcc, &sources[*i], gen_dir, &m.fatbin, all);
                        if let (Ok(warnings), Some(entry)) = (&r, entry) {
                            cache.store(&m.name, entry, &m.fatbin, warnings);
                        }
                        compiled.lock().expect("no panics while held").push((*i, r));
                    }
                });
            }
        });
        results.extend(compiled.into_inner().expect("threads joined"));
        let mut failed = false;
        for (i, r) in results {
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
    }

    /// What every module's nvcc run reads besides its own source: nvcc's version, the
    /// environment nvcc reads flags from, the headers of `cuda/` and the generated ones.
    fn shared_inputs(nvcc: &Path, sources: &[PathBuf], gen_dir: &Path) -> Vec<Vec<u8>> {
        let version = Command::new(nvcc)
            .arg("--version")
            .output()
            .unwrap_or_else(|e| fail(&format!("cannot run {} --version: {e}", nvcc.display())));
        let mut inputs = vec![version.stdout, BASE_FLAGS.join(" ").into_bytes()];
        for var in ["NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"] {
            inputs.push(std::env::var(var).unwrap_or_default().into_bytes());
        }
        let cuda_dir = sources[0].parent().expect("cuda/ file");
        for dir in [cuda_dir, gen_dir] {
            let entries = std::fs::read_dir(dir)
                .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", dir.display())));
            let mut headers: Vec<PathBuf> = entries
                .filter_map(|e| Some(e.ok()?.path()))
                .filter(|p| p.extension().is_some_and(|e| e == "cuh"))
                .collect();
            headers.sort();
            for h in headers {
                inputs.push(h.file_name().expect("file").as_encoded_bytes().to_vec());
                inputs.push(
                    std::fs::read(&h)
                        .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", h.display()))),
                );
            }
        }
        inputs
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

        let (args_rs, layout) = contract::generate(&cuda_dir.join("args.cuh"));
        write(&out_dir.join("args.rs"), &args_rs);
        let gen_dir = out_dir.join("cuda-gen");
        std::fs::create_dir_all(&gen_dir)
            .unwrap_or_else(|e| fail(&format!("cannot create {}: {e}", gen_dir.display())));
        write(&gen_dir.join("args_layout.cuh"), &layout);
        println!("cargo:rerun-if-changed=build/instances.rs");

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
                let mut kernels = kernel_decls(src, &text);
                if let Some(inst) = generated_header(src, &name, &text) {
                    let path = gen_dir.join(format!("{name}.inst.cuh"));
                    write(&path, &inst);
                    kernels.extend(kernel_decls(&path, &inst));
                }
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
                    flags: file_flags(&text),
                }
            })
            .collect();

        compile_all(&nvcc, &sources, &modules, &flags, &gen_dir, &out_dir);

        let mut seen = std::collections::HashMap::new();
        for m in &modules {
            for k in &m.kernels {
                if let Some(other) = seen.insert(k.name.clone(), m.name.clone()) {
                    fail(&format!(
                        "kernel {} is declared in both {other}.cu and {}.cu",
                        k.name, m.name
                    ));
                }
            }
        }
        modules.sort_by(|a, b| a.name.cmp(&b.name));
        let mut code = generate(&modules);
        code.push_str(&kernel_sets::generate(&modules));
        code.push_str(&elementwise::rust_maps(&cuda_dir));
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
        s.push_str("\n/// Every compiled module, in the order of [`KernelId::module`].\n");
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
        s.push_str("];\n\n/// One constant per kernel, named after it and typed by its argument struct.\npub mod k {\n    use super::{Kernel, KernelId};\n    use crate::backend::cuda::args::*;\n");
        let mut all = Vec::new();
        let mut index = 0usize;
        for (mi, m) in modules.iter().enumerate() {
            writeln!(s, "    // {}.cu", m.name).expect("write to string");
            for k in &m.kernels {
                let c = k.name.to_uppercase();
                writeln!(
                    s,
                    "    /// `{}` in `cuda/{}.cu`.\n    pub const {c}: Kernel<{}> = Kernel::new(KernelId {{ index: {index}, module: {mi}, name: {:?}, resident: {} }});",
                    k.name, m.name, k.args, k.name, k.resident
                )
                .expect("write to string");
                all.push(c);
                index += 1;
            }
        }
        s.push_str("}\n\n/// Every kernel of every module, in index order.\npub const ALL: &[KernelId] = &[\n");
        for c in &all {
            writeln!(s, "    k::{c}.id,").expect("write to string");
        }
        s.push_str("];\n");
        s
    }

    /// The C/Rust contract: `cuda/args.cuh` parsed into Rust structs and constants.
    mod contract {
        use std::fmt::Write as _;
        use std::path::Path;

        use super::fail;

        /// A field's C type and its Rust mirror.
        #[derive(Clone, Copy)]
        enum Ty {
            I64,
            U64,
            I32,
            F32,
            Tensor4,
            Ptr,
        }

        impl Ty {
            fn parse(c: &str) -> Option<Ty> {
                let c = c.trim();
                if c.ends_with('*') {
                    return Some(Ty::Ptr);
                }
                match c {
                    "i64" => Some(Ty::I64),
                    "u64" => Some(Ty::U64),
                    "int" => Some(Ty::I32),
                    "float" => Some(Ty::F32),
                    "Tensor4" => Some(Ty::Tensor4),
                    _ => None,
                }
            }

            fn rust(self) -> &'static str {
                match self {
                    Ty::I64 => "i64",
                    Ty::U64 | Ty::Ptr => "u64",
                    Ty::I32 => "i32",
                    Ty::F32 => "f32",
                    Ty::Tensor4 => "Tensor4",
                }
            }

            fn size(self) -> usize {
                match self {
                    Ty::I64 | Ty::U64 | Ty::Ptr => 8,
                    Ty::I32 | Ty::F32 => 4,
                    Ty::Tensor4 => 72,
                }
            }
        }

        struct Field {
            name: String,
            ty: Ty,
            len: Option<usize>,
            doc: String,
        }

        struct Struct {
            name: String,
            doc: String,
            fields: Vec<Field>,
            size: Option<usize>,
        }

        /// Splits `code // comment` into its two halves (both trimmed).
        fn split_comment(line: &str) -> (&str, &str) {
            match line.find("//") {
                Some(i) => (line[..i].trim(), line[i + 2..].trim()),
                None => (line.trim(), ""),
            }
        }

        fn join(doc: &mut String, more: &str) {
            if more.is_empty() {
                return;
            }
            if !doc.is_empty() {
                doc.push(' ');
            }
            doc.push_str(more);
        }

        /// One field declaration `TYPE NAME;` or `TYPE NAME[N];`.
        fn field(path: &Path, code: &str, doc: &str) -> Field {
            let bad = || -> ! { fail(&format!("{}: cannot parse field `{code}`", path.display())) };
            let decl = code.strip_suffix(';').unwrap_or_else(|| bad());
            let split = decl
                .rfind(|c: char| c.is_whitespace() || c == '*')
                .unwrap_or_else(|| bad());
            let (ty, name) = (decl[..=split].trim(), decl[split + 1..].trim());
            let (name, len) = match name.split_once('[') {
                Some((n, rest)) => {
                    let n_len = rest.trim_end_matches(']').parse().unwrap_or_else(|_| bad());
                    (n, Some(n_len))
                }
                None => (name, None),
            };
            let ty = Ty::parse(ty).unwrap_or_else(|| bad());
            Field {
                name: name.to_string(),
                ty,
                len,
                doc: doc.to_string(),
            }
        }

        /// `static_assert(sizeof(NAME) == N, ...)`: (NAME, N).
        fn size_assert(code: &str) -> Option<(String, usize)> {
            let rest = code.strip_prefix("static_assert(sizeof(")?;
            let (name, rest) = rest.split_once(')')?;
            let n = rest.trim().strip_prefix("==")?.split(',').next()?.trim();
            Some((name.to_string(), n.parse().ok()?))
        }

        /// `constexpr TYPE NAME = VALUE;` as a Rust constant.
        fn constant(path: &Path, code: &str, doc: &str) -> String {
            let bad = || -> ! { fail(&format!("{}: cannot parse `{code}`", path.display())) };
            let rest = code.strip_prefix("constexpr ").unwrap_or_else(|| bad());
            let (lhs, value) = rest.split_once('=').unwrap_or_else(|| bad());
            let value = value
                .trim()
                .strip_suffix(';')
                .unwrap_or_else(|| bad())
                .trim();
            let (ty, name) = lhs.trim().split_once(' ').unwrap_or_else(|| bad());
            let ty = match ty {
                "i64" => "i64",
                "int" => "i32",
                _ => bad(),
            };
            if value.parse::<i64>().is_err() {
                bad();
            }
            format!("/// {doc}\npub const {}: {ty} = {value};\n", name.trim())
        }

        /// The Rust mirror of the contract region of `path`, and the header of `static_assert`s
        /// that checks the C side against it (`args_layout.cuh`).
        pub fn generate(path: &Path) -> (String, String) {
            let text = std::fs::read_to_string(path)
                .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
            let region = text
                .split_once("\n// contract:begin\n")
                .and_then(|(_, r)| r.split_once("\n// contract:end"))
                .map(|(r, _)| r)
                .unwrap_or_else(|| fail(&format!("{}: no contract region", path.display())));
            let mut structs: Vec<Struct> = Vec::new();
            let mut consts = String::new();
            let mut doc = String::new();
            let mut open: Option<Struct> = None;
            for line in region.lines() {
                let (code, comment) = split_comment(line);
                if let Some(s) = open.as_mut() {
                    if code == "};" {
                        structs.push(open.take().expect("open"));
                    } else if code.is_empty() {
                        if let Some(f) = s.fields.last_mut() {
                            join(&mut f.doc, comment);
                        }
                    } else {
                        s.fields.push(field(path, code, comment));
                    }
                    continue;
                }
                if code.is_empty() {
                    if comment.is_empty() {
                        doc.clear();
                    } else {
                        join(&mut doc, comment);
                    }
                } else if let Some(rest) = code.strip_prefix("struct ") {
                    let name = rest.trim_end_matches('{').trim().to_string();
                    let mut d = std::mem::take(&mut doc);
                    join(&mut d, comment);
                    open = Some(Struct {
                        name,
                        doc: d,
                        fields: Vec::new(),
                        size: None,
                    });
                } else if let Some((name, n)) = size_assert(code) {
                    match structs.iter_mut().find(|s| s.name == name) {
                        Some(s) => s.size = Some(n),
                        None => fail(&format!("{}: sizeof({name}) of no struct", path.display())),
                    }
                } else if code.starts_with("constexpr ") {
                    join(&mut doc, comment);
                    consts.push_str(&constant(path, code, &std::mem::take(&mut doc)));
                } else {
                    fail(&format!(
                        "{}: unexpected line in the contract: `{code}`",
                        path.display()
                    ));
                }
            }
            (rust(path, &structs, &consts), layout(&structs))
        }

        /// Byte offset of each field of `st` as laid out one after another (`rust` has
        /// checked there is no padding, so this is the `#[repr(C)]` layout).
        fn offsets(st: &Struct) -> Vec<(&str, usize)> {
            let mut at = 0;
            st.fields
                .iter()
                .map(|f| {
                    let off = at;
                    at += f.ty.size() * f.len.unwrap_or(1);
                    (f.name.as_str(), off)
                })
                .collect()
        }

        /// `static_assert`s that every field of every struct is where the Rust mirror has it.
        fn layout(structs: &[Struct]) -> String {
            let mut s = String::from(
                "// Generated by build.rs from cuda/args.cuh: every field at the offset of its Rust\n\
                 // mirror (OUT_DIR/args.rs asserts the same offsets). Do not edit.\n#pragma once\n\n\
                 #include <cstddef>\n\n",
            );
            for st in structs {
                for (field, off) in offsets(st) {
                    writeln!(
                        s,
                        "static_assert(offsetof({n}, {field}) == {off}, \"{n}.{field} is at byte {off} in Rust\");",
                        n = st.name
                    )
                    .expect("string");
                }
            }
            s
        }

        fn rust(path: &Path, structs: &[Struct], consts: &str) -> String {
            let mut s =
                String::from("// Generated by build.rs from cuda/args.cuh. Do not edit.\n\n");
            s.push_str(consts);
            for st in structs {
                let bytes: usize = st
                    .fields
                    .iter()
                    .map(|f| f.ty.size() * f.len.unwrap_or(1))
                    .sum();
                if st.size != Some(bytes) {
                    fail(&format!(
                        "{}: {} has {bytes} bytes of fields but its static_assert says {:?}: \
                         padding or a wrong size",
                        path.display(),
                        st.name,
                        st.size
                    ));
                }
                let doc = if st.doc.is_empty() {
                    st.name.clone()
                } else {
                    st.doc.clone()
                };
                writeln!(s, "\n/// {doc}\n#[repr(C)]\n#[derive(Clone, Copy, Debug, Default, PartialEq)]\npub struct {} {{", st.name).expect("string");
                for f in &st.fields {
                    let ty = match f.len {
                        Some(n) => format!("[{}; {n}]", f.ty.rust()),
                        None => f.ty.rust().to_string(),
                    };
                    let doc = if f.doc.is_empty() {
                        "See cuda/args.cuh."
                    } else {
                        &f.doc
                    };
                    writeln!(s, "    /// {doc}\n    pub {}: {ty},", f.name).expect("string");
                }
                s.push_str("}\n");
                writeln!(
                    s,
                    "const _: () = assert!(std::mem::size_of::<{}>() == {bytes});",
                    st.name
                )
                .expect("string");
                for (field, off) in offsets(st) {
                    writeln!(
                        s,
                        "const _: () = assert!(std::mem::offset_of!({}, {field}) == {off});",
                        st.name
                    )
                    .expect("string");
                }
                if st.name.ends_with("Args") {
                    writeln!(
                        s,
                        "// SAFETY: repr(C) with the fields of cuda/args.cuh in their order, and \
                         the size of the fields alone: no padding, the same layout.\n\
                         unsafe impl KernelArgs for {} {{}}",
                        st.name
                    )
                    .expect("string");
                }
            }
            s
        }
    }

    /// Elementwise kernels instantiated from functors, and their Rust op maps.
    mod elementwise {
        use std::fmt::Write as _;
        use std::path::Path;

        use super::fail;

        /// An elementwise family: the `.cu` stem, the functor base struct, the kernel
        /// template, its argument struct, how many operands carry a dtype, and the Rust op
        /// enum whose variants are named like the functors.
        struct Family {
            stem: &'static str,
            base: &'static str,
            template: &'static str,
            args: &'static str,
            arity: usize,
            rust_enum: &'static str,
            rust_fn: &'static str,
        }

        const FAMILIES: [Family; 2] = [
            Family {
                stem: "unary",
                base: "UnaryFunctor",
                template: "unary",
                args: "UnaryArgs",
                arity: 1,
                rust_enum: "UnaryOp",
                rust_fn: "unary",
            },
            Family {
                stem: "binary",
                base: "BinaryFunctor",
                template: "binary",
                args: "BinaryArgs",
                arity: 2,
                rust_enum: "BinaryOp",
                rust_fn: "binary",
            },
        ];

        /// Float dtypes: kernel-name suffix and C type.
        const FLOATS: [(&str, &str); 3] = [("f32", "float"), ("f16", "f16"), ("bf16", "bf16")];

        /// Names of the `struct NAME : BASE` functors in `text`.
        fn functors(text: &str, base: &str) -> Vec<String> {
            let mut out = Vec::new();
            for line in text.lines() {
                let Some(rest) = line.trim_start().strip_prefix("struct ") else {
                    continue;
                };
                let Some((name, tail)) = rest.split_once(':') else {
                    continue;
                };
                if tail.trim_start().starts_with(base) {
                    out.push(name.trim().to_string());
                }
            }
            out
        }

        fn snake(camel: &str) -> String {
            let mut s = String::new();
            for (i, c) in camel.chars().enumerate() {
                if c.is_ascii_uppercase() && i > 0 {
                    s.push('_');
                }
                s.push(c.to_ascii_lowercase());
            }
            s
        }

        /// Every dtype combination of `arity` float operands, as (suffix, C types).
        fn combos(arity: usize) -> Vec<(String, Vec<&'static str>)> {
            let mut out = vec![(String::new(), Vec::new())];
            for _ in 0..arity {
                out = out
                    .into_iter()
                    .flat_map(|(s, t)| {
                        FLOATS.iter().map(move |(suf, ct)| {
                            let mut t = t.clone();
                            t.push(*ct);
                            (format!("{s}_{suf}"), t)
                        })
                    })
                    .collect();
            }
            out
        }

        /// The generated instantiations for `cuda/<stem>.cu`, if it is an elementwise
        /// family file (which must include `<stem>.inst.cuh`).
        pub fn instantiate(src: &Path, stem: &str, text: &str) -> Option<String> {
            let fam = FAMILIES.iter().find(|f| f.stem == stem)?;
            let names = functors(text, fam.base);
            if names.is_empty() {
                fail(&format!(
                    "{}: no `struct NAME : {}` functor",
                    src.display(),
                    fam.base
                ));
            }
            if !text.contains(&format!("#include \"{stem}.inst.cuh\"")) {
                fail(&format!(
                    "{} must `#include \"{stem}.inst.cuh\"`",
                    src.display()
                ));
            }
            let mut s = format!(
                "// Generated by build.rs from the {} functors of cuda/{stem}.cu. Do not edit.\n",
                fam.base
            );
            for f in &names {
                for (suffix, types) in combos(fam.arity) {
                    writeln!(
                        s,
                        "extern \"C\" __global__ void {}{suffix}(const {} p) {{ {}<{f}, {}>(p); }}",
                        snake(f),
                        fam.args,
                        fam.template,
                        types.join(", ")
                    )
                    .expect("string");
                }
            }
            Some(s)
        }

        /// For each family, `pub fn <rust_fn>(op) -> &'static KernelSet<arity>`: an
        /// exhaustive match from the Rust op enum to the functors' kernel sets.
        pub fn rust_maps(cuda_dir: &Path) -> String {
            let mut s = String::new();
            for fam in &FAMILIES {
                let path = cuda_dir.join(format!("{}.cu", fam.stem));
                let text = std::fs::read_to_string(&path)
                    .unwrap_or_else(|e| fail(&format!("cannot read {}: {e}", path.display())));
                writeln!(
                    s,
                    "\n/// The kernels of each [`{e}`], one per `{b}` functor of `cuda/{st}.cu`.\npub fn {fun}(op: crate::graph::op::{e}) -> &'static KernelSet<crate::backend::cuda::args::{args}, {a}> {{\n    use crate::graph::op::{e};\n    match op {{",
                    e = fam.rust_enum,
                    b = fam.base,
                    st = fam.stem,
                    fun = fam.rust_fn,
                    args = fam.args,
                    a = fam.arity
                )
                .expect("string");
                for f in functors(&text, fam.base) {
                    writeln!(
                        s,
                        "        {}::{f} => &by::{},",
                        fam.rust_enum,
                        snake(&f).to_uppercase()
                    )
                    .expect("string");
                }
                s.push_str("    }\n}\n");
            }
            s
        }
    }

    /// Kernels grouped into sets keyed by the dtypes their names end in.
    mod kernel_sets {
        use std::collections::BTreeMap;
        use std::fmt::Write as _;

        use super::{fail, Module};

        /// Kernel-name suffixes naming a dtype, and the `DType` of each.
        const DTYPES: [(&str, &str); 26] = [
            ("f32", "F32"),
            ("f16", "F16"),
            ("bf16", "BF16"),
            ("i32", "I32"),
            ("q4_0", "Q4_0"),
            ("q4_1", "Q4_1"),
            ("q5_0", "Q5_0"),
            ("q5_1", "Q5_1"),
            ("q8_0", "Q8_0"),
            ("q8_1", "Q8_1"),
            ("q4_k", "Q4_K"),
            ("q5_k", "Q5_K"),
            ("q6_k", "Q6_K"),
            ("q2_k", "Q2_K"),
            ("q3_k", "Q3_K"),
            ("iq4_nl", "IQ4_NL"),
            ("iq4_xs", "IQ4_XS"),
            ("iq2_xxs", "IQ2_XXS"),
            ("iq2_xs", "IQ2_XS"),
            ("iq2_s", "IQ2_S"),
            ("iq3_xxs", "IQ3_XXS"),
            ("iq3_s", "IQ3_S"),
            ("iq1_s", "IQ1_S"),
            ("iq1_m", "IQ1_M"),
            ("tq1_0", "TQ1_0"),
            ("tq2_0", "TQ2_0"),
        ];

        /// `(family, dtype variants)` of a kernel name: dtype suffixes are stripped from
        /// the end, the rest is the family. None when the name ends in no dtype.
        fn split(name: &str) -> Option<(String, Vec<&'static str>)> {
            let mut rest = name;
            let mut dts = Vec::new();
            'strip: loop {
                for (suffix, variant) in DTYPES {
                    if let Some(r) = rest.strip_suffix(suffix).and_then(|r| r.strip_suffix('_')) {
                        dts.push(variant);
                        rest = r;
                        continue 'strip;
                    }
                }
                break;
            }
            dts.reverse();
            (!dts.is_empty()).then(|| (rest.to_string(), dts))
        }

        /// A family name ending in `_d<N>` (a head dim) or `_c<N>` (a column count): the
        /// table it belongs to (`dims`, `cols`), the name without the suffix, and `N`.
        fn keyed(family: &str) -> Option<(&'static str, &str, usize)> {
            let (base, last) = family.rsplit_once('_')?;
            let table = match last.chars().next()? {
                'd' => "dims",
                'c' => "cols",
                _ => return None,
            };
            Some((table, base, last[1..].parse().ok()?))
        }

        pub fn generate(modules: &[Module]) -> String {
            // family -> (argument struct, [(dtypes, kernel constant)])
            type Set<'m> = (&'m str, Vec<(Vec<&'static str>, String)>);
            let mut sets: BTreeMap<String, Set> = BTreeMap::new();
            for m in modules {
                for k in &m.kernels {
                    if let Some((family, dts)) = split(&k.name) {
                        let set = sets.entry(family.clone()).or_insert((&k.args, Vec::new()));
                        if set.0 != k.args {
                            fail(&format!(
                                "kernels of family `{family}` take different argument structs ({} and {})",
                                set.0, k.args
                            ));
                        }
                        set.1.push((dts, k.name.to_uppercase()));
                    }
                }
            }
            let mut s = String::from(
                "\n/// Kernel sets: the kernels named `<family>_<dtype>..`, keyed by those dtypes.\npub mod by {\n    use super::{k, KernelSet};\n    use crate::backend::cuda::args::*;\n    use crate::graph::DType;\n",
            );
            // (table, base) -> (argument struct, arity, [(key, set constant)])
            type Keyed<'m> = (&'m str, usize, Vec<(usize, String)>);
            let mut tables: BTreeMap<(&str, String), Keyed> = BTreeMap::new();
            for (family, (args, entries)) in &sets {
                let arity = entries[0].0.len();
                if entries.iter().any(|(d, _)| d.len() != arity) {
                    fail(&format!(
                        "kernels of family `{family}` end in different numbers of dtypes"
                    ));
                }
                writeln!(
                    s,
                    "    /// `{family}_*`.\n    pub const {}: KernelSet<{args}, {arity}> = KernelSet {{\n        name: \"{family}\",\n        entries: &[",
                    family.to_uppercase()
                )
                .expect("string");
                for (dts, k) in entries {
                    let key: Vec<String> = dts.iter().map(|d| format!("DType::{d}")).collect();
                    writeln!(s, "            ([{}], k::{k}),", key.join(", ")).expect("string");
                }
                s.push_str("        ],\n    };\n");
                if let Some((table, base, n)) = keyed(family) {
                    let t = tables.entry((table, base.to_string())).or_insert((
                        args,
                        arity,
                        Vec::new(),
                    ));
                    if (t.0, t.1) != (args, arity) {
                        fail(&format!(
                            "the sets `{base}_{table}*` differ in arguments or dtypes"
                        ));
                    }
                    t.2.push((n, family.to_uppercase()));
                }
            }
            s.push_str("}\n");
            for table in ["dims", "cols"] {
                let what = match table {
                    "dims" => "head dim",
                    _ => "column count",
                };
                writeln!(
                    s,
                    "\n/// Kernel sets named `<family>_{}<N>_<dtype>..`, keyed by the {what} `N`.\npub mod {table} {{\n    use super::{{by, KeyedSets}};\n    use crate::backend::cuda::args::*;",
                    &table[..1]
                )
                .expect("string");
                for ((_, base), (args, arity, entries)) in
                    tables.iter_mut().filter(|((t, _), _)| *t == table)
                {
                    entries.sort();
                    writeln!(
                        s,
                        "    /// `{base}_{}<N>_*`.\n    pub const {}: KeyedSets<{args}, {arity}> = KeyedSets {{\n        name: \"{base}\",\n        key: \"{what}\",\n        entries: &[",
                        &table[..1],
                        base.to_uppercase()
                    )
                    .expect("string");
                    for (n, set) in entries.iter() {
                        writeln!(s, "            ({n}, by::{set}),").expect("string");
                    }
                    s.push_str("        ],\n    };\n");
                }
                s.push_str("}\n");
            }
            s
        }
    }
}
