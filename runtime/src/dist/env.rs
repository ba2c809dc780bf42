//! The launch environment of one process: which rank it is, how many there are and where the
//! rendezvous is, read from the variables torchrun or Slurm set (or none: a single process).
//!
//! Precedence: torchrun's variables (`RANK`, `WORLD_SIZE`, ...) when any is set, else Slurm's
//! (`SLURM_PROCID`, `SLURM_NTASKS`, ...) when `SLURM_PROCID` is set, else one process. Under
//! Slurm the rendezvous host is `MASTER_ADDR` when set, else the first host of
//! `SLURM_JOB_NODELIST` (or `SLURM_NODELIST`); the port is `MASTER_PORT`, else 29500 (torchrun's
//! default).

use super::DistError;

/// The rendezvous port under Slurm when `MASTER_PORT` is not set (torchrun's default).
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// The most hosts a nodelist expands to (a guard against `node[0-999999999]`).
const MAX_NODELIST_HOSTS: usize = 1 << 20;

/// Who launched this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: one process.
    Single,
    /// torchrun (or `titan-run --nproc-per-node`): `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, ...
    Torchrun,
    /// `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_JOB_NODELIST`.
    Slurm,
}

impl Launcher {
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Single => "single process",
            Launcher::Torchrun => "torchrun-style env",
            Launcher::Slurm => "slurm",
        }
    }
}

/// Where this process sits in the run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DistEnv {
    pub launcher: Launcher,
    pub rank: usize,
    pub world_size: usize,
    /// The rank among the processes of this host (picks the GPU).
    pub local_rank: usize,
    /// Processes on this host, when the launcher says.
    pub local_world_size: Option<usize>,
    /// The rendezvous host and port (rank 0 listens there); `None` for a single process.
    pub master: Option<(String, u16)>,
}

impl DistEnv {
    /// One process, no rendezvous.
    pub fn single() -> DistEnv {
        DistEnv { launcher: Launcher::Single, rank: 0, world_size: 1, local_rank: 0, local_world_size: Some(1), master: None }
    }

    /// Read this process's environment.
    pub fn from_process_env() -> Result<DistEnv, DistError> {
        DistEnv::detect(|k| std::env::var(k).ok())
    }

    /// Read the launch variables through `var` (the process environment, or a map in tests).
    pub fn detect(var: impl Fn(&str) -> Option<String>) -> Result<DistEnv, DistError> {
        const TORCHRUN: [&str; 4] = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"];
        if TORCHRUN.iter().any(|k| var(k).is_some()) {
            return torchrun(&var);
        }
        if var("SLURM_PROCID").is_some() {
            return slurm(&var);
        }
        Ok(DistEnv::single())
    }

    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }
}

fn env_err(msg: String) -> DistError {
    DistError::Env(msg)
}

/// The variable `k` as a count or index; `None` when unset.
fn number(var: &impl Fn(&str) -> Option<String>, k: &str) -> Result<Option<usize>, DistError> {
    let Some(v) = var(k) else { return Ok(None) };
    v.trim().parse::<usize>().map(Some).map_err(|_| env_err(format!("{k}={v:?} is not a non-negative integer")))
}

fn required(var: &impl Fn(&str) -> Option<String>, k: &str, launcher: &str, needed_by: &str) -> Result<usize, DistError> {
    number(var, k)?.ok_or_else(|| env_err(format!("{launcher} launch: {needed_by} is set but {k} is not")))
}

fn port(var: &impl Fn(&str) -> Option<String>) -> Result<Option<u16>, DistError> {
    let Some(v) = var("MASTER_PORT") else { return Ok(None) };
    match v.trim().parse::<u16>() {
        Ok(p) if p > 0 => Ok(Some(p)),
        _ => Err(env_err(format!("MASTER_PORT={v:?} is not a port number (1-65535)"))),
    }
}

/// Check the rank numbers every launcher gives.
fn check_ranks(names: [&str; 4], rank: usize, world: usize, local_rank: usize, local_world: Option<usize>) -> Result<(), DistError> {
    let [r, w, lr, lw] = names;
    if world == 0 {
        return Err(env_err(format!("{w}=0: a run needs at least one process")));
    }
    if rank >= world {
        return Err(env_err(format!("{r}={rank} is not below {w}={world} (ranks count from 0)")));
    }
    if let Some(lw_n) = local_world {
        if lw_n == 0 || lw_n > world {
            return Err(env_err(format!("{lw}={lw_n} must be between 1 and {w}={world}")));
        }
        if local_rank >= lw_n {
            return Err(env_err(format!("{lr}={local_rank} is not below {lw}={lw_n}")));
        }
    } else if local_rank >= world {
        return Err(env_err(format!("{lr}={local_rank} is not below {w}={world}")));
    }
    Ok(())
}

