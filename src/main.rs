//! The `graft` command line: generate text with a Llama model, write its logits, dump
//! its graphs and benchmark it (see `graft --help`).

mod cli;

fn main() -> std::process::ExitCode {
    cli::main()
}
