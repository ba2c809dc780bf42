//! `titanc`: parses the command line, runs the command from the library and prints its output;
//! errors go to stderr with exit code 1.

use std::io::{ErrorKind, Write};
use std::process::ExitCode;

use anyhow::Context;
use clap::Parser;
use titan_compiler::cli::{Cli, CliError, execute};

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // `--help` and `--version` land here too; they go to stdout and succeed.
            let _ = e.print();
            return if e.use_stderr() { ExitCode::FAILURE } else { ExitCode::SUCCESS };
        }
    };
    match run(&cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            let text = match e.downcast_ref::<CliError>() {
                Some(c) => c.render(),
                None => format!("error: {e:#}"),
            };
            let _ = writeln!(std::io::stderr(), "{}", text.trim_end());
            ExitCode::FAILURE
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let out = execute(cli)?;
    let _ = std::io::stderr().write_all(out.stderr.as_bytes());
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(out.stdout.as_bytes()).and_then(|()| stdout.flush()) {
        // `titanc new ... | head` closes the pipe early; that is not an error.
        Err(e) if e.kind() == ErrorKind::BrokenPipe => Ok(()),
        r => r.context("cannot write to stdout"),
    }
}