fn torchrun(var: &impl Fn(&str) -> Option<String>) -> Result<DistEnv, DistError> {
    let rank = required(var, "RANK", "torchrun", "one of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE")?;
    let world = required(var, "WORLD_SIZE", "torchrun", "one of RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE")?;
    // Launchers that set only RANK and WORLD_SIZE run one host: the local rank is the rank.
    let local_rank = number(var, "LOCAL_RANK")?.unwrap_or(rank);
    let local_world = number(var, "LOCAL_WORLD_SIZE")?;
    check_ranks(["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"], rank, world, local_rank, local_world)?;
    let master = if world > 1 {
        let addr = var("MASTER_ADDR").map(|a| a.trim().to_string()).filter(|a| !a.is_empty());
        let addr = addr.ok_or_else(|| env_err(format!("WORLD_SIZE={world} needs MASTER_ADDR, the host rank 0 runs on (the rendezvous)")))?;
        let port = port(var)?.ok_or_else(|| env_err(format!("WORLD_SIZE={world} needs MASTER_PORT, a free port on MASTER_ADDR for the rendezvous")))?;
        Some((addr, port))
    } else {
        None
    };
    Ok(DistEnv { launcher: Launcher::Torchrun, rank, world_size: world, local_rank, local_world_size: local_world, master })
}

fn slurm(var: &impl Fn(&str) -> Option<String>) -> Result<DistEnv, DistError> {
    let rank = required(var, "SLURM_PROCID", "slurm", "SLURM_PROCID")?;
    let world = required(var, "SLURM_NTASKS", "slurm", "SLURM_PROCID")?;
    let local_rank = required(var, "SLURM_LOCALID", "slurm", "SLURM_PROCID")?;
    let local_world = number(var, "SLURM_NTASKS_PER_NODE").ok().flatten();
    check_ranks(["SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE"], rank, world, local_rank, local_world)?;
    let master = if world > 1 {
        let addr = match var("MASTER_ADDR").map(|a| a.trim().to_string()).filter(|a| !a.is_empty()) {
            Some(a) => a,
            None => {
                let (k, list) = ["SLURM_JOB_NODELIST", "SLURM_NODELIST"]
                    .iter()
                    .find_map(|k| var(k).map(|v| (*k, v)))
                    .ok_or_else(|| env_err(format!("SLURM_NTASKS={world} needs SLURM_JOB_NODELIST (or MASTER_ADDR) to find the rendezvous host")))?;
                first_host(&list).map_err(|e| env_err(format!("{k}={list:?}: {e}")))?
            }
        };
        Some((addr, port(var)?.unwrap_or(DEFAULT_MASTER_PORT)))
    } else {
        None
    };
    Ok(DistEnv { launcher: Launcher::Slurm, rank, world_size: world, local_rank, local_world_size: local_world, master })
}

/// One piece of a nodelist host pattern: literal text or a bracketed set of numbered ranges.
#[derive(Debug)]
enum Piece<'a> {
    Text(&'a str),
    /// `(first, last, width)` ranges; `width` is the zero-padded width of `first`'s digits.
    Ranges(Vec<(u64, u64, usize)>),
}

/// Split a nodelist at the commas outside brackets: `gpu[001-004,007],cpu1` is two patterns.
fn patterns(list: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err("nested `[`".into()),
            ']' if depth == 1 => depth = 0,
            ']' => return Err("`]` without `[`".into()),
            ',' if depth == 0 => {
                out.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err("`[` without `]`".into());
    }
    out.push(&list[start..]);
    if out.iter().any(|p| p.trim().is_empty()) {
        return Err("an empty host name".into());
    }
    Ok(out.into_iter().map(str::trim).collect())
}

/// Parse one pattern such as `rack[1-2]-n[01-04,09]` into its pieces.
fn pieces(pattern: &str) -> Result<Vec<Piece<'_>>, String> {
    let mut out = Vec::new();
    let mut rest = pattern;
    while !rest.is_empty() {
        let Some(open) = rest.find('[') else {
            out.push(Piece::Text(rest));
            break;
        };
        if open > 0 {
            out.push(Piece::Text(&rest[..open]));
        }
        let close = rest[open..].find(']').map(|c| open + c).ok_or_else(|| format!("`{pattern}`: `[` without `]`"))?;
        let mut ranges = Vec::new();
        for part in rest[open + 1..close].split(',') {
            let part = part.trim();
            let (a, b) = part.split_once('-').unwrap_or((part, part));
            let digits = |s: &str| -> Result<u64, String> {
                if s.is_empty() || !s.bytes().all(|c| c.is_ascii_digit()) {
                    return Err(format!("`{pattern}`: `{part}` is not a number or a range `a-b`"));
                }
                s.parse::<u64>().map_err(|_| format!("`{pattern}`: `{s}` is too large"))
            };
            let (first, last) = (digits(a)?, digits(b)?);
            if last < first {
                return Err(format!("`{pattern}`: the range `{part}` runs backwards"));
            }
            ranges.push((first, last, a.len()));
        }
        out.push(Piece::Ranges(ranges));
        rest = &rest[close + 1..];
    }
    Ok(out)
}

