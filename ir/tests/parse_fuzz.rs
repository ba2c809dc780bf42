//! Mutation fuzzing of the parser and verifier: thousands of corrupted variants of valid files
//! must each be accepted or rejected with diagnostics, never panic. Inputs that still parse must
//! also print and parse back to the same text.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

use proptest::strategy::{Strategy, ValueTree};
use proptest::test_runner::TestRunner;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use titan_ir::print::print_graph;
use titan_ir::*;

/// The random graph generator and the every-op graph (its own tests return early here).
#[allow(dead_code)]
#[path = "parse_roundtrip.rs"]
mod roundtrip;

const MUTANTS: usize = 40_000;
/// Inputs accepted by `parse_and_verify` so far.
static VERIFIED: AtomicUsize = AtomicUsize::new(0);

const SEED: u64 = 0x0074_6974_616e_2d69;

/// Tokens of the format, and some nasty ones, inserted at random places.
const VOCAB: &[&str] = &[
    "graph",
    "meta",
    "dims",
    "block",
    "func",
    "input",
    "param",
    "state",
    "blockarg",
    "output",
    "update",
    "return",
    "{",
    "}",
    "(",
    ")",
    "[",
    "]",
    ",",
    "=",
    ":",
    "#[",
    "#",
    "<-",
    "<",
    "%",
    "%0",
    "%1",
    "%x",
    "%?1",
    "@",
    "@layer",
    "@main",
    "\"",
    "\"s\"",
    "\"\\u{",
    "\\",
    "//",
    "\n",
    "-",
    "-inf",
    "inf",
    "nan",
    "1e309",
    "1e",
    "-0.0",
    "0",
    "1",
    "2",
    "-1",
    "99999999999999999999",
    "18446744073709551615",
    "4294967296",
    "9223372036854775808",
    "-9223372036854775809",
    "f32",
    "bf16",
    "i32",
    "f32[]",
    "bf16[batch, seq]",
    "i32[",
    "Shard(",
    "Shard(4294967296)",
    "Replicate",
    "Partial",
    "true",
    "false",
    "{i}",
    "linear",
    "repeat",
    "matmul",
    "reshape",
    "attention",
    "adamw",
    "rope",
    "constant",
    "block = @layer",
    "count = 0",
    "carry = 5",
    "stacked = 9",
    "eps = \"x\"",
    "axes = [9]",
    "perm = [0, 0]",
    "\u{0}",
    "é",
    "\u{2028}",
    "\r",
    "\t",
    "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[",
    "((((((((((((((((((((",
    "]]]]]]]]]]",
    "}}}}}}",
];

/// Words swapped for one another to make files that parse but break typing rules.
const WORDS: &[&str] = &[
    "f32",
    "bf16",
    "f16",
    "i32",
    "i64",
    "f8e4m3",
    "batch",
    "seq",
    "linear",
    "matmul",
    "add",
    "neg",
    "reshape",
    "transpose",
    "broadcast",
    "attention",
    "attention_bwd",
    "rmsnorm",
    "rmsnorm_bwd",
    "embedding",
    "gather",
    "scatter_add",
    "cast",
    "repeat",
    "adamw",
    "lr_schedule",
    "cross_entropy",
    "cross_entropy_stats",
    "cross_entropy_combine",
    "true",
    "false",
    "input",
    "param",
    "state",
    "half",
    "cosine",
];

