//! Tokenization throughput: `cargo run --release -p titan-data --example tokenize_bench --
//! TOKENIZER DATA OUT_DIR` runs `titan_data::tokenize::tokenize_to_shards` (the code of `titanc
//! data tokenize`) and prints its summary (MB/s, tokens/s) for docs/performance.md.

use std::sync::Arc;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [tokenizer, data, out] = args.as_slice() else {
        return Err("usage: tokenize_bench TOKENIZER DATA OUT_DIR".into());
    };
    let tokenizer = Arc::new(titan_data::TextTokenizer::from_file(tokenizer.as_ref())?);
    println!("{}", tokenizer.describe());
    let corpus = titan_data::Corpus::open(data.as_ref(), "text")?;
    let opts = titan_data::tokenize::TokenizeOptions { shard_tokens: 100_000_000, name: "bench".into(), progress: false };
    let summary = titan_data::tokenize::tokenize_to_shards(corpus, tokenizer, out.as_ref(), &opts)?;
    print!("{}", summary.render());
    Ok(())
}
