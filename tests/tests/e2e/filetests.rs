//! Per-pass filetests: every `tests/filetests/passes/<pass>/*.ir` file holds small hand-written
//! cases, each run through `titanc opt` and checked against a snapshot next to the file
//! (`<name>.snap`), and against the case's own `; check:` / `; not:` lines when it has them.
//!
//! File format (lines starting with `;` are directives; the IR's own comments are `//`):
//!
//! ```text
//! ; run: opt --passes cse            <- the `titanc opt` arguments after the file name
//! graph @g { ... }                   <- case 1
//! ; -----                            <- separates independent cases
//! ; run: opt --passes cse,dce        <- a case may override the file's run line
//! ; check: %1 = add                  <- a line of the output containing this, after the previous check
//! ; not: mul                         <- no line of the output contains this
//! ; error: does not divide           <- the run must fail with a message containing this
//! graph @g { ... }                   <- case 2
//! ```
//!
//! Line numbers in messages are those of the whole file (a case is parsed with the lines
//! before it blanked). To accept new output: `INSTA_UPDATE=always cargo test -p titan-tests
//! --test e2e filetests` (or `cargo insta review`), then read the diff before committing.

use std::path::{Path, PathBuf};

use titan_compiler::cli::{Command, opt_on_text, parse_args};

/// The directory of the per-pass filetests.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("filetests/passes")
}

/// One case of a file: its directives and its IR text (other lines blanked).
#[derive(Debug)]
struct Case {
    /// 1-based line of the case's first line in the file.
    line: usize,
    run: Vec<String>,
    checks: Vec<String>,
    nots: Vec<String>,
    error: Option<String>,
    source: String,
}

fn directive<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    line.trim_start().strip_prefix(';')?.trim_start().strip_prefix(key).map(str::trim)
}

/// Split a file into cases; the first case's `; run:` is the default for the others.
fn cases(text: &str) -> Result<Vec<Case>, String> {
    let lines: Vec<&str> = text.lines().collect();
    let mut starts = vec![0];
    starts.extend(lines.iter().enumerate().filter(|(_, l)| l.trim() == "; -----").map(|(i, _)| i + 1));
    let mut out: Vec<Case> = Vec::new();
    for (k, &start) in starts.iter().enumerate() {
        let end = starts.get(k + 1).map_or(lines.len(), |&next| next - 1);
        let mut case = Case { line: start + 1, run: Vec::new(), checks: Vec::new(), nots: Vec::new(), error: None, source: "\n".repeat(start) };
        for (i, l) in lines[start..end].iter().enumerate() {
            if let Some(r) = directive(l, "run:") {
                let args: Vec<String> = r.split_whitespace().map(str::to_string).collect();
                if args.first().map(String::as_str) != Some("opt") {
                    return Err(format!("line {}: a run line starts with `opt`, found `{r}`", start + i + 1));
                }
                case.run = args[1..].to_vec();
            } else if let Some(c) = directive(l, "check:") {
                case.checks.push(c.to_string());
            } else if let Some(c) = directive(l, "not:") {
                case.nots.push(c.to_string());
            } else if let Some(c) = directive(l, "error:") {
                case.error = Some(c.to_string());
            } else if l.trim_start().starts_with(';') && !l.trim().is_empty() {
                return Err(format!("line {}: unknown directive `{}` (run:, check:, not:, error:, -----)", start + i + 1, l.trim()));
            }
            case.source.push_str(if l.trim_start().starts_with(';') { "" } else { l });
            case.source.push('\n');
        }
        if case.run.is_empty() {
            match out.first() {
                Some(first) => case.run = first.run.clone(),
                None => return Err("the file must start with a `; run: opt --passes ...` line".into()),
            }
        }
        if case.source.trim().is_empty() {
            return Err(format!("case at line {} has no IR", case.line));
        }
        out.push(case);
    }
    Ok(out)
}

