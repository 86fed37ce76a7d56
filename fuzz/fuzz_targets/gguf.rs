//! The GGUF reader: metadata, tensor infos, the config it implies, and the weights.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = maxc_fuzz::write("model.gguf", data);
    if let Ok(g) = maxc_graph::weights::gguf::GgufFile::open(&path) {
        if let Ok(config) = maxc_graph::arch::gguf::config_from_gguf(&g) {
            let _ = maxc_graph::Registry::builtin().parse_config(&path, &config);
        }
        if let Ok(weights) = g.state_dict() {
            for (key, w) in weights.iter() {
                let _ = w.to_f32(key);
            }
        }
    }
});
