//! `ParallelDims`, as TorchTitan defines them: `dp_replicate`, `dp_shard`, `cp`, `tp`, `pp`,
//! `ep`, with `world_size = dp_replicate * dp_shard * cp * tp * pp`, `dp_shard = -1` meaning
//! "whatever is left of the world", and `ep` borrowing ranks of `dp_shard * cp * tp`.
//!
//! Three layers of checks, each a hard error that says what to change:
//! 1. [`ParallelDims::resolve`]: the degrees among themselves and against the world size;
//! 2. [`ParallelDims::check_model`]: the degrees against the model (`seq_len % (tp * 2 * cp)`,
//!    heads, ffn and vocab divisible by `tp`, `tp` dividing the kv heads or a multiple of them);
//! 3. [`ParallelDims::require_built`]: degrees whose parallelism titan does not build yet (cp,
//!    pp, ep) are rejected as "not supported yet" rather than ignored.

use std::fmt;

use titan_ir::Graph;
use titan_ir::artifact::MeshDim;

/// The degrees as requested (command line over job config); `None` where nobody said.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ParallelRequest {
    pub dp_replicate: Option<i64>,
    /// `-1` fills the rest of the world.
    pub dp_shard: Option<i64>,
    pub cp: Option<i64>,
    pub tp: Option<i64>,
    pub pp: Option<i64>,
    pub ep: Option<i64>,
    pub world_size: Option<i64>,
    /// TorchTitan's `disable_loss_parallel`: all-gather the vocab-parallel logits and compute the
    /// cross-entropy whole on every tp rank (instead of the per-token statistics exchange).
    pub disable_loss_parallel: Option<bool>,
    /// titan's `disable_prefetch_next_layer` (no TorchTitan equivalent: FSDP2 prefetches the
    /// next layer implicitly): gather each layer's weight shards at the top of that layer
    /// instead of during the previous one (the `prefetch-next-layer` pass is a no-op).
    pub disable_prefetch_next_layer: Option<bool>,
}

impl ParallelRequest {
    /// `self`'s values where set, `base`'s elsewhere (flags over the job config).
    pub fn over(self, base: ParallelRequest) -> ParallelRequest {
        ParallelRequest {
            dp_replicate: self.dp_replicate.or(base.dp_replicate),
            dp_shard: self.dp_shard.or(base.dp_shard),
            cp: self.cp.or(base.cp),
            tp: self.tp.or(base.tp),
            pp: self.pp.or(base.pp),
            ep: self.ep.or(base.ep),
            world_size: self.world_size.or(base.world_size),
            disable_loss_parallel: self.disable_loss_parallel.or(base.disable_loss_parallel),
            disable_prefetch_next_layer: self.disable_prefetch_next_layer.or(base.disable_prefetch_next_layer),
        }
    }
}

/// Resolved degrees; every one >= 1 and their product (without `ep`) is the world size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ParallelDims {
    pub dp_replicate: u32,
    pub dp_shard: u32,
    pub cp: u32,
    pub tp: u32,
    pub pp: u32,
    pub ep: u32,
    pub world_size: u32,
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ParallelError {
    #[error("invalid parallel config: {0}")]
    Invalid(String),
    #[error("{0} is not supported yet; {1}")]
    Unsupported(String, String),
}

fn divisors(n: u64) -> String {
    let ds: Vec<String> = (1..=n).filter(|d| n.is_multiple_of(*d)).map(|d| d.to_string()).collect();
    if ds.len() > 12 {
        let head = ds[..10].join(", ");
        return format!("{{{head}, ...}}");
    }
    format!("{{{}}}", ds.join(", "))
}

fn degree(name: &str, v: Option<i64>) -> Result<u32, ParallelError> {
    match v {
        None => Ok(1),
        Some(d) if d >= 1 && d <= i64::from(u32::MAX) => Ok(d as u32),
        Some(d) => Err(ParallelError::Invalid(format!("{name} must be a degree >= 1, found {d}"))),
    }
}

impl ParallelDims {
    /// One device, no parallelism.
    pub fn single() -> ParallelDims {
        ParallelDims { dp_replicate: 1, dp_shard: 1, cp: 1, tp: 1, pp: 1, ep: 1, world_size: 1 }
    }