fn mutate(rng: &mut ChaCha8Rng, text: &str) -> String {
    let mut b = text.as_bytes().to_vec();
    let rounds = rng.random_range(1..4);
    for _ in 0..rounds {
        let len = b.len();
        let pos = if len == 0 { 0 } else { rng.random_range(0..len) };
        match rng.random_range(0..11) {
            // Flip a byte.
            0 if len > 0 => b[pos] = rng.random(),
            // Delete a range.
            1 if len > 0 => {
                let end = (pos + rng.random_range(1..24)).min(len);
                b.drain(pos..end);
            }
            // Duplicate a range somewhere.
            2 if len > 0 => {
                let end = (pos + rng.random_range(1..80)).min(len);
                let chunk = b[pos..end].to_vec();
                let at = rng.random_range(0..=len);
                b.splice(at..at, chunk);
            }
            // Insert a token.
            3 | 4 => {
                let tok = VOCAB[rng.random_range(0..VOCAB.len())];
                b.splice(pos..pos, tok.bytes());
            }
            // Swap two lines.
            5 => {
                let s = String::from_utf8_lossy(&b).into_owned();
                let mut lines: Vec<&str> = s.split('\n').collect();
                let (i, j) = (rng.random_range(0..lines.len()), rng.random_range(0..lines.len()));
                lines.swap(i, j);
                b = lines.join("\n").into_bytes();
            }
            // Truncate.
            6 => b.truncate(pos),
            // Insert a random Unicode character.
            7 => {
                let c = char::from_u32(rng.random_range(0..0x11_0000)).unwrap_or('\u{fffd}');
                b.splice(pos..pos, c.to_string().into_bytes());
            }
            // Replace a number with another one.
            8 => {
                if let Some(start) = (pos..len).find(|&i| b[i].is_ascii_digit()) {
                    let end = (start..len).find(|&i| !b[i].is_ascii_digit()).unwrap_or(len);
                    let n: u64 = match rng.random_range(0..4) {
                        0 => 0,
                        1 => rng.random_range(1..10),
                        2 => rng.random_range(0..100_000),
                        _ => rng.random(),
                    };
                    b.splice(start..end, n.to_string().into_bytes());
                }
            }
            // Replace a word with another word of the format.
            9 => {
                if let Some(start) = (pos..len).find(|&i| b[i].is_ascii_alphabetic()) {
                    let end = (start..len).find(|&i| !(b[i].is_ascii_alphanumeric() || b[i] == b'_')).unwrap_or(len);
                    let w = WORDS[rng.random_range(0..WORDS.len())];
                    b.splice(start..end, w.bytes());
                }
            }
            // Delete or duplicate a whole line.
            _ => {
                let s = String::from_utf8_lossy(&b).into_owned();
                let mut lines: Vec<&str> = s.split('\n').collect();
                let i = rng.random_range(0..lines.len());
                if rng.random_bool(0.5) {
                    lines.remove(i);
                } else {
                    let l = lines[i];
                    lines.insert(i, l);
                }
                b = lines.join("\n").into_bytes();
            }
        }
    }
    String::from_utf8_lossy(&b).into_owned()
}

/// Parse, verify, render errors; for accepted inputs, check the print/parse round trip.
/// Returns a description of a broken round trip (panics are caught by the caller).
fn exercise(src: &str) -> Option<String> {
    match parse_and_verify("fuzz.ir", src) {
        Ok(g) => {
            VERIFIED.fetch_add(1, Ordering::Relaxed);
            let printed = print_graph(&g);
            match parse_and_verify("printed.ir", &printed) {
                Ok(g2) if print_graph(&g2) == printed => None,
                Ok(g2) => Some(format!("printing an accepted graph is not stable:\n{printed}\n---\n{}", print_graph(&g2))),
                Err(e) => Some(format!("the printed form of an accepted graph does not parse:\n{e}\n---\n{printed}")),
            }
        }
        Err(e) => {
            let report = e.to_string();
            if report.is_empty() || e.diagnostics.is_empty() {
                return Some("rejected without any diagnostic".to_string());
            }
            None
        }
    }
}

