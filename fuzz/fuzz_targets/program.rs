//! A role's program (bincode) decoded and checked by `Program::validate` against the template
//! artifact's manifest and weights, as the runtime does before mapping any code.
#![no_main]
use libfuzzer_sys::fuzz_target;
use maxc_runtime::schema::{bincode_config, Program, ProgramEnv};
use maxc_runtime::Artifact;
use std::sync::OnceLock;

fn template() -> &'static Artifact {
    static A: OnceLock<Artifact> = OnceLock::new();
    A.get_or_init(|| Artifact::open(&maxc_fuzz::template()).expect("the template artifact opens"))
}

fuzz_target!(|data: &[u8]| {
    let a = template();
    let Ok((program, _)) = bincode::serde::decode_from_slice::<Program, _>(data, bincode_config())
    else {
        return;
    };
    let Some(entry) = a.manifest.roles.get("decoder") else {
        return;
    };
    let infos = a.weight_infos();
    let env = ProgramEnv {
        dims: &entry.dims,
        max_seq_len: a.manifest.runtime.max_seq_len,
        page_size: a.manifest.runtime.page_size,
        arena_bytes: entry.arena_bytes,
        weights: &infos,
    };
    let _ = program.validate(&env);
});