/// Every host of a Slurm nodelist in order: `gpu[001-003,007],cpu1` is gpu001, gpu002,
/// gpu003, gpu007, cpu1. Several bracket groups in one name expand as a product, the last
/// fastest (`r[1-2]n[1-2]`: r1n1, r1n2, r2n1, r2n2); numbers keep the zero padding of the
/// range's first bound.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("the nodelist is empty".into());
    }
    let mut hosts = Vec::new();
    for pattern in patterns(list)? {
        let mut names = vec![String::new()];
        for piece in pieces(pattern)? {
            match piece {
                Piece::Text(t) => names.iter_mut().for_each(|n| n.push_str(t)),
                Piece::Ranges(ranges) => {
                    let count: u64 = ranges.iter().map(|(a, b, _)| b - a + 1).sum();
                    if (names.len() as u64).saturating_mul(count).saturating_add(hosts.len() as u64) > MAX_NODELIST_HOSTS as u64 {
                        return Err(format!("`{pattern}` names more than {MAX_NODELIST_HOSTS} hosts"));
                    }
                    let mut next = Vec::with_capacity(names.len() * count as usize);
                    for n in &names {
                        for &(a, b, width) in &ranges {
                            for x in a..=b {
                                next.push(format!("{n}{x:0width$}"));
                            }
                        }
                    }
                    names = next;
                }
            }
        }
        hosts.extend(names);
    }
    Ok(hosts)
}

