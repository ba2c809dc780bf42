//! Every `titanc` command in the README's code blocks runs as written, in order (each one may use
//! the files the ones before it wrote). The commands run in-process through
//! `titan_compiler::cli::run_args`, the function the `titanc` binary's `main` calls (this package
//! cannot name another package's binary, and another binary linking the compiler would be one
//! more static LLVM link). The README's commands run in the repository root: here the files they
//! read from the repository (`examples/...`) come from it, and the files they write (`model.ir`,
//! `out`) go to a scratch directory instead.

use std::path::{Path, PathBuf};

use crate::common::scratch;

/// The `titanc` command lines of the README's fenced code blocks, as words, in order. Comments
/// (`# ...`) are dropped and lines ending in `\` continued.
fn readme_titanc_commands(readme: &str) -> Vec<Vec<String>> {
    let mut commands = Vec::new();
    let mut in_block = false;
    let mut pending = String::new();
    for line in readme.lines() {
        if line.trim_start().starts_with("```") {
            in_block = !in_block;
            continue;
        }
        if !in_block {
            continue;
        }
        let code = line.split('#').next().unwrap_or("").trim_end();
        let (code, continued) = match code.strip_suffix('\\') {
            Some(c) => (c, true),
            None => (code, false),
        };
        pending.push_str(code);
        pending.push(' ');
        if continued {
            continue;
        }
        let words: Vec<String> = pending.split_whitespace().map(str::to_string).collect();
        pending.clear();
        if words.first().is_some_and(|w| w == "titanc" || w.ends_with("/titanc")) {
            commands.push(words);
        }
    }
    commands
}

/// Where `arg` points when the command runs in `work` instead of the repository root: a path
/// (a word with `/` or a file extension, or the value of `-o`) that the commands so far did not
/// write and the repository has is read from the repository; any other path is in `work`.
fn resolve(arg: &str, prev: Option<&str>, repo: &Path, work: &Path) -> String {
    let output = matches!(prev, Some("-o" | "--output"));
    let path_like =
        !arg.starts_with('-') && arg.parse::<f64>().is_err() && (arg.contains('/') || [".ir", ".json", ".toml", ".bin"].iter().any(|e| arg.ends_with(e)));
    if !(output || path_like) {
        return arg.to_string();
    }
    let in_repo = repo.join(arg);
    let p: PathBuf = if !output && !work.join(arg).exists() && in_repo.exists() { in_repo } else { work.join(arg) };
    p.display().to_string()
}

#[test]
fn readme_extracts_commands_with_continuations_and_comments() {
    let text = "text\n```sh\ntitanc new llama3 -o m.ir   # a comment\n# only a comment\ntarget/release/titanc build m.ir \\\n    --lr 3e-3\ncargo build\n```\ntitanc not in a block\n";
    let got = readme_titanc_commands(text);
    assert_eq!(got, [vec!["titanc", "new", "llama3", "-o", "m.ir"], vec!["target/release/titanc", "build", "m.ir", "--lr", "3e-3"]]);
}

#[test]
fn every_titanc_command_of_the_readme_runs_as_written() {
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(repo.join("README.md")).expect("read README.md");
    let commands = readme_titanc_commands(&readme);
    assert!(commands.len() >= 10, "found only {} titanc commands in README.md: {commands:?}", commands.len());
    let work = scratch("readme", "commands");
    std::fs::create_dir_all(&work).expect("create the scratch directory");
    for words in &commands {
        let mut args = vec!["titanc".to_string()];
        for (i, w) in words.iter().enumerate().skip(1) {
            args.push(resolve(w, words.get(i - 1).map(String::as_str), &repo, &work));
        }
        if let Err(e) = titan_compiler::cli::run_args(&args) {
            panic!("README.md: `{}` fails:\n{}", words.join(" "), e.render());
        }
    }
}
