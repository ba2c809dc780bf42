//! `titan-run`: see [`titan_runtime::cli`].

fn main() -> std::process::ExitCode {
    titan_runtime::cli::main()
}
