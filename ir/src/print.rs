//! The text format printer. `docs/ir.md` describes the format; `parse` reads it back.

use std::collections::HashMap;
use std::fmt::{self, Write};

use crate::graph::{ArgKind, Graph, Region, Value};
use crate::placement::Placement;
use crate::shape::TensorType;

/// How values of one region are spelled: their name, or their number in definition order.
pub struct ValueNames {
    names: HashMap<Value, String>,
}

impl ValueNames {
    pub fn new(region: &Region) -> ValueNames {
        let mut names = HashMap::new();
        let mut next = 0usize;
        let mut assign = |v: Value| {
            let s = match &region.value(v).name {
                Some(n) => format!("%{n}"),
                None => format!("%{next}"),
            };
            next += 1;
            names.insert(v, s);
        };
        for a in &region.args {
            assign(a.value);
        }
        for &n in &region.order {
            for &r in &region.node(n).results {
                assign(r);
            }
        }
        ValueNames { names }
    }

    /// The spelling of `v`; a value defined nowhere prints as `%?N`.
    pub fn get(&self, v: Value) -> String {
        self.names.get(&v).cloned().unwrap_or_else(|| format!("%?{}", v.0))
    }
}

fn placement_suffix(p: &[Placement]) -> String {
    if p.is_empty() {
        return String::new();
    }
    let parts: Vec<String> = p.iter().map(|x| x.to_string()).collect();
    format!(" #[{}]", parts.join(", "))
}

fn typed(region: &Region, v: Value) -> String {
    let d = region.value(v);
    format!("{}{}", d.ty, placement_suffix(&d.placement))
}

/// Print one region's body (nodes, outputs, updates) with `indent`.
fn print_body(g: &Graph, region: &Region, names: &ValueNames, indent: &str, out: &mut String) -> fmt::Result {
    let block_name = |b: crate::graph::BlockId| g.blocks.get(b.index()).map(|r| r.name.clone()).unwrap_or_else(|| format!("?{}", b.0));
    for &n in &region.order {
        let node = region.node(n);
        let results: Vec<String> = node.results.iter().map(|&r| names.get(r)).collect();
        let inputs: Vec<String> = node.inputs.iter().map(|&i| names.get(i)).collect();
        write!(out, "{indent}{} = {}({})", results.join(", "), node.op.name(), inputs.join(", "))?;
        let attrs = node.op.attrs(&block_name);
        if !attrs.is_empty() {
            write!(out, " {attrs}")?;
        }
        let types: Vec<String> = node.results.iter().map(|&r| typed(region, r)).collect();
        writeln!(out, " : {}", types.join(", "))?;
    }
    Ok(())
}

fn print_region_args_main(region: &Region, names: &ValueNames, indent: &str, out: &mut String) -> fmt::Result {
    for a in &region.args {
        let v = names.get(a.value);
        let t = typed(region, a.value);
        match &a.kind {
            ArgKind::Input => writeln!(out, "{indent}input {v} : {t}")?,
            ArgKind::Param(p) | ArgKind::State(p) => {
                let kw = if matches!(a.kind, ArgKind::Param(_)) { "param" } else { "state" };
                writeln!(out, "{indent}{kw} {v} : {t} {{name = {}, init = {}}}", crate::attr::fmt_string(&p.name), p.init.to_attr())?
            }
            // A block argument in `main` is invalid; print it so the verifier can point at it.
            ArgKind::Block => writeln!(out, "{indent}blockarg {v} : {t}")?,
        }
    }
    Ok(())
}

/// Print a whole graph in the text format.
pub fn print_graph(g: &Graph) -> String {
    let mut out = String::new();
    write_graph(g, &mut out).expect("invariant: writing to a String cannot fail");
    out
}

fn write_graph(g: &Graph, out: &mut String) -> fmt::Result {
    writeln!(out, "graph @{} {{", g.name)?;
    if !g.meta.is_empty() {
        writeln!(out, "  meta {}", g.meta)?;
    }
    if !g.dims.is_empty() {
        let parts: Vec<String> = g.dims.iter().map(|(k, v)| format!("{k} = {v}")).collect();
        writeln!(out, "  dims {{{}}}", parts.join(", "))?;
    }
    for b in &g.blocks {
        let names = ValueNames::new(b);
        writeln!(out)?;
        let args: Vec<String> = b.args.iter().map(|a| format!("{}: {}", names.get(a.value), typed(b, a.value))).collect();
        writeln!(out, "  block @{}({}) {{", b.name, args.join(", "))?;
        print_body(g, b, &names, "    ", out)?;
        let rets: Vec<String> = b.outputs.iter().map(|o| names.get(o.value)).collect();
        writeln!(out, "    return {}", rets.join(", "))?;
        writeln!(out, "  }}")?;
    }
    writeln!(out)?;
    let m = &g.main;
    let names = ValueNames::new(m);
    writeln!(out, "  func @{} {{", m.name)?;
    print_region_args_main(m, &names, "    ", out)?;
    print_body(g, m, &names, "    ", out)?;
    for o in &m.outputs {
        let name = o.name.as_deref().unwrap_or("out");
        writeln!(out, "    output {name} = {}", names.get(o.value))?;
    }
    for u in &m.updates {
        writeln!(out, "    update {} <- {}", names.get(u.state), names.get(u.value))?;
    }
    writeln!(out, "  }}")?;
    writeln!(out, "}}")
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&print_graph(self))
    }
}

/// Print a type with its placement, as a node result is printed.
pub fn print_type(t: &TensorType, p: &[Placement]) -> String {
    format!("{t}{}", placement_suffix(p))
}