fn seeds() -> Vec<String> {
    let mut seeds = vec![roundtrip::EVERY_OP.to_string()];
    let mut runner = TestRunner::deterministic();
    let strategy = roundtrip::generator::recipe();
    for _ in 0..48 {
        let tree = strategy.new_tree(&mut runner).unwrap_or_else(|e| panic!("cannot generate a graph: {e}"));
        seeds.push(print_graph(&roundtrip::generator::build(&tree.current())));
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for dir in [root.join("examples"), root.join("tests/filetests/errors")] {
        let mut stack = vec![dir];
        while let Some(d) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&d) else { continue };
            for e in entries.flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "ir")
                    && let Ok(s) = std::fs::read_to_string(&p)
                {
                    seeds.push(s);
                }
            }
        }
    }
    seeds
}

#[test]
fn mutated_files_never_panic() {
    let seeds = seeds();
    // The unmutated seeds themselves: valid ones round-trip, error files are rejected cleanly.
    for s in &seeds {
        if let Some(problem) = exercise(s) {
            panic!("{problem}\ninput:\n{s}");
        }
    }
    let mut rng = ChaCha8Rng::seed_from_u64(SEED);
    let start = Instant::now();
    let (mut accepted, mut rejected) = (0usize, 0usize);
    let verified_before = VERIFIED.load(Ordering::Relaxed);
    for i in 0..MUTANTS {
        let seed = &seeds[rng.random_range(0..seeds.len())];
        let input = mutate(&mut rng, seed);
        match catch_unwind(AssertUnwindSafe(|| (exercise(&input), parse(&input).is_ok()))) {
            Ok((Some(problem), _)) => panic!("mutant {i}: {problem}\ninput: {input:?}"),
            Ok((None, true)) => accepted += 1,
            Ok((None, false)) => rejected += 1,
            Err(_) => panic!("mutant {i} panicked; input: {input:?}"),
        }
    }
    let verified = VERIFIED.load(Ordering::Relaxed) - verified_before;
    eprintln!(
        "{MUTANTS} mutants of {} seeds in {:.1?}: {rejected} rejected by the parser, {accepted} parsed, {verified} of them verified",
        seeds.len(),
        start.elapsed()
    );
    assert!(
        rejected > MUTANTS / 4 && accepted > MUTANTS / 50 && verified > MUTANTS / 200,
        "mutations should produce all kinds of input: {rejected} rejected, {accepted} parsed, {verified} verified"
    );
}

#[test]
fn pathological_inputs() {
    let cases = [
        String::new(),
        "graph".to_string(),
        "graph @g {".to_string(),
        "}".repeat(1000),
        "{".repeat(100_000),
        format!("graph @g {{\n  meta {{x = {}}}\n}}", "[".repeat(100_000)),
        format!("graph @g {{\n  meta {{x = {}}}\n}}", "f(".repeat(100_000)),
        format!("graph @g {{\n  dims {{n = {}}}\n}}", "9".repeat(1000)),
        "graph @g {\n  func @main {\n    input %x : f32[18446744073709551615, 18446744073709551615]\n    %0 = reshape(%x) : f32[1]\n    output y = %0\n  }\n}\n".to_string(),
        "graph @g {\n  func @main {\n    input %x : f32[4294967296, 4294967296, 4294967296]\n    %0 = neg(%x) : f32[4294967296, 4294967296, 4294967296]\n    output y = %0\n  }\n}\n".to_string(),
        "graph @g {\n  func @main {\n    input %x : i32[]\n    %0 = repeat(%x) {block = @main, count = 1, carry = 1, stacked = 0, reverse = false} : i32[]\n    output y = %0\n  }\n}\n".to_string(),
        "\"".repeat(10_000),
        "\u{feff}graph @g {}".to_string(),
        "graph @g {\n  func @main {\n".repeat(2000),
    ];
    for c in &cases {
        let r = catch_unwind(AssertUnwindSafe(|| exercise(c)));
        match r {
            Ok(None) => {}
            Ok(Some(problem)) => panic!("{problem}"),
            Err(_) => panic!("panicked on {:?}", c.chars().take(200).collect::<String>()),
        }
    }
}
