//! The lexer of the text format: source text to tokens with byte spans, one error per bad line.

use crate::diag::{Diagnostic, Span};

/// One token kind, with its payload already decoded (string escapes, numbers).
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    /// A bare word: `graph`, `linear`, `bf16`, `batch`, `true`.
    Ident(String),
    /// An integer literal, sign included; range checks happen where it is used.
    Int(i128),
    /// A float literal (`0.5`, `1e-5`, `-inf`).
    Float(f64),
    /// A string literal, escapes decoded.
    Str(String),
    /// `%name`, without the `%`.
    Value(String),
    /// `@name`, without the `@`.
    Symbol(String),
    LBrace,
    RBrace,
    LParen,
    RParen,
    LBracket,
    RBracket,
    Comma,
    Eq,
    Colon,
    /// `#[`, which opens a placement list.
    HashBracket,
    /// `<-` of `update %state <- %value`.
    Arrow,
    /// Something malformed; its diagnostic has already been reported.
    Error,
    Eof,
}

#[derive(Clone, Debug)]
pub(crate) struct Token {
    pub tok: Tok,
    pub span: Span,
    /// The first token of its line (statements are one per line; error recovery relies on it).
    pub line_start: bool,
}

/// Characters of value and block names after `%` and `@`.
pub(crate) fn is_name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '.'
}

fn is_ident_start(c: char) -> bool {
    c.is_ascii_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Human description of a token for "expected X, found Y" messages.
pub(crate) fn describe(t: &Tok) -> String {
    match t {
        Tok::Ident(s) => format!("`{s}`"),
        Tok::Int(i) => format!("number `{i}`"),
        Tok::Float(x) => format!("number `{}`", crate::attr::fmt_float(*x)),
        Tok::Str(_) => "a string".to_string(),
        Tok::Value(s) => format!("`%{s}`"),
        Tok::Symbol(s) => format!("`@{s}`"),
        Tok::LBrace => "`{`".to_string(),
        Tok::RBrace => "`}`".to_string(),
        Tok::LParen => "`(`".to_string(),
        Tok::RParen => "`)`".to_string(),
        Tok::LBracket => "`[`".to_string(),
        Tok::RBracket => "`]`".to_string(),
        Tok::Comma => "`,`".to_string(),
        Tok::Eq => "`=`".to_string(),
        Tok::Colon => "`:`".to_string(),
        Tok::HashBracket => "`#[`".to_string(),
        Tok::Arrow => "`<-`".to_string(),
        Tok::Error => "a malformed token".to_string(),
        Tok::Eof => "the end of the file".to_string(),
    }
}

struct Lexer<'s> {
    src: &'s str,
    pos: usize,
    toks: Vec<Token>,
    diags: Vec<Diagnostic>,
    line_start: bool,
    /// Byte offset of the start of the line of the last lexer error (one error per line).
    last_error_line: Option<usize>,
}

impl<'s> Lexer<'s> {
    fn peek_char(&self) -> Option<char> {
        self.src[self.pos..].chars().next()
    }

    fn char_at(&self, pos: usize) -> Option<char> {
        self.src.get(pos..).and_then(|s| s.chars().next())
    }

    fn push(&mut self, tok: Tok, start: usize) {
        let span = Span::new(start, self.pos);
        self.toks.push(Token { tok, span, line_start: self.line_start });
        self.line_start = false;
    }

    fn error(&mut self, span: Span, msg: String) {
        let line = self.src[..span.start.min(self.src.len())].rfind('\n').map_or(0, |i| i + 1);
        if self.last_error_line != Some(line) {
            self.diags.push(Diagnostic::new(msg, Some(span)));
            self.last_error_line = Some(line);
        }
    }

