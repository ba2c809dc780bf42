//! Checkpoints of the debug model's artifact (`titanc build` through `build_artifact`) on the CPU
//! backend: 20 steps with a checkpoint at step 10, resumed from it for 10 more, give the same
//! losses and final states, bit for bit, as 20 uninterrupted steps; the checkpoint carries the
//! Hugging Face names of every layer, and `--init-from` of its `model.safetensors` reproduces
//! the parameters.

use std::collections::BTreeMap;

use crate::common::Scratch;
use titan_compiler::build::{BuildOptions, build_artifact};
use titan_compiler::{LlamaConfig, Preset, build_llama3};
use titan_ir::DecayKind;
use titan_passes::TrainOptions;
use titan_runtime::checkpoint::{self, CHECKPOINT_FORMAT_VERSION, MODEL_FILE, OPTIMIZER_FILE, TrainerState};
use titan_runtime::{Artifact, BUNDLED_CORPUS, Batcher, CpuArtifactTrainer, Trainer, byte_tokens};

fn scratch(name: &str) -> Scratch {
    crate::common::scratch("checkpoint-e2e", name)
}

fn bits(t: &dyn Trainer) -> BTreeMap<String, Vec<u32>> {
    t.states().expect("states").into_iter().map(|(n, s)| (n, s.floats().expect("float state").iter().map(|x| x.to_bits()).collect())).collect()
}

/// Run steps `from + 1 ..= to`, drawing batches from position `from`.
fn steps(t: &mut dyn Trainer, seed: u64, from: u64, to: u64) -> (Vec<f64>, Batcher) {
    let mut b = Batcher::new(byte_tokens(BUNDLED_CORPUS.as_bytes()), t.batch_size(), t.seq_len(), seed).expect("batcher");
    b.seek(from);
    let losses = (from..to).map(|_| t.step(&b.next_batch()).expect("step").loss).collect();
    (losses, b)
}

#[test]
fn debug_model_resumes_bit_identically_from_a_checkpoint() {
    let model = build_llama3(&LlamaConfig::preset(Preset::Debug), "llama3_debug").expect("debug model");
    let art_dir = scratch("artifact");
    let train =
        TrainOptions { lr: 3e-3, warmup_steps: 5, decay_steps: 15, decay: DecayKind::Cosine, min_lr_ratio: 0.1, weight_decay: 0.01, ..TrainOptions::default() };
    let opts = BuildOptions { train, ..BuildOptions::default() };
    build_artifact(&model, &titan_ir::print::print_graph(&model), &opts, &art_dir.0).expect("build");
    let art = Artifact::load(&art_dir.0).expect("load");
    let hash = art.manifest.content_hash.clone();
    let seed = 21;

    let mut full = CpuArtifactTrainer::new(&art, seed).expect("trainer");
    let (want, _) = steps(&mut full, seed, 0, 20);

    let ckpt = scratch("ckpt");
    let mut first = CpuArtifactTrainer::new(&art, seed).expect("trainer");
    let (mut got, data) = steps(&mut first, seed, 0, 10);
    let state = TrainerState {
        format_version: CHECKPOINT_FORMAT_VERSION,
        step: 10,
        seed,
        data_position: data.position(),
        data_stream: None,
        content_hash: hash.clone(),
        data: "bundled corpus".into(),
        mesh: Default::default(),
        model_hash: None,
        model_config: Default::default(),
    };
    let written = checkpoint::save(&ckpt.0, &first, &state).expect("save");
    let at_10 = bits(&first);
    drop(first);

    // The checkpoint holds every layer under its Hugging Face name.
    let tensors = checkpoint::read_safetensors(&written.join(MODEL_FILE)).expect("model file");
    for l in 0..2 {
        for name in [
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        ] {
            assert!(tensors.contains_key(&format!("model.layers.{l}.{name}.weight")), "layer {l} {name}: {:?}", tensors.keys());
        }
    }
    assert_eq!(tensors["model.layers.1.self_attn.k_proj.weight"].shape, vec![32, 64], "n_kv_heads 2 x head_dim 16 by dim 64");
    for name in ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] {
        assert!(tensors.contains_key(name), "{name}");
    }
    let moments = checkpoint::read_safetensors(&written.join(OPTIMIZER_FILE)).expect("optimizer file");
    assert_eq!(moments.len(), 2 * tensors.len());
    assert!(moments.contains_key("model.layers.0.mlp.down_proj.weight.exp_avg_sq"));

    // Resume into a trainer initialized from another seed: the checkpoint decides everything.
    let mut second = CpuArtifactTrainer::new(&art, seed + 1).expect("trainer");
    let (_, st) = checkpoint::resume(&ckpt.0, &mut second, &hash, false).expect("resume");
    assert_eq!(bits(&second), at_10, "restored states");
    let (rest, _) = steps(&mut second, st.seed, st.data_position, 20);
    got.extend(rest);
    assert_eq!(got, want, "losses of the resumed run");
    assert!(bits(&second) == bits(&full), "final states differ from the uninterrupted run");

    // Parameters only: the masters match, the moments start at zero.
    let mut fresh = CpuArtifactTrainer::new(&art, seed + 2).expect("trainer");
    checkpoint::init_from(&written.join(MODEL_FILE), &mut fresh).expect("init from");
    for (name, b) in bits(&fresh) {
        if checkpoint::is_optimizer_state(&name) {
            assert!(b.iter().all(|&x| x == 0), "{name} starts at zero");
        } else {
            assert_eq!(b, at_10[&name], "{name}");
        }
    }
}
