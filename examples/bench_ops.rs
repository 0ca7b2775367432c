//! The CUDA op benchmark: `cargo run --release --features cuda --example bench_ops --
//! [--json] [--json-out FILE] [--iters N] [--device N]`. Prints markdown tables (JSON
//! instead with `--json`; `--json-out` also writes JSON to a file); see
//! `graft::backend::cuda::bench` for what is measured.

#[cfg(feature = "cuda")]
fn main() {
    use graft::backend::cuda::bench::{run_bench_ops, BenchOptions};

    let mut opts = BenchOptions::default();
    let mut json = false;
    let mut json_out = None;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut number = |name: &str| -> usize {
            match args.next().map(|v| v.parse::<usize>()) {
                Some(Ok(n)) => n,
                _ => {
                    eprintln!("bench_ops: {name} needs a number");
                    std::process::exit(2)
                }
            }
        };
        match a.as_str() {
            "--json" => json = true,
            "--json-out" => match args.next() {
                Some(path) => json_out = Some(path),
                None => {
                    eprintln!("bench_ops: --json-out needs a file");
                    std::process::exit(2)
                }
            },
            "--iters" => opts.iters = number("--iters"),
            "--device" => opts.device = number("--device"),
            other => {
                eprintln!(
                    "bench_ops: unknown argument {other} (use --json, --json-out FILE, --iters N, --device N)"
                );
                std::process::exit(2)
            }
        }
    }
    let report = match run_bench_ops(&opts) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("bench_ops: {e}");
            std::process::exit(1)
        }
    };
    let text = serde_json::to_string_pretty(&report).expect("the report serializes");
    if let Some(path) = json_out {
        if let Err(e) = std::fs::write(&path, &text) {
            eprintln!("bench_ops: {path}: {e}");
            std::process::exit(1)
        }
    }
    if json {
        println!("{text}");
    } else {
        print!("{}", report.markdown());
    }
}

#[cfg(not(feature = "cuda"))]
fn main() {
    eprintln!("bench_ops needs the CUDA backend: build with --features cuda");
    std::process::exit(2)
}