/// Run one case through `titanc opt`; returns the snapshot text of the case, or why it failed
/// its own `check`/`not`/`error` lines.
fn run_case(label: &str, case: &Case) -> Result<String, String> {
    let mut argv = vec!["titanc".to_string(), "opt".to_string(), label.to_string(), "--stats".to_string()];
    argv.extend(case.run.iter().cloned());
    let cli = parse_args(&argv).map_err(|e| format!("line {}: bad run line: {e}", case.line))?;
    let Command::Opt(args) = &cli.command else { unreachable!("the argv starts with `opt`") };
    let header = format!("; case at line {}: opt {}\n", case.line, case.run.join(" "));
    let output = match (opt_on_text(args, label, &case.source), &case.error) {
        (Ok(out), None) => {
            let stats: String =
                out.stderr.lines().filter_map(|l| l.split_once(' ').map(|(pass, counters)| format!("; stats: {pass}: {}\n", counters.trim()))).collect();
            format!("{stats}{}", out.stdout)
        }
        (Ok(out), Some(want)) => return Err(format!("line {}: expected an error containing `{want}`, got:\n{}", case.line, out.stdout)),
        (Err(e), Some(want)) => {
            let text = e.render();
            if !text.contains(want.as_str()) {
                return Err(format!("line {}: expected an error containing `{want}`, got:\n{text}", case.line));
            }
            text
        }
        (Err(e), None) => return Err(format!("line {}: unexpected error:\n{}", case.line, e.render())),
    };
    let mut rest = output.lines();
    for c in &case.checks {
        if !rest.any(|l| l.contains(c.as_str())) {
            return Err(format!("line {}: `; check: {c}` matches no line of the output after the previous check:\n{output}", case.line));
        }
    }
    for n in &case.nots {
        if let Some(l) = output.lines().find(|l| l.contains(n.as_str())) {
            return Err(format!("line {}: `; not: {n}` matches `{l}`", case.line));
        }
    }
    Ok(format!("{header}{output}"))
}

/// Every filetest file, sorted: `(pass directory, file)`.
fn files() -> Vec<(String, PathBuf)> {
    let mut out = Vec::new();
    for dir in std::fs::read_dir(root()).expect("tests/filetests/passes exists").flatten() {
        if !dir.path().is_dir() {
            continue;
        }
        let pass = dir.file_name().to_string_lossy().into_owned();
        for f in std::fs::read_dir(dir.path()).expect("readable").flatten() {
            if f.path().extension().is_some_and(|e| e == "ir") {
                out.push((pass.clone(), f.path()));
            }
        }
    }
    out.sort();
    out
}

/// Run one file and compare its snapshot; `Err` says what failed.
fn check_file(path: &Path) -> Result<(), String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("tests/ is inside the repository");
    let label = path.strip_prefix(repo).unwrap_or(path).display().to_string();
    let mut snapshot = String::new();
    for (i, case) in cases(&text)?.iter().enumerate() {
        if i > 0 {
            snapshot.push_str("; -----\n");
        }
        snapshot.push_str(&run_case(&label, case)?);
        if !snapshot.ends_with('\n') {
            snapshot.push('\n');
        }
    }
    let name = path.file_stem().expect("a file name").to_string_lossy().into_owned();
    let dir = path.parent().expect("a directory").to_path_buf();
    std::panic::catch_unwind(|| {
        let mut settings = insta::Settings::clone_current();
        settings.set_snapshot_path(dir);
        settings.set_prepend_module_to_snapshot(false);
        settings.set_input_file(path);
        settings.set_omit_expression(true);
        settings.bind(|| insta::assert_snapshot!(name, snapshot));
    })
    .map_err(|_| "the output differs from the snapshot (see the diff above)".to_string())
}

#[test]
fn every_pass_filetest_matches_its_snapshot() {
    let files = files();
    let failures: Vec<String> = files.iter().filter_map(|(_, f)| check_file(f).err().map(|e| format!("{}: {e}", f.display()))).collect();
    assert!(failures.is_empty(), "{} of {} filetests failed:\n{}", failures.len(), files.len(), failures.join("\n\n"));
}

/// Each pass of the table has its directory, and at least three cases in it.
#[test]
fn every_pass_has_at_least_three_filetest_cases() {
    let files = files();
    for p in titan_passes::pass_table() {
        let n: usize =
            files.iter().filter(|(d, _)| d == p.name).map(|(_, f)| cases(&std::fs::read_to_string(f).expect("readable")).map_or(0, |c| c.len())).sum();
        assert!(n >= 3, "pass `{}` has {n} filetest cases in tests/filetests/passes/{}/; add at least 3 (one where it must do nothing)", p.name, p.name);
    }
}

#[test]
fn the_case_splitter_keeps_line_numbers_and_inherits_the_run_line() {
    let text = "; run: opt --passes cse\ngraph @a {}\n; -----\n; check: x\ngraph @b {}\n";
    let cs = cases(text).expect("valid");
    assert_eq!(cs.len(), 2);
    assert_eq!((cs[0].line, cs[1].line), (1, 4));
    assert_eq!(cs[1].run, ["--passes", "cse"]);
    assert_eq!(cs[1].checks, ["x"]);
    // The second case's IR stays on line 5 of the file.
    assert_eq!(cs[1].source.lines().position(|l| l.contains("@b")), Some(4));
    assert!(cases("graph @a {}\n").is_err());
    assert!(cases("; run: opt --passes cse\n; bogus: 1\ngraph @a {}\n").expect_err("unknown").contains("unknown directive"));
}