    /// Resolve `dp_shard = -1` and check the degrees against each other and the world size.
    /// Without a world size, the world is the product of the given degrees (`dp_shard = -1`
    /// then means 1).
    pub fn resolve(r: &ParallelRequest) -> Result<ParallelDims, ParallelError> {
        let dp_replicate = degree("dp_replicate", r.dp_replicate)?;
        let cp = degree("cp", r.cp)?;
        let tp = degree("tp", r.tp)?;
        let pp = degree("pp", r.pp)?;
        let ep = degree("ep", r.ep)?;
        let fixed = u64::from(dp_replicate) * u64::from(cp) * u64::from(tp) * u64::from(pp);
        let world = match r.world_size {
            None => None,
            Some(w) if w >= 1 && w <= i64::from(u32::MAX) => Some(w as u64),
            Some(w) => return Err(ParallelError::Invalid(format!("world size must be >= 1, found {w}"))),
        };
        let dp_shard: u64 = match r.dp_shard {
            None | Some(-1) => match world {
                None => 1,
                Some(w) => {
                    if w % fixed != 0 {
                        return Err(ParallelError::Invalid(format!(
                            "world size {w} is not divisible by dp_replicate*cp*tp*pp = {dp_replicate}*{cp}*{tp}*{pp} = {fixed}, so dp_shard = -1 cannot fill it; choose a world size that is a multiple of {fixed} or change the degrees"
                        )));
                    }
                    w / fixed
                }
            },
            Some(d) if d >= 1 => d as u64,
            Some(d) => return Err(ParallelError::Invalid(format!("dp_shard must be -1 (fill the rest of the world) or a degree >= 1, found {d}"))),
        };
        let product = fixed * dp_shard;
        let world = world.unwrap_or(product);
        if product != world {
            return Err(ParallelError::Invalid(format!(
                "dp_replicate*dp_shard*cp*tp*pp = {dp_replicate}*{dp_shard}*{cp}*{tp}*{pp} = {product} does not match world size {world}; set dp_shard to -1 to fill the world, or change the degrees or the world size"
            )));
        }
        let world_size = u32::try_from(world).map_err(|_| ParallelError::Invalid(format!("world size {world} is too large")))?;
        let dp_shard = dp_shard as u32;
        // ep borrows ranks from dp_shard * cp * tp (TorchTitan's expert parallel mesh).
        let borrow = u64::from(dp_shard) * u64::from(cp) * u64::from(tp);
        if borrow % u64::from(ep) != 0 {
            return Err(ParallelError::Invalid(format!(
                "ep={ep} does not divide dp_shard*cp*tp = {dp_shard}*{cp}*{tp} = {borrow} (expert parallelism reuses those ranks); choose ep in {}",
                divisors(borrow)
            )));
        }
        Ok(ParallelDims { dp_replicate, dp_shard, cp, tp, pp, ep, world_size })
    }

    /// Check the degrees against the model's dimensions (from the graph's `meta`).
    pub fn check_model(&self, model: &Graph) -> Result<(), ParallelError> {
        let get = |k: &str| -> Result<u64, ParallelError> {
            model
                .meta_i64(k)
                .filter(|&v| v > 0)
                .map(|v| v as u64)
                .ok_or_else(|| ParallelError::Invalid(format!("the model has no `{k}` in its meta; generate it with `titanc new`")))
        };
        let seq = model.dims.get("seq").copied().map_or_else(|| get("seq_len"), Ok)?;
        let (tp, cp) = (u64::from(self.tp), u64::from(self.cp));
        let n_heads = get("n_heads")?;
        if n_heads % tp != 0 {
            return Err(ParallelError::Invalid(format!("tp={tp} does not divide n_heads={n_heads}; choose tp in {}", divisors(n_heads))));
        }
        // kv heads: whole heads per rank (tp divides them) or kv-head replication, each kv
        // head shared by tp / n_kv_heads ranks (n_kv_heads divides tp; `shard-tp`).
        let n_kv = get("n_kv_heads")?;
        if n_kv % tp != 0 && tp % n_kv != 0 {
            let ok: Vec<String> = (1..=n_heads).filter(|t| n_heads % t == 0 && (n_kv % t == 0 || t % n_kv == 0)).map(|t| t.to_string()).collect();
            return Err(ParallelError::Invalid(format!(
                "tp={tp} neither divides n_kv_heads={n_kv} nor is a multiple of it (each rank needs whole kv heads, or one kv head shared by tp/n_kv_heads ranks); choose tp in {{{}}}",
                ok.join(", ")
            )));
        }
        for key in ["ffn_dim", "vocab_size"] {
            let n = get(key)?;
            if n % tp != 0 {
                return Err(ParallelError::Invalid(format!("tp={tp} does not divide {key}={n}; choose tp in {}", divisors(n))));
            }
        }
        let need = tp * 2 * cp;
        if need > 1 && (self.tp > 1 || self.cp > 1) && seq % need != 0 {
            return Err(ParallelError::Invalid(format!(
                "seq_len={seq} is not divisible by tp*2*cp = {tp}*2*{cp} = {need} (sequence parallelism splits the sequence over tp and context parallelism into 2*cp chunks); choose a seq_len that is a multiple of {need} or smaller degrees"
            )));
        }
        Ok(())
    }

