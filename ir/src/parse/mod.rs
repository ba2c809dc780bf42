//! The text-format parser: reads what `print.rs` writes back into a [`Graph`] and a
//! [`SourceMap`], reporting every syntax and name-resolution error it can find in one go.
//!
//! Statements are one per line; after an error the parser skips to the next line and goes on.
//! Inside a region values may be used before the line that defines them: names are resolved
//! once the region is read, and nodes are then put in a stable topological order (text order
//! is kept when there is a cycle, so the verifier can report it).

mod lexer;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::Path;
use std::str::FromStr;

use petgraph::algo::kosaraju_scc;
use petgraph::graph::{DiGraph, NodeIndex};

use crate::attr::{AttrValue, Attrs};
use crate::diag::{Diagnostic, SourceError, Span};
use crate::dtype::DType;
use crate::graph::{ArgKind, BlockId, Graph, Init, Output, ParamInfo, Region, Update, Value};
use crate::op::Op;
use crate::placement::Placement;
use crate::shape::{Dim, DimTable, TensorType};
use crate::verify::{to_diagnostics, verify};
use lexer::{Tok, Token, describe, lex};

/// Source spans of one region's parts, indexed like the region's own tables.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RegionSpans {
    /// The region header: `block @layer(...)` or `func @main`.
    pub region: Span,
    /// Each argument declaration, by argument number.
    pub args: Vec<Span>,
    /// Each node's line, indexed by `NodeId`.
    pub nodes: Vec<Span>,
    /// Each `output` line of `func`, or each value of a block's `return`.
    pub outputs: Vec<Span>,
    /// Each `update` line.
    pub updates: Vec<Span>,
    /// How each value was spelled in the source (without `%`), by value index, so messages can
    /// use the user's numbering of unnamed values rather than the canonical one.
    pub value_names: Vec<String>,
}

/// Where each part of a parsed graph came from in the source text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SourceMap {
    pub main: RegionSpans,
    /// By `BlockId`.
    pub blocks: Vec<RegionSpans>,
    /// The `graph @name` header.
    pub graph: Span,
}

/// Deepest nesting of attribute lists and calls the parser accepts.
const MAX_ATTR_DEPTH: usize = 32;

/// A diagnostic has been recorded; the caller recovers.
struct Fail;

type PResult<T> = Result<T, Fail>;

/// What a name of a region stands for while the region is being read.
#[derive(Clone, Copy, Debug)]
enum DefKind {
    Arg,
    /// A result of node draft number `0`.
    Node(usize),
    /// Defined by a statement that failed to parse: uses are not reported as undefined.
    Poisoned,
}

#[derive(Clone, Copy, Debug)]
struct Def {
    span: Span,
    kind: DefKind,
}

/// A parsed type with its optional placement list.
#[derive(Clone, Debug)]
struct Typed {
    ty: TensorType,
    placement: Vec<Placement>,
}

struct ArgDraft {
    name: String,
    typed: Typed,
    kind: ArgKind,
    span: Span,
}

struct NodeDraft {
    results: Vec<String>,
    types: Vec<Typed>,
    op_name: String,
    op_span: Span,
    /// The attributes until the op is built (once every block name is known).
    attrs: Vec<AttrEntry>,
    op: Option<Op>,
    inputs: Vec<(String, Span)>,
    span: Span,
}

struct OutputDraft {
    name: Option<String>,
    value: (String, Span),
    span: Span,
}

struct UpdateDraft {
    state: (String, Span),
    value: (String, Span),
    span: Span,
}

struct RegionDraft {
    name: String,
    is_main: bool,
    header: Span,
    args: Vec<ArgDraft>,
    nodes: Vec<NodeDraft>,
    outputs: Vec<OutputDraft>,
    updates: Vec<UpdateDraft>,
    defs: HashMap<String, Def>,
    returned: bool,
}

impl RegionDraft {
    fn new(name: String, is_main: bool, header: Span) -> RegionDraft {
        RegionDraft {
            name,
            is_main,
            header,
            args: Vec::new(),
            nodes: Vec::new(),
            outputs: Vec::new(),
            updates: Vec::new(),
            defs: HashMap::new(),
            returned: false,
        }
    }

    fn describe(&self) -> String {
        if self.is_main { format!("func @{}", self.name) } else { format!("block @{}", self.name) }
    }
}

/// An attribute dictionary entry with the spans of its key and value.
struct AttrEntry {
    key: String,
    key_span: Span,
    value: AttrValue,
    value_span: Span,
}

struct Parser {
    /// Byte offset where each line starts.
    line_starts: Vec<usize>,
    toks: Vec<Token>,
    pos: usize,
    diags: Vec<Diagnostic>,
    graph_name: String,
    graph_span: Span,
    meta: Option<Attrs>,
    dims: Option<DimTable>,
    /// Block names by id, with the span of their definition.
    block_names: Vec<(String, Span)>,
    blocks: Vec<RegionDraft>,
    main: Option<RegionDraft>,
    /// A `func` keyword was seen (so a missing func is not reported again).
    saw_func: bool,
    /// Token index where the current statement started.
    stmt_start: usize,
}

