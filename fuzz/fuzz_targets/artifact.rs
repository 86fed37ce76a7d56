//! An artifact's manifest.json: the template artifact's files with a fuzzed manifest, opened
//! (format, files and checksums, programs, validation) as `maxc run` and `serve` open it.
#![no_main]
use libfuzzer_sys::fuzz_target;
use std::path::PathBuf;
use std::sync::OnceLock;

fn dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let src = maxc_fuzz::template();
        let dst = maxc_fuzz::scratch().join("artifact.maxc");
        copy(&src, &dst);
        dst
    })
}

fn copy(src: &std::path::Path, dst: &std::path::Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        let to = dst.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy(&e.path(), &to);
        } else {
            std::fs::copy(e.path(), to).unwrap();
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let dir = dir();
    std::fs::write(dir.join("manifest.json"), data).unwrap();
    let _ = maxc_runtime::Artifact::open(dir);
});
