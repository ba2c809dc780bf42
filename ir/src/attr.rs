//! Attribute values: the `{key = value}` dictionaries of ops, params and graph metadata.

use std::fmt;

/// One attribute value as written in the text format.
#[derive(Clone, Debug, PartialEq)]
pub enum AttrValue {
    Bool(bool),
    Int(i64),
    /// Always printed with a decimal point or exponent so it parses back as a float.
    Float(f64),
    Str(String),
    /// A bare word naming an enum case: `cosine`, `half`, `zeros`.
    Ident(String),
    /// A reference to a block: `@layer`.
    Symbol(String),
    List(Vec<AttrValue>),
    /// `normal(0.02)`: a word applied to arguments (used for initializers).
    Call(String, Vec<AttrValue>),
}

impl AttrValue {
    pub fn as_f64(&self) -> Option<f64> {
        match self {
            AttrValue::Float(x) => Some(*x),
            AttrValue::Int(i) => Some(*i as f64),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match self {
            AttrValue::Int(i) => Some(*i),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match self {
            AttrValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            AttrValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_ident(&self) -> Option<&str> {
        match self {
            AttrValue::Ident(s) => Some(s),
            _ => None,
        }
    }

    /// A human-readable description of the kind of value, for error messages.
    pub fn kind(&self) -> &'static str {
        match self {
            AttrValue::Bool(_) => "a bool",
            AttrValue::Int(_) => "an integer",
            AttrValue::Float(_) => "a float",
            AttrValue::Str(_) => "a string",
            AttrValue::Ident(_) => "a word",
            AttrValue::Symbol(_) => "a block reference",
            AttrValue::List(_) => "a list",
            AttrValue::Call(..) => "a call",
        }
    }
}

/// Print a float so that Rust's parser reads back the identical bits and the lexer sees a float.
pub fn fmt_float(x: f64) -> String {
    if x.is_nan() {
        return "nan".to_string();
    }
    if x.is_infinite() {
        return if x > 0.0 { "inf".to_string() } else { "-inf".to_string() };
    }
    let s = format!("{x:?}");
    if s.contains('.') || s.contains('e') || s.contains("inf") || s.contains("NaN") { s } else { format!("{s}.0") }
}

/// Write a string literal with `"` and `\` escaped and non-printable characters as `\u{..}`.
pub fn fmt_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            c if c.is_control() => out.push_str(&format!("\\u{{{:x}}}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl fmt::Display for AttrValue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            AttrValue::Bool(b) => write!(f, "{b}"),
            AttrValue::Int(i) => write!(f, "{i}"),
            AttrValue::Float(x) => f.write_str(&fmt_float(*x)),
            AttrValue::Str(s) => f.write_str(&fmt_string(s)),
            AttrValue::Ident(s) => f.write_str(s),
            AttrValue::Symbol(s) => write!(f, "@{s}"),
            AttrValue::List(items) => {
                f.write_str("[")?;
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str("]")
            }
            AttrValue::Call(name, args) => {
                write!(f, "{name}(")?;
                for (i, v) in args.iter().enumerate() {
                    if i > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{v}")?;
                }
                f.write_str(")")
            }
        }
    }
}

/// An ordered attribute dictionary that hands out typed fields and reports leftovers.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Attrs {
    pub entries: Vec<(String, AttrValue)>,
}

impl Attrs {
    pub fn new(entries: Vec<(String, AttrValue)>) -> Attrs {
        Attrs { entries }
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn get(&self, key: &str) -> Option<&AttrValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Remove and return `key`.
    pub fn take(&mut self, key: &str) -> Option<AttrValue> {
        let i = self.entries.iter().position(|(k, _)| k == key)?;
        Some(self.entries.remove(i).1)
    }

    pub fn take_required(&mut self, key: &str) -> Result<AttrValue, String> {
        self.take(key).ok_or_else(|| format!("missing attribute `{key}`"))
    }

    pub fn take_f64(&mut self, key: &str) -> Result<f64, String> {
        let v = self.take_required(key)?;
        v.as_f64().ok_or_else(|| format!("attribute `{key}` must be a number, found {}", v.kind()))
    }

    pub fn take_u64(&mut self, key: &str) -> Result<u64, String> {
        let v = self.take_required(key)?;
        match v.as_i64() {
            Some(i) if i >= 0 => Ok(i as u64),
            _ => Err(format!("attribute `{key}` must be a non-negative integer, found {v}")),
        }
    }

    pub fn take_bool(&mut self, key: &str) -> Result<bool, String> {
        let v = self.take_required(key)?;
        v.as_bool().ok_or_else(|| format!("attribute `{key}` must be true or false, found {}", v.kind()))
    }

    pub fn take_ident(&mut self, key: &str) -> Result<String, String> {
        let v = self.take_required(key)?;
        v.as_ident().map(str::to_string).ok_or_else(|| format!("attribute `{key}` must be a word, found {}", v.kind()))
    }

    pub fn take_usize_list(&mut self, key: &str) -> Result<Vec<usize>, String> {
        let v = self.take_required(key)?;
        match v {
            AttrValue::List(items) => items
                .iter()
                .map(|x| match x.as_i64() {
                    Some(i) if i >= 0 => Ok(i as usize),
                    _ => Err(format!("attribute `{key}` must be a list of non-negative integers")),
                })
                .collect(),
            other => Err(format!("attribute `{key}` must be a list, found {}", other.kind())),
        }
    }

    /// Error if any key was not consumed.
    pub fn finish(self, what: &str) -> Result<(), String> {
        match self.entries.first() {
            None => Ok(()),
            Some((k, _)) => Err(format!("unknown attribute `{k}` for {what}")),
        }
    }
}

impl fmt::Display for Attrs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("{")?;
        for (i, (k, v)) in self.entries.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{k} = {v}")?;
        }
        f.write_str("}")
    }
}
