//! Diagnostics: errors with a source location, rendered as `file:line:col` plus a caret excerpt.

use std::fmt;

/// A byte range of the source text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Span {
        Span { start, end }
    }
}

/// 1-based line and column (in characters) of byte offset `pos` in `src`.
pub fn line_col(src: &str, pos: usize) -> (usize, usize) {
    let pos = pos.min(src.len());
    let pos = (0..=pos).rev().find(|&p| src.is_char_boundary(p)).unwrap_or(0);
    let before = &src[..pos];
    let line = before.matches('\n').count() + 1;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let col = src[line_start..pos].chars().count() + 1;
    (line, col)
}

/// One problem found in a source file or graph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Diagnostic {
    pub message: String,
    /// Where in the source, when the graph came from text.
    pub span: Option<Span>,
    /// Extra lines printed after the excerpt (`note: ...`).
    pub notes: Vec<String>,
}

impl Diagnostic {
    pub fn new(message: impl Into<String>, span: Option<Span>) -> Diagnostic {
        Diagnostic { message: message.into(), span, notes: Vec::new() }
    }

    pub fn with_note(mut self, note: impl Into<String>) -> Diagnostic {
        self.notes.push(note.into());
        self
    }

    /// `file:line:col: error: message`, the source line, and a caret under the span.
    pub fn render(&self, file: &str, src: &str) -> String {
        let mut out = String::new();
        match self.span {
            Some(span) => {
                let (line, col) = line_col(src, span.start);
                out.push_str(&format!("{file}:{line}:{col}: error: {}\n", self.message));
                let text = src.lines().nth(line - 1).unwrap_or("");
                let gutter = line.to_string().len();
                let line_chars = text.chars().count();
                let start_col = col.min(line_chars + 1);
                let (end_line, end_col) = line_col(src, span.end.max(span.start));
                let width = if end_line == line && end_col > col { end_col - col } else { 1 };
                let width = width.min(line_chars + 1 - start_col + 1).max(1);
                out.push_str(&format!("{:gutter$} |\n", ""));
                out.push_str(&format!("{line:>gutter$} | {text}\n"));
                out.push_str(&format!("{:gutter$} | {}{}\n", "", " ".repeat(start_col - 1), "^".repeat(width)));
            }
            None => out.push_str(&format!("{file}: error: {}\n", self.message)),
        }
        for n in &self.notes {
            out.push_str(&format!("  note: {n}\n"));
        }
        out
    }
}

impl fmt::Display for Diagnostic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Render every diagnostic of a file, in order.
pub fn render_all(diags: &[Diagnostic], file: &str, src: &str) -> String {
    diags.iter().map(|d| d.render(file, src)).collect::<Vec<_>>().join("")
}

/// A failed parse or verification of a named file, with every problem found.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{}", render_all(.diagnostics, .file, .source_text).trim_end())]
pub struct SourceError {
    pub file: String,
    pub source_text: String,
    pub diagnostics: Vec<Diagnostic>,
}
