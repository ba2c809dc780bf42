//! Error filetests: each `tests/filetests/errors/*.ir` file is parsed (and verified when it
//! parses) and its diagnostics must be exactly the ones its `// expected-error` comments announce.
//!
//! `// expected-error @+1 {{text}}` expects an error on the next line whose message contains
//! `text`; `@-N`/`@+N` pick other lines relative to the comment, and no `@` means the comment's
//! own line. A line may carry several annotations.

use std::path::{Path, PathBuf};

use titan_ir::diag::{Diagnostic, line_col, render_all};
use titan_ir::*;

#[derive(Debug)]
struct Expected {
    line: usize,
    text: String,
    /// The line of the annotation itself, for messages.
    at: usize,
}

/// The `expected-error` annotations of a file.
fn expectations(src: &str) -> Result<Vec<Expected>, String> {
    let mut out = Vec::new();
    for (i, line) in src.lines().enumerate() {
        let at = i + 1;
        let Some(comment) = line.find("//").map(|p| &line[p..]) else { continue };
        let mut rest = comment;
        while let Some(p) = rest.find("expected-error") {
            rest = rest[p + "expected-error".len()..].trim_start();
            let mut target = at;
            if let Some(r) = rest.strip_prefix('@') {
                let sign_len = usize::from(r.starts_with(['+', '-']));
                let digits = r[sign_len..].chars().take_while(char::is_ascii_digit).count();
                let offset: usize = r[sign_len..sign_len + digits].parse().map_err(|_| format!("line {at}: expected `@+N` or `@-N` after expected-error"))?;
                target = match &r[..sign_len] {
                    "-" => at.checked_sub(offset).ok_or_else(|| format!("line {at}: `@-{offset}` points before the file"))?,
                    _ => at + offset,
                };
                rest = r[sign_len + digits..].trim_start();
            }
            let body = rest.strip_prefix("{{").ok_or_else(|| format!("line {at}: expected `{{{{text}}}}` after expected-error"))?;
            let end = body.find("}}").ok_or_else(|| format!("line {at}: unclosed `{{{{` in expected-error"))?;
            out.push(Expected { line: target, text: body[..end].to_string(), at });
            rest = &body[end + 2..];
        }
    }
    Ok(out)
}

/// Parse errors, or when parsing succeeds, the verifier's errors mapped to the source.
fn diagnostics(src: &str) -> Vec<Diagnostic> {
    match parse(src) {
        Err(diags) => diags,
        Ok((g, map)) => to_diagnostics(&verify(&g), Some(&map)),
    }
}

fn error_files() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/filetests/errors");
    let mut files: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.extension().is_some_and(|x| x == "ir")).collect(),
        Err(e) => panic!("cannot read {}: {e}", dir.display()),
    };
    files.sort();
    files
}

/// Check one file; returns the problems found (empty when the file passes).
fn check_file(path: &Path) -> Vec<String> {
    let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let src = match std::fs::read_to_string(path) {
        Ok(s) => s,
        Err(e) => return vec![format!("cannot read: {e}")],
    };
    let expected = match expectations(&src) {
        Ok(x) => x,
        Err(e) => return vec![e],
    };
    let mut problems = Vec::new();
    if expected.is_empty() {
        problems.push("no `expected-error` annotations; an error file must expect at least one error".to_string());
    }
    let diags = diagnostics(&src);
    let mut used = vec![false; diags.len()];
    for d in &diags {
        let rendered = d.render(&name, &src);
        match d.span {
            None => problems.push(format!("diagnostic without a location: {}", d.message)),
            Some(span) => {
                let (line, col) = line_col(&src, span.start);
                let head = format!("{name}:{line}:{col}: error: ");
                if !rendered.starts_with(&head) {
                    problems.push(format!("rendered diagnostic does not start with `{head}`:\n{rendered}"));
                }
                if !rendered.lines().any(|l| l.contains(" | ") && l.trim_end().ends_with('^')) {
                    problems.push(format!("rendered diagnostic has no caret line:\n{rendered}"));
                }
            }
        }
    }
    for e in &expected {
        let found =
            diags.iter().enumerate().find(|(i, d)| !used[*i] && d.span.is_some_and(|s| line_col(&src, s.start).0 == e.line) && d.message.contains(&e.text));
        match found {
            Some((i, _)) => used[i] = true,
            None => problems.push(format!("line {}: expected an error containing {:?} (annotation on line {})", e.line, e.text, e.at)),
        }
    }
    for (d, _) in diags.iter().zip(&used).filter(|(_, u)| !**u) {
        let line = d.span.map_or(0, |s| line_col(&src, s.start).0);
        problems.push(format!("line {line}: unexpected error: {}", d.message));
    }
    // parse_and_verify reports the same set, in source order.
    match parse_and_verify(&name, &src) {
        Ok(_) => problems.push("parse_and_verify accepted the file".to_string()),
        Err(err) => {
            if err.diagnostics.len() != diags.len() {
                problems.push(format!("parse_and_verify reported {} errors, expected {}", err.diagnostics.len(), diags.len()));
            }
            let starts: Vec<usize> = err.diagnostics.iter().filter_map(|d| d.span.map(|s| s.start)).collect();
            if starts.windows(2).any(|w| w[0] > w[1]) {
                problems.push("parse_and_verify's errors are not in source order".to_string());
            }
            if err.file != name || err.source_text != src {
                problems.push("SourceError does not carry the file name and text".to_string());
            }
        }
    }
    if !problems.is_empty() {
        problems.push(format!("all diagnostics:\n{}", render_all(&diags, &name, &src)));
    }
    problems
}