fn is_ident(s: &str) -> bool {
    let mut cs = s.chars();
    cs.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_') && cs.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// A value spelled `%123` has no name; any other spelling is kept as its name.
fn value_name(s: &str) -> Option<String> {
    if s.chars().all(|c| c.is_ascii_digit()) { None } else { Some(s.to_string()) }
}

impl Parser {
    fn peek(&self) -> &Token {
        &self.toks[self.pos.min(self.toks.len() - 1)]
    }

    fn peek_tok(&self) -> &Tok {
        &self.peek().tok
    }

    fn advance(&mut self) -> Token {
        let t = self.peek().clone();
        if t.tok != Tok::Eof {
            self.pos += 1;
        }
        t
    }

    /// End of the previous token (for statement spans).
    fn prev_end(&self) -> usize {
        if self.pos == 0 { 0 } else { self.toks[self.pos - 1].span.end }
    }

    /// 1-based line of `span`, by binary search over the line starts.
    fn line_of(&self, span: Span) -> usize {
        self.line_starts.partition_point(|&start| start <= span.start)
    }

    fn error(&mut self, span: Span, msg: impl Into<String>) -> Fail {
        self.diags.push(Diagnostic::new(msg, Some(span)));
        Fail
    }

    /// "expected X, found Y" at the next token (silent when that token is already an error).
    /// When the statement ran off its line, the error points at the end of that line.
    fn unexpected(&mut self, what: &str) -> Fail {
        let t = self.peek().clone();
        if t.tok == Tok::Error {
            return Fail;
        }
        if t.line_start && self.pos > self.stmt_start {
            let end = self.prev_end();
            return self.error(Span::new(end, end), format!("expected {what}, found the end of the line"));
        }
        self.error(t.span, format!("expected {what}, found {}", describe(&t.tok)))
    }

    fn at(&self, t: &Tok) -> bool {
        std::mem::discriminant(self.peek_tok()) == std::mem::discriminant(t)
    }

    fn at_word(&self, w: &str) -> bool {
        matches!(self.peek_tok(), Tok::Ident(s) if s == w)
    }

    fn expect(&mut self, t: Tok, what: &str) -> PResult<Span> {
        if self.at(&t) { Ok(self.advance().span) } else { Err(self.unexpected(what)) }
    }

    fn expect_word(&mut self, w: &str) -> PResult<Span> {
        if self.at_word(w) { Ok(self.advance().span) } else { Err(self.unexpected(&format!("`{w}`"))) }
    }

    fn expect_ident(&mut self, what: &str) -> PResult<(String, Span)> {
        match self.peek_tok().clone() {
            Tok::Ident(s) => Ok((s, self.advance().span)),
            _ => Err(self.unexpected(what)),
        }
    }

    fn expect_value(&mut self) -> PResult<(String, Span)> {
        match self.peek_tok().clone() {
            Tok::Value(s) => Ok((s, self.advance().span)),
            _ => Err(self.unexpected("a value `%name`")),
        }
    }

    fn expect_symbol(&mut self, what: &str) -> PResult<(String, Span)> {
        match self.peek_tok().clone() {
            Tok::Symbol(s) => Ok((s, self.advance().span)),
            _ => Err(self.unexpected(what)),
        }
    }

    /// Skip the rest of the line the failed statement started on (at least one token), so
    /// parsing resumes at the next line.
    fn skip_line(&mut self, stmt_start: usize) {
        if self.pos <= stmt_start {
            self.pos = (stmt_start + 1).min(self.toks.len() - 1);
        }
        while !self.peek().line_start {
            self.pos += 1;
        }
    }

    /// After a statement: the line must end here (a `}` may follow on the same line).
    fn end_of_statement(&mut self) -> PResult<()> {
        if self.peek().line_start || self.at(&Tok::RBrace) { Ok(()) } else { Err(self.unexpected("the end of the line")) }
    }

    // ---- whole file ----

    fn parse_top(&mut self) {
        let start = self.pos;
        let header = (|| -> PResult<()> {
            let kw = self.expect_word("graph")?;
            let (name, span) = self.expect_symbol("the graph name `@name`")?;
            self.graph_name = name;
            self.graph_span = Span::new(kw.start, span.end);
            self.expect(Tok::LBrace, "`{`")?;
            self.end_of_statement()
        })();
        if header.is_err() {
            self.skip_line(start);
        }
        loop {
            let start = self.pos;
            self.stmt_start = start;
            let t = self.peek().clone();
            let r = match &t.tok {
                Tok::RBrace => {
                    self.advance();
                    break;
                }
                Tok::Eof => {
                    self.error(t.span, format!("missing `}}` closing graph @{}", self.graph_name));
                    break;
                }
                Tok::Ident(w) if w == "meta" => self.parse_meta(),
                Tok::Ident(w) if w == "dims" => self.parse_dims(),
                Tok::Ident(w) if w == "block" => self.parse_block(),
                Tok::Ident(w) if w == "func" => {
                    self.saw_func = true;
                    self.parse_func()
                }
                _ => Err(self.unexpected("`meta`, `dims`, `block` or `func`")),
            };
            if r.is_err() {
                self.skip_line(start);
            }
        }
        if !self.at(&Tok::Eof) {
            let _ = self.unexpected("the end of the file after the closing `}` of the graph");
        }
        if !self.saw_func {
            let span = if self.graph_span == Span::default() { self.peek().span } else { self.graph_span };
            self.error(span, format!("graph @{} has no `func`; add `func @main {{ ... }}` after the blocks", self.graph_name));
        }
    }

    fn parse_meta(&mut self) -> PResult<()> {
        let kw = self.advance();
        let entries = self.parse_attr_dict()?;
        self.end_of_statement()?;
        if self.meta.is_some() {
            return Err(self.error(kw.span, "duplicate `meta` section; merge it into the first one"));
        }
        self.meta = Some(Attrs::new(entries.into_iter().map(|e| (e.key, e.value)).collect()));
        Ok(())
    }

    fn parse_dims(&mut self) -> PResult<()> {
        let kw = self.advance();
        let entries = self.parse_attr_dict()?;
        self.end_of_statement()?;
        let mut table = DimTable::new();
        let mut ok = true;
        for e in entries {
            match e.value {
                AttrValue::Int(n) if n >= 0 => {
                    table.insert(e.key, n as u64);
                }
                other => {
                    self.error(e.value_span, format!("dimension `{}` must be a non-negative integer, found {}", e.key, other.kind()));
                    ok = false;
                }
            }
        }
        if self.dims.is_some() {
            return Err(self.error(kw.span, "duplicate `dims` section; merge it into the first one"));
        }
        self.dims = Some(table);
        if ok { Ok(()) } else { Err(Fail) }
    }

    fn parse_block(&mut self) -> PResult<()> {
        let start = self.stmt_start;
        let kw = self.advance();
        let mut draft = RegionDraft::new(String::new(), false, kw.span);
        let header = self.parse_block_header(&mut draft);
        draft.header = Span::new(kw.span.start, self.prev_end().max(kw.span.end));
        if let Some((_, first)) = self.block_names.iter().find(|(n, _)| *n == draft.name && !n.is_empty()) {
            let line = self.line_of(*first);
            let d = Diagnostic::new(format!("duplicate block `@{}`; rename one of them", draft.name), Some(draft.header))
                .with_note(format!("first defined on line {line}"));
            self.diags.push(d);
        }
        if let Some(main) = &self.main {
            let msg = format!("block `@{}` is defined after func @{}; define blocks before func", draft.name, main.name);
            self.error(draft.header, msg);
        }
        self.block_names.push((draft.name.clone(), draft.header));
        if header.is_ok() || self.recover_into_body(start) {
            self.parse_body(&mut draft);
        }
        self.blocks.push(draft);
        Ok(())
    }

    /// After a broken region header: skip its line, and tell whether the following lines look
    /// like the region's body (the header ended with `{`, or the next line is no top-level item).
    fn recover_into_body(&mut self, start: usize) -> bool {
        self.skip_line(start);
        let opened = self.pos > 0 && self.toks[self.pos - 1].tok == Tok::LBrace;
        let item = match self.peek_tok() {
            Tok::Ident(w) => matches!(w.as_str(), "meta" | "dims" | "block" | "func"),
            Tok::RBrace | Tok::Eof => true,
            _ => false,
        };
        opened || !item
    }

    fn parse_block_header(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let (name, _) = self.expect_symbol("the block name `@name`")?;
        d.name = name;
        self.expect(Tok::LParen, "`(`")?;
        if !self.at(&Tok::RParen) {
            loop {
                let (name, span) = self.expect_value()?;
                self.expect(Tok::Colon, "`:` and the argument's type")?;
                let typed = self.parse_typed()?;
                let span = Span::new(span.start, self.prev_end());
                self.define(d, &name, span, DefKind::Arg)?;
                d.args.push(ArgDraft { name, typed, kind: ArgKind::Block, span });
                if self.at(&Tok::Comma) {
                    self.advance();
                } else {
                    break;
                }
            }
        }
        self.expect(Tok::RParen, "`,` or `)`")?;
        self.expect(Tok::LBrace, "`{`")?;
        self.end_of_statement()
    }

    fn parse_func(&mut self) -> PResult<()> {
        let start = self.stmt_start;
        let kw = self.advance();
        let mut draft = RegionDraft::new("main".to_string(), true, kw.span);
        let header = (|| -> PResult<()> {
            let (name, span) = self.expect_symbol("the function name `@main`")?;
            draft.name = name;
            draft.header = Span::new(kw.span.start, span.end);
            self.expect(Tok::LBrace, "`{`")?;
            self.end_of_statement()
        })();
        if self.main.is_some() {
            self.error(draft.header, "duplicate func; a graph has exactly one");
        }
        if header.is_ok() || self.recover_into_body(start) {
            self.parse_body(&mut draft);
        }
        if self.main.is_none() {
            self.main = Some(draft);
        }
        Ok(())
    }

    // ---- regions ----

    fn parse_body(&mut self, d: &mut RegionDraft) {
        loop {
            let t = self.peek().clone();
            match &t.tok {
                Tok::RBrace => {
                    self.advance();
                    break;
                }
                Tok::Eof => {
                    self.error(t.span, format!("missing `}}` closing {}", d.describe()));
                    break;
                }
                Tok::Ident(w) if t.line_start && (w == "block" || w == "func") => {
                    self.error(t.span, format!("missing `}}` closing {} before this `{w}`", d.describe()));
                    break;
                }
                _ => {
                    let start = self.pos;
                    self.stmt_start = start;
                    if self.parse_stmt(d).and_then(|()| self.end_of_statement()).is_err() {
                        self.skip_line(start);
                    }
                }
            }
        }
        self.resolve(d);
    }

    /// Record a definition of `%name`, reporting a duplicate.
    fn define(&mut self, d: &mut RegionDraft, name: &str, span: Span, kind: DefKind) -> PResult<()> {
        if let Some(prev) = d.defs.get(name) {
            let line = self.line_of(prev.span);
            let diag = Diagnostic::new(format!("`%{name}` is already defined in {}; rename one of them", d.describe()), Some(span))
                .with_note(format!("first defined on line {line}"));
            self.diags.push(diag);
            return Err(Fail);
        }
        d.defs.insert(name.to_string(), Def { span, kind });
        Ok(())
    }

    fn parse_stmt(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let t = self.peek().clone();
        match &t.tok {
            Tok::Value(_) => self.parse_node(d),
            Tok::Ident(w) if matches!(w.as_str(), "input" | "param" | "state" | "blockarg") => {
                if d.is_main {
                    self.parse_arg(d)
                } else {
                    Err(self.error(t.span, format!("`{w}` is not allowed in a block; block arguments are declared in its header `block @name(%x: type, ...)`")))
                }
            }
            Tok::Ident(w) if w == "output" => {
                if d.is_main {
                    self.parse_output(d)
                } else {
                    Err(self.error(t.span, "`output` is not allowed in a block; a block returns its results with `return %x, ...`"))
                }
            }
            Tok::Ident(w) if w == "update" => {
                if d.is_main {
                    self.parse_update(d)
                } else {
                    Err(self.error(t.span, "`update` is not allowed in a block; only func updates state"))
                }
            }
            Tok::Ident(w) if w == "return" => {
                if d.is_main {
                    Err(self.error(t.span, "`return` is not allowed in func; name its results with `output NAME = %x`"))
                } else {
                    self.parse_return(d)
                }
            }
            _ => {
                let what = if d.is_main {
                    "a statement (`%x = op(...) : type`, `input`, `param`, `state`, `output`, `update`) or `}`"
                } else {
                    "a statement (`%x = op(...) : type` or `return`) or `}`"
                };
                Err(self.unexpected(what))
            }
        }
    }

    fn parse_node(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let start = self.peek().span.start;
        let mut results = Vec::new();
        let result_start = self.peek().span;
        loop {
            let (name, span) = self.expect_value()?;
            self.define(d, &name, span, DefKind::Poisoned)?;
            results.push(name);
            if self.at(&Tok::Comma) {
                self.advance();
            } else {
                break;
            }
        }
        let results_span = Span::new(result_start.start, self.prev_end());
        self.expect(Tok::Eq, "`=` or `,`")?;
        let (op_name, op_span) = self.expect_ident("an op name")?;
        self.expect(Tok::LParen, "`(` and the op's operands")?;
        let mut inputs = Vec::new();
        if !self.at(&Tok::RParen) {
            loop {
                inputs.push(self.expect_value()?);
                if self.at(&Tok::Comma) {
                    self.advance();
                } else {
                    break;
                }
            }
        }
        self.expect(Tok::RParen, "`,` or `)`")?;
        let attrs = if self.at(&Tok::LBrace) { self.parse_attr_dict()? } else { Vec::new() };
        self.expect(Tok::Colon, "`:` and the result types")?;
        let types_start = self.peek().span.start;
        let mut types = Vec::new();
        loop {
            types.push(self.parse_typed()?);
            if self.at(&Tok::Comma) {
                self.advance();
            } else {
                break;
            }
        }
        let end = self.prev_end();
        if types.len() != results.len() {
            let msg = format!(
                "{} result{} named but {} type{} declared; declare one type per result",
                results.len(),
                if results.len() == 1 { " is" } else { "s are" },
                types.len(),
                if types.len() == 1 { " is" } else { "s are" },
            );
            let span = if types.len() > results.len() { Span::new(types_start, end) } else { results_span };
            return Err(self.error(span, msg));
        }
        let idx = d.nodes.len();
        for r in &results {
            if let Some(def) = d.defs.get_mut(r) {
                def.kind = DefKind::Node(idx);
            }
        }
        d.nodes.push(NodeDraft { results, types, op_name, op_span, attrs, op: None, inputs, span: Span::new(start, end) });
        Ok(())
    }

    fn parse_arg(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let kw = self.advance();
        let word = match &kw.tok {
            Tok::Ident(w) => w.clone(),
            _ => String::new(),
        };
        let (name, name_span) = self.expect_value()?;
        self.define(d, &name, name_span, DefKind::Poisoned)?;
        self.expect(Tok::Colon, "`:` and the argument's type")?;
        let typed = self.parse_typed()?;
        let kind = match word.as_str() {
            "input" => ArgKind::Input,
            "blockarg" => ArgKind::Block,
            _ => {
                if !self.at(&Tok::LBrace) {
                    return Err(self.unexpected(&format!("`{{name = \"...\", init = ...}}` after the type of {word} `%{name}`")));
                }
                let info = self.parse_param_info(&word, &name)?;
                if word == "param" { ArgKind::Param(info) } else { ArgKind::State(info) }
            }
        };
        let span = Span::new(kw.span.start, self.prev_end());
        if let Some(def) = d.defs.get_mut(&name) {
            def.kind = DefKind::Arg;
        }
        d.args.push(ArgDraft { name, typed, kind, span });
        Ok(())
    }

    fn parse_param_info(&mut self, word: &str, name: &str) -> PResult<ParamInfo> {
        let open = self.peek().span;
        let entries = self.parse_attr_dict()?;
        let dict_span = Span::new(open.start, self.prev_end());
        let mut ckpt = None;
        let mut init = None;
        let mut failed = false;
        for e in entries {
            match e.key.as_str() {
                "name" => match e.value {
                    AttrValue::Str(s) => ckpt = Some(s),
                    other => {
                        self.error(e.value_span, format!("attribute `name` of {word} `%{name}` must be a string, found {}", other.kind()));
                        failed = true;
                    }
                },
                "init" => match Init::from_attr(&e.value) {
                    Ok(i) => init = Some(i),
                    Err(msg) => {
                        self.error(e.value_span, msg);
                        failed = true;
                    }
                },
                other => {
                    self.error(e.key_span, format!("unknown attribute `{other}` for {word} `%{name}`; expected `name` and `init`"));
                    failed = true;
                }
            }
        }
        if failed {
            return Err(Fail);
        }
        match (ckpt, init) {
            (Some(name), Some(init)) => Ok(ParamInfo { name, init }),
            (None, _) => Err(self.error(dict_span, format!("missing attribute `name` of {word} `%{name}` (its checkpoint name, a string)"))),
            (_, None) => Err(self.error(dict_span, format!("missing attribute `init` of {word} `%{name}` (e.g. `init = zeros`)"))),
        }
    }

    fn parse_output(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let kw = self.advance();
        let (name, _) = self.expect_ident("the output name")?;
        self.expect(Tok::Eq, "`=`")?;
        let value = self.expect_value()?;
        d.outputs.push(OutputDraft { name: Some(name), value, span: Span::new(kw.span.start, self.prev_end()) });
        Ok(())
    }

    fn parse_update(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let kw = self.advance();
        let state = self.expect_value()?;
        self.expect(Tok::Arrow, "`<-`")?;
        let value = self.expect_value()?;
        d.updates.push(UpdateDraft { state, value, span: Span::new(kw.span.start, self.prev_end()) });
        Ok(())
    }

    fn parse_return(&mut self, d: &mut RegionDraft) -> PResult<()> {
        let kw = self.advance();
        if d.returned {
            return Err(self.error(kw.span, format!("second `return` in {}; a block returns once", d.describe())));
        }
        d.returned = true;
        if matches!(self.peek_tok(), Tok::Value(_)) && !self.peek().line_start {
            loop {
                let (name, span) = self.expect_value()?;
                d.outputs.push(OutputDraft { name: None, value: (name, span), span });
                if self.at(&Tok::Comma) {
                    self.advance();
                } else {
                    break;
                }
            }
        }
        Ok(())
    }

    /// Resolve the uses of a finished region: report undefined names.
    fn resolve(&mut self, d: &RegionDraft) {
        let uses =
            d.nodes.iter().flat_map(|n| n.inputs.iter()).chain(d.outputs.iter().map(|o| &o.value)).chain(d.updates.iter().flat_map(|u| [&u.state, &u.value]));
        let mut missing = Vec::new();
        for (name, span) in uses {
            if !d.defs.contains_key(name) {
                missing.push(Diagnostic::new(format!("undefined value `%{name}` in {}", d.describe()), Some(*span)));
            }
        }
        self.diags.extend(missing);
    }

    // ---- types and attributes ----

    /// `dtype[d0, d1]` and an optional `#[placement, ...]`.
    fn parse_typed(&mut self) -> PResult<Typed> {
        let (dt, dt_span) = self.expect_ident("a type such as `f32[4, 8]`")?;
        let dtype = DType::from_str(&dt).map_err(|msg| self.error(dt_span, msg))?;
        self.expect(Tok::LBracket, "`[` and the shape")?;
        let mut shape = Vec::new();
        if !self.at(&Tok::RBracket) {
            loop {
                let t = self.peek().clone();
                match t.tok {
                    Tok::Int(n) => {
                        self.advance();
                        let n = u64::try_from(n).map_err(|_| self.error(t.span, format!("dimension size `{n}` must be a non-negative 64-bit integer")))?;
                        shape.push(Dim::Fixed(n));
                    }
                    Tok::Ident(s) => {
                        self.advance();
                        shape.push(Dim::Named(s));
                    }
                    _ => return Err(self.unexpected("a dimension (a size or a name bound in `dims`)")),
                }
                if self.at(&Tok::Comma) {
                    self.advance();
                } else {
                    break;
                }
            }
        }
        self.expect(Tok::RBracket, "`,` or `]`")?;
        let mut placement = Vec::new();
        if self.at(&Tok::HashBracket) {
            self.advance();
            if !self.at(&Tok::RBracket) {
                loop {
                    placement.push(self.parse_placement()?);
                    if self.at(&Tok::Comma) {
                        self.advance();
                    } else {
                        break;
                    }
                }
            }
            self.expect(Tok::RBracket, "`,` or `]`")?;
        }
        Ok(Typed { ty: TensorType::new(dtype, shape), placement })
    }

    fn parse_placement(&mut self) -> PResult<Placement> {
        let (w, span) = self.expect_ident("a placement (`Replicate`, `Shard(dim)` or `Partial`)")?;
        match w.as_str() {
            "Replicate" => Ok(Placement::Replicate),
            "Partial" => Ok(Placement::Partial),
            "Shard" => {
                self.expect(Tok::LParen, "`(` and the sharded dimension")?;
                let t = self.peek().clone();
                let d = match t.tok {
                    Tok::Int(n) => {
                        self.advance();
                        u32::try_from(n).map_err(|_| self.error(t.span, format!("shard dimension `{n}` is out of range")))?
                    }
                    _ => return Err(self.unexpected("the sharded dimension (an integer)")),
                };
                self.expect(Tok::RParen, "`)`")?;
                Ok(Placement::Shard(d))
            }
            other => Err(self.error(span, format!("unknown placement `{other}`; expected `Replicate`, `Shard(dim)` or `Partial`"))),
        }
    }

    /// `{key = value, ...}`; duplicate keys are errors.
    fn parse_attr_dict(&mut self) -> PResult<Vec<AttrEntry>> {
        self.expect(Tok::LBrace, "`{`")?;
        let mut entries: Vec<AttrEntry> = Vec::new();
        while !self.at(&Tok::RBrace) {
            let (key, key_span) = self.expect_ident("an attribute name or `}`")?;
            self.expect(Tok::Eq, "`=`")?;
            let (value, value_span) = self.parse_attr_value(0)?;
            if entries.iter().any(|e| e.key == key) {
                return Err(self.error(key_span, format!("duplicate attribute `{key}`")));
            }
            entries.push(AttrEntry { key, key_span, value, value_span });
            if self.at(&Tok::Comma) {
                self.advance();
            } else if !self.at(&Tok::RBrace) {
                return Err(self.unexpected("`,` or `}`"));
            }
        }
        self.advance();
        Ok(entries)
    }

    fn parse_attr_value(&mut self, depth: usize) -> PResult<(AttrValue, Span)> {
        let t = self.peek().clone();
        if depth > MAX_ATTR_DEPTH {
            return Err(self.error(t.span, format!("attribute value is nested too deeply (more than {MAX_ATTR_DEPTH} levels)")));
        }
        let v = match &t.tok {
            Tok::Ident(w) => {
                self.advance();
                match w.as_str() {
                    "true" => AttrValue::Bool(true),
                    "false" => AttrValue::Bool(false),
                    "inf" => AttrValue::Float(f64::INFINITY),
                    "nan" => AttrValue::Float(f64::NAN),
                    _ if self.at(&Tok::LParen) => {
                        self.advance();
                        let args = self.parse_attr_list(Tok::RParen, "`,` or `)`", depth)?;
                        AttrValue::Call(w.clone(), args)
                    }
                    _ => AttrValue::Ident(w.clone()),
                }
            }
            Tok::Int(i) => {
                self.advance();
                AttrValue::Int(i64::try_from(*i).map_err(|_| self.error(t.span, format!("integer `{i}` does not fit in 64 bits")))?)
            }
            Tok::Float(x) => {
                self.advance();
                AttrValue::Float(*x)
            }
            Tok::Str(s) => {
                self.advance();
                AttrValue::Str(s.clone())
            }
            Tok::Symbol(s) => {
                self.advance();
                AttrValue::Symbol(s.clone())
            }
            Tok::LBracket => {
                self.advance();
                AttrValue::List(self.parse_attr_list(Tok::RBracket, "`,` or `]`", depth)?)
            }
            _ => return Err(self.unexpected("an attribute value")),
        };
        Ok((v, Span::new(t.span.start, self.prev_end())))
    }

    /// Values separated by commas up to `close` (already past the opener).
    fn parse_attr_list(&mut self, close: Tok, what: &str, depth: usize) -> PResult<Vec<AttrValue>> {
        let mut items = Vec::new();
        while !self.at(&close) {
            items.push(self.parse_attr_value(depth + 1)?.0);
            if self.at(&Tok::Comma) {
                self.advance();
            } else if !self.at(&close) {
                return Err(self.unexpected(what));
            }
        }
        self.advance();
        Ok(items)
    }

    /// Build every node's op now that all block names are known (blocks may refer to blocks
    /// defined after them, e.g. kernel bodies).
    fn build_ops(&mut self) {
        let names: Vec<String> = self.block_names.iter().map(|(n, _)| n.clone()).collect();
        let lookup = |s: &str| names.iter().position(|n| n == s).map(|i| BlockId(i as u32));
        let mut errors = Vec::new();
        for d in self.blocks.iter_mut().chain(self.main.as_mut()) {
            for node in &mut d.nodes {
                let entries = std::mem::take(&mut node.attrs);
                let spans: Vec<(String, Span)> = entries.iter().map(|e| (e.key.clone(), e.value_span)).collect();
                let attrs = Attrs::new(entries.into_iter().map(|e| (e.key, e.value)).collect());
                match Op::from_parts(&node.op_name, attrs, &lookup) {
                    Ok(op) => node.op = Some(op),
                    Err(msg) => {
                        // Point at the attribute the message is about, if any.
                        let span = spans.iter().find(|(k, _)| msg.contains(&format!("attribute `{k}`"))).map_or(node.op_span, |(_, s)| *s);
                        errors.push(Diagnostic::new(msg, Some(span)));
                    }
                }
            }
        }
        self.diags.extend(errors);
    }

    // ---- building the graph ----

    fn build(self) -> (Graph, SourceMap) {
        let mut g = Graph::new(&self.graph_name);
        g.meta = self.meta.unwrap_or_default();
        g.dims = self.dims.unwrap_or_default();
        let mut map = SourceMap { graph: self.graph_span, ..SourceMap::default() };
        for b in &self.blocks {
            let (r, spans) = lower(b);
            g.blocks.push(r);
            map.blocks.push(spans);
        }
        if let Some(m) = &self.main {
            let (r, spans) = lower(m);
            g.main = r;
            map.main = spans;
        }
        (g, map)
    }
}

/// The nodes of `d` in a stable topological order (by text position among the nodes that are
/// ready). Nodes on a cycle stay together in text order, after everything they depend on, so the
/// only edges against the order are the cycle's own and the verifier reports just the cycle.
fn node_order(d: &RegionDraft) -> Vec<usize> {
    let n = d.nodes.len();
    let mut dg: DiGraph<usize, ()> = DiGraph::with_capacity(n, 0);
    let ix: Vec<NodeIndex> = (0..n).map(|i| dg.add_node(i)).collect();
    for (i, node) in d.nodes.iter().enumerate() {
        for (name, _) in &node.inputs {
            if let Some(Def { kind: DefKind::Node(j), .. }) = d.defs.get(name) {
                dg.add_edge(ix[*j], ix[i], ());
            }
        }
    }
    // Components (single nodes when acyclic), each with its members in text order.
    let mut comps: Vec<Vec<usize>> = kosaraju_scc(&dg).into_iter().map(|c| c.into_iter().map(|x| x.index()).collect()).collect();
    let mut comp_of = vec![0usize; n];
    for (k, c) in comps.iter_mut().enumerate() {
        c.sort_unstable();
        for &m in c.iter() {
            comp_of[m] = k;
        }
    }
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); comps.len()];
    let mut indegree = vec![0usize; comps.len()];
    for e in dg.raw_edges() {
        let (a, b) = (comp_of[e.source().index()], comp_of[e.target().index()]);
        if a != b {
            users[a].push(b);
            indegree[b] += 1;
        }
    }
    let mut ready: BinaryHeap<Reverse<(usize, usize)>> = (0..comps.len()).filter(|&k| indegree[k] == 0).map(|k| Reverse((comps[k][0], k))).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse((_, k))) = ready.pop() {
        order.extend_from_slice(&comps[k]);
        for &u in &users[k] {
            indegree[u] -= 1;
            if indegree[u] == 0 {
                ready.push(Reverse((comps[u][0], u)));
            }
        }
    }
    order
}