    /// Reject degrees whose parallelism is not built yet: data parallelism (DDP/FSDP/HSDP) and
    /// TP build into SPMD artifacts; context, pipeline and expert parallelism do not yet.
    pub fn require_built(&self) -> Result<(), ParallelError> {
        let checks = [(self.cp, "context parallelism", "cp"), (self.pp, "pipeline parallelism", "pp"), (self.ep, "expert parallelism", "ep")];
        for (d, what, name) in checks {
            if d > 1 {
                return Err(ParallelError::Unsupported(
                    format!("{what} ({name}={d})"),
                    format!("titan builds meshes of dp_replicate, dp_shard and tp today; set {name} to 1"),
                ));
            }
        }
        Ok(())
    }

    /// The device mesh of an SPMD training graph (`titanc lower --to train`): data parallelism,
    /// FSDP/HSDP and TP are partitioned; cp, pp and ep are not yet.
    pub fn spmd_mesh(&self) -> Result<titan_ir::Mesh, ParallelError> {
        for (d, what, name) in [(self.cp, "context parallelism", "cp"), (self.pp, "pipeline parallelism", "pp"), (self.ep, "expert parallelism", "ep")] {
            if d > 1 {
                return Err(ParallelError::Unsupported(
                    format!("{what} ({name}={d})"),
                    format!("the partitioning passes handle dp_replicate, dp_shard and tp; set {name} to 1"),
                ));
            }
        }
        Ok(titan_ir::Mesh::new(self.dp_replicate, self.dp_shard, self.tp))
    }