    /// Skip a run of `[A-Za-z0-9_.]` starting at `self.pos`; returns the run.
    fn take_while(&mut self, f: fn(char) -> bool) -> &'s str {
        let start = self.pos;
        while let Some(c) = self.peek_char() {
            if !f(c) {
                break;
            }
            self.pos += c.len_utf8();
        }
        &self.src[start..self.pos]
    }

    fn run(&mut self) {
        while let Some(c) = self.peek_char() {
            let start = self.pos;
            match c {
                '\n' => {
                    self.pos += 1;
                    self.line_start = true;
                }
                ' ' | '\t' | '\r' => self.pos += 1,
                '/' if self.char_at(start + 1) == Some('/') => {
                    while let Some(c) = self.peek_char() {
                        if c == '\n' {
                            break;
                        }
                        self.pos += c.len_utf8();
                    }
                }
                '{' | '}' | '(' | ')' | '[' | ']' | ',' | '=' | ':' => {
                    self.pos += 1;
                    let tok = match c {
                        '{' => Tok::LBrace,
                        '}' => Tok::RBrace,
                        '(' => Tok::LParen,
                        ')' => Tok::RParen,
                        '[' => Tok::LBracket,
                        ']' => Tok::RBracket,
                        ',' => Tok::Comma,
                        '=' => Tok::Eq,
                        _ => Tok::Colon,
                    };
                    self.push(tok, start);
                }
                '#' => {
                    if self.char_at(start + 1) == Some('[') {
                        self.pos += 2;
                        self.push(Tok::HashBracket, start);
                    } else {
                        self.pos += 1;
                        self.error(Span::new(start, self.pos), "unexpected `#`; a placement list is written `#[Replicate, Shard(0)]`".into());
                        self.push(Tok::Error, start);
                    }
                }
                '<' => {
                    if self.char_at(start + 1) == Some('-') {
                        self.pos += 2;
                        self.push(Tok::Arrow, start);
                    } else {
                        self.pos += 1;
                        self.error(Span::new(start, self.pos), "unexpected `<`; did you mean `<-`?".into());
                        self.push(Tok::Error, start);
                    }
                }
                '%' | '@' => {
                    self.pos += 1;
                    let name = self.take_while(is_name_char).to_string();
                    if name.is_empty() {
                        let what = if c == '%' { "value" } else { "block" };
                        self.error(Span::new(start, self.pos), format!("expected a {what} name after `{c}`; names use letters, digits, `_` and `.`"));
                        self.push(Tok::Error, start);
                    } else if c == '%' {
                        self.push(Tok::Value(name), start);
                    } else {
                        self.push(Tok::Symbol(name), start);
                    }
                }
                '"' => self.string(),
                '-' => {
                    let rest = &self.src[start + 1..];
                    if rest.starts_with(|d: char| d.is_ascii_digit()) {
                        self.number();
                    } else if rest.starts_with("inf") && !rest[3..].starts_with(is_ident_char) {
                        self.pos += 4;
                        self.push(Tok::Float(f64::NEG_INFINITY), start);
                    } else {
                        self.pos += 1;
                        self.error(Span::new(start, self.pos), "unexpected `-`; negative numbers are written `-1`, `-0.5` or `-inf`".into());
                        self.push(Tok::Error, start);
                    }
                }
                c if c.is_ascii_digit() => self.number(),
                c if is_ident_start(c) => {
                    let word = self.take_while(is_ident_char).to_string();
                    self.push(Tok::Ident(word), start);
                }
                c => {
                    self.pos += c.len_utf8();
                    self.error(Span::new(start, self.pos), format!("unexpected character `{}`", c.escape_debug()));
                    self.push(Tok::Error, start);
                }
            }
        }
        let end = self.src.len();
        self.toks.push(Token { tok: Tok::Eof, span: Span::new(end, end), line_start: true });
    }

    fn digits(&mut self) -> usize {
        self.take_while(|c| c.is_ascii_digit()).len()
    }

    /// `-?[0-9]+(.[0-9]*)?([eE][+-]?[0-9]+)?`; anything glued to it makes it malformed.
    fn number(&mut self) {
        let start = self.pos;
        if self.peek_char() == Some('-') {
            self.pos += 1;
        }
        self.digits();
        let mut is_float = false;
        let mut ok = true;
        if self.peek_char() == Some('.') {
            is_float = true;
            self.pos += 1;
            self.digits();
        }
        if matches!(self.peek_char(), Some('e' | 'E')) {
            is_float = true;
            self.pos += 1;
            if matches!(self.peek_char(), Some('+' | '-')) {
                self.pos += 1;
            }
            if self.digits() == 0 {
                ok = false;
            }
        }
        if self.peek_char().is_some_and(is_name_char) {
            self.take_while(is_name_char);
            ok = false;
        }
        let text = &self.src[start..self.pos];
        let span = Span::new(start, self.pos);
        if !ok {
            self.error(span, format!("malformed number `{text}`"));
            self.push(Tok::Error, start);
        } else if is_float {
            match text.parse::<f64>() {
                Ok(x) => self.push(Tok::Float(x), start),
                Err(_) => {
                    self.error(span, format!("malformed number `{text}`"));
                    self.push(Tok::Error, start);
                }
            }
        } else {
            match text.parse::<i128>() {
                Ok(i) => self.push(Tok::Int(i), start),
                Err(_) => {
                    self.error(span, format!("integer `{text}` is too large"));
                    self.push(Tok::Error, start);
                }
            }
        }
    }

    /// A string literal; escapes `\"`, `\\`, `\n`, `\t`, `\u{hex}`. It must end on its line.
    fn string(&mut self) {
        let start = self.pos;
        self.pos += 1;
        let mut out = String::new();
        let mut bad: Option<(Span, String)> = None;
        loop {
            let Some(c) = self.peek_char() else {
                self.error(Span::new(start, start + 1), "unterminated string; add the closing `\"`".into());
                self.push(Tok::Error, start);
                return;
            };
            let here = self.pos;
            match c {
                '"' => {
                    self.pos += 1;
                    break;
                }
                '\n' => {
                    self.error(Span::new(start, start + 1), "unterminated string; add the closing `\"` before the end of the line".into());
                    self.push(Tok::Error, start);
                    return;
                }
                '\\' => {
                    self.pos += 1;
                    let e = self.peek_char();
                    match e {
                        Some('"') => out.push('"'),
                        Some('\\') => out.push('\\'),
                        Some('n') => out.push('\n'),
                        Some('t') => out.push('\t'),
                        Some('u') => {
                            self.pos += 1;
                            match self.unicode_escape() {
                                Some(ch) => out.push(ch),
                                None => {
                                    bad.get_or_insert((
                                        Span::new(here, self.pos),
                                        "invalid unicode escape; write `\\u{...}` with 1 to 6 hex digits of a valid code point".into(),
                                    ));
                                }
                            }
                            continue;
                        }
                        Some('\n') | None => continue,
                        Some(other) => {
                            bad.get_or_insert((
                                Span::new(here, self.pos + other.len_utf8()),
                                format!("unknown escape `\\{}` in string; use `\\\"`, `\\\\`, `\\n`, `\\t` or `\\u{{...}}`", other.escape_debug()),
                            ));
                        }
                    }
                    if let Some(e) = e {
                        self.pos += e.len_utf8();
                    }
                }
                c => {
                    out.push(c);
                    self.pos += c.len_utf8();
                }
            }
        }
        match bad {
            None => self.push(Tok::Str(out), start),
            Some((span, msg)) => {
                self.error(span, msg);
                self.push(Tok::Error, start);
            }
        }
    }

    /// After `\u`: `{hex}`. Consumes what it can; `None` when malformed.
    fn unicode_escape(&mut self) -> Option<char> {
        if self.peek_char() != Some('{') {
            return None;
        }
        self.pos += 1;
        let hex = self.take_while(|c| c.is_ascii_hexdigit());
        if self.peek_char() != Some('}') {
            return None;
        }
        self.pos += 1;
        if hex.is_empty() || hex.len() > 6 {
            return None;
        }
        u32::from_str_radix(hex, 16).ok().and_then(char::from_u32)
    }
}