/// Turn a region draft without errors into a region: arguments first, then nodes in order.
fn lower(d: &RegionDraft) -> (Region, RegionSpans) {
    let order = node_order(d);
    let mut ids: HashMap<&str, Value> = HashMap::new();
    for (k, a) in d.args.iter().enumerate() {
        ids.insert(&a.name, Value(k as u32));
    }
    let mut next = d.args.len() as u32;
    for &i in &order {
        for r in &d.nodes[i].results {
            ids.insert(r, Value(next));
            next += 1;
        }
    }
    // Every name was resolved before lowering; a stray one maps past the table for the verifier.
    let id = |name: &str| ids.get(name).copied().unwrap_or(Value(u32::MAX));
    let mut r = Region::new(&d.name);
    let mut spans = RegionSpans { region: d.header, ..RegionSpans::default() };
    for a in &d.args {
        let v = r.add_arg(a.typed.ty.clone(), a.kind.clone(), value_name(&a.name).as_deref());
        r.values[v.index()].placement = a.typed.placement.clone();
        spans.args.push(a.span);
        spans.value_names.push(a.name.clone());
    }
    for &i in &order {
        let node = &d.nodes[i];
        let inputs = node.inputs.iter().map(|(n, _)| id(n)).collect();
        let types = node.types.iter().map(|t| t.ty.clone()).collect();
        let op = node.op.clone().expect("invariant: a region is lowered only when all its ops were built");
        let nid = r.add_node(op, inputs, types);
        let results = r.nodes[nid.index()].results.clone();
        for ((v, name), t) in results.iter().zip(&node.results).zip(&node.types) {
            let data = &mut r.values[v.index()];
            data.name = value_name(name);
            data.placement = t.placement.clone();
        }
        spans.nodes.push(node.span);
        spans.value_names.extend(node.results.iter().cloned());
    }
    for o in &d.outputs {
        r.outputs.push(Output { name: o.name.clone(), value: id(&o.value.0) });
        spans.outputs.push(o.span);
    }
    for u in &d.updates {
        r.updates.push(Update { state: id(&u.state.0), value: id(&u.value.0) });
        spans.updates.push(u.span);
    }
    (r, spans)
}

