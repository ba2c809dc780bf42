//! `titan-run` built inside this package, so the end-to-end tests can launch it as separate
//! processes (`env!("CARGO_BIN_EXE_titan-run-e2e")`; Cargo gives tests the path of their own
//! package's binaries only). The same program as `titan-run`: [`titan_runtime::cli`].

fn main() -> std::process::ExitCode {
    titan_runtime::cli::main()
}
