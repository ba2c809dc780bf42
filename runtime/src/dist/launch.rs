//! `titan-run --nproc-per-node N`: run N ranks on this host, torchrun-style; with
//! `--nnodes M --node-rank K --master-addr HOST --master-port P` the ranks `K N .. (K+1) N - 1`
//! of an `M N`-rank run (one such launch per node, as `torchrun --nnodes`).
//!
//! Each rank is a copy of the program with `RANK`, `LOCAL_RANK`, `WORLD_SIZE`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set (on one node `127.0.0.1` and a free
//! port). Rank 0's output passes through unchanged (it alone prints the step log); every line of
//! the other ranks is prefixed `[rank k] ` (they print only warnings and errors). When a rank fails the others
//! get a few seconds to exit on their own (the control plane makes their next collective fail,
//! which says why), then are killed; the launch fails naming the first rank that failed.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::DistError;
use super::rendezvous::free_port;

/// How long the other ranks get to exit after one fails, before they are killed.
const GRACE: Duration = Duration::from_secs(5);

/// Copy `from` to `to` line by line, each line after `prefix`.
fn forward(from: impl Read + Send + 'static, mut to: impl Write + Send + 'static, prefix: String) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(from);
        // The prefix and the line go out in one `write_all`: stdout/stderr lock per call, so two
        // ranks' forwarders never interleave a prefix with the other rank's line.
        let mut line = prefix.clone().into_bytes();
        loop {
            line.truncate(prefix.len());
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let _ = to.write_all(&line).and_then(|()| to.flush());
                }
            }
        }
    })
}

/// `exit status 1` / `killed by signal 9`.
fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(sig) = status.signal() {
            return format!("was killed by signal {sig}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with status {c}"),
        None => format!("ended ({status})"),
    }
}

/// Where this launch sits in a run of several nodes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Nodes {
    pub nnodes: usize,
    pub node_rank: usize,
    /// Where rank 0 (on node 0) listens.
    pub master: (String, u16),
}

/// Run `program args` as this host's `nproc` ranks and wait for them all: ranks `0..nproc` of
/// a one-node run (`nodes` = `None`), or node `node_rank`'s share of `nnodes * nproc` ranks.
pub fn launch_local(nproc: usize, nodes: Option<&Nodes>, program: &Path, args: &[OsString]) -> Result<(), DistError> {
    if nproc == 0 {
        return Err(DistError::Launch("--nproc-per-node must be at least 1".into()));
    }
    let (addr, port, first, world) = match nodes {
        None => ("127.0.0.1".to_string(), free_port()?, 0, nproc),
        Some(n) => {
            if n.nnodes == 0 || n.node_rank >= n.nnodes {
                return Err(DistError::Launch(format!(
                    "--node-rank {} is not below --nnodes {}; number the nodes 0 to {}",
                    n.node_rank,
                    n.nnodes,
                    n.nnodes.saturating_sub(1)
                )));
            }
            (n.master.0.clone(), n.master.1, n.node_rank * nproc, n.nnodes * nproc)
        }
    };
    let mut children: Vec<Child> = Vec::with_capacity(nproc);
    let mut pipes = Vec::new();
    for local in 0..nproc {
        let rank = first + local;
        let spawned = Command::new(program)
            .args(args)
            .env("RANK", rank.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("WORLD_SIZE", world.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("MASTER_ADDR", &addr)
            .env("MASTER_PORT", port.to_string())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(DistError::Launch(format!("cannot start rank {rank} ({}): {e}", program.display())));
            }
        };
        let prefix = if rank == 0 { String::new() } else { format!("[rank {rank}] ") };
        if let Some(out) = child.stdout.take() {
            pipes.push(forward(out, std::io::stdout(), prefix.clone()));
        }
        if let Some(err) = child.stderr.take() {
            pipes.push(forward(err, std::io::stderr(), prefix));
        }
        children.push(child);
    }
    let mut status: Vec<Option<ExitStatus>> = vec![None; nproc];
    // Below, `r` is the local index; messages name the global rank.
    // The first rank that failed, and when.
    let mut first_failure: Option<(usize, ExitStatus, Instant)> = None;
    let mut killed = Vec::new();
    while status.iter().any(Option::is_none) {
        // Ranks seen failing in this round: a rank that dies makes the others fail soon after,
        // so when several are seen at once, the one killed by a signal is the cause.
        let mut failed_now = Vec::new();
        for (r, c) in children.iter_mut().enumerate() {
            if status[r].is_some() {
                continue;
            }
            match c.try_wait() {
                Ok(Some(s)) => {
                    status[r] = Some(s);
                    if !s.success() {
                        failed_now.push((r, s));
                    }
                }
                Ok(None) => {}
                Err(e) => return Err(DistError::Launch(format!("cannot wait for rank {}: {e}", first + r))),
            }
        }
        if first_failure.is_none()
            && let Some(&(r, s)) = failed_now.iter().find(|(_, s)| s.code().is_none()).or(failed_now.first())
        {
            first_failure = Some((r, s, Instant::now()));
        }
        if let Some((_, _, at)) = first_failure
            && at.elapsed() >= GRACE
        {
            for (r, c) in children.iter_mut().enumerate() {
                if status[r].is_none() {
                    let _ = c.kill();
                    killed.push(r);
                    status[r] = c.wait().ok();
                }
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for p in pipes {
        let _ = p.join();
    }
    match first_failure {
        None => Ok(()),
        Some((r, s, _)) => {
            let others: Vec<String> = status
                .iter()
                .enumerate()
                .filter(|&(k, st)| k != r && !killed.contains(&k) && st.is_some_and(|s| !s.success()))
                .map(|(k, _)| (first + k).to_string())
                .collect();
            let mut msg = format!("rank {} {}", first + r, describe(s));
            if !others.is_empty() {
                msg.push_str(&format!("; then rank{} {} failed too", if others.len() == 1 { "" } else { "s" }, others.join(", ")));
            }
            if !killed.is_empty() {
                let k: Vec<String> = killed.iter().map(|k| (first + k).to_string()).collect();
                msg.push_str(&format!("; killed rank{} {} after {} s", if k.len() == 1 { "" } else { "s" }, k.join(", "), GRACE.as_secs()));
            }
            Err(DistError::Launch(msg))
        }
    }
}