    /// The mesh dimensions of more than one rank, outermost first (TorchTitan order:
    /// pp, dp_replicate, dp_shard, cp, tp).
    pub fn mesh_dims(&self) -> Vec<MeshDim> {
        [("pp", self.pp), ("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard), ("cp", self.cp), ("tp", self.tp)]
            .into_iter()
            .filter(|(_, d)| *d > 1)
            .map(|(n, d)| MeshDim { name: n.to_string(), size: d })
            .collect()
    }
}

impl fmt::Display for ParallelDims {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "world {} = dp_replicate {} x dp_shard {} x cp {} x tp {} x pp {} (ep {})",
            self.world_size, self.dp_replicate, self.dp_shard, self.cp, self.tp, self.pp, self.ep
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(dp_replicate: i64, dp_shard: i64, cp: i64, tp: i64, pp: i64, ep: i64, world: Option<i64>) -> ParallelRequest {
        ParallelRequest {
            dp_replicate: Some(dp_replicate),
            dp_shard: Some(dp_shard),
            cp: Some(cp),
            tp: Some(tp),
            pp: Some(pp),
            ep: Some(ep),
            world_size: world,
            disable_loss_parallel: None,
            disable_prefetch_next_layer: None,
        }
    }

    fn err(r: ParallelRequest) -> String {
        ParallelDims::resolve(&r).expect_err("must fail").to_string()
    }

    #[test]
    fn dp_shard_minus_one_fills_the_world() {
        let d = ParallelDims::resolve(&req(2, -1, 1, 4, 1, 1, Some(32))).unwrap();
        assert_eq!((d.dp_replicate, d.dp_shard, d.tp, d.world_size), (2, 4, 4, 32));
        assert_eq!(d.mesh_dims().iter().map(|m| (m.name.as_str(), m.size)).collect::<Vec<_>>(), vec![("dp_replicate", 2), ("dp_shard", 4), ("tp", 4)]);
        assert_eq!(d.to_string(), "world 32 = dp_replicate 2 x dp_shard 4 x cp 1 x tp 4 x pp 1 (ep 1)");
        // No world size: the product of the given degrees, dp_shard -1 meaning 1.
        let d = ParallelDims::resolve(&ParallelRequest { tp: Some(8), dp_shard: Some(-1), ..Default::default() }).unwrap();
        assert_eq!((d.dp_shard, d.world_size), (1, 8));
        assert_eq!(ParallelDims::resolve(&ParallelRequest::default()).unwrap(), ParallelDims::single());
    }

    #[test]
    fn every_invalid_degree_config_says_what_to_change() {
        assert_eq!(err(req(1, 1, 1, 0, 1, 1, None)), "invalid parallel config: tp must be a degree >= 1, found 0");
        assert_eq!(err(req(-1, 1, 1, 1, 1, 1, None)), "invalid parallel config: dp_replicate must be a degree >= 1, found -1");
        assert_eq!(err(req(1, -2, 1, 1, 1, 1, None)), "invalid parallel config: dp_shard must be -1 (fill the rest of the world) or a degree >= 1, found -2");
        assert_eq!(err(req(1, 1, 1, 1, 1, 1, Some(0))), "invalid parallel config: world size must be >= 1, found 0");
        assert!(err(req(2, -1, 1, 4, 1, 1, Some(30))).contains("world size 30 is not divisible by dp_replicate*cp*tp*pp = 2*1*4*1 = 8"));
        assert_eq!(
            err(req(2, 4, 1, 2, 1, 1, Some(32))),
            "invalid parallel config: dp_replicate*dp_shard*cp*tp*pp = 2*4*1*2*1 = 16 does not match world size 32; set dp_shard to -1 to fill the world, or change the degrees or the world size"
        );
        assert!(
            err(req(1, 2, 1, 2, 1, 3, None))
                .contains("ep=3 does not divide dp_shard*cp*tp = 2*1*2 = 4 (expert parallelism reuses those ranks); choose ep in {1, 2, 4}")
        );
    }

    fn model(seq: u64) -> Graph {
        let mut cfg = crate::LlamaConfig::preset(crate::Preset::B8);
        cfg.n_layers = 1;
        cfg.seq_len = seq;
        crate::build_llama3(&cfg, "m").unwrap()
    }

    #[test]
    fn model_checks_name_the_dimension_and_the_choices() {
        let g = model(8192);
        let dims = |tp: i64, cp: i64| ParallelDims::resolve(&ParallelRequest { tp: Some(tp), cp: Some(cp), ..Default::default() }).unwrap();
        dims(8, 1).check_model(&g).unwrap();
        dims(4, 2).check_model(&g).unwrap();
        assert_eq!(
            dims(3, 1).check_model(&g).unwrap_err().to_string(),
            "invalid parallel config: tp=3 does not divide n_heads=32; choose tp in {1, 2, 4, 8, 16, 32}"
        );
        // tp = 16 > n_kv_heads = 8: kv-head replication, two ranks per kv head.
        dims(16, 1).check_model(&g).unwrap();
        let mut cfg = crate::LlamaConfig::preset(crate::Preset::B8);
        cfg.n_layers = 1;
        cfg.n_heads = 48;
        cfg.dim = 6144;
        let g48 = crate::build_llama3(&cfg, "m").unwrap();
        assert_eq!(
            dims(12, 1).check_model(&g48).unwrap_err().to_string(),
            "invalid parallel config: tp=12 neither divides n_kv_heads=8 nor is a multiple of it (each rank needs whole kv heads, or one kv head shared by tp/n_kv_heads ranks); choose tp in {1, 2, 4, 8, 16, 24, 48}"
        );
        let odd = model(8196);
        assert!(dims(8, 1).check_model(&odd).unwrap_err().to_string().contains("seq_len=8196 is not divisible by tp*2*cp = 8*2*1 = 16"));
        // ffn and vocab: a custom model whose ffn is not a multiple of tp.
        let mut cfg = crate::LlamaConfig::preset(crate::Preset::Debug);
        cfg.n_heads = 4;
        cfg.n_kv_heads = 4;
        cfg.ffn_dim = 190;
        let g = crate::build_llama3(&cfg, "m").unwrap();
        assert!(dims(4, 1).check_model(&g).unwrap_err().to_string().contains("tp=4 does not divide ffn_dim=190; choose tp in {1, 2, 5, 10, 19, 38, 95, 190}"));
        cfg.ffn_dim = 192;
        cfg.vocab_size = 258;
        let g = crate::build_llama3(&cfg, "m").unwrap();
        assert!(dims(4, 1).check_model(&g).unwrap_err().to_string().contains("tp=4 does not divide vocab_size=258"));
    }

    #[test]
    fn unbuilt_parallelism_is_rejected_not_ignored() {
        ParallelDims::single().require_built().unwrap();
        let cases = [
            (
                req(1, 1, 2, 1, 1, 1, None),
                "context parallelism (cp=2) is not supported yet; titan builds meshes of dp_replicate, dp_shard and tp today; set cp to 1",
            ),
            (req(1, 1, 1, 1, 2, 1, None), "pipeline parallelism (pp=2) is not supported yet"),
            (req(1, 2, 1, 1, 1, 2, None), "expert parallelism (ep=2) is not supported yet"),
        ];
        for (r, want) in cases {
            let got = ParallelDims::resolve(&r).unwrap().require_built().unwrap_err().to_string();
            assert!(got.contains(want), "{got}");
        }
        // Data parallelism and TP are built (SPMD artifacts).
        for r in [req(1, 1, 1, 4, 1, 1, None), req(1, 4, 1, 1, 1, 1, None), req(2, 1, 1, 1, 1, 1, None), req(2, 2, 1, 2, 1, 1, None)] {
            ParallelDims::resolve(&r).unwrap().require_built().unwrap();
        }
    }
}
