//! Parameter initialization from the IR's `init` attributes, deterministic per (seed, name):
//! the same parameter gets the same values whatever else the model contains.
//!
//! Every parameter (every layer of a stacked one) is cut into chunks of [`CHUNK_ELEMS`]
//! elements; chunk `c` of the layer with checkpoint name `name` is drawn from its own ChaCha8
//! stream (key from `(seed, name)`, stream number `c`). The values therefore depend on neither
//! the number of threads nor the order in which chunks run, and the chunks of a large model are
//! drawn in parallel ([`init_values`] on [`init_threads`] threads, or [`fill_chunk`] driven by a
//! backend that encodes and uploads each chunk as soon as it is drawn).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use titan_ir::Init;

/// Elements per independently seeded chunk (4 MiB of f32). Changing it changes every value.
pub const CHUNK_ELEMS: usize = 1 << 20;

/// Rejections in a row after which a truncated normal is deemed unusable.
const MAX_TRIES: u32 = 1000;

/// Why a parameter cannot be initialized.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum InitError {
    #[error("bad {what} std {std}: {message}")]
    BadStd { what: &'static str, std: f64, message: String },
    #[error("trunc_normal bounds must satisfy lo < hi, found [{lo}, {hi}]")]
    BadBounds { lo: f64, hi: f64 },
    #[error("trunc_normal({std}, {lo}, {hi}) rejects almost every sample; widen the bounds")]
    Rejects { std: f64, lo: f64, hi: f64 },
    #[error("a compute copy is the cast of its master weight, not drawn; initialize the master and cast it")]
    ComputeCopy,
}

