//! The TCP rendezvous and control plane of a multi-process run.
//!
//! Rank 0 listens at `MASTER_ADDR:MASTER_PORT`; every other rank connects (retrying until the
//! timeout) and sends a hello: its rank, the world size, an identity string (the program and
//! run it executes) and its host name. Rank 0 checks that everyone agrees (same world size,
//! same identity, each rank once) and answers every rank with the payload (opaque bytes: the
//! NCCL unique id on GPUs) or with the reason the run cannot start. When a rank does not show
//! up in time, every rank fails with a message naming the missing ranks.
//!
//! The connections stay open: the star through rank 0 is the control plane. A thread on rank 0
//! (the hub) routes collective exchanges: each rank sends its contribution, the hub answers
//! every member of the group with all the contributions in the group's order. A rank whose
//! step fails sends `abort`; a connection that closes without a `bye` is a rank that died.
//! Either way the hub tells every other rank, whose next collective (or barrier) fails with an
//! error naming the failed rank instead of hanging.
//!
//! Frames are `[tag: u8][length: u32 LE][body]`; numbers little-endian, floats as their bits.

use std::collections::HashMap;
use std::io::{BufReader, ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::DistError;

/// The first bytes of every hello, so a stray connection is told apart from a rank.
const MAGIC: &str = "titan-rendezvous/1";
/// The largest frame accepted (a collective's contribution included).
const MAX_FRAME: usize = 1 << 31;

/// How long to wait for the ranks.
#[derive(Clone, Copy, Debug)]
pub struct RendezvousOptions {
    /// For every rank to join (each rank counts from its own start).
    pub join_timeout: Duration,
    /// For the other ranks of a group at a collective or barrier; a rank that fails or exits is
    /// reported at once, this only bounds a rank that hangs.
    pub collective_timeout: Duration,
}

impl Default for RendezvousOptions {
    fn default() -> RendezvousOptions {
        RendezvousOptions { join_timeout: Duration::from_secs(300), collective_timeout: Duration::from_secs(600) }
    }
}

/// The group one exchange runs in: the ranks that differ only along mesh dim `kind` (0-2), or
/// every rank (`kind` [`WORLD`]). `key` names the group (the coordinates with `kind`'s zeroed).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GroupKey {
    pub kind: u8,
    pub key: [u32; 3],
}

/// The group kind of a world-wide exchange (barriers).
pub const WORLD: u8 = 3;

/// A message of the protocol.
#[derive(Clone, Debug, PartialEq)]
enum Msg {
    Hello {
        rank: u32,
        world: u32,
        identity: String,
        host: String,
    },
    Welcome {
        payload: Vec<u8>,
        hosts: Vec<String>,
    },
    Reject {
        message: String,
    },
    /// A contribution: this rank is member `index` of `size` in `group`, call number `seq`.
    Exchange {
        group: GroupKey,
        index: u32,
        size: u32,
        seq: u64,
        data: Vec<f64>,
    },
    Parts {
        group: GroupKey,
        seq: u64,
        parts: Vec<Vec<f64>>,
    },
    /// Hub to ranks: `rank` failed; the run is over.
    Failed {
        rank: u32,
        message: String,
    },
    /// Rank to hub: this rank failed.
    Abort {
        message: String,
    },
    /// Rank to hub: this rank is done; its connection closing is not a failure.
    Bye,
}

#[derive(Default)]
struct Enc(Vec<u8>);

impl Enc {
    fn u8(&mut self, x: u8) {
        self.0.push(x);
    }
    fn u32(&mut self, x: u32) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn u64(&mut self, x: u64) {
        self.0.extend_from_slice(&x.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u64(n as u64);
    }
    fn bytes(&mut self, b: &[u8]) {
        self.len(b.len());
        self.0.extend_from_slice(b);
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn floats(&mut self, xs: &[f64]) {
        self.len(xs.len());
        self.0.reserve(xs.len() * 8);
        for x in xs {
            self.0.extend_from_slice(&x.to_bits().to_le_bytes());
        }
    }
    fn group(&mut self, g: GroupKey) {
        self.u8(g.kind);
        g.key.iter().for_each(|&k| self.u32(k));
    }
}

struct Dec<'a>(&'a [u8]);

impl Dec<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], String> {
        if self.0.len() < n {
            return Err("truncated message".into());
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }
    fn u8(&mut self) -> Result<u8, String> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().map_err(|_| "truncated message")?))
    }
    fn u64(&mut self) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().map_err(|_| "truncated message")?))
    }
    /// A length of items of `item` bytes each, checked against what is left.
    fn len(&mut self, item: usize) -> Result<usize, String> {
        let n = usize::try_from(self.u64()?).map_err(|_| "bad length")?;
        if n.saturating_mul(item.max(1)) > self.0.len() {
            return Err("truncated message".into());
        }
        Ok(n)
    }
    fn bytes(&mut self) -> Result<Vec<u8>, String> {
        let n = self.len(1)?;
        Ok(self.take(n)?.to_vec())
    }
    fn str(&mut self) -> Result<String, String> {
        String::from_utf8(self.bytes()?).map_err(|_| "a string is not UTF-8".into())
    }
    fn floats(&mut self) -> Result<Vec<f64>, String> {
        let n = self.len(8)?;
        let raw = self.take(n * 8)?;
        Ok(raw.chunks_exact(8).map(|c| f64::from_bits(u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))).collect())
    }
    fn group(&mut self) -> Result<GroupKey, String> {
        Ok(GroupKey { kind: self.u8()?, key: [self.u32()?, self.u32()?, self.u32()?] })
    }
}

