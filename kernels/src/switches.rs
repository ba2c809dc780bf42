//! Build-time switches: environment variables that change the generated kernels, kept so the
//! measured alternatives of docs/performance.md can be rebuilt and compared (`bench/*_check.sh`,
//! `bench/attention_variants.sh`). A generator reads one only as [`var`]`(Switch::...)`, so a
//! switch cannot be read without being listed here, and [`active`] lists those set, which
//! `titanc build` folds into the artifact's content hash and records in its manifest: two builds
//! that differ only in a switch never share a hash.
//!
//! The environment is the right place for them: they are for the people measuring kernels, not
//! options a user should reach for, and a build with none set (every user's) is unaffected.

use std::collections::BTreeMap;

/// Every build-time switch; the module that reads it documents what each value selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    /// `attention_bwd::five`: the five-product backward, `1` wherever it can run, `0` never.
    AttBwd5p,
    /// `attention_bwd`: the backward's grid in bands, `all`, `wave` or a divisor of b hkv.
    AttBwdBand,
    /// `attention`: `full` keeps the backward's subnormal exponentials.
    AttBwdEx2,
    /// `attention_bwd`: `diag` masks only the tiles crossing the diagonal.
    AttBwdMask,
    /// `attention_bwd`: the key walk, `up`, `down` or `down-heads-inner`.
    AttBwdWalk,
    /// `attention_bwd`: the warp-specialized passes, `0`, `dkdv` or `all`.
    AttBwdWs,
    /// `attention`: the forward's grid in bands of g (batch, kv head)s.
    AttFwdBand,
    /// `attention`: `full` keeps the forward's subnormal exponentials.
    AttFwdEx2,
    /// `attention::fwd_ws`: `0` turns the warpgroups' turns off.
    AttFwdPingpong,
    /// `attention`: `0` always rescales O.
    AttFwdSkipRescale,
    /// `attention::fwd_ws`: the warp-specialized forward, `1` wherever it can run, `0` never.
    AttFwdWs,
    /// `scatter`: CTAs per block of rows, a power of two up to 64.
    ScatterSplit,
    /// `warp_spec`: how a warpgroup finds its index, `shfl` or `tid`.
    WsWgi,
}

impl Switch {
    pub const ALL: [Switch; 13] = [
        Switch::AttBwd5p,
        Switch::AttBwdBand,
        Switch::AttBwdEx2,
        Switch::AttBwdMask,
        Switch::AttBwdWalk,
        Switch::AttBwdWs,
        Switch::AttFwdBand,
        Switch::AttFwdEx2,
        Switch::AttFwdPingpong,
        Switch::AttFwdSkipRescale,
        Switch::AttFwdWs,
        Switch::ScatterSplit,
        Switch::WsWgi,
    ];

    /// The environment variable.
    pub fn name(self) -> &'static str {
        match self {
            Switch::AttBwd5p => "TITAN_ATT_BWD_5P",
            Switch::AttBwdBand => "TITAN_ATT_BWD_BAND",
            Switch::AttBwdEx2 => "TITAN_ATT_BWD_EX2",
            Switch::AttBwdMask => "TITAN_ATT_BWD_MASK",
            Switch::AttBwdWalk => "TITAN_ATT_BWD_WALK",
            Switch::AttBwdWs => "TITAN_ATT_BWD_WS",
            Switch::AttFwdBand => "TITAN_ATT_FWD_BAND",
            Switch::AttFwdEx2 => "TITAN_ATT_FWD_EX2",
            Switch::AttFwdPingpong => "TITAN_ATT_FWD_PINGPONG",
            Switch::AttFwdSkipRescale => "TITAN_ATT_FWD_SKIP_RESCALE",
            Switch::AttFwdWs => "TITAN_ATT_FWD_WS",
            Switch::ScatterSplit => "TITAN_SCATTER_SPLIT",
            Switch::WsWgi => "TITAN_WS_WGI",
        }
    }
}

/// The value of switch `s` when it is set (to valid UTF-8).
pub fn var(s: Switch) -> Option<String> {
    std::env::var(s.name()).ok()
}

/// The switches set in this process's environment, by name. Empty for every ordinary build.
pub fn active() -> BTreeMap<String, String> {
    Switch::ALL.iter().filter_map(|s| var(*s).map(|v| (s.name().to_string(), v))).collect()
}

/// Prefixes of the switches' names: a variable with one of them that is not a switch is most
/// likely a misspelt one, which would otherwise build the default kernels without a word.
const PREFIXES: &[&str] = &["TITAN_ATT_", "TITAN_SCATTER", "TITAN_WS_"];

/// Variables of `vars` named like a switch (one of its prefixes) that are not one, by name.
pub fn unknown_in(vars: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut v: Vec<String> = vars.into_iter().filter(|n| PREFIXES.iter().any(|p| n.starts_with(p)) && !Switch::ALL.iter().any(|s| s.name() == n)).collect();
    v.sort();
    v.dedup();
    v
}

/// [`unknown_in`] over this process's environment.
pub fn unknown() -> Vec<String> {
    unknown_in(std::env::vars_os().filter_map(|(k, _)| k.into_string().ok()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// No source of this crate reads the environment except through [`var`] (and `ptxas.rs`,
    /// which finds the assembler: where it is, not what it builds), and every switch is read by
    /// some generator: a new switch cannot bypass the hash, and a dropped one leaves the list.
    #[test]
    fn every_switch_is_read_and_nothing_else_is() {
        let mut files = vec![];
        let mut dirs = vec![std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") && !p.ends_with("switches.rs") {
                    files.push((std::fs::read_to_string(&p).unwrap(), p));
                }
            }
        }
        for (text, f) in &files {
            for (i, line) in text.lines().enumerate() {
                assert!(!line.contains("env::var") || f.ends_with("ptxas.rs"), "{}:{}: reads the environment directly; use switches::var", f.display(), i + 1);
            }
        }
        for s in Switch::ALL {
            let used = format!("Switch::{s:?}");
            assert!(files.iter().any(|(t, _)| t.contains(&used)), "no generator reads {}", s.name());
            assert!(PREFIXES.iter().any(|p| s.name().starts_with(p)), "{} has none of the prefixes `unknown` looks for", s.name());
        }
    }

    #[test]
    fn misspelt_switches_are_found() {
        let vars = ["TITAN_ATT_FWD_W", "TITAN_ATT_FWD_WS", "TITAN_SCATTER_SPLITS", "TITAN_WS_WGI", "TITAN_PTXAS", "HOME", "TITAN_ATT_FWD_W"];
        assert_eq!(unknown_in(vars.iter().map(|s| s.to_string())), ["TITAN_ATT_FWD_W", "TITAN_SCATTER_SPLITS"]);
    }
}