/// FNV-1a of the parameter name, mixed with the run seed.
fn seed_for(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// The threads initialization runs on: `TITAN_INIT_THREADS` when set to a positive number,
/// else [`std::thread::available_parallelism`].
pub fn init_threads() -> usize {
    if let Some(n) = std::env::var("TITAN_INIT_THREADS").ok().and_then(|s| s.trim().parse::<usize>().ok()).filter(|&n| n > 0) {
        return n;
    }
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Chunks of a layer of `per_layer` elements (at least one, so an empty layer still validates).
pub fn chunks_per_layer(per_layer: usize) -> usize {
    per_layer.div_ceil(CHUNK_ELEMS).max(1)
}

/// The distribution of layer `layer`, with the initializer's arguments checked.
fn normal_of(init: Init, layer: usize) -> Result<Option<Normal<f64>>, InitError> {
    match init {
        Init::Zeros | Init::Ones => Ok(None),
        Init::ComputeCopy => Err(InitError::ComputeCopy),
        Init::Normal { std } => Normal::new(0.0, std).map(Some).map_err(|e| InitError::BadStd { what: "normal", std, message: e.to_string() }),
        Init::TruncNormal { std, lo, hi, depth_scaled } => {
            if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
                return Err(InitError::BadBounds { lo, hi });
            }
            let std = if depth_scaled { std / (2.0 * (layer as f64 + 1.0)).sqrt() } else { std };
            Normal::new(0.0, std).map(Some).map_err(|e| InitError::BadStd { what: "trunc_normal", std, message: e.to_string() })
        }
    }
}

/// Check `init`'s arguments once (for any layer) before chunks are handed to threads.
pub fn check_init(init: Init) -> Result<(), InitError> {
    normal_of(init, 0).map(|_| ())
}

/// Fill `out` (at most [`CHUNK_ELEMS`] elements) with chunk `chunk` of layer `layer` of a
/// parameter whose layer has checkpoint name `name`. Truncated normals resample out-of-bounds
/// draws; depth scaling divides the std by `sqrt(2 (layer + 1))`.
pub fn fill_chunk(init: Init, layer: usize, seed: u64, name: &str, chunk: usize, out: &mut [f32]) -> Result<(), InitError> {
    fill_seeded(init, layer, seed_for(seed, name), chunk, out)
}

fn fill_seeded(init: Init, layer: usize, layer_seed: u64, chunk: usize, out: &mut [f32]) -> Result<(), InitError> {
    debug_assert!(out.len() <= CHUNK_ELEMS);
    match init {
        Init::Zeros => out.fill(0.0),
        Init::Ones => out.fill(1.0),
        Init::ComputeCopy => return Err(InitError::ComputeCopy),
        Init::Normal { .. } | Init::TruncNormal { .. } => {
            let Some(d) = normal_of(init, layer)? else { return Ok(()) };
            let mut rng = ChaCha8Rng::seed_from_u64(layer_seed);
            rng.set_stream(chunk as u64);
            match init {
                Init::TruncNormal { lo, hi, .. } => {
                    for x in out.iter_mut() {
                        let mut v = d.sample(&mut rng);
                        let mut tries = 0;
                        while !(lo..=hi).contains(&v) {
                            tries += 1;
                            if tries > MAX_TRIES {
                                return Err(InitError::Rejects { std: d.std_dev(), lo, hi });
                            }
                            v = d.sample(&mut rng);
                        }
                        *x = v as f32;
                    }
                }
                _ => out.iter_mut().for_each(|x| *x = d.sample(&mut rng) as f32),
            }
        }
    }
    Ok(())
}

/// Fill `n` values per layer for `layers` layers (1 for an unstacked parameter), on
/// [`init_threads`] threads. `name_of(l)` is the checkpoint name of layer `l`.
pub fn init_values(init: Init, layers: usize, per_layer: usize, seed: u64, name_of: &dyn Fn(usize) -> String) -> Result<Vec<f32>, InitError> {
    init_values_with(init, layers, per_layer, seed, name_of, init_threads())
}

/// [`init_values`] on exactly `threads` threads (the values do not depend on it).
pub fn init_values_with(
    init: Init,
    layers: usize,
    per_layer: usize,
    seed: u64,
    name_of: &dyn Fn(usize) -> String,
    threads: usize,
) -> Result<Vec<f32>, InitError> {
    check_init(init)?;
    match init {
        Init::Zeros => return Ok(vec![0.0; layers * per_layer]),
        Init::Ones => return Ok(vec![1.0; layers * per_layer]),
        _ => {}
    }
    let seeds: Vec<u64> = (0..layers).map(|l| seed_for(seed, &name_of(l))).collect();
    let mut out = vec![0.0f32; layers * per_layer];
    // One task per chunk: (layer, chunk index, its slice of `out`).
    let mut tasks: Vec<(usize, usize, &mut [f32])> = Vec::new();
    if per_layer > 0 {
        for (l, layer) in out.chunks_mut(per_layer).enumerate() {
            for (c, part) in layer.chunks_mut(CHUNK_ELEMS).enumerate() {
                tasks.push((l, c, part));
            }
        }
    }
    let threads = threads.clamp(1, tasks.len().max(1));
    if threads == 1 {
        for (l, c, part) in tasks {
            fill_seeded(init, l, seeds[l], c, part)?;
        }
        return Ok(out);
    }
    // Round-robin the chunks over the threads (they cost about the same).
    let mut buckets: Vec<Vec<(usize, usize, &mut [f32])>> = (0..threads).map(|_| Vec::new()).collect();
    for (i, t) in tasks.into_iter().enumerate() {
        buckets[i % threads].push(t);
    }
    let seeds = &seeds;
    let results: Vec<Result<(), InitError>> = std::thread::scope(|s| {
        let handles: Vec<_> = buckets
            .into_iter()
            .map(|bucket| s.spawn(move || bucket.into_iter().try_for_each(|(l, c, part)| fill_seeded(init, l, seeds[l], c, part))))
            .collect();
        handles.into_iter().map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p))).collect()
    });
    results.into_iter().collect::<Result<(), InitError>>()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(l: usize) -> String {
        format!("layers.{l}.w")
    }

    #[test]
    fn values_do_not_depend_on_the_thread_count() {
        let init = Init::TruncNormal { std: 0.02, lo: -0.04, hi: 0.04, depth_scaled: true };
        // Two layers of 2.5 chunks each: full and partial chunks, several per thread.
        let per_layer = 2 * CHUNK_ELEMS + CHUNK_ELEMS / 2;
        let one = init_values_with(init, 2, per_layer, 7, &name, 1).expect("1 thread");
        for threads in [2, 3, 8] {
            let many = init_values_with(init, 2, per_layer, 7, &name, threads).expect("n threads");
            assert!(one.iter().zip(&many).all(|(a, b)| a.to_bits() == b.to_bits()), "{threads} threads differ");
        }
        assert_eq!(one.len(), 2 * per_layer);
        assert!(one.iter().all(|x| (-0.04..=0.04).contains(&(*x as f64))));
        // Chunks are different streams, and layer 1 is depth-scaled below layer 0.
        assert_ne!(one[..16], one[CHUNK_ELEMS..CHUNK_ELEMS + 16]);
        let rms = |xs: &[f32]| (xs.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / xs.len() as f64).sqrt();
        assert!(rms(&one[per_layer..]) < rms(&one[..per_layer]));
    }

    #[test]
    fn chunks_match_the_whole_parameter() {
        let init = Init::Normal { std: 1.0 };
        let per_layer = CHUNK_ELEMS + 10;
        let all = init_values_with(init, 2, per_layer, 3, &name, 4).expect("init");
        let mut tail = vec![0.0; 10];
        fill_chunk(init, 1, 3, &name(1), 1, &mut tail).expect("chunk");
        assert_eq!(&all[2 * per_layer - 10..], &tail[..]);
        // The same name and seed give the same values whatever the layer count.
        let single = init_values_with(init, 1, per_layer, 3, &name, 2).expect("init");
        assert_eq!(&all[..per_layer], &single[..]);
    }

    #[test]
    fn constant_and_invalid_inits() {
        assert_eq!(init_values_with(Init::Zeros, 2, 3, 0, &name, 4).expect("zeros"), vec![0.0; 6]);
        assert_eq!(init_values_with(Init::Ones, 1, 3, 0, &name, 4).expect("ones"), vec![1.0; 3]);
        let e = init_values_with(Init::TruncNormal { std: 1.0, lo: 1.0, hi: -1.0, depth_scaled: false }, 1, 3, 0, &name, 1);
        assert_eq!(e, Err(InitError::BadBounds { lo: 1.0, hi: -1.0 }));
        let e = init_values_with(Init::TruncNormal { std: 1.0, lo: 50.0, hi: 51.0, depth_scaled: false }, 1, 3, 0, &name, 1);
        assert!(matches!(e, Err(InitError::Rejects { .. })), "{e:?}");
        assert!(init_values_with(Init::Normal { std: f64::NAN }, 1, 3, 0, &name, 1).is_err());
        assert_eq!(init_values_with(Init::Normal { std: 1.0 }, 3, 0, 0, &name, 4).expect("empty"), Vec::<f32>::new());
    }

    /// User + system CPU seconds of this process so far (Linux; 0 elsewhere).
    fn cpu_seconds() -> f64 {
        let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
        let Some(rest) = stat.rsplit(')').next() else { return 0.0 };
        let f: Vec<f64> = rest.split_whitespace().skip(11).take(2).filter_map(|x| x.parse().ok()).collect();
        f.iter().sum::<f64>() / 100.0
    }

    /// Host time to draw the parameters of Llama-3 8B dims x 4 layers (1.92 B values) on 1
    /// and `init_threads()` threads, two ways: `init_values` (the CPU backends: one vector per
    /// parameter) and chunk by chunk into a reused buffer encoded as f32 (what the CUDA backend
    /// does before each upload). `TITAN_INIT_BENCH=1 cargo test -p titan-runtime --lib
    /// init_bench -- --nocapture`; without the variable it draws 1/64 of them.
    #[test]
    fn init_bench() {
        let (d, kv, ffn, vocab, layers) = (4096usize, 1024usize, 14336usize, 128256usize, 4usize);
        let full = std::env::var("TITAN_INIT_BENCH").is_ok_and(|v| v == "1");
        let scale = if full { 1 } else { 64 };
        // (per-layer elements, layers): embedding, output, attention and MLP weights per layer.
        let params = [(vocab * d, 1), (vocab * d, 1), (2 * d * d + 2 * d * kv, layers), (3 * d * ffn, layers)];
        let init = Init::TruncNormal { std: 0.02, lo: -0.04, hi: 0.04, depth_scaled: true };
        let total: usize = params.iter().map(|(n, l)| n / scale * l).sum();
        let report = |what: &str, threads: usize, f: &dyn Fn() -> f64| -> f64 {
            let (start, cpu) = (std::time::Instant::now(), cpu_seconds());
            let check = f();
            let (s, c) = (start.elapsed().as_secs_f64(), cpu_seconds() - cpu);
            eprintln!(
                "init_bench: {what}, {total} values, {threads} thread(s): {s:.2} s wall, {c:.2} s cpu ({:.2} ns/value wall) [{check:.4}]",
                1e9 * s / total as f64
            );
            s
        };
        for threads in [1, init_threads().max(2)] {
            let whole = report("init_values", threads, &|| {
                let mut sum = 0.0f64;
                for (i, &(n, l)) in params.iter().enumerate() {
                    let v = init_values_with(init, l, n / scale, 0, &|k| format!("p{i}.{k}"), threads).expect("init");
                    sum += f64::from(v[v.len() / 2]);
                }
                sum
            });
            let chunked = report("chunks encoded as f32", threads, &|| {
                let jobs: Vec<(usize, usize, usize, usize)> = params
                    .iter()
                    .enumerate()
                    .flat_map(|(i, &(n, l))| {
                        let n = n / scale;
                        (0..l).flat_map(move |k| (0..chunks_per_layer(n)).map(move |c| (i, k, c, CHUNK_ELEMS.min(n - (c * CHUNK_ELEMS).min(n)))))
                    })
                    .collect();
                let next = std::sync::atomic::AtomicUsize::new(0);
                let sums: Vec<f64> = std::thread::scope(|s| {
                    let hs: Vec<_> = (0..threads)
                        .map(|_| {
                            s.spawn(|| {
                                let (mut scratch, mut bytes, mut sum) = (vec![0.0f32; CHUNK_ELEMS], vec![0u8; 4 * CHUNK_ELEMS], 0.0);
                                while let Some(&(i, k, c, n)) = jobs.get(next.fetch_add(1, std::sync::atomic::Ordering::Relaxed)) {
                                    fill_chunk(init, k, 0, &format!("p{i}.{k}"), c, &mut scratch[..n]).expect("chunk");
                                    crate::backend::codec::encode_floats(&scratch[..n], titan_ir::DType::F32, &mut bytes[..4 * n]).expect("encode");
                                    sum += f64::from(bytes[0]);
                                }
                                sum
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().expect("worker")).collect()
                });
                sums.iter().sum()
            });
            eprintln!("init_bench: {threads} thread(s): init_values {whole:.2} s, chunks {chunked:.2} s");
        }
    }
}