impl Msg {
    fn encode(&self) -> Vec<u8> {
        let mut e = Enc::default();
        let tag = match self {
            Msg::Hello { rank, world, identity, host } => {
                e.str(MAGIC);
                e.u32(*rank);
                e.u32(*world);
                e.str(identity);
                e.str(host);
                1
            }
            Msg::Welcome { payload, hosts } => {
                e.bytes(payload);
                e.len(hosts.len());
                hosts.iter().for_each(|h| e.str(h));
                2
            }
            Msg::Reject { message } => {
                e.str(message);
                3
            }
            Msg::Exchange { group, index, size, seq, data } => {
                e.group(*group);
                e.u32(*index);
                e.u32(*size);
                e.u64(*seq);
                e.floats(data);
                4
            }
            Msg::Parts { group, seq, parts } => {
                e.group(*group);
                e.u64(*seq);
                e.len(parts.len());
                parts.iter().for_each(|p| e.floats(p));
                5
            }
            Msg::Failed { rank, message } => {
                e.u32(*rank);
                e.str(message);
                6
            }
            Msg::Abort { message } => {
                e.str(message);
                7
            }
            Msg::Bye => 8,
        };
        let mut frame = Vec::with_capacity(5 + e.0.len());
        frame.push(tag);
        frame.extend_from_slice(&(e.0.len() as u32).to_le_bytes());
        frame.extend_from_slice(&e.0);
        frame
    }

    fn decode(tag: u8, body: &[u8]) -> Result<Msg, String> {
        let mut d = Dec(body);
        let msg = match tag {
            1 => {
                if d.str()? != MAGIC {
                    return Err("not a titan rendezvous hello".into());
                }
                Msg::Hello { rank: d.u32()?, world: d.u32()?, identity: d.str()?, host: d.str()? }
            }
            2 => {
                let payload = d.bytes()?;
                let n = d.len(8)?;
                Msg::Welcome { payload, hosts: (0..n).map(|_| d.str()).collect::<Result<_, _>>()? }
            }
            3 => Msg::Reject { message: d.str()? },
            4 => Msg::Exchange { group: d.group()?, index: d.u32()?, size: d.u32()?, seq: d.u64()?, data: d.floats()? },
            5 => {
                let (group, seq) = (d.group()?, d.u64()?);
                let n = d.len(8)?;
                Msg::Parts { group, seq, parts: (0..n).map(|_| d.floats()).collect::<Result<_, _>>()? }
            }
            6 => Msg::Failed { rank: d.u32()?, message: d.str()? },
            7 => Msg::Abort { message: d.str()? },
            8 => Msg::Bye,
            t => return Err(format!("unknown message tag {t}")),
        };
        if !d.0.is_empty() {
            return Err("trailing bytes after a message".into());
        }
        Ok(msg)
    }
}

/// Why reading a frame failed.
#[derive(Debug)]
enum ReadError {
    /// The peer closed the connection.
    Closed,
    TimedOut,
    Io(std::io::Error),
    Protocol(String),
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Closed => write!(f, "connection closed"),
            ReadError::TimedOut => write!(f, "timed out"),
            ReadError::Io(e) => write!(f, "{e}"),
            ReadError::Protocol(e) => write!(f, "protocol error: {e}"),
        }
    }
}

fn read_msg(r: &mut impl Read) -> Result<Msg, ReadError> {
    let mut head = [0u8; 5];
    if let Err(e) = r.read_exact(&mut head) {
        return Err(match e.kind() {
            ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe => ReadError::Closed,
            ErrorKind::WouldBlock | ErrorKind::TimedOut => ReadError::TimedOut,
            _ => ReadError::Io(e),
        });
    }
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_FRAME {
        return Err(ReadError::Protocol(format!("a frame of {len} bytes")));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).map_err(|e| match e.kind() {
        ErrorKind::WouldBlock | ErrorKind::TimedOut => ReadError::TimedOut,
        ErrorKind::UnexpectedEof | ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted => ReadError::Closed,
        _ => ReadError::Io(e),
    })?;
    Msg::decode(head[0], &body).map_err(ReadError::Protocol)
}

fn write_msg(mut w: &TcpStream, msg: &Msg) -> std::io::Result<()> {
    w.write_all(&msg.encode())?;
    w.flush()
}

/// This machine's host name, for messages.
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".into())
}

/// A duration in seconds for messages: `1.5`, `300`.
fn secs(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s < 10.0 { format!("{s:.1}") } else { format!("{s:.0}") }
}

/// `0, 2, 5` for messages.
fn rank_list(ranks: impl IntoIterator<Item = usize>) -> String {
    ranks.into_iter().map(|r| r.to_string()).collect::<Vec<_>>().join(", ")
}

/// What the hub hears: a frame from a rank, a rank's connection ending, or rank 0 itself.
enum HubEvent {
    Frame(usize, Msg),
    Closed(usize, String),
}

/// A collective in progress on the hub.
struct Meeting {
    /// Each member's contribution (and its rank), by its index in the group.
    parts: Vec<Option<(usize, Vec<f64>)>>,
}

/// The router on rank 0.
struct Hub {
    /// The connection to each rank (none for rank 0).
    peers: Vec<Option<TcpStream>>,
    /// Messages to rank 0's own exchanges.
    local: Sender<Msg>,
    meetings: HashMap<(GroupKey, u64), Meeting>,
    /// Ranks that said bye: their connection closing is expected.
    gone: Vec<bool>,
    failed: Option<(usize, String)>,
    /// The first failure, for rank 0's [`FailureProbe`].
    notice: Arc<Mutex<Option<String>>>,
}

