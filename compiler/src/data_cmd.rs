//! `titanc data tokenize`: text tokenized once into llm.c shards for `titan-run --data DIR`.
//! The work is `titan_data::tokenize` (the code `titan-run --tokenizer` streams with); this file
//! holds the arguments and the summary.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;

use clap::{Args, Subcommand};
use titan_data::tokenize::{TokenizeOptions, tokenize_to_shards};
use titan_data::{Corpus, TextTokenizer};

use crate::cli::{CliError, Outcome};

/// llm.c's shard size (`fineweb.py`): 10^8 tokens.
pub const DEFAULT_SHARD_TOKENS: u64 = 100_000_000;

#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Tokenize `.txt`/`.jsonl` text (a file, a directory or a glob) into llm.c `.bin` shards
    Tokenize(TokenizeArgs),
}

#[derive(Debug, Args)]
pub struct TokenizeArgs {
    /// The text: a `.txt` or `.jsonl` file, a directory of them, or a glob (quoted)
    pub data: PathBuf,
    /// A Hugging Face tokenizer.json; each document is put between its BOS and EOS
    #[arg(long, value_name = "FILE")]
    pub tokenizer: PathBuf,
    /// The directory to write `<name>_000000.bin`, ... into (created if needed)
    #[arg(short, long, value_name = "DIR")]
    pub output: PathBuf,
    /// Tokens per shard (the last shard holds the rest)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SHARD_TOKENS, value_parser = titan_ir::flags::positive::<u64>, allow_negative_numbers = true)]
    pub shard_tokens: u64,
    /// The field of each `.jsonl` line that holds its text
    #[arg(long, value_name = "NAME", default_value = "text")]
    pub text_field: String,
    /// The shards' file name prefix
    #[arg(long, default_value = "train")]
    pub name: String,
}

/// Run a `titanc data` command.
pub fn cmd_data(c: &DataCommand) -> Result<Outcome, CliError> {
    match c {
        DataCommand::Tokenize(a) => cmd_tokenize(a),
    }
}

fn cmd_tokenize(a: &TokenizeArgs) -> Result<Outcome, CliError> {
    let tokenizer = Arc::new(TextTokenizer::from_file(&a.tokenizer)?);
    let corpus = Corpus::open(&a.data, &a.text_field)?;
    let header = format!("titanc: {}\n", tokenizer.describe());
    let opts = TokenizeOptions { shard_tokens: a.shard_tokens, name: a.name.clone(), progress: std::io::stderr().is_terminal() };
    let summary = tokenize_to_shards(corpus, tokenizer, &a.output, &opts)?;
    Ok(Outcome { stdout: summary.render(), stderr: header })
}

#[cfg(test)]
mod tests {
    use crate::cli::run_args;

    const TOKENIZER: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/data/tokenizer.json");

    #[test]
    fn tokenize_writes_shards_and_a_summary() {
        let dir = std::env::temp_dir().join(format!("titanc-data-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let text = dir.join("t.jsonl");
        std::fs::write(&text, "{\"body\": \"the keeper climbed the steps\"}\n{\"body\": \"the lamp\"}\n").expect("write");
        let (t, out) = (text.display().to_string(), dir.join("out").display().to_string());
        let o = run_args(["titanc", "data", "tokenize", &t, "--tokenizer", TOKENIZER, "-o", &out, "--text-field", "body"]).expect("tokenize");
        assert!(o.stdout.starts_with("tokenized 1 file(s), 0.00 MB: 2 documents, ") && o.stdout.contains("train_000000.bin"), "{}", o.stdout);
        assert!(o.stderr.contains("(512 tokens, BOS <|begin_of_text|> (0), EOS <|end_of_text|> (1))"), "{}", o.stderr);
        let e = run_args(["titanc", "data", "tokenize", &t, "--tokenizer", TOKENIZER, "-o", &out]).expect_err("no text field").render();
        assert!(e.contains("byte offset 0: the line has no string field `text` (its fields: body)"), "{e}");
        let e = run_args(["titanc", "data", "tokenize", &t, "--tokenizer", TOKENIZER, "-o", &out, "--shard-tokens", "0"]).expect_err("zero").render();
        assert!(e.contains("the value must be at least 1"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