/// Split `src` into tokens, always ending with [`Tok::Eof`]. Malformed tokens become
/// [`Tok::Error`] with a diagnostic (at most one per line).
pub(crate) fn lex(src: &str) -> (Vec<Token>, Vec<Diagnostic>) {
    let mut lx = Lexer { src, pos: 0, toks: Vec::new(), diags: Vec::new(), line_start: true, last_error_line: None };
    lx.run();
    (lx.toks, lx.diags)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Vec<Tok> {
        lex(src).0.into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn numbers_and_names() {
        assert_eq!(
            kinds("%a.b_1 @x 12 -3 1e-5 -0.0 -inf <- #["),
            vec![
                Tok::Value("a.b_1".into()),
                Tok::Symbol("x".into()),
                Tok::Int(12),
                Tok::Int(-3),
                Tok::Float(1e-5),
                Tok::Float(-0.0),
                Tok::Float(f64::NEG_INFINITY),
                Tok::Arrow,
                Tok::HashBracket,
                Tok::Eof
            ]
        );
    }

    #[test]
    fn strings_decode_escapes() {
        assert_eq!(kinds(r#""a\"b\\c\n\t\u{1f600}""#), vec![Tok::Str("a\"b\\c\n\t\u{1f600}".into()), Tok::Eof]);
        let (_, d) = lex("\"abc\n\"");
        assert!(d[0].message.contains("unterminated string"), "{d:?}");
        let (_, d) = lex(r#""\q""#);
        assert!(d[0].message.contains("unknown escape"), "{d:?}");
        let (_, d) = lex(r#""\u{110000}""#);
        assert!(d[0].message.contains("invalid unicode escape"), "{d:?}");
    }

    #[test]
    fn malformed_tokens() {
        let (_, d) = lex("12ab 1e $\n99999999999999999999999999999999999999999999");
        assert_eq!(d.len(), 2, "one error per line: {d:?}");
        assert!(d[0].message.contains("malformed number `12ab`"));
        assert!(d[1].message.contains("too large"));
    }

    #[test]
    fn comments_and_line_starts() {
        let toks = lex("a // b c\n d e").0;
        let starts: Vec<bool> = toks.iter().map(|t| t.line_start).collect();
        assert_eq!(starts, vec![true, true, false, true]);
    }
}