impl Hub {
    fn send(&self, rank: usize, msg: &Msg) {
        // A rank that cannot be written to has died; its reader reports the closed connection.
        if rank == 0 {
            let _ = self.local.send(msg.clone());
        } else if let Some(s) = self.peers.get(rank).and_then(Option::as_ref) {
            let _ = write_msg(s, msg);
        }
    }

    /// The first failure ends the run: tell every other rank.
    fn fail(&mut self, rank: usize, message: String) {
        if self.failed.is_some() {
            return;
        }
        self.meetings.clear();
        let msg = Msg::Failed { rank: rank as u32, message: message.clone() };
        for r in 0..self.peers.len() {
            if r != rank && !self.gone[r] {
                self.send(r, &msg);
            }
        }
        if let Ok(mut n) = self.notice.lock() {
            n.get_or_insert_with(|| format!("rank {rank} failed: {message}"));
        }
        self.failed = Some((rank, message));
    }

    fn handle(&mut self, event: HubEvent) {
        match event {
            HubEvent::Closed(r, why) => {
                if !self.gone[r] {
                    self.gone[r] = true;
                    self.fail(r, format!("its process exited or lost its connection to rank 0 ({why})"));
                }
            }
            HubEvent::Frame(r, Msg::Bye) => self.gone[r] = true,
            HubEvent::Frame(r, Msg::Abort { message }) => self.fail(r, message),
            HubEvent::Frame(r, Msg::Exchange { group, index, size, seq, data }) => {
                if let Some((f, m)) = &self.failed {
                    let msg = Msg::Failed { rank: *f as u32, message: m.clone() };
                    self.send(r, &msg);
                    return;
                }
                let meeting = self.meetings.entry((group, seq)).or_insert_with(|| Meeting { parts: vec![None; size as usize] });
                let n = meeting.parts.len();
                match meeting.parts.get_mut(index as usize) {
                    Some(slot @ None) if n == size as usize => *slot = Some((r, data)),
                    _ => {
                        self.fail(r, format!("it issued collective #{seq} as member {index} of {size}, which does not match the group of {n} (the ranks run different programs)"));
                        return;
                    }
                }
                if meeting.parts.iter().all(Option::is_some) {
                    let Some(meeting) = self.meetings.remove(&(group, seq)) else { return };
                    let (ranks, parts): (Vec<usize>, Vec<Vec<f64>>) = meeting.parts.into_iter().flatten().unzip();
                    let msg = Msg::Parts { group, seq, parts };
                    for r in ranks {
                        self.send(r, &msg);
                    }
                }
            }
            HubEvent::Frame(r, other) => self.fail(r, format!("it sent an unexpected message {other:?}")),
        }
    }
}

/// How this process reaches the others.
enum Role {
    /// Rank 0: exchanges go to the hub thread in this process.
    Host {
        to_hub: Mutex<Sender<HubEvent>>,
        from_hub: Mutex<Receiver<Msg>>,
        hub: Mutex<Option<std::thread::JoinHandle<()>>>,
        notice: Arc<Mutex<Option<String>>>,
    },
    /// Other ranks: the connection to rank 0.
    Worker { conn: Arc<Mutex<BufReader<TcpStream>>>, stream: TcpStream },
}

/// The ranks of a run after the rendezvous, connected through rank 0.
pub struct ProcessGroup {
    rank: usize,
    world: usize,
    payload: Vec<u8>,
    hosts: Vec<String>,
    role: Role,
    collective_timeout: Duration,
    /// World-wide calls so far (barriers).
    barriers: Mutex<u64>,
}

impl ProcessGroup {
    /// Meet the other ranks. Rank 0 listens at `master` and sends `payload` to everyone (the
    /// others' `payload` is ignored); `identity` must be the same on every rank.
    pub fn rendezvous(
        rank: usize,
        world: usize,
        master: (&str, u16),
        identity: &str,
        payload: Vec<u8>,
        opts: RendezvousOptions,
    ) -> Result<ProcessGroup, DistError> {
        if world == 0 || rank >= world {
            return Err(DistError::Rendezvous(format!("rank {rank} of world size {world}")));
        }
        if rank == 0 { host(world, master, identity, payload, opts) } else { join(rank, world, master, identity, opts) }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world
    }

    /// What rank 0 sent every rank at the rendezvous.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// Each rank's host name, by rank.
    pub fn hosts(&self) -> &[String] {
        &self.hosts
    }

