//! The watchdog of a GPU rank: NCCL calls block inside kernels, so a rank whose peer died (or
//! never issued the matching collective) would wait forever. A thread polls NCCL's asynchronous
//! errors and times the step in flight; on an error, or a step longer than the timeout, it
//! aborts the communicators (which unblocks the kernels) and ends the process with the reason,
//! as PyTorch's NCCL watchdog does.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What the watchdog checks, and what it does when something is wrong.
pub struct Checks {
    /// A failure the communicators report (`None`: all well).
    pub poll: Box<dyn Fn() -> Option<String> + Send>,
    /// A failed peer process (the control plane's [`super::FailureProbe`]), polled only while a
    /// step is in flight: between steps a peer may end its run normally.
    pub peers: Option<Box<dyn Fn() -> Option<String> + Send>>,
    /// Called once with the reason; for a GPU rank it aborts the communicators and exits.
    pub fail: Box<dyn Fn(String) + Send>,
}

/// A running watchdog; stopped on drop.
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    /// Milliseconds (since `epoch`) the step in flight started at, or 0 between steps.
    started_ms: Arc<AtomicU64>,
    epoch: Instant,
    thread: Option<JoinHandle<()>>,
}

impl Watchdog {
    /// Start polling every `every`; a step running longer than `step_timeout` fails.
    pub fn start(checks: Checks, every: Duration, step_timeout: Duration) -> Watchdog {
        let stop = Arc::new(AtomicBool::new(false));
        let started_ms = Arc::new(AtomicU64::new(0));
        let epoch = Instant::now();
        let (s, t) = (Arc::clone(&stop), Arc::clone(&started_ms));
        let thread = std::thread::Builder::new()
            .name("titan-watchdog".into())
            .spawn(move || {
                while !s.load(Ordering::Relaxed) {
                    std::thread::sleep(every);
                    if let Some(why) = (checks.poll)() {
                        (checks.fail)(why);
                        return;
                    }
                    let started = t.load(Ordering::Relaxed);
                    if started > 0
                        && let Some(why) = checks.peers.as_ref().and_then(|p| p())
                    {
                        (checks.fail)(why);
                        return;
                    }
                    let now = epoch.elapsed().as_millis() as u64;
                    if started > 0 && now.saturating_sub(started) > step_timeout.as_millis() as u64 {
                        (checks.fail)(format!(
                            "a step has run for more than {:.1} s: a peer rank failed or hangs, or the ranks issued different collectives",
                            step_timeout.as_secs_f64()
                        ));
                        return;
                    }
                }
            })
            .ok();
        Watchdog { stop, started_ms, epoch, thread }
    }

    /// A step starts (its collectives may block from now on).
    pub fn step_started(&self) {
        self.started_ms.store((self.epoch.elapsed().as_millis() as u64).max(1), Ordering::Relaxed);
    }

    /// The step finished.
    pub fn step_done(&self) {
        self.started_ms.store(0, Ordering::Relaxed);
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    type Seen = Arc<Mutex<Vec<String>>>;

    fn recorder() -> (Seen, Box<dyn Fn(String) + Send>) {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        (seen, Box::new(move |why| s.lock().expect("lock").push(why)))
    }

    fn wait_for(seen: &Seen) -> Vec<String> {
        let deadline = Instant::now() + Duration::from_secs(5);
        while seen.lock().expect("lock").is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        seen.lock().expect("lock").clone()
    }

    #[test]
    fn an_asynchronous_error_fails_the_rank_once() {
        let (seen, fail) = recorder();
        let calls = Arc::new(AtomicU64::new(0));
        let c = Arc::clone(&calls);
        let poll = Box::new(move || (c.fetch_add(1, Ordering::Relaxed) >= 2).then(|| "NCCL: remote process exited".to_string()));
        let w = Watchdog::start(Checks { poll, peers: None, fail }, Duration::from_millis(2), Duration::from_secs(60));
        assert_eq!(wait_for(&seen), vec!["NCCL: remote process exited".to_string()]);
        drop(w);
        assert_eq!(seen.lock().expect("lock").len(), 1);
    }

    #[test]
    fn a_step_over_the_timeout_fails_and_steps_under_it_do_not() {
        let (seen, fail) = recorder();
        let w = Watchdog::start(Checks { poll: Box::new(|| None), peers: None, fail }, Duration::from_millis(2), Duration::from_millis(100));
        for _ in 0..3 {
            w.step_started();
            std::thread::sleep(Duration::from_millis(20));
            w.step_done();
        }
        std::thread::sleep(Duration::from_millis(150));
        assert!(seen.lock().expect("lock").is_empty(), "idle time between steps does not count");
        w.step_started();
        let got = wait_for(&seen);
        assert!(got.len() == 1 && got[0].contains("more than 0.1 s"), "{got:?}");
    }

    #[test]
    fn a_failed_peer_counts_only_while_a_step_is_in_flight() {
        let (seen, fail) = recorder();
        let peers: Box<dyn Fn() -> Option<String> + Send> = Box::new(|| Some("rank 1 failed: killed".to_string()));
        let w = Watchdog::start(Checks { poll: Box::new(|| None), peers: Some(peers), fail }, Duration::from_millis(2), Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(50));
        assert!(seen.lock().expect("lock").is_empty(), "a peer that ended its run between steps is no failure");
        w.step_started();
        assert_eq!(wait_for(&seen), vec!["rank 1 failed: killed".to_string()]);
    }
}
