//! The memory plan of a manifest as an SVG picture (`titanc build --memory-svg`, `titan-run
//! --memory-svg`): every buffer is a rectangle at its planned place (its arena's band, at its
//! offset) over the schedule positions it lives in ([`super::liveness`]), with a `<title>` that
//! names it; the bytes live at each position are drawn as a line; the planned peak (the sum of
//! the arenas, what a rank allocates) is marked, and a measured peak can be overlaid.

use std::fmt::Write as _;

use super::liveness::buffer_lifetimes;
use super::{BufferClass, Manifest, arena_name, human_bytes};

/// A measured peak to draw over the plan, with what was measured (e.g. "measured on the GPU").
#[derive(Clone, Debug, PartialEq)]
pub struct MeasuredPeak {
    pub bytes: u64,
    pub what: String,
}

const WIDTH: f64 = 1100.0;
const HEIGHT: f64 = 620.0;
const LEFT: f64 = 150.0;
const RIGHT: f64 = 40.0;
const TOP: f64 = 60.0;
const BOTTOM: f64 = 50.0;

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;").replace('"', "&quot;")
}

fn fill(class: BufferClass) -> &'static str {
    match class {
        BufferClass::Input => "#9e9e9e",
        BufferClass::Param => "#4e79a7",
        BufferClass::OptimizerState => "#76b7b2",
        BufferClass::ComputeCopy => "#a0cbe8",
        BufferClass::Grad => "#f28e2b",
        BufferClass::Activation => "#e15759",
    }
}