    /// Contribute `data` as member `index` of `size` of `group` (call `seq` of that group) and
    /// return every member's contribution in index order.
    pub fn exchange(&self, group: GroupKey, index: usize, size: usize, seq: u64, data: Vec<f64>) -> Result<Vec<Vec<f64>>, DistError> {
        if size == 1 {
            return Ok(vec![data]);
        }
        let what = if group.kind == WORLD { format!("barrier #{seq}") } else { format!("collective #{seq}") };
        let msg = Msg::Exchange { group, index: index as u32, size: size as u32, seq, data };
        let timeout = self.collective_timeout;
        let reply = match &self.role {
            Role::Host { to_hub, from_hub, .. } => {
                let rx = from_hub.lock().map_err(|_| DistError::Collective("a thread panicked".into()))?;
                to_hub
                    .lock()
                    .map_err(|_| DistError::Collective("a thread panicked".into()))?
                    .send(HubEvent::Frame(0, msg))
                    .map_err(|_| DistError::Collective(format!("{what}: the control plane has stopped")))?;
                match rx.recv_timeout(timeout) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => return Err(timed_out(&what, timeout)),
                    Err(RecvTimeoutError::Disconnected) => return Err(DistError::Collective(format!("{what}: the control plane has stopped"))),
                }
            }
            Role::Worker { conn, stream } => {
                let mut conn = conn.lock().map_err(|_| DistError::Collective("a thread panicked".into()))?;
                write_msg(stream, &msg).map_err(|e| lost_rank0(&what, &e.to_string()))?;
                let _ = stream.set_read_timeout(Some(timeout));
                match read_msg(&mut *conn) {
                    Ok(m) => m,
                    Err(ReadError::TimedOut) => return Err(timed_out(&what, timeout)),
                    Err(e) => return Err(lost_rank0(&what, &e.to_string())),
                }
            }
        };
        match reply {
            Msg::Parts { group: g, seq: s, parts } if g == group && s == seq && parts.len() == size => Ok(parts),
            Msg::Failed { rank, message } => Err(DistError::Collective(format!("{what} abandoned: rank {rank} failed: {message}"))),
            other => Err(DistError::Collective(format!("{what}: unexpected reply from rank 0: {other:?}"))),
        }
    }

    /// A handle that tells, between collectives of this group, whether another rank failed
    /// (see [`FailureProbe`]).
    pub fn failure_probe(&self) -> FailureProbe {
        FailureProbe(match &self.role {
            Role::Host { notice, .. } => Probe::Host(Arc::clone(notice)),
            Role::Worker { conn, .. } => Probe::Worker(Arc::clone(conn)),
        })
    }

    /// Wait until every rank reaches its barrier (or fail naming a rank that failed).
    pub fn barrier(&self) -> Result<(), DistError> {
        let seq = {
            let mut b = self.barriers.lock().map_err(|_| DistError::Collective("a thread panicked".into()))?;
            *b += 1;
            *b
        };
        self.exchange(GroupKey { kind: WORLD, key: [0; 3] }, self.rank, self.world, seq, Vec::new()).map(|_| ())
    }

    /// Tell every other rank this one failed with `message` (their next collective fails).
    pub fn abort(&self, message: &str) {
        let msg = Msg::Abort { message: message.to_string() };
        match &self.role {
            Role::Host { to_hub, .. } => {
                if let Ok(tx) = to_hub.lock() {
                    let _ = tx.send(HubEvent::Frame(0, msg));
                }
            }
            Role::Worker { stream, .. } => {
                let _ = write_msg(stream, &msg);
            }
        }
    }

    /// End the run cleanly: a final barrier, so rank 0 (which routes the collectives) stays up
    /// until every rank is done, then `bye`. Rank 0 then waits (up to the collective timeout) for
    /// its hub to see every other rank's `bye` or closed connection: the hub answers rank 0's
    /// final barrier before it has written the other ranks' answers, and rank 0 exiting first
    /// would cut those writes off.
    pub fn finish(&self) -> Result<(), DistError> {
        self.barrier()?;
        match &self.role {
            Role::Host { to_hub, hub, .. } => {
                if let Ok(tx) = to_hub.lock() {
                    let _ = tx.send(HubEvent::Frame(0, Msg::Bye));
                }
                let handle = hub.lock().ok().and_then(|mut h| h.take());
                if let Some(h) = handle {
                    let deadline = Instant::now() + self.collective_timeout;
                    while !h.is_finished() && Instant::now() < deadline {
                        std::thread::sleep(Duration::from_millis(5));
                    }
                    if h.is_finished() {
                        let _ = h.join();
                    }
                }
            }
            Role::Worker { stream, .. } => {
                let _ = write_msg(stream, &Msg::Bye);
                let _ = stream.shutdown(Shutdown::Both);
            }
        }
        Ok(())
    }
}

/// Whether another rank of a [`ProcessGroup`] has failed, seen from outside the group's
/// collectives: a GPU rank's collectives go through NCCL, whose kernels wait forever for a peer
/// that died, so its watchdog polls this. On rank 0 it reads the hub's first failure (a rank's
/// `abort`, or its connection closing without `bye`); on the others it looks, without blocking,
/// at the connection to rank 0: rank 0 sends nothing outside an exchange except a failure, and a
/// closed connection means rank 0 itself is gone.
#[derive(Clone)]
pub struct FailureProbe(Probe);

#[derive(Clone)]
enum Probe {
    Host(Arc<Mutex<Option<String>>>),
    Worker(Arc<Mutex<BufReader<TcpStream>>>),
}

impl FailureProbe {
    /// The failure, if one was reported (`None`: all well, or an exchange of this rank is in
    /// flight, which sees failures itself).
    pub fn check(&self) -> Option<String> {
        match &self.0 {
            Probe::Host(notice) => notice.lock().ok().and_then(|n| n.clone()),
            Probe::Worker(conn) => {
                let Ok(mut conn) = conn.try_lock() else { return None };
                if conn.buffer().is_empty() {
                    let s = conn.get_ref();
                    // Exchanges set their own read timeout before they read.
                    let _ = s.set_read_timeout(Some(Duration::from_millis(1)));
                    match s.peek(&mut [0u8; 1]) {
                        Ok(0) => return Some("lost the connection to rank 0 (it exited or failed)".into()),
                        Ok(_) => {}
                        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted) => return None,
                        Err(e) => return Some(format!("lost the connection to rank 0: {e}")),
                    }
                }
                let _ = conn.get_ref().set_read_timeout(Some(Duration::from_secs(5)));
                Some(match read_msg(&mut *conn) {
                    Ok(Msg::Failed { rank, message }) => format!("rank {rank} failed: {message}"),
                    Ok(other) => format!("rank 0 sent {other:?} outside a collective"),
                    Err(e) => format!("lost the connection to rank 0: {e}"),
                })
            }
        }
    }
}

