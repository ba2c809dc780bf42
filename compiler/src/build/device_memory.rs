//! The device-memory check of `titanc build`: a rank's predicted peak (the memory plan plus the
//! library workspaces) against the memory of the target GPU (`--device-memory GIB`, default the
//! smallest GPU of the target, [`DEVICE_MEMORY`]). Exceeding it is a warning, not an error: the
//! artifact is still valid, and `titan-run --backend cuda` refuses to start where it does not fit
//! (`titan_runtime::memory_fit`).

use titan_ir::artifact::human_bytes;
use titan_ir::artifact::workspace::dp_shard_to_fit;

use super::BuildSummary;

/// Per target: the device memory (GiB) `titanc build` checks a rank's peak against by default,
/// and the GPU it is. sm_90a is the H100 (80 GiB) and the H200 (141 GiB); the default is the
/// smaller, so an artifact that builds without a warning fits either; H200 users pass
/// `--device-memory 141`.
pub const DEVICE_MEMORY: [(&str, u64, &str); 1] = [("sm_90a", 80, "the 80 GiB of an H100 (the sm_90a default; `--device-memory 141` for an H200)")];

/// `--device-memory`'s value: a positive, finite number of GiB.
pub fn parse_gib(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err(format!("`{s}` is not a device memory size; give a positive number of GiB, e.g. 80 (H100) or 141 (H200)")),
    }
}

/// The budget in bytes and how to name it: `device_memory_gib` when given, else the target's.
fn budget(target: &str, device_memory_gib: Option<f64>) -> Option<(u64, String)> {
    match device_memory_gib {
        Some(g) => Some(((g * (1u64 << 30) as f64) as u64, format!("the {} of `--device-memory {g}`", human_bytes((g * (1u64 << 30) as f64) as u64, 2)))),
        None => DEVICE_MEMORY.iter().find(|(t, ..)| *t == target).map(|&(_, gib, what)| (gib << 30, what.to_string())),
    }
}

/// The warning to print when a rank's predicted peak exceeds the device memory, naming both
/// numbers and the `--dp-shard` degree that would fit; `None` when it fits (or the target has
/// no known memory and none was given).
pub fn memory_warning(summary: &BuildSummary, target: &str, device_memory_gib: Option<f64>) -> Option<String> {
    let (budget, what) = budget(target, device_memory_gib)?;
    let plan = summary.peak_bytes_per_rank.iter().copied().max().unwrap_or(0);
    let ws = summary.workspaces.total();
    let need = plan.saturating_add(ws);
    if need <= budget {
        return None;
    }
    let dp_shard = summary.mesh.dims.iter().find(|d| d.name == "dp_shard").map_or(1, |d| d.size);
    let memory =
        titan_ir::artifact::MemoryPlan { arenas: summary.arenas.clone(), peak_bytes: plan, activation_bytes_unplanned: summary.activation_bytes_unplanned };
    let fix = match dp_shard_to_fit(&memory, dp_shard, ws, budget) {
        Some(d) => format!("shard the parameters, optimizer state and gradients over more ranks: `--dp-shard {d}` should fit"),
        None => "sharding over `--dp-shard` alone cannot fit the activations: use a smaller batch or sequence (`titanc new --batch-size/--seq-len`) or a larger `--tp`".into(),
    };
    let who = if summary.mesh.world_size > 1 { "each rank" } else { "the rank" };
    Some(format!(
        "{who} needs {} (memory plan {} + library workspaces {}), more than {what}; titan-run --backend cuda will refuse to start; {fix}",
        human_bytes(need, 2),
        human_bytes(plan, 2),
        human_bytes(ws, 2)
    ))
}