#[test]
fn error_files_report_exactly_the_expected_errors() {
    let files = error_files();
    assert!(files.len() >= 20, "expected the error filetests in tests/filetests/errors, found {} files", files.len());
    let mut failures = Vec::new();
    for f in &files {
        let problems = check_file(f);
        if !problems.is_empty() {
            failures.push(format!("== {}\n{}", f.display(), problems.join("\n")));
        }
    }
    assert!(failures.is_empty(), "{} of {} error files failed:\n{}", failures.len(), files.len(), failures.join("\n\n"));
}

#[test]
fn files_with_many_errors_report_all_of_them() {
    for name in ["many_errors.ir", "shape_mismatch.ir", "structure.ir"] {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/filetests/errors").join(name);
        let src = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let lines: std::collections::BTreeSet<usize> = diagnostics(&src).iter().filter_map(|d| d.span).map(|s| line_col(&src, s.start).0).collect();
        assert!(lines.len() >= 3, "{name}: expected errors on at least 3 lines, found {lines:?}");
    }
}

#[test]
fn annotation_syntax() {
    let src = "a // expected-error {{one}} expected-error {{two}}\n// expected-error @+2 {{three}}\n\nb // expected-error @-3 {{four}}\n";
    let e = expectations(src).unwrap_or_else(|e| panic!("{e}"));
    let got: Vec<(usize, &str)> = e.iter().map(|x| (x.line, x.text.as_str())).collect();
    assert_eq!(got, [(1, "one"), (1, "two"), (4, "three"), (1, "four")]);
    assert!(expectations("// expected-error @+1 {{open\n").is_err());
    assert!(expectations("// expected-error @-5 {{x}}\n").is_err());
}

#[test]
fn missing_file_is_a_source_error_without_span() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/filetests/errors/does_not_exist.ir");
    let err = match parse_file(&path) {
        Ok(_) => panic!("a missing file parsed"),
        Err(e) => e,
    };
    assert_eq!(err.diagnostics.len(), 1);
    assert_eq!(err.diagnostics[0].span, None);
    assert!(err.diagnostics[0].message.starts_with(&format!("cannot read `{}`: ", path.display())), "{}", err.diagnostics[0].message);
    assert!(err.to_string().contains(": error: cannot read"), "{err}");
}

const VERIFY_REPORT_SRC: &str = "graph @report {
  dims {batch = 2, seq = 8}

  block @layer(%h: f32[batch, seq, 16], %w: f32[16, 16]) {
    %2 = linear(%h, %w) : f32[batch, seq, 16]
    return %2
  }

  func @main {
    input %x : f32[batch, seq, 16]
    input %y : bf16[batch, seq, 16]
    param %w : f32[3, 16, 16] {name = \"layers.{i}.w\", init = normal(0.02)}
    %0 = repeat(%x, %w) {block = @layer, count = 2, carry = 1, stacked = 1, reverse = false} : f32[batch, seq, 16]
    %1 = add(%0, %y) : f32[batch, seq, 16]
    %2 = neg(%3) : f32[batch, seq, 16]
    %3 = exp(%2) : f32[batch, seq, 16]
    output loss = %1
    update %x <- %1
  }
}
";

#[test]
fn rendered_verifier_report() {
    let err = match parse_and_verify("report.ir", VERIFY_REPORT_SRC) {
        Ok(_) => panic!("the report source verified"),
        Err(e) => e,
    };
    insta::assert_snapshot!(err.to_string(), @r#"
report.ir:13:5: error: repeat: stacked operand 1 is f32[3, 16, 16], @layer expects [2] + f32[16, 16]
   |
13 |     %0 = repeat(%x, %w) {block = @layer, count = 2, carry = 1, stacked = 1, reverse = false} : f32[batch, seq, 16]
   |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
report.ir:14:5: error: `add`: dtype mismatch, f32 vs bf16
   |
14 |     %1 = add(%0, %y) : f32[batch, seq, 16]
   |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
report.ir:15:5: error: cycle through %2, %3; a value cannot depend on itself
   |
15 |     %2 = neg(%3) : f32[batch, seq, 16]
   |     ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
report.ir:18:5: error: update target `%x` is an input; only `state` arguments can be updated
   |
18 |     update %x <- %1
   |     ^^^^^^^^^^^^^^^
"#);
}

#[test]
fn rendered_parse_report() {
    let src = "graph @g {\n  func @main {\n    input %x : f32[4]\n    %0 = nope(%x) : f32[4]\n    %1 = neg(%x : f32[4]\n    %2 = neg(%zz) : f33[4]\n    output y = %q\n  }\n}\n";
    let err = match src.parse::<Graph>() {
        Ok(_) => panic!("the report source parsed"),
        Err(e) => e,
    };
    insta::assert_snapshot!(err.to_string(), @r#"
<input>:4:10: error: unknown op `nope`
  |
4 |     %0 = nope(%x) : f32[4]
  |          ^^^^
<input>:5:17: error: expected `,` or `)`, found `:`
  |
5 |     %1 = neg(%x : f32[4]
  |                 ^
<input>:6:21: error: unknown dtype `f33`; expected one of f32, bf16, f16, f8e4m3, f8e5m2, i32, i64
  |
6 |     %2 = neg(%zz) : f33[4]
  |                     ^^^
<input>:7:16: error: undefined value `%q` in func @main
  |
7 |     output y = %q
  |                ^^
"#);
}