fn timed_out(what: &str, timeout: Duration) -> DistError {
    DistError::Collective(format!(
        "{what} timed out after {} s waiting for the other ranks (a rank hangs, or the ranks issued different collectives)",
        secs(timeout)
    ))
}

fn lost_rank0(what: &str, why: &str) -> DistError {
    DistError::Collective(format!("{what}: lost the connection to rank 0 (it exited or failed: {why})"))
}

/// Listen where the other ranks will connect.
fn listen(master: (&str, u16)) -> Result<TcpListener, DistError> {
    let (addr, port) = master;
    match TcpListener::bind((addr, port)) {
        Ok(l) => Ok(l),
        Err(e) if e.kind() == ErrorKind::AddrInUse => {
            Err(DistError::Rendezvous(format!("rank 0 cannot listen on {addr}:{port}: the port is in use (pick another MASTER_PORT)")))
        }
        // MASTER_ADDR may name this host by an address it does not own (NAT, an alias): listen
        // on every interface instead.
        Err(_) => TcpListener::bind(("0.0.0.0", port)).map_err(|e| DistError::Rendezvous(format!("rank 0 cannot listen on port {port}: {e}"))),
    }
}

/// Rank 0: wait for every rank, check them, answer them, start the hub.
fn host(world: usize, master: (&str, u16), identity: &str, payload: Vec<u8>, opts: RendezvousOptions) -> Result<ProcessGroup, DistError> {
    let listener = listen(master)?;
    listener.set_nonblocking(true).map_err(|e| DistError::Rendezvous(e.to_string()))?;
    let deadline = Instant::now() + opts.join_timeout;
    let mut hosts = vec![String::new(); world];
    hosts[0] = hostname();
    let mut joined: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
    let mut count = 1;
    // Tell every connected rank why the run will not start, then return that reason.
    let reject = |joined: &[Option<TcpStream>], extra: Option<&TcpStream>, message: String| -> DistError {
        let msg = Msg::Reject { message: message.clone() };
        for s in joined.iter().flatten().chain(extra) {
            let _ = write_msg(s, &msg);
        }
        DistError::Rendezvous(message)
    };
    while count < world {
        let now = Instant::now();
        if now >= deadline {
            let missing: Vec<usize> = (1..world).filter(|&r| joined[r].is_none()).collect();
            let present: Vec<usize> = (0..world).filter(|&r| r == 0 || joined[r].is_some()).collect();
            let message = format!(
                "timed out after {} s at {}:{}: rank{} {} of {world} did not show up (joined: {})",
                secs(opts.join_timeout),
                master.0,
                master.1,
                if missing.len() == 1 { "" } else { "s" },
                rank_list(missing),
                rank_list(present)
            );
            return Err(reject(&joined, None, message));
        }
        let (stream, peer) = match listener.accept() {
            Ok(x) => x,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(20));
                continue;
            }
            Err(e) => return Err(reject(&joined, None, format!("accepting a connection: {e}"))),
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let _ = stream.set_read_timeout(Some((deadline - now).clamp(Duration::from_millis(100), Duration::from_secs(10))));
        let hello = read_msg(&mut &stream);
        let Ok(Msg::Hello { rank, world: w, identity: id, host: h }) = hello else {
            let why = hello.map_or_else(|e| e.to_string(), |m| format!("it sent {m:?}"));
            eprintln!("titan-run: rendezvous: ignored a connection from {peer} that is not a titan rank ({why})");
            continue;
        };
        let r = rank as usize;
        let who = format!("rank {rank} (on {h})");
        if w as usize != world {
            return Err(reject(&joined, Some(&stream), format!("{who} has world size {w}, rank 0 has {world}; every rank must get the same WORLD_SIZE")));
        }
        if id != identity {
            return Err(reject(
                &joined,
                Some(&stream),
                format!("{who} runs `{id}`, rank 0 runs `{identity}`; every rank must run the same build, graph, data and seed"),
            ));
        }
        if r == 0 || r >= world {
            return Err(reject(&joined, Some(&stream), format!("{who} claims a rank that is not between 1 and {}; check RANK on each process", world - 1)));
        }
        if joined[r].is_some() {
            return Err(reject(&joined, Some(&stream), format!("rank {rank} joined twice (on {} and on {h}); check RANK on each process", hosts[r])));
        }
        let _ = stream.set_read_timeout(None);
        hosts[r] = h;
        joined[r] = Some(stream);
        count += 1;
    }
    drop(listener);
    let welcome = Msg::Welcome { payload: payload.clone(), hosts: hosts.clone() };
    for (r, s) in joined.iter().enumerate() {
        if let Some(s) = s
            && let Err(e) = write_msg(s, &welcome)
        {
            return Err(reject(&joined, None, format!("rank {r} (on {}) left during the rendezvous: {e}", hosts[r])));
        }
    }
    let (to_hub, events) = mpsc::channel();
    let (local, from_hub) = mpsc::channel();
    for (r, s) in joined.iter().enumerate() {
        let Some(s) = s else { continue };
        let reader = s.try_clone().map_err(|e| DistError::Rendezvous(e.to_string()))?;
        let tx = to_hub.clone();
        std::thread::Builder::new()
            .name(format!("titan-rank{r}-reader"))
            .spawn(move || {
                let mut reader = BufReader::new(reader);
                loop {
                    match read_msg(&mut reader) {
                        Ok(m) => {
                            let bye = m == Msg::Bye;
                            if tx.send(HubEvent::Frame(r, m)).is_err() || bye {
                                return;
                            }
                        }
                        Err(e) => {
                            let _ = tx.send(HubEvent::Closed(r, e.to_string()));
                            return;
                        }
                    }
                }
            })
            .map_err(|e| DistError::Rendezvous(format!("cannot start a thread: {e}")))?;
    }
    let notice = Arc::new(Mutex::new(None));
    let mut hub = Hub { peers: joined, local, meetings: HashMap::new(), gone: vec![false; world], failed: None, notice: Arc::clone(&notice) };
    let hub_thread = std::thread::Builder::new()
        .name("titan-hub".into())
        .spawn(move || {
            while let Ok(event) = events.recv() {
                hub.handle(event);
                if hub.gone.iter().skip(1).all(|&g| g) && hub.gone[0] {
                    return;
                }
            }
        })
        .map_err(|e| DistError::Rendezvous(format!("cannot start a thread: {e}")))?;
    Ok(ProcessGroup {
        rank: 0,
        world,
        payload,
        hosts,
        role: Role::Host { to_hub: Mutex::new(to_hub), from_hub: Mutex::new(from_hub), hub: Mutex::new(Some(hub_thread)), notice },
        collective_timeout: opts.collective_timeout,
        barriers: Mutex::new(0),
    })
}

