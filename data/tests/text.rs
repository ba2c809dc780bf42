//! The text pipeline with a tokenizer trained in the test (`titan_data::testing::train_bpe`):
//! round trips, document boundaries, packing, resuming at a recorded position, shards read back
//! as the same stream, and the errors for a mismatched vocabulary and malformed files.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use titan_data::llmc::ShardStream;
use titan_data::stream::{StreamPosition, TextStream, TokenSource};
use titan_data::tokenize::{TokenizeOptions, tokenize_to_shards};
use titan_data::{Corpus, DataError, Packer, TextTokenizer, testing};

const CORPUS: &str = include_str!("../../examples/data/tiny_corpus.txt");
const VOCAB: usize = 512;

/// The tokenizer of these tests, trained once on the bundled corpus.
fn tokenizer() -> Arc<TextTokenizer> {
    static T: OnceLock<Arc<TextTokenizer>> = OnceLock::new();
    Arc::clone(T.get_or_init(|| Arc::new(testing::train_bpe(&[CORPUS], VOCAB).expect("train"))))
}

/// A fresh directory for one test.
struct Dir(PathBuf);

impl Dir {
    fn new(name: &str) -> Dir {
        let d = std::env::temp_dir().join(format!("titan-data-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("create dir");
        Dir(d)
    }

    fn write(&self, name: &str, bytes: impl AsRef<[u8]>) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, bytes).expect("write");
        p
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn jsonl(docs: &[&str]) -> String {
    docs.iter().map(|d| format!("{}\n", serde_json::json!({ "id": 1, "text": d }))).collect()
}

/// Every token of `spec` in one pass.
fn stream_tokens(spec: &Path, piece_bytes: usize) -> Result<Vec<u32>, DataError> {
    let corpus = Corpus::open(spec, "text")?;
    let mut s = TextStream::with_piece_bytes(corpus, tokenizer(), &StreamPosition::default(), false, piece_bytes)?;
    let mut out = Vec::new();
    while let Some(c) = s.next_chunk()? {
        out.extend(c.tokens);
    }
    Ok(out)
}

fn text_packer(spec: &Path, start: &StreamPosition, window: usize, piece_bytes: usize) -> Packer {
    let corpus = Corpus::open(spec, "text").expect("corpus");
    Packer::new(Box::new(TextStream::with_piece_bytes(corpus, tokenizer(), start, true, piece_bytes).expect("stream")), window)
}

fn err_text(r: Result<Vec<u32>, DataError>) -> String {
    r.expect_err("must fail").to_string()
}

#[test]
fn text_round_trips_through_the_trained_tokenizer() {
    let t = tokenizer();
    assert_eq!(t.vocab_size(), VOCAB);
    let (bos, eos) = (t.bos().expect("bos"), t.eos().expect("eos"));
    for text in ["The lighthouse keeper climbed the steps.", "  two spaces, tabs\tand\nnewlines\n\n", "unicode: café — naïve ☃"] {
        let ids = t.encode_document(text).expect("encode");
        assert_eq!((ids[0], ids[ids.len() - 1]), (bos, eos), "{text:?}");
        assert!(ids.iter().all(|&i| (i as usize) < VOCAB));
        assert_eq!(t.decode(&ids, true).expect("decode"), text);
    }
    assert!(t.describe().contains("BOS <|begin_of_text|> (0), EOS <|end_of_text|> (1)"), "{}", t.describe());
}

#[test]
fn each_jsonl_line_is_a_document_between_bos_and_eos() {
    let d = Dir::new("docs");
    let docs = ["first document.", "second one, a little longer than the first.", "third"];
    let p = d.write("a.jsonl", jsonl(&docs) + "\n   \n");
    let t = tokenizer();
    let got = stream_tokens(&p, 1 << 20).expect("stream");
    let want: Vec<u32> = docs.iter().flat_map(|doc| t.encode_document(doc).expect("encode")).collect();
    assert_eq!(got, want);
    let text = t.decode(&got, false).expect("decode");
    assert_eq!(text.matches("<|begin_of_text|>").count(), 3, "{text}");
    assert!(text.contains("first document.<|end_of_text|><|begin_of_text|>second one"), "{text}");
}

/// A `.txt` file is one document read in pieces; the pieces tokenize to the whole file's tokens.
#[test]
fn a_text_file_in_pieces_tokenizes_as_a_whole() {
    let d = Dir::new("pieces");
    let p = d.write("corpus.txt", CORPUS);
    let whole = tokenizer().encode_document(CORPUS).expect("encode");
    for piece_bytes in [64, 1000, 1 << 20] {
        assert_eq!(stream_tokens(&p, piece_bytes).expect("stream"), whole, "pieces of {piece_bytes} bytes");
    }
}

#[test]
fn directories_and_globs_take_files_in_sorted_order() {
    let d = Dir::new("sources");
    d.write("b.jsonl", jsonl(&["bee"]));
    d.write("a.txt", "ant");
    d.write("notes.md", "not data");
    let t = tokenizer();
    let want: Vec<u32> = ["ant", "bee"].iter().flat_map(|x| t.encode_document(x).expect("encode")).collect();
    assert_eq!(stream_tokens(&d.0, 1 << 20).expect("dir"), want);
    assert_eq!(stream_tokens(&d.0.join("*.jsonl"), 1 << 20).expect("glob"), t.encode_document("bee").expect("encode"));
    assert!(err_text(stream_tokens(&d.0.join("*.md"), 1 << 20)).ends_with("notes.md` is not a .txt or .jsonl file of text"));
    assert!(err_text(stream_tokens(&d.0.join("*.parquet"), 1 << 20)).starts_with("no file matches"));
    assert!(err_text(stream_tokens(&d.0.join("missing.txt"), 1 << 20)).ends_with("missing.txt`: no such file or directory"));
}

/// Windows are consecutive, non-overlapping `seq + 1` slices of the document stream.
#[test]
fn documents_pack_into_consecutive_windows() {
    let d = Dir::new("pack");
    let docs: Vec<String> = (0..40).map(|i| format!("document number {i} says something about the sea.")).collect();
    let p = d.write("docs.jsonl", jsonl(&docs.iter().map(String::as_str).collect::<Vec<_>>()));
    let stream = stream_tokens(&p, 1 << 20).expect("stream");
    let window = 17;
    let mut packer = text_packer(&p, &StreamPosition::default(), window, 1 << 20);
    let n = stream.len() / window;
    for k in 0..n {
        let w = packer.next_window().expect("window").expect("wraps");
        assert_eq!(w.tokens, stream[k * window..(k + 1) * window], "window {k}");
    }
    // Past the end the data starts over, in pass 2, after the leftover tokens of pass 1.
    let w = packer.next_window().expect("window").expect("wraps");
    let rest = stream.len() - n * window;
    assert_eq!(w.tokens[..rest], stream[n * window..]);
    assert_eq!(w.tokens[rest..], stream[..window - rest]);
    assert_eq!(packer.position().expect("pos").expect("pos").epoch, 1);
}

/// A packer started at the position recorded before window `k` gives window `k` and on.
#[test]
fn packing_resumes_at_a_recorded_position() {
    let d = Dir::new("resume");
    let cut = CORPUS[3000..].find('\n').expect("a line end") + 3001;
    d.write("a.txt", &CORPUS[..cut]);
    let paragraphs: Vec<&str> = CORPUS[cut..].split("\n\n").take(12).collect();
    d.write("b.jsonl", jsonl(&paragraphs));
    let window = 65;
    let mut full = text_packer(&d.0, &StreamPosition::default(), window, 500);
    let mut positions = Vec::new();
    let mut windows = Vec::new();
    for _ in 0..60 {
        positions.push(full.position().expect("pos").expect("pos"));
        windows.push(full.next_window().expect("window").expect("wraps").tokens);
    }
    assert!(positions.iter().any(|p| p.file == 1) && positions.iter().any(|p| p.epoch == 1), "covers both files and a wrap: {positions:?}");
    assert!(positions.iter().any(|p| p.offset > 0 && p.token > 0), "a position inside a piece");
    for k in [1, 7, 20, 33, 59] {
        let mut resumed = text_packer(&d.0, &positions[k], window, 500);
        for (j, want) in windows.iter().enumerate().skip(k).take(3) {
            assert_eq!(&resumed.next_window().expect("window").expect("wraps").tokens, want, "resumed at window {k}: window {j}");
        }
    }
    // The same file reached by another path resumes; another file is refused.
    let dotted = StreamPosition {
        path: format!("{}/./{}", d.0.display(), Path::new(&positions[33].path).file_name().and_then(|n| n.to_str()).expect("name")),
        ..positions[33].clone()
    };
    let mut resumed = text_packer(&d.0, &dotted, window, 500);
    assert_eq!(resumed.next_window().expect("window").expect("wraps").tokens, windows[33]);
    let moved = StreamPosition { path: "elsewhere.txt".into(), ..positions[33].clone() };
    let e = TextStream::new(Corpus::open(&d.0, "text").expect("corpus"), tokenizer(), &moved, true).err().expect("refused").to_string();
    assert!(e.contains("the data position is in file") && e.contains("elsewhere.txt"), "{e}");
}

/// `titanc data tokenize`'s shards hold the stream: read back, they pack into the same windows.
#[test]
fn shards_read_back_as_the_streamed_text() {
    let d = Dir::new("shards");
    let src = d.0.join("src");
    std::fs::create_dir_all(&src).expect("mkdir");
    std::fs::write(src.join("a.txt"), CORPUS).expect("write");
    std::fs::write(src.join("b.jsonl"), jsonl(&["one", "two two", "three three three"])).expect("write");
    let out = d.0.join("shards");
    let opts = TokenizeOptions { shard_tokens: 1000, name: "train".into(), progress: false };
    let summary = tokenize_to_shards(Corpus::open(&src, "text").expect("corpus"), tokenizer(), &out, &opts).expect("tokenize");
    let stream = stream_tokens(&src, 1 << 20).expect("stream");
    assert_eq!((summary.documents, summary.tokens, summary.files), (4, stream.len() as u64, 2));
    assert_eq!(summary.shards.len(), stream.len().div_ceil(1000));
    assert_eq!(summary.shards[0].file_name().and_then(|n| n.to_str()), Some("train_000000.bin"));
    let bytes = std::fs::read(&summary.shards[0]).expect("read");
    assert_eq!(&bytes[..12], &[20240520i32, 1, 1000].iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()[..], "llm.c header, uint16 tokens");
    assert!(summary.render().contains("4 documents"), "{}", summary.render());

    let window = 129;
    let mut text = text_packer(&src, &StreamPosition::default(), window, 1 << 20);
    let mut bins = Packer::new(Box::new(ShardStream::open(&out, &StreamPosition::default(), true).expect("shards")), window);
    let mut positions = Vec::new();
    let mut windows = Vec::new();
    for k in 0..(2 * stream.len() / window) {
        positions.push(bins.position().expect("pos").expect("pos"));
        let w = bins.next_window().expect("window").expect("wraps").tokens;
        assert_eq!(w, text.next_window().expect("window").expect("wraps").tokens, "window {k}");
        windows.push(w);
    }
    for k in [3, positions.len() / 2 + 3] {
        let mut resumed = Packer::new(Box::new(ShardStream::open(&out, &positions[k], true).expect("shards")), window);
        for want in &windows[k..k + 3] {
            assert_eq!(&resumed.next_window().expect("window").expect("wraps").tokens, want, "resumed at window {k}");
        }
    }
}

#[test]
fn a_tokenizer_larger_than_the_model_vocabulary_is_refused() {
    let e = tokenizer().check_model_vocab(256).expect_err("refused").to_string();
    assert!(e.contains("has 512 tokens but the model's vocabulary has 256") && e.contains("--vocab-size 512"), "{e}");
    tokenizer().check_model_vocab(512).expect("fits");
    tokenizer().check_model_vocab(1024).expect("a larger model vocabulary is fine");
}

#[test]
fn bos_and_eos_come_from_tokenizer_config_or_the_added_tokens() {
    let d = Dir::new("specials");
    let json = testing::train_bpe_json(&[CORPUS], 300).expect("train");
    let p = d.write("tokenizer.json", &json);
    let t = TextTokenizer::from_file(&p).expect("load");
    assert_eq!((t.bos(), t.eos()), (Some(0), Some(1)));
    d.write("tokenizer_config.json", r#"{"bos_token": {"content": "<|end_of_text|>"}, "eos_token": null}"#);
    let t = TextTokenizer::from_file(&p).expect("load");
    assert_eq!((t.bos(), t.eos()), (Some(1), Some(1)), "a config's bos_token wins; no eos_token in it: the added tokens'");
    d.write("tokenizer_config.json", r#"{"bos_token": "<|im_start|>"}"#);
    let e = TextTokenizer::from_file(&p).err().expect("refused").to_string();
    assert!(e.contains("names bos_token `<|im_start|>`, which is not in the tokenizer's vocabulary"), "{e}");
    // Without separators documents would run together: refused.
    std::fs::remove_file(d.0.join("tokenizer_config.json")).expect("remove");
    let plain = json.replace("<|begin_of_text|>", "<x>").replace("<|end_of_text|>", "<y>");
    let p = d.write("plain.json", plain);
    let e = TextTokenizer::from_file(&p).err().expect("refused").to_string();
    assert!(e.contains("has no BOS or EOS special token") && e.contains("plain.json"), "{e}");
    let e = TextTokenizer::from_file(&d.write("bad.json", "{")).err().expect("refused").to_string();
    assert!(e.starts_with(&format!("cannot use the tokenizer `{}`", d.0.join("bad.json").display())), "{e}");
}

#[test]
fn malformed_files_are_named_with_the_byte_offset() {
    let d = Dir::new("errors");
    let good = jsonl(&["fine", "also fine"]);
    let truncated = d.write("cut.jsonl", format!("{good}{{\"text\": \"the file stops here"));
    let e = err_text(stream_tokens(&truncated, 1 << 20));
    let at = good.len() + r#"{"text": "the file stops here"#.len();
    assert_eq!(
        e,
        format!(
            "`{}`, byte offset {at}: the file ends in the middle of the JSON line that starts at byte {}; it is truncated (re-download or regenerate it)",
            truncated.display(),
            good.len()
        )
    );

    let invalid = d.write("bad.jsonl", format!("{good}{{\"text\": 3}}\n"));
    let e = err_text(stream_tokens(&invalid, 1 << 20));
    assert!(e.starts_with(&format!("`{}`, byte offset {}: the line has no string field `text`", invalid.display(), good.len())), "{e}");
    assert!(e.ends_with("pass --text-field with the field that holds the text"), "{e}");
    let broken = d.write("broken.jsonl", format!("{good}{{\"text\" \"x\"}}\n"));
    assert!(err_text(stream_tokens(&broken, 1 << 20)).contains("the line is not valid JSON"));

    let mut bytes = b"plain text, then a Latin-1 byte: caf".to_vec();
    let at = bytes.len();
    bytes.extend_from_slice(b"\xe9 and more\n");
    let latin1 = d.write("latin1.txt", &bytes);
    assert_eq!(
        err_text(stream_tokens(&latin1, 1 << 20)),
        format!("`{}`, byte offset {at}: the text is not valid UTF-8; convert the file to UTF-8 (e.g. `iconv -t UTF-8`)", latin1.display())
    );
    // In a later piece of a long file, the offset still counts from the start of the file.
    let mut long = CORPUS.as_bytes().to_vec();
    let at = long.len();
    long.extend_from_slice(b"\xff\n");
    let latin1 = d.write("long.txt", &long);
    assert!(err_text(stream_tokens(&latin1, 256)).contains(&format!("byte offset {at}:")));
    let mut line = good.clone().into_bytes();
    line.extend_from_slice(b"{\"text\": \"\xff\"}\n");
    let bad = d.write("latin1.jsonl", line);
    assert!(err_text(stream_tokens(&bad, 1 << 20)).starts_with(&format!("`{}`, byte offset {}: the line is not valid UTF-8", bad.display(), good.len() + 10)));
}

#[test]
fn another_text_field_is_read_with_text_field() {
    let d = Dir::new("field");
    let p = d.write("c.jsonl", "{\"content\": \"hello there\"}\n");
    let corpus = Corpus::open(&p, "content").expect("corpus");
    let mut s = TextStream::new(corpus, tokenizer(), &StreamPosition::default(), false).expect("stream");
    assert_eq!(s.next_chunk().expect("chunk").expect("chunk").tokens, tokenizer().encode_document("hello there").expect("encode"));
}

/// Llama 3's pre-tokenizer (its split pattern, then byte-level without a regex), on the trained
/// BPE: the pattern runs on fancy-regex (no onig), and `.txt` pieces still encode to the whole
/// file's tokens under it.
#[test]
fn llama3_split_pattern_loads_and_keeps_pieces_exact() {
    let json = testing::train_bpe_json(&[CORPUS], VOCAB).expect("train");
    let mut v: serde_json::Value = serde_json::from_str(&json).expect("json");
    v["pre_tokenizer"] = serde_json::json!({
        "type": "Sequence",
        "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": testing::LLAMA3_SPLIT_PATTERN}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]
    });
    let d = Dir::new("llama3");
    let p = d.write("tokenizer.json", v.to_string());
    let t = TextTokenizer::from_file(&p).expect("loads with fancy-regex");
    let text = "Tomas's lamp: 1234 steps!\n\n  indented\tline\r\nend.\n";
    assert_eq!(t.decode(&t.encode_document(text).expect("encode"), true).expect("decode"), text);
    let whole = t.encode_document(CORPUS).expect("encode");
    let txt = d.write("corpus.txt", CORPUS);
    let corpus = Corpus::open(&txt, "text").expect("corpus");
    let mut s = TextStream::with_piece_bytes(corpus, Arc::new(t), &StreamPosition::default(), false, 64).expect("stream");
    let mut got = Vec::new();
    while let Some(c) = s.next_chunk().expect("chunk") {
        got.extend(c.tokens);
    }
    assert_eq!(got, whole);
}
