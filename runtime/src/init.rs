//! Parameter initialization from the IR's `init` attributes, deterministic per (seed, name):
//! the same parameter gets the same values whatever else the model contains.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use titan_ir::Init;

/// FNV-1a of the parameter name, mixed with the run seed.
fn seed_for(seed: u64, name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// Fill `n` values per layer for `layers` layers (1 for an unstacked parameter).
/// `name_of(l)` is the checkpoint name of layer `l`.
pub fn init_values(init: Init, layers: usize, per_layer: usize, seed: u64, name_of: &dyn Fn(usize) -> String) -> Result<Vec<f32>, String> {
    let mut out = Vec::with_capacity(layers * per_layer);
    for l in 0..layers {
        let mut rng = ChaCha8Rng::seed_from_u64(seed_for(seed, &name_of(l)));
        match init {
            Init::Zeros => out.extend(std::iter::repeat_n(0.0, per_layer)),
            Init::Ones => out.extend(std::iter::repeat_n(1.0, per_layer)),
            Init::Normal { std } => {
                let d = Normal::new(0.0, std).map_err(|e| format!("bad normal std {std}: {e}"))?;
                out.extend((0..per_layer).map(|_| d.sample(&mut rng) as f32));
            }
            Init::TruncNormal { std, lo, hi, depth_scaled } => {
                if lo.partial_cmp(&hi) != Some(std::cmp::Ordering::Less) {
                    return Err(format!("trunc_normal bounds must satisfy lo < hi, found [{lo}, {hi}]"));
                }
                let std = if depth_scaled { std / (2.0 * (l as f64 + 1.0)).sqrt() } else { std };
                let d = Normal::new(0.0, std).map_err(|e| format!("bad trunc_normal std {std}: {e}"))?;
                for _ in 0..per_layer {
                    let mut x = d.sample(&mut rng);
                    let mut tries = 0;
                    while !(lo..=hi).contains(&x) {
                        tries += 1;
                        if tries > 1000 {
                            return Err(format!("trunc_normal({std}, {lo}, {hi}) rejects almost every sample; widen the bounds"));
                        }
                        x = d.sample(&mut rng);
                    }
                    out.push(x as f32);
                }
            }
        }
    }
    Ok(out)
}