/// The SVG of rank `rank`'s memory plan in `m` (one plan serves every rank of an SPMD
/// artifact; the schedule is the rank's). The root element carries `data-peak-bytes` (the
/// plan's peak) and, with `measured`, `data-measured-bytes`.
pub fn memory_svg(m: &Manifest, rank: usize, measured: Option<&MeasuredPeak>) -> String {
    let lifetimes = buffer_lifetimes(m, rank);
    let positions = lifetimes.iter().flatten().map(|l| l.end + 1).max().unwrap_or(1).max(1);
    let peak = m.memory.peak_bytes;
    let top_bytes = peak.max(measured.map_or(0, |p| p.bytes)).max(1);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |pos: f64| LEFT + pos / f64::from(positions) * plot_w;
    let y = |bytes: f64| TOP + plot_h - bytes / top_bytes as f64 * plot_h;

    // Arena bands stacked from the bottom, in the plan's order.
    let mut base = std::collections::HashMap::new();
    let mut at = 0u64;
    for a in &m.memory.arenas {
        base.insert(a.arena, at);
        at += a.bytes;
    }

    let mut s = String::new();
    let _ = writeln!(
        s,
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12" data-peak-bytes="{peak}"{}>"##,
        measured.map_or(String::new(), |p| format!(r##" data-measured-bytes="{}""##, p.bytes))
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="22" font-size="15">memory plan of rank {rank}: {} buffers over {positions} schedule positions, planned peak {}</text>"##,
        m.buffers.len(),
        human_bytes(peak, 2)
    );
    let _ = writeln!(
        s,
        r##"<text x="{LEFT}" y="40" fill="#555">x: position in the step's schedule (loops once); y: bytes, arenas stacked; hover a rectangle for its buffer</text>"##
    );
    for a in &m.memory.arenas {
        let b = base[&a.arena];
        let (y0, y1) = (y((b + a.bytes) as f64), y(b as f64));
        let _ = writeln!(
            s,
            r##"<g class="arena" data-arena="{name}" data-bytes="{bytes}"><rect x="{LEFT}" y="{y0:.2}" width="{plot_w:.2}" height="{h:.2}" fill="#f7f7f7" stroke="#bbb"><title>arena {name}: {human}</title></rect><text x="{tx:.2}" y="{ty:.2}" text-anchor="end">{name} {human}</text></g>"##,
            name = arena_name(a.arena),
            bytes = a.bytes,
            h = (y1 - y0).max(0.0),
            human = human_bytes(a.bytes, 2),
            tx = LEFT - 6.0,
            ty = (y0 + y1) / 2.0 + 4.0,
        );
    }
    let mut live = vec![0u64; positions as usize];
    let _ = writeln!(s, r##"<g class="buffers">"##);
    for (b, lt) in m.buffers.iter().zip(&lifetimes) {
        // Persistent state and inputs hold their bytes across the whole step.
        let persistent = matches!(b.class, BufferClass::Param | BufferClass::OptimizerState | BufferClass::ComputeCopy | BufferClass::Input);
        let (start, end) = match (persistent, lt) {
            (true, _) => (0, positions - 1),
            (false, Some(l)) => (l.start, l.end),
            (false, None) => continue,
        };
        for p in &mut live[start as usize..=end as usize] {
            *p += b.bytes;
        }
        let off = base.get(&b.arena).copied().unwrap_or(0) + b.offset;
        let (y0, y1) = (y((off + b.bytes) as f64), y(off as f64));
        let (x0, x1) = (x(f64::from(start)), x(f64::from(end) + 1.0));
        let _ = writeln!(
            s,
            r##"<rect x="{x0:.2}" y="{y0:.2}" width="{w:.2}" height="{h:.2}" fill="{color}" fill-opacity="0.8" stroke="#333" stroke-width="0.2"><title>{name}: {dtype} {shape:?}, {human} in {arena} at +{offset}, positions {start}-{end}</title></rect>"##,
            w = (x1 - x0).max(0.5),
            h = (y1 - y0).max(0.5),
            color = fill(b.class),
            name = escape(&b.name),
            dtype = b.dtype,
            shape = b.shape,
            human = human_bytes(b.bytes, 2),
            arena = arena_name(b.arena),
            offset = b.offset,
        );
    }
    let _ = writeln!(s, "</g>");
    // The bytes live at each position, and where they peak.
    let mut points = String::new();
    for (p, &bytes) in live.iter().enumerate() {
        let _ = write!(points, "{:.2},{:.2} {:.2},{:.2} ", x(p as f64), y(bytes as f64), x(p as f64 + 1.0), y(bytes as f64));
    }
    let (max_at, max_live) = live.iter().enumerate().max_by_key(|(i, b)| (**b, std::cmp::Reverse(*i))).map(|(i, b)| (i, *b)).unwrap_or((0, 0));
    let _ = writeln!(
        s,
        r##"<polyline class="live" points="{}" fill="none" stroke="#222" stroke-width="1.2"><title>bytes live at each position; most {} at position {max_at}</title></polyline>"##,
        points.trim_end(),
        human_bytes(max_live, 2)
    );
    let _ = writeln!(
        s,
        r##"<line class="peak" data-bytes="{peak}" x1="{LEFT}" x2="{x2:.2}" y1="{py:.2}" y2="{py:.2}" stroke="#c00" stroke-width="1.5"><title>planned peak: {human} ({peak} bytes), the arenas' sum</title></line><text x="{x2:.2}" y="{ty:.2}" fill="#c00" text-anchor="end">planned peak {human}</text>"##,
        x2 = LEFT + plot_w,
        py = y(peak as f64),
        ty = y(peak as f64) - 4.0,
        human = human_bytes(peak, 2)
    );
    if let Some(mp) = measured {
        let _ = writeln!(
            s,
            r##"<line class="measured" data-bytes="{b}" x1="{LEFT}" x2="{x2:.2}" y1="{my:.2}" y2="{my:.2}" stroke="#060" stroke-width="1.5" stroke-dasharray="6 4"><title>{what}: {human} ({b} bytes)</title></line><text x="{LEFT}" y="{ty:.2}" fill="#060">{what}: {human}</text>"##,
            b = mp.bytes,
            x2 = LEFT + plot_w,
            my = y(mp.bytes as f64),
            ty = y(mp.bytes as f64) - 4.0,
            what = escape(&mp.what),
            human = human_bytes(mp.bytes, 2)
        );
    }
    let _ = writeln!(
        s,
        r##"<line x1="{LEFT}" x2="{x2:.2}" y1="{by:.2}" y2="{by:.2}" stroke="#000"/><text x="{LEFT}" y="{ty:.2}">0</text><text x="{x2:.2}" y="{ty:.2}" text-anchor="end">{positions}</text>"##,
        x2 = LEFT + plot_w,
        by = TOP + plot_h,
        ty = TOP + plot_h + 16.0
    );
    let mut lx = LEFT + 60.0;
    for (class, label) in [
        (BufferClass::Param, "params"),
        (BufferClass::ComputeCopy, "compute copies"),
        (BufferClass::OptimizerState, "optimizer state"),
        (BufferClass::Grad, "grads"),
        (BufferClass::Activation, "activations"),
        (BufferClass::Input, "inputs"),
    ] {
        let _ = writeln!(
            s,
            r##"<rect x="{lx:.2}" y="{ly:.2}" width="10" height="10" fill="{}"/><text x="{tx:.2}" y="{ty:.2}">{label}</text>"##,
            fill(class),
            ly = HEIGHT - 22.0,
            tx = lx + 14.0,
            ty = HEIGHT - 13.0
        );
        lx += 130.0;
    }
    s.push_str("</svg>\n");
    s
}
