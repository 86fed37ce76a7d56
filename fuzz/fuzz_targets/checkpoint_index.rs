//! A sharded checkpoint's `model.safetensors.index.json` over two real shards.
#![no_main]
use libfuzzer_sys::fuzz_target;
use maxc_graph::weights::{write_safetensors, StateDict, WeightTensor};
use maxc_graph::DType;
use std::sync::Once;

fn shards() -> &'static std::path::Path {
    static INIT: Once = Once::new();
    let dir = maxc_fuzz::scratch();
    INIT.call_once(|| {
        for (file, key) in [("a.safetensors", "x.weight"), ("b.safetensors", "y.bias")] {
            let mut sd = StateDict::new();
            let bytes: Vec<u8> = (0..16u32).flat_map(|i| (i as f32).to_le_bytes()).collect();
            sd.insert(
                key,
                WeightTensor::from_bytes(DType::F32, vec![4, 4], bytes).unwrap(),
            );
            write_safetensors(&dir.join(file), &sd, None).unwrap();
        }
    });
    dir
}

fuzz_target!(|data: &[u8]| {
    let dir = shards();
    std::fs::write(dir.join("model.safetensors.index.json"), data).unwrap();
    let _ = maxc_graph::weights::load_checkpoint_weights(dir);
});