/// The first host of a Slurm nodelist (the whole list is checked, not expanded).
pub fn first_host(list: &str) -> Result<String, String> {
    let list = list.trim();
    if list.is_empty() {
        return Err("the nodelist is empty".into());
    }
    let all = patterns(list)?;
    let mut first = None;
    for pattern in all {
        let mut name = String::new();
        for piece in pieces(pattern)? {
            match piece {
                Piece::Text(t) => name.push_str(t),
                Piece::Ranges(r) => {
                    let (a, _, width) = r[0];
                    name.push_str(&format!("{a:0width$}"));
                }
            }
        }
        first.get_or_insert(name);
    }
    first.ok_or_else(|| "the nodelist is empty".into())
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn detect(vars: &[(&str, &str)]) -> Result<DistEnv, DistError> {
        let m: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::detect(|k| m.get(k).cloned())
    }

    fn err(vars: &[(&str, &str)]) -> String {
        detect(vars).expect_err("should be rejected").to_string()
    }

    #[test]
    fn no_variables_is_a_single_process() {
        assert_eq!(detect(&[]).unwrap(), DistEnv::single());
        assert!(!DistEnv::single().is_distributed());
    }

    #[test]
    fn torchrun_variables() {
        let e =
            detect(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "node7"), ("MASTER_PORT", "29400")])
                .unwrap();
        assert_eq!(
            e,
            DistEnv { launcher: Launcher::Torchrun, rank: 3, world_size: 8, local_rank: 1, local_world_size: Some(2), master: Some(("node7".into(), 29400)) }
        );
        // One rank needs no rendezvous; LOCAL_RANK defaults to RANK.
        let e = detect(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!((e.rank, e.local_rank, e.master), (0, 0, None));
    }

    #[test]
    fn torchrun_takes_precedence_over_slurm() {
        let e =
            detect(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "5000"), ("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")])
                .unwrap();
        assert_eq!((e.launcher, e.rank, e.world_size), (Launcher::Torchrun, 1, 2));
    }

    #[test]
    fn bad_torchrun_variables_are_named() {
        let ok = [("MASTER_ADDR", "h"), ("MASTER_PORT", "1234")];
        let with = |extra: &[(&'static str, &'static str)]| -> Vec<(&'static str, &'static str)> { ok.iter().chain(extra).copied().collect() };
        assert!(err(&with(&[("RANK", "2"), ("WORLD_SIZE", "2")])).contains("RANK=2 is not below WORLD_SIZE=2"));
        assert!(err(&with(&[("RANK", "x"), ("WORLD_SIZE", "2")])).contains("RANK=\"x\" is not a non-negative integer"));
        assert!(err(&with(&[("RANK", "-1"), ("WORLD_SIZE", "2")])).contains("RANK=\"-1\""));
        assert!(err(&with(&[("WORLD_SIZE", "2")])).contains("RANK is not"));
        assert!(err(&with(&[("RANK", "0")])).contains("WORLD_SIZE is not"));
        assert!(err(&with(&[("RANK", "0"), ("WORLD_SIZE", "0")])).contains("at least one process"));
        assert!(
            err(&with(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")]))
                .contains("LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2")
        );
        assert!(err(&with(&[("RANK", "0"), ("WORLD_SIZE", "4"), ("LOCAL_WORLD_SIZE", "8")])).contains("LOCAL_WORLD_SIZE=8 must be between 1 and WORLD_SIZE=4"));
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "1")]).contains("needs MASTER_ADDR"));
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", " ")]).contains("needs MASTER_ADDR"));
        assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")]).contains("needs MASTER_PORT"));
        for bad in ["0", "70000", "http"] {
            assert!(err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", bad)]).contains("is not a port number"), "{bad}");
        }
    }

    #[test]
    fn slurm_variables_and_the_first_host_of_the_nodelist() {
        let e = detect(&[("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1"), ("SLURM_JOB_NODELIST", "gpu[003-004,007],cpu1")]).unwrap();
        assert_eq!(
            e,
            DistEnv {
                launcher: Launcher::Slurm,
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: None,
                master: Some(("gpu003".into(), DEFAULT_MASTER_PORT))
            }
        );
        // MASTER_ADDR / MASTER_PORT override; SLURM_NODELIST is the older name.
        let e = detect(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_NODELIST", "a,b"), ("MASTER_PORT", "4000")]).unwrap();
        assert_eq!(e.master, Some(("a".into(), 4000)));
        let e = detect(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("MASTER_ADDR", "login1")]).unwrap();
        assert_eq!(e.master, Some(("login1".into(), DEFAULT_MASTER_PORT)));
    }

    #[test]
    fn bad_slurm_variables_are_named() {
        assert!(err(&[("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0")]).contains("SLURM_NTASKS is not"));
        assert!(err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]).contains("SLURM_LOCALID is not"));
        assert!(err(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4"), ("SLURM_LOCALID", "0")]).contains("SLURM_PROCID=4 is not below SLURM_NTASKS=4"));
        assert!(err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0")]).contains("needs SLURM_JOB_NODELIST"));
        let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_JOB_NODELIST", "gpu[1-")]);
        assert!(e.contains("SLURM_JOB_NODELIST=\"gpu[1-\"") && e.contains("without `]`"), "{e}");
    }

    #[test]
    fn nodelist_expansion() {
        assert_eq!(expand_nodelist("gpu[001-004,007],cpu1").unwrap(), ["gpu001", "gpu002", "gpu003", "gpu004", "gpu007", "cpu1"]);
        assert_eq!(expand_nodelist("node1").unwrap(), ["node1"]);
        assert_eq!(expand_nodelist("a,b[2],c").unwrap(), ["a", "b2", "c"]);
        assert_eq!(expand_nodelist("r[1-2]n[08-09]").unwrap(), ["r1n08", "r1n09", "r2n08", "r2n09"]);
        assert_eq!(expand_nodelist("n[9-11]-ib").unwrap(), ["n9-ib", "n10-ib", "n11-ib"]);
        assert_eq!(expand_nodelist("x[098-100]").unwrap(), ["x098", "x099", "x100"]);
        assert_eq!(expand_nodelist("my-host.example,gpu-[1,3]").unwrap(), ["my-host.example", "gpu-1", "gpu-3"]);
        for bad in ["", "gpu[1-", "gpu1]", "gpu[[1]]", "gpu[a-b]", "gpu[3-1]", "a,,b", "gpu[]", "gpu[1-2-3]", "n[0-99999999]"] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?} should be rejected");
        }
    }

    #[test]
    fn first_host_of_a_nodelist() {
        assert_eq!(first_host("gpu[001-004,007],cpu1").unwrap(), "gpu001");
        assert_eq!(first_host("cpu1,gpu[001-004]").unwrap(), "cpu1");
        assert_eq!(first_host(" r[3-4]n[10-12] ").unwrap(), "r3n10");
        assert_eq!(first_host("gpu[007,001]").unwrap(), "gpu007");
        // The whole list is checked, not only its first name.
        assert!(first_host("a,b[1-").is_err());
        assert!(first_host("").is_err());
    }
}
