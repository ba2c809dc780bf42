//! Build-time switches: environment variables that change the generated kernels, kept so the
//! measured alternatives of docs/performance.md can be rebuilt and compared (`bench/*_check.sh`,
//! `bench/attention_variants.sh`). Every one is read through [`var`], and [`active`] lists those
//! set, which `titanc build` folds into the artifact's content hash and records in its manifest:
//! two builds that differ only in a switch never share a hash.
//!
//! The environment is the right place for them: they are for the people measuring kernels, not
//! options a user should reach for, and a build with none set (every user's) is unaffected.

use std::collections::BTreeMap;

/// Every switch, the module that reads it and what it selects (the module's docs say more).
pub const SWITCHES: &[(&str, &str)] = &[
    ("TITAN_ATT_BWD_5P", "attention_bwd::five: the five-product backward, `1` wherever it can run, `0` never"),
    ("TITAN_ATT_BWD_BAND", "attention_bwd: the backward's grid in bands, `all`, `wave` or a divisor of b hkv"),
    ("TITAN_ATT_BWD_EX2", "attention: `full` keeps the backward's subnormal exponentials"),
    ("TITAN_ATT_BWD_MASK", "attention_bwd: `diag` masks only the diagonal tile"),
    ("TITAN_ATT_BWD_WALK", "attention_bwd: the key walk, `up`, `down` or `down-heads-inner`"),
    ("TITAN_ATT_BWD_WS", "attention_bwd: which passes are warp-specialized, `0`, `dkdv`, ..."),
    ("TITAN_ATT_FWD_BAND", "attention: the forward's grid in bands of g (batch, kv head)s"),
    ("TITAN_ATT_FWD_EX2", "attention: `full` keeps the forward's subnormal exponentials"),
    ("TITAN_ATT_FWD_PINGPONG", "attention::fwd_ws: `0` turns the warpgroups' turns off"),
    ("TITAN_ATT_FWD_SKIP_RESCALE", "attention: `0` always rescales O"),
    ("TITAN_ATT_FWD_WS", "attention::fwd_ws: the warp-specialized forward, `1` wherever it can run, `0` never"),
    ("TITAN_SCATTER_SPLIT", "scatter: CTAs per block of rows, a power of two up to 64"),
    ("TITAN_WS_WGI", "warp_spec: how a warpgroup finds its index, `shfl` or `tid`"),
];

/// The value of the build-time switch `name` when it is set (to valid UTF-8).
///
/// # Panics
/// When `name` is not one of [`SWITCHES`]: a switch read without being listed would change
/// kernels without changing the content hash.
pub fn var(name: &str) -> Option<String> {
    assert!(SWITCHES.iter().any(|(n, _)| *n == name), "build-time switch `{name}` is not listed in titan_kernels::switches::SWITCHES");
    std::env::var(name).ok()
}

/// The switches set in this process's environment, by name. Empty for every ordinary build.
pub fn active() -> BTreeMap<String, String> {
    active_in(|n| std::env::var(n).ok())
}

/// [`active`] over any environment.
pub fn active_in(get: impl Fn(&str) -> Option<String>) -> BTreeMap<String, String> {
    SWITCHES.iter().filter_map(|(n, _)| get(n).map(|v| (n.to_string(), v))).collect()
}

/// Prefixes of the switches' names: a variable with one of them that is not a switch is most
/// likely a misspelt one, which would otherwise build the default kernels without a word.
const PREFIXES: &[&str] = &["TITAN_ATT_", "TITAN_SCATTER", "TITAN_WS_"];

/// Variables of `vars` named like a switch (one of its prefixes) that are not one, by name.
pub fn unknown_in(vars: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut v: Vec<String> = vars.into_iter().filter(|n| PREFIXES.iter().any(|p| n.starts_with(p)) && !SWITCHES.iter().any(|(s, _)| s == n)).collect();
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

    /// Every environment read in this crate's sources goes through [`var`] with a listed name,
    /// and every listed name is read somewhere: a new switch cannot bypass the hash.
    #[test]
    fn every_switch_is_listed_and_read() {
        let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
        let mut files = vec![];
        let mut dirs = vec![src];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    files.push(p);
                }
            }
        }
        let mut read = std::collections::BTreeSet::new();
        for f in &files {
            let text = std::fs::read_to_string(f).unwrap();
            if f.ends_with("switches.rs") {
                continue;
            }
            for (i, line) in text.lines().enumerate() {
                // ptxas.rs finds the assembler (TITAN_PTXAS, PATH): where it is, not what it builds.
                if line.contains("env::var(") && !f.ends_with("ptxas.rs") {
                    panic!("{}:{}: reads the environment directly; use switches::var", f.display(), i + 1);
                }
                for (k, _) in line.match_indices("switches::var(\"") {
                    let rest = &line[k + "switches::var(\"".len()..];
                    let name = &rest[..rest.find('"').unwrap()];
                    assert!(SWITCHES.iter().any(|(n, _)| *n == name), "{}:{}: `{name}` is not listed", f.display(), i + 1);
                    read.insert(name.to_string());
                }
            }
        }
        // The two exponential switches are read through `ex2_ftz(name)`.
        for name in ["TITAN_ATT_FWD_EX2", "TITAN_ATT_BWD_EX2"] {
            assert!(files.iter().any(|f| std::fs::read_to_string(f).unwrap().contains(&format!("ex2_ftz(\"{name}\")"))), "{name}");
            read.insert(name.to_string());
        }
        let listed: std::collections::BTreeSet<String> = SWITCHES.iter().map(|(n, _)| n.to_string()).collect();
        assert_eq!(read, listed, "listed switches no source reads, or the other way round");
    }

    #[test]
    fn active_lists_only_set_switches() {
        let env = |n: &str| (n == "TITAN_SCATTER_SPLIT").then(|| "1".to_string()).or_else(|| (n == "HOME").then(|| "/root".into()));
        let a = active_in(env);
        assert_eq!(a.into_iter().collect::<Vec<_>>(), vec![("TITAN_SCATTER_SPLIT".to_string(), "1".to_string())]);
        assert!(active_in(|_| None).is_empty());
    }

    #[test]
    fn misspelt_switches_are_found() {
        let vars = ["TITAN_ATT_FWD_W", "TITAN_ATT_FWD_WS", "TITAN_SCATTER_SPLITS", "TITAN_WS_WGI", "TITAN_PTXAS", "HOME", "TITAN_ATT_FWD_W"];
        assert_eq!(unknown_in(vars.iter().map(|s| s.to_string())), ["TITAN_ATT_FWD_W", "TITAN_SCATTER_SPLITS"]);
    }

    #[test]
    #[should_panic(expected = "not listed")]
    fn an_unlisted_switch_is_refused() {
        var("TITAN_NOT_A_SWITCH");
    }
}
