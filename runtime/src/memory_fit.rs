//! Whether an artifact's step fits the free memory of the device it is about to run on: the
//! memory plan's predicted peak plus the library workspaces
//! ([`titan_ir::artifact::workspace`]) against what the driver reports free. A pure decision, so
//! it is tested without a GPU; the CUDA backend calls [`check_fits`] before allocating anything.

use titan_ir::artifact::workspace::{LibraryWorkspaces, dp_shard_to_fit, library_workspaces};
use titan_ir::artifact::{Manifest, MemoryPlan, human_bytes};

/// Why a step cannot start on this device.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FitError {
    #[error(
        "the step needs {} per GPU (memory plan {} + library workspaces {}: cuBLASLt {}, kernel workspaces {}, collective staging {}, NCCL {}) but only {} is free on this GPU; {suggestion}",
        human_bytes(.plan + .workspaces.total(), 2),
        human_bytes(*.plan, 2),
        human_bytes(.workspaces.total(), 2),
        human_bytes(.workspaces.cublaslt, 2),
        human_bytes(.workspaces.kernels, 2),
        human_bytes(.workspaces.collective_staging, 2),
        human_bytes(.workspaces.nccl, 2),
        human_bytes(*.free, 2)
    )]
    TooLarge { plan: u64, workspaces: LibraryWorkspaces, free: u64, suggestion: String },
}

/// Whether `memory` (planned at `dp_shard`) plus `workspaces` fits in `free` bytes; the error
/// names both numbers and the `titanc build` flags that would make it fit.
pub fn check_fits(memory: &MemoryPlan, dp_shard: u32, workspaces: LibraryWorkspaces, free: u64) -> Result<(), FitError> {
    let need = memory.peak_bytes.saturating_add(workspaces.total());
    if need <= free {
        return Ok(());
    }
    let suggestion = match dp_shard_to_fit(memory, dp_shard, workspaces.total(), free) {
        Some(d) => format!(
            "rebuild with `titanc build --dp-shard {d}` (FSDP over {d} ranks shards the parameters, optimizer state and gradients; about {d} GPUs per replica), free memory on this GPU, or run on a GPU with more memory"
        ),
        None => "even sharding the parameters, optimizer state and gradients over 1024 ranks (`--dp-shard`) leaves the activations too large: \
                 rebuild with a smaller batch or sequence (`titanc new --batch-size/--seq-len`) or a larger `--tp`"
            .to_string(),
    };
    Err(FitError::TooLarge { plan: memory.peak_bytes, workspaces, free, suggestion })
}

/// The predicted peak device memory of a GPU rank running `m`: the plan's arenas plus the
/// library workspaces (what `titan-run` compares the measured peak with).
pub fn predicted_device_bytes(m: &Manifest) -> u64 {
    m.memory.peak_bytes.saturating_add(library_workspaces(m).total())
}

/// [`check_fits`] for `m`'s plan, mesh and library workspaces.
pub fn check_manifest_fits(m: &Manifest, free: u64) -> Result<(), FitError> {
    let dp_shard = m.mesh.dims.iter().find(|d| d.name == "dp_shard").map_or(1, |d| d.size);
    check_fits(&m.memory, dp_shard, library_workspaces(m), free)
}

#[cfg(test)]
mod tests {
    use super::*;
    use titan_ir::artifact::{Arena, ArenaPlan};

    const GIB: u64 = 1 << 30;

    fn plan(params: u64, optimizer_state: u64, activations: u64) -> MemoryPlan {
        MemoryPlan {
            arenas: vec![
                ArenaPlan { arena: Arena::Inputs, bytes: 0 },
                ArenaPlan { arena: Arena::Params, bytes: params },
                ArenaPlan { arena: Arena::OptimizerState, bytes: optimizer_state },
                ArenaPlan { arena: Arena::Activations, bytes: activations },
            ],
            peak_bytes: params + optimizer_state + activations,
            activation_bytes_unplanned: activations,
        }
    }

    fn ws() -> LibraryWorkspaces {
        LibraryWorkspaces { cublaslt: 32 << 20, kernels: 1 << 20, collective_staging: 0, nccl: 0 }
    }

    #[test]
    fn a_step_that_fits_starts() {
        assert_eq!(check_fits(&plan(GIB, 2 * GIB, 2 * GIB), 1, ws(), 80 * GIB), Ok(()));
        // Exactly the free memory fits.
        let p = plan(GIB, 0, 0);
        assert_eq!(check_fits(&p, 1, ws(), GIB + ws().total()), Ok(()));
    }

    /// The 70B-shaped case: 360 GiB per rank on a 141 GiB GPU names both numbers and the
    /// dp_shard degree that fits (the sharded 330 GiB over 4 is 82.5 GiB, plus 30 GiB of
    /// activations), and nothing about activation checkpointing.
    #[test]
    fn a_step_too_large_names_both_numbers_and_the_dp_shard_that_fits() {
        let err = check_fits(&plan(90 * GIB, 240 * GIB, 30 * GIB), 1, ws(), 141 * GIB).expect_err("does not fit").to_string();
        assert!(err.contains("the step needs 360.03 GiB per GPU (memory plan 360.00 GiB + library workspaces 33.00 MiB"), "{err}");
        assert!(err.contains("only 141.00 GiB is free"), "{err}");
        assert!(err.contains("`titanc build --dp-shard 4`"), "{err}");
        assert!(!err.contains("checkpoint"), "{err}");
        // Already sharded over 2: the next degree that fits is counted from there.
        let err = check_fits(&plan(90 * GIB, 240 * GIB, 30 * GIB), 2, ws(), 100 * GIB).expect_err("does not fit").to_string();
        assert!(err.contains("--dp-shard 16"), "{err}");
    }

    #[test]
    fn activations_that_never_fit_say_so() {
        let err = check_fits(&plan(GIB, GIB, 200 * GIB), 1, ws(), 141 * GIB).expect_err("does not fit").to_string();
        assert!(err.contains("leaves the activations too large"), "{err}");
        assert!(err.contains("--seq-len"), "{err}");
    }
}
