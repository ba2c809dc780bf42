//! Warp specialization, FA3's producer/consumer structure, as the attention kernels share it: a
//! CTA of three warpgroups where warpgroup 2 copies tiles into a ring of shared-memory stages
//! and warpgroups 0 and 1 compute on them, synchronized by `mbarrier`s only (no CTA-wide barrier
//! after the roles split, so the consumers drift apart and one's softmax overlaps the other's
//! `wgmma`), with `setmaxnreg` moving registers from the producer to the consumers.

use crate::attention::{Em, for_each, if_else, if_then, sw128_copy, sw128_slot};

/// Threads of a warpgroup.
const THREADS: i64 = 128;

/// Threads of a warp-specialized CTA: the two consumer warpgroups, then the producer warpgroup.
pub(crate) const WS_THREADS: i64 = 384;
/// Registers a thread launches with (384 x 168 fill the SM's 64K), then what `setmaxnreg` moves
/// each role to: 2 x 128 x 240 + 128 x 24 = 384 x 168.
pub(crate) const WS_LAUNCH_REGS: u32 = 168;
pub(crate) const WS_CONSUMER_REGS: u32 = 240;
pub(crate) const WS_PRODUCER_REGS: u32 = 24;

/// The ring of stages between the producer warpgroup and the two consumer warpgroups of a
/// warp-specialized pass: per slot a `full` `mbarrier` (128 producer arrivals) and an `empty`
/// one (256 consumer arrivals), 8 bytes each at `bars + 8 s` and `bars + 8 (n + s)`. Tile `f`
/// uses slot `f % n` in round `r = f / n`: consumers wait for `full`'s phase of parity `r & 1`,
/// the producer for `empty`'s of parity `(r & 1) ^ 1` (round 0 passes at once).
pub(crate) struct Ring {
    bars: String,
    pub(crate) n: i64,
}

impl Ring {
    /// Thread 0 initializes the barriers at byte `bar0` of `smem`; a CTA-wide barrier follows.
    pub(crate) fn new(e: &mut Em, smem: &str, bar0: i64, n: i64, tid: &str) -> Ring {
        let smem32 = e.smem_addr32(smem);
        let bars = e.addk(&smem32, bar0);
        let zero_i = e.i32c(0);
        let first = e.op(&format!("arith.cmpi eq, {tid}, {zero_i} : i32"));
        if_then(e, &first, |e| {
            for s in 0..n {
                let b = e.addk(&bars, 8 * s);
                e.mbar_init(&b, THREADS);
                let b = e.addk(&bars, 8 * (n + s));
                e.mbar_init(&b, 2 * THREADS);
            }
        });
        e.barrier();
        Ring { bars, n }
    }

    /// (slot, phase parity) of tile `f`.
    pub(crate) fn slot(&self, e: &mut Em, f: &str) -> (String, String) {
        let s = e.remk(f, self.n);
        let r = e.divk(f, self.n);
        let par = e.remk(&r, 2);
        (s, par)
    }

    pub(crate) fn bar(&self, e: &mut Em, s: &str, empty: bool) -> String {
        let o = e.mulk(s, 8);
        let b = e.addi(&self.bars, &o);
        if empty { e.addk(&b, 8 * self.n) } else { b }
    }

    /// The producer's loop over tiles `0..total`: `load(f)` issues tile f's `cp.async` copies
    /// into slot `f % n` (tile 0's group also holds whatever the caller issued before). Tile f's
    /// copies go out before tile f - 1's are waited for; a waited group is fenced for the async
    /// proxy (`wgmma` reads it) and published on its `full` barrier.
    pub(crate) fn produce(&self, e: &mut Em, total: &str, load: &dyn Fn(&mut Em, &str)) {
        let publish = |e: &mut Em, f: &str| {
            e.fence_proxy_async();
            let (s, _) = self.slot(e, f);
            let b = self.bar(e, &s, false);
            e.mbar_arrive(&b);
        };
        let zero_i = e.i32c(0);
        load(e, &zero_i);
        e.commit();
        let one = e.i32c(1);
        for_each(e, &one, total, |e, f| {
            let (s, par) = self.slot(e, f);
            let free = e.op(&format!("arith.xori {par}, {one} : i32"));
            let b = self.bar(e, &s, true);
            e.mbar_wait(&b, &free);
            load(e, f);
            e.commit();
            e.wait_group(1);
            let prev = e.addk(f, -1);
            publish(e, &prev);
        });
        e.wait_group(0);
        let last = e.addk(total, -1);
        publish(e, &last);
    }

    /// A consumer waits until tile `f` has landed; returns its slot.
    pub(crate) fn acquire(&self, e: &mut Em, f: &str) -> String {
        let (s, par) = self.slot(e, f);
        let b = self.bar(e, &s, false);
        e.mbar_wait(&b, &par);
        s
    }

    /// A consumer is done reading slot `s` (its `wgmma` chains waited for).
    pub(crate) fn release(&self, e: &mut Em, s: &str) {
        let b = self.bar(e, s, true);
        e.mbar_arrive(&b);
    }
}