/// Parse the text format. Reports every syntax and name-resolution error found, in source
/// order; typing and structural rules are the verifier's ([`parse_and_verify`] runs both).
pub fn parse(src: &str) -> Result<(Graph, SourceMap), Vec<Diagnostic>> {
    let (toks, lex_diags) = lex(src);
    let mut p = Parser {
        line_starts: std::iter::once(0).chain(src.match_indices('\n').map(|(i, _)| i + 1)).collect(),
        toks,
        pos: 0,
        diags: lex_diags,
        graph_name: String::new(),
        graph_span: Span::default(),
        meta: None,
        dims: None,
        block_names: Vec::new(),
        blocks: Vec::new(),
        main: None,
        saw_func: false,
        stmt_start: 0,
    };
    p.parse_top();
    p.build_ops();
    if p.diags.is_empty() {
        Ok(p.build())
    } else {
        let mut diags = std::mem::take(&mut p.diags);
        diags.sort_by_key(|d| d.span.map_or(usize::MAX, |s| s.start));
        Err(diags)
    }
}

/// Parse and verify `src` (named `file` in messages), then canonicalize the graph.
pub fn parse_and_verify(file: &str, src: &str) -> Result<Graph, SourceError> {
    let (mut g, _) = parse_and_verify_with_map(file, src)?;
    g.canonicalize();
    Ok(g)
}