/// Ranks 1..: connect to rank 0 (retrying until the deadline), say hello, wait for the answer.
fn join(rank: usize, world: usize, master: (&str, u16), identity: &str, opts: RendezvousOptions) -> Result<ProcessGroup, DistError> {
    let (addr, port) = master;
    let deadline = Instant::now() + opts.join_timeout;
    let mut last_error = String::from("no attempt");
    let stream = loop {
        let now = Instant::now();
        if now >= deadline {
            return Err(DistError::Rendezvous(format!(
                "rank {rank} could not reach rank 0 at {addr}:{port} within {} s (last error: {last_error}); is rank 0 running, and MASTER_ADDR/MASTER_PORT the same on every rank?",
                secs(opts.join_timeout)
            )));
        }
        match (addr, port).to_socket_addrs() {
            Ok(addrs) => {
                let addrs: Vec<SocketAddr> = addrs.collect();
                let attempt = (deadline - now).min(Duration::from_secs(5));
                let mut connected = None;
                for a in &addrs {
                    match TcpStream::connect_timeout(a, attempt) {
                        Ok(s) => {
                            connected = Some(s);
                            break;
                        }
                        Err(e) => last_error = format!("{a}: {e}"),
                    }
                }
                if let Some(s) = connected {
                    break s;
                }
            }
            Err(e) => last_error = format!("cannot resolve `{addr}`: {e}"),
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let _ = stream.set_nodelay(true);
    let hello = Msg::Hello { rank: rank as u32, world: world as u32, identity: identity.to_string(), host: hostname() };
    write_msg(&stream, &hello).map_err(|e| DistError::Rendezvous(format!("rank {rank} lost the connection to rank 0 at {addr}:{port}: {e}")))?;
    // Rank 0 answers at the latest when its own wait ends.
    let _ = stream.set_read_timeout(Some(opts.join_timeout + Duration::from_secs(10)));
    let mut conn = BufReader::new(stream.try_clone().map_err(|e| DistError::Rendezvous(e.to_string()))?);
    match read_msg(&mut conn) {
        Ok(Msg::Welcome { payload, hosts }) if hosts.len() == world => {
            let _ = stream.set_read_timeout(None);
            Ok(ProcessGroup {
                rank,
                world,
                payload,
                hosts,
                role: Role::Worker { conn: Arc::new(Mutex::new(conn)), stream },
                collective_timeout: opts.collective_timeout,
                barriers: Mutex::new(0),
            })
        }
        Ok(Msg::Reject { message }) => Err(DistError::Rendezvous(format!("rank 0 refused the run: {message}"))),
        Ok(other) => Err(DistError::Rendezvous(format!("rank 0 at {addr}:{port} answered {other:?}"))),
        Err(e) => Err(DistError::Rendezvous(format!("rank {rank} got no answer from rank 0 at {addr}:{port}: {e}"))),
    }
}

/// A port that was free a moment ago on 127.0.0.1 (for launching ranks on one host).
pub fn free_port() -> Result<u16, DistError> {
    let l = TcpListener::bind(("127.0.0.1", 0)).map_err(|e| DistError::Launch(format!("cannot find a free port: {e}")))?;
    l.local_addr().map(|a| a.port()).map_err(|e| DistError::Launch(format!("cannot find a free port: {e}")))
}

/// A test group: the process group of every rank of `world`, all in this process.
#[cfg(test)]
pub(crate) fn local_groups(world: usize, identity: &str) -> Vec<ProcessGroup> {
    let port = free_port().expect("port");
    let opts = RendezvousOptions { join_timeout: Duration::from_secs(20), collective_timeout: Duration::from_secs(20) };
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..world).map(|r| s.spawn(move || ProcessGroup::rendezvous(r, world, ("127.0.0.1", port), identity, vec![7; 128], opts))).collect();
        hs.into_iter().map(|h| h.join().expect("thread").expect("rendezvous")).collect()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(join_s: f64) -> RendezvousOptions {
        RendezvousOptions { join_timeout: Duration::from_secs_f64(join_s), collective_timeout: Duration::from_secs(20) }
    }

    /// Run `f(rank)` for `ranks` on threads, returning each result.
    fn on_threads<T: Send>(ranks: &[usize], f: impl Fn(usize) -> T + Sync) -> Vec<T> {
        std::thread::scope(|s| {
            let f = &f;
            let hs: Vec<_> = ranks.iter().map(|&r| s.spawn(move || f(r))).collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        })
    }

    #[test]
    fn messages_round_trip() {
        let g = GroupKey { kind: 2, key: [1, 0, 3] };
        for m in [
            Msg::Hello { rank: 3, world: 4, identity: "id".into(), host: "h".into() },
            Msg::Welcome { payload: vec![1, 2, 3], hosts: vec!["a".into(), "b".into()] },
            Msg::Reject { message: "no".into() },
            Msg::Exchange { group: g, index: 1, size: 2, seq: 9, data: vec![1.5, -0.0, f64::NAN.copysign(-1.0), f64::INFINITY] },
            Msg::Parts { group: g, seq: 9, parts: vec![vec![1.0], vec![]] },
            Msg::Failed { rank: 2, message: "x".into() },
            Msg::Abort { message: "y".into() },
            Msg::Bye,
        ] {
            let f = m.encode();
            let back = read_msg(&mut &f[..]).expect("decode");
            // Compare bit patterns (NaN != NaN).
            assert_eq!(format!("{back:?}"), format!("{m:?}"));
        }
        assert!(matches!(read_msg(&mut &[4u8, 3, 0, 0, 0, 1, 2, 3][..]), Err(ReadError::Protocol(_))));
        assert!(matches!(read_msg(&mut &[1u8, 0][..]), Err(ReadError::Closed)));
        // A length that claims more than the frame holds is refused without allocating it.
        let mut bad = Msg::Reject { message: "abc".into() }.encode();
        bad[5] = 0xff;
        bad[12] = 0x7f;
        assert!(matches!(read_msg(&mut &bad[..]), Err(ReadError::Protocol(_))));
    }

    #[test]
    fn ranks_meet_and_share_the_payload() {
        let port = free_port().unwrap();
        // The workers start first: they retry until rank 0 listens.
        let groups = on_threads(&[3, 1, 2, 0], |r| {
            if r == 0 {
                std::thread::sleep(Duration::from_millis(300));
            }
            let payload = if r == 0 { (0..128).collect() } else { Vec::new() };
            ProcessGroup::rendezvous(r, 4, ("127.0.0.1", port), "same", payload, opts(20.0))
        });
        for g in &groups {
            let g = g.as_ref().expect("rendezvous");
            assert_eq!(g.payload(), (0..128).collect::<Vec<u8>>());
            assert_eq!(g.world_size(), 4);
            assert_eq!(g.hosts().len(), 4);
        }
        let groups: Vec<ProcessGroup> = groups.into_iter().map(Result::unwrap).collect();
        // A world-wide exchange returns everyone's data in rank order, on every rank.
        let out = on_threads(&[0, 1, 2, 3], |r| {
            let g = groups.iter().find(|g| g.rank() == r).unwrap();
            g.exchange(GroupKey { kind: WORLD, key: [0; 3] }, r, 4, 1, vec![r as f64; 3]).unwrap()
        });
        for o in out {
            assert_eq!(o, (0..4).map(|r| vec![r as f64; 3]).collect::<Vec<_>>());
        }
        on_threads(&[0, 1, 2, 3], |r| groups.iter().find(|g| g.rank() == r).unwrap().barrier().unwrap());
        std::thread::scope(|s| {
            for g in groups {
                s.spawn(move || g.finish().expect("finish"));
            }
        });
    }

    /// Poll `probe` for up to 10 s.
    fn wait_for(probe: &FailureProbe) -> Option<String> {
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(10) {
            if let Some(why) = probe.check() {
                return Some(why);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        None
    }

    #[test]
    fn probes_see_a_failure_outside_collectives() {
        let groups = local_groups(3, "probe");
        let probes: Vec<FailureProbe> = groups.iter().map(ProcessGroup::failure_probe).collect();
        for _ in 0..20 {
            assert!(probes.iter().all(|p| p.check().is_none()), "no rank has failed yet");
        }
        // A world-wide exchange still works after the probes have peeked.
        let out = on_threads(&[0, 1, 2], |r| groups[r].exchange(GroupKey { kind: WORLD, key: [0; 3] }, r, 3, 1, vec![r as f64]).unwrap());
        assert!(out.iter().all(|o| *o == vec![vec![0.0], vec![1.0], vec![2.0]]));
        groups[2].abort("out of memory");
        for r in [0, 1] {
            let why = wait_for(&probes[r]).unwrap_or_else(|| panic!("rank {r} never saw rank 2 fail"));
            assert!(why.contains("rank 2 failed: out of memory"), "rank {r}: {why}");
        }
    }

    #[test]
    fn probes_see_a_rank_die_and_rank_0_vanish() {
        // Rank 1 exits without `bye`: rank 0's hub sees the connection close.
        let mut groups = local_groups(2, "probe");
        let probe = groups[0].failure_probe();
        drop(groups.pop());
        let why = wait_for(&probe).expect("rank 0 never saw rank 1 die");
        assert!(why.contains("rank 1 failed") && why.contains("exited or lost its connection"), "{why}");
        // A rank 0 that welcomes rank 1 and then dies: rank 1's probe sees the closed connection.
        let port = free_port().unwrap();
        let listener = TcpListener::bind(("127.0.0.1", port)).unwrap();
        let fake = std::thread::spawn(move || {
            let (s, _) = listener.accept().unwrap();
            let _ = read_msg(&mut &s).unwrap();
            write_msg(&s, &Msg::Welcome { payload: Vec::new(), hosts: vec!["a".into(), "b".into()] }).unwrap();
            std::thread::sleep(Duration::from_millis(200));
        });
        let g = ProcessGroup::rendezvous(1, 2, ("127.0.0.1", port), "x", Vec::new(), opts(10.0)).expect("join");
        let probe = g.failure_probe();
        fake.join().unwrap();
        let why = wait_for(&probe).expect("rank 1 never saw rank 0 vanish");
        assert!(why.contains("lost the connection to rank 0"), "{why}");
    }

    #[test]
    fn a_missing_rank_is_named_when_the_rendezvous_times_out() {
        let port = free_port().unwrap();
        let started = Instant::now();
        let out = on_threads(&[0, 1, 3], |r| ProcessGroup::rendezvous(r, 4, ("127.0.0.1", port), "same", Vec::new(), opts(1.5)).err().map(|e| e.to_string()));
        assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
        let e0 = out[0].as_ref().expect("rank 0 must fail");
        assert!(e0.contains("rank 2 of 4 did not show up") && e0.contains("joined: 0, 1, 3"), "{e0}");
        // The ranks that joined hear why, rather than timing out on their own.
        for e in &out[1..] {
            let e = e.as_ref().expect("must fail");
            assert!(e.contains("rank 0 refused the run") && e.contains("rank 2 of 4 did not show up"), "{e}");
        }
    }

    #[test]
    fn a_rank_without_rank_0_times_out_clearly() {
        let port = free_port().unwrap();
        let e = ProcessGroup::rendezvous(1, 2, ("127.0.0.1", port), "same", Vec::new(), opts(0.5)).err().expect("no rank 0").to_string();
        assert!(e.contains("rank 1 could not reach rank 0 at 127.0.0.1") && e.contains("within"), "{e}");
    }

    #[test]
    fn ranks_that_disagree_are_refused() {
        let port = free_port().unwrap();
        let out = on_threads(&[0, 1], |r| {
            let id = if r == 0 { "graph-a" } else { "graph-b" };
            ProcessGroup::rendezvous(r, 2, ("127.0.0.1", port), id, Vec::new(), opts(10.0)).err().map(|e| e.to_string())
        });
        for e in &out {
            let e = e.as_ref().expect("must fail");
            assert!(e.contains("rank 1") && e.contains("runs `graph-b`, rank 0 runs `graph-a`"), "{e}");
        }
        let port = free_port().unwrap();
        let out = on_threads(&[0, 1], |r| ProcessGroup::rendezvous(r, 2 + r, ("127.0.0.1", port), "id", Vec::new(), opts(10.0)).err().map(|e| e.to_string()));
        assert!(out[0].as_ref().is_some_and(|e| e.contains("has world size 3, rank 0 has 2")), "{out:?}");
        let port = free_port().unwrap();
        let out =
            on_threads(&[0, 1, 2], |r| ProcessGroup::rendezvous(r.min(1), 3, ("127.0.0.1", port), "id", Vec::new(), opts(10.0)).err().map(|e| e.to_string()));
        assert!(out[0].as_ref().is_some_and(|e| e.contains("rank 1 joined twice")), "{out:?}");
    }

    #[test]
    fn a_stray_connection_is_ignored() {
        let port = free_port().unwrap();
        let out = on_threads(&[0, 1, 99], |r| {
            if r == 99 {
                // Not a titan rank: connects, sends junk, leaves.
                std::thread::sleep(Duration::from_millis(100));
                if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
                    let _ = s.write_all(b"GET / HTTP/1.0\r\n\r\n");
                }
                return true;
            }
            std::thread::sleep(Duration::from_millis(if r == 1 { 400 } else { 0 }));
            ProcessGroup::rendezvous(r, 2, ("127.0.0.1", port), "id", Vec::new(), opts(10.0)).is_ok()
        });
        assert_eq!(out, [true, true, true]);
    }

    /// Ranks 0..3 meet; `rank` then dies (`die`) while the others call a collective, which must
    /// fail promptly naming it.
    fn others_fail_when(victim: usize, die: impl Fn(ProcessGroup) + Sync) {
        let groups = local_groups(3, "id");
        let started = Instant::now();
        let errors: Vec<Option<String>> = std::thread::scope(|s| {
            let hs: Vec<_> = groups
                .into_iter()
                .map(|g| {
                    let die = &die;
                    s.spawn(move || {
                        g.barrier().expect("first barrier");
                        if g.rank() == victim {
                            std::thread::sleep(Duration::from_millis(200));
                            die(g);
                            return None;
                        }
                        let r = g.rank();
                        let e = g.exchange(GroupKey { kind: WORLD, key: [0; 3] }, r, 3, 99, vec![1.0]).expect_err("must fail").to_string();
                        // The next call fails too, at once.
                        let again = g.barrier().expect_err("must fail").to_string();
                        Some(format!("{e} / {again}"))
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().expect("thread")).collect()
        });
        assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
        for e in errors.into_iter().flatten() {
            assert!(e.contains(&format!("rank {victim}")), "{e}");
        }
    }

    #[test]
    fn a_worker_that_dies_makes_the_others_fail() {
        // Dropping the group closes its connection without a bye, as a killed process does.
        others_fail_when(2, drop);
    }

    #[test]
    fn a_worker_that_fails_makes_the_others_fail_with_its_message() {
        others_fail_when(1, |g| g.abort("step 3: out of memory"));
    }

    #[test]
    fn rank_0_failing_makes_the_others_fail() {
        others_fail_when(0, |g| g.abort("step 2: loss is NaN"));
    }
}
