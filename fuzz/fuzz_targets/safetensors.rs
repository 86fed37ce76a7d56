//! The safetensors reader: header, offsets, dtypes and shapes of any file; every tensor it
//! accepts is read back as f32.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = maxc_fuzz::write("model.safetensors", data);
    if let Ok(weights) = maxc_graph::weights::read_safetensors_file(&path) {
        for (key, w) in weights.iter() {
            let _ = w.to_f32(key);
        }
    }
});
