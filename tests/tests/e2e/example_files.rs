//! Every `examples/**/*.ir` file parses, verifies and prints back to exactly its own text
//! (lines holding only a `//` comment are ignored in the comparison).

use std::path::{Path, PathBuf};

use titan_ir::print::print_graph;

fn collect_ir_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir).map_err(|e| format!("cannot read `{}`: {e}", dir.display()))?;
    for entry in entries {
        let path = entry.map_err(|e| format!("cannot read `{}`: {e}", dir.display()))?.path();
        if path.is_dir() {
            collect_ir_files(&path, out)?;
        } else if path.extension().is_some_and(|x| x == "ir") {
            out.push(path);
        }
    }
    Ok(())
}

/// The text without its comment-only lines (the printer does not keep comments).
fn without_comment_lines(src: &str) -> String {
    src.lines().filter(|l| !l.trim_start().starts_with("//")).map(|l| format!("{l}\n")).collect()
}

/// Describe where two texts first differ, line by line.
fn first_difference(want: &str, got: &str) -> String {
    let (w, g): (Vec<&str>, Vec<&str>) = (want.lines().collect(), got.lines().collect());
    let i = w.iter().zip(&g).position(|(a, b)| a != b).unwrap_or(w.len().min(g.len()));
    format!(
        "first difference at line {} (after removing comment lines):\n  file:    {:?}\n  printed: {:?}",
        i + 1,
        w.get(i).copied().unwrap_or("<end of file>"),
        g.get(i).copied().unwrap_or("<end of file>")
    )
}

#[test]
fn example_files_parse_verify_and_round_trip() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples");
    let mut files = Vec::new();
    if let Err(e) = collect_ir_files(&dir, &mut files) {
        panic!("{e}");
    }
    files.sort();
    assert!(!files.is_empty(), "no `.ir` files under `{}`; add the example graphs (e.g. examples/llama3-debug.ir)", dir.display());
    let mut failures = Vec::new();
    for path in &files {
        let g = match titan_ir::parse_file(path) {
            Ok(g) => g,
            Err(e) => {
                failures.push(e.to_string());
                continue;
            }
        };
        let src = match std::fs::read_to_string(path) {
            Ok(s) => s,
            Err(e) => {
                failures.push(format!("cannot read `{}`: {e}", path.display()));
                continue;
            }
        };
        let want = without_comment_lines(&src);
        let printed = print_graph(&g);
        if printed != want {
            failures.push(format!("{}: printing the parsed graph changes the text; {}", path.display(), first_difference(&want, &printed)));
        }
    }
    assert!(failures.is_empty(), "{} of {} example files failed:\n\n{}", failures.len(), files.len(), failures.join("\n\n"));
}