/// A copying thread of a warp-specialized pass: its index in the copying warpgroup, its row
/// (`ptid / 8`) and 16-byte chunk (`ptid % 8`) of a copy, as in the single-warpgroup passes.
pub(crate) struct Copier {
    pub(crate) ptid: String,
    pub(crate) crow: String,
    pub(crate) cc864: String,
    pub(crate) s_off: String,
}

impl Copier {
    /// `cp.async` of `rows` rows (`grow` elements apart) of `src` from element `go` (the
    /// thread's row and chunk of the tile's first row) into the 128-byte-swizzled tile of `d`
    /// dims at shared element offset `base`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn copy(&self, e: &mut Em, smem: &str, src: &str, go: &str, grow: i64, rows: i64, d: i64, base: &str) {
        let g0 = e.gep(src, 1, go, "i64", "bf16");
        let so = e.addi(base, &self.s_off);
        let s0 = e.gep(smem, 3, &so, "i32", "bf16");
        for it in 0..rows * d / 8 / THREADS {
            let (gk, sk) = sw128_copy(it, rows, grow);
            let gk = e.i64c(gk);
            let gp = e.gep(&g0, 1, &gk, "i64", "bf16");
            let sp = e.gepk(&s0, 3, sk);
            e.cp_async16(&sp, &gp);
        }
    }
}

/// The warpgroups of a warp-specialized pass part ways: warpgroup 2 shrinks its registers and
/// runs `producer` with its [`Copier`], warpgroups 0 and 1 grow theirs and run `consumer` with
/// their index (i32).
pub(crate) fn ws_split(e: &mut Em, tid: &str, wgi: WgIndex, producer: impl FnOnce(&mut Em, &Copier), consumer: impl FnOnce(&mut Em, &str)) {
    ws_split_regs(e, tid, (WS_CONSUMER_REGS, WS_PRODUCER_REGS), wgi, producer, consumer);
}

/// How the computing warpgroups of a warp-specialized pass get their index (0 or 1). `tid /
/// 128` is the same in every lane of a warp, but ptxas cannot prove it, so the `wgmma`
/// descriptors derived from it live in vector registers and are moved to uniform ones (`R2UR`)
/// before every product; broadcasting it from lane 0 (`shfl.sync.idx`, the same value) tells
/// ptxas, and the descriptors stay uniform. `TITAN_WS_WGI=shfl` (or `tid`) at build time makes
/// every pass broadcast (or divide), for measuring (kernels/tests/ws_uniform_wgi.rs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WgIndex {
    /// `tid / 128`. The forward's choice: broadcasting took its key loop from 507 to 491 SASS
    /// instructions at the 8B shape, yet held at the power cap on an H100 it ran 0.6-1.0%
    /// slower (1,021 against 1,003-1,019 us a launch, session 31).
    Divided,
    /// `tid / 128` broadcast from lane 0. The backward's: 8B's dK/dV key loop 699 -> 618 SASS
    /// instructions, and held on an H100 (session 31) the backward 2.6% (8B shape, seq 8192)
    /// to 8.4% (head_dim 64, seq 8192) faster, 2-10% less energy a launch at seq 4096-8192
    /// (level at seq 2048).
    Broadcast,
}

impl WgIndex {
    /// The pass's choice, or the one `TITAN_WS_WGI` forces.
    fn chosen(self) -> WgIndex {
        match crate::switches::var(crate::switches::Switch::WsWgi).as_deref() {
            Some("shfl") => WgIndex::Broadcast,
            Some("tid") => WgIndex::Divided,
            _ => self,
        }
    }
}

/// [`ws_split`] with the (consumer, producer) register counts given: `2 x 128 x consumer + 128
/// x producer` must not exceed the `384 x 168` the CTA launched with.
pub(crate) fn ws_split_regs(
    e: &mut Em,
    tid: &str,
    (consumer_regs, producer_regs): (u32, u32),
    wgi_from: WgIndex,
    producer: impl FnOnce(&mut Em, &Copier),
    consumer: impl FnOnce(&mut Em, &str),
) {
    let wgi = e.divk(tid, THREADS);
    let two = e.i32c(2);
    let is_producer = e.op(&format!("arith.cmpi eq, {wgi}, {two} : i32"));
    if_else(
        e,
        &is_producer,
        |e| {
            e.setmaxnreg(false, producer_regs);
            let ptid = e.remk(tid, THREADS);
            let crow = e.divk(&ptid, 8);
            let cch = e.remk(&ptid, 8);
            let cc8 = e.mulk(&cch, 8);
            let s_off = sw128_slot(e, &crow, &cch);
            let cc864 = e.ext64(&cc8);
            producer(e, &Copier { ptid, crow, cc864, s_off });
        },
        |e| {
            e.setmaxnreg(true, consumer_regs);
            let wgi = if wgi_from.chosen() == WgIndex::Broadcast {
                let z = e.i32c(0);
                let w = e.i32c(32);
                let r = e.fresh();
                let ok = e.fresh();
                e.line(&format!("{r}, {ok} = gpu.shuffle idx {wgi}, {z}, {w} : i32"));
                r
            } else {
                wgi
            };
            consumer(e, &wgi);
        },
    );
}
