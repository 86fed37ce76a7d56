//! config.json through the registry: parsing, the deployment config, and every role's graph.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::Path;

fuzz_target!(|data: &[u8]| {
    let Ok(json) = serde_json::from_slice::<serde_json::Value>(data) else {
        return;
    };
    let registry = maxc_graph::Registry::builtin();
    if let Ok(spec) = registry.parse_config(Path::new("config.json"), &json) {
        let _ = spec.deployment();
        for role in spec.roles() {
            let _ = spec.build(role, &Default::default());
        }
    }
});
