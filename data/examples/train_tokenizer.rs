//! Train a byte-level BPE tokenizer (`titan_data::testing::train_bpe_json`) on text files and
//! write its `tokenizer.json`: `cargo run -p titan-data --example train_tokenizer -- OUT VOCAB
//! FILE...`. `examples/data/tokenizer.json` is `OUT=examples/data/tokenizer.json VOCAB=512
//! FILE=examples/data/tiny_corpus.txt`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [out, vocab, files @ ..] = args.as_slice() else {
        return Err("usage: train_tokenizer OUT VOCAB FILE...".into());
    };
    let texts = files.iter().map(std::fs::read_to_string).collect::<Result<Vec<_>, _>>()?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let json = titan_data::testing::train_bpe_json(&refs, vocab.parse()?)?;
    std::fs::write(out, json)?;
    Ok(())
}
