//! `maxc serve --config-file`: any bytes as the YAML file, whole or as a section, give
//! settings or an error, never a panic; an error names a line where it has a location.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let _ = maxc_serve::config::parse(text, None);
    if let Err(e) = maxc_serve::config::parse(text, Some("serve")) {
        assert!(!e.is_empty());
    }
});