/// Parse and verify `src` (named `file` in messages), keeping the graph as parsed (not
/// canonicalized) so that its ids match the returned source map: for tools that locate later
/// errors (a pass's) in the source.
pub fn parse_and_verify_with_map(file: &str, src: &str) -> Result<(Graph, SourceMap), SourceError> {
    let fail = |diagnostics| SourceError { file: file.to_string(), source_text: src.to_string(), diagnostics };
    let (g, map) = parse(src).map_err(fail)?;
    let errors = verify(&g);
    if !errors.is_empty() {
        let mut diags = to_diagnostics(&errors, Some(&map));
        diags.sort_by_key(|d| d.span.map_or(usize::MAX, |s| s.start));
        return Err(fail(diags));
    }
    Ok((g, map))
}

/// Read, parse and verify a file.
pub fn parse_file(path: &Path) -> Result<Graph, SourceError> {
    let file = path.display().to_string();
    match std::fs::read_to_string(path) {
        Ok(src) => parse_and_verify(&file, &src),
        Err(e) => {
            Err(SourceError { file: file.clone(), source_text: String::new(), diagnostics: vec![Diagnostic::new(format!("cannot read `{file}`: {e}"), None)] })
        }
    }
}

impl FromStr for Graph {
    type Err = SourceError;

    fn from_str(s: &str) -> Result<Graph, SourceError> {
        parse_and_verify("<input>", s)
    }
}

/// Whether `s` can be written as a bare word of the text format.
pub(crate) fn is_word(s: &str) -> bool {
    is_ident(s)
}

/// Whether `s` can follow `%` or `@` in the text format.
pub(crate) fn is_name(s: &str) -> bool {
    !s.is_empty() && s.chars().all(lexer::is_name_char)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diag::line_col;

    const SMALL: &str = "graph @g {
  dims {n = 4}

  func @main {
    input %x : f32[n]
    %1 = neg(%0) : f32[n]
    %0 = exp(%x) : f32[n]
    output y = %1
  }
}
";

    #[test]
    fn forward_references_are_reordered() {
        let (g, map) = parse(SMALL).map_err(|d| format!("{d:?}")).unwrap_or_else(|e| panic!("{e}"));
        let names: Vec<&str> = g.main.order.iter().map(|&n| g.main.node(n).op.name()).collect();
        assert_eq!(names, ["exp", "neg"]);
        assert_eq!(map.main.nodes.len(), 2);
        assert_eq!(line_col(SMALL, map.main.nodes[0].start).0, 7);
    }

    #[test]
    fn errors_are_collected_per_line() {
        let src = "graph @g {\n  func @main {\n    %1 = nope(%x) : f32[]\n    %2 = neg(%y : f32[]\n    %3 = neg(%zz) : f33[]\n  }\n}\n";
        let diags = parse(src).err().unwrap_or_default();
        let lines: Vec<usize> = diags.iter().filter_map(|d| d.span).map(|s| line_col(src, s.start).0).collect();
        // Line 3 has two independent errors: the unknown op and the undefined `%x`.
        assert_eq!(lines, [3, 3, 4, 5], "{diags:?}");
    }

    #[test]
    fn deep_nesting_is_an_error() {
        let src = format!("graph @g {{\n  meta {{x = {}}}\n  func @main {{\n  }}\n}}\n", "[".repeat(10_000));
        let diags = parse(&src).err().unwrap_or_default();
        assert!(diags.iter().any(|d| d.message.contains("nested too deeply")), "{diags:?}");
    }
}
