//! What the fuzz targets share: a scratch directory per process (in memory where /dev/shm
//! exists) and the template artifact `scripts/fuzz.sh` compiles (`MAXC_FUZZ_ARTIFACT`).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A directory of this process's own, removed at exit by the OS's tmp cleaning (it lives as
/// long as the process).
pub fn scratch() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let base = Path::new("/dev/shm");
        if base.is_dir() {
            tempfile::tempdir_in(base)
        } else {
            tempfile::tempdir()
        }
        .expect("a scratch directory")
    })
    .path()
}

/// The template artifact (a small compiled model) that scripts/fuzz.sh makes.
pub fn template() -> PathBuf {
    PathBuf::from(
        std::env::var_os("MAXC_FUZZ_ARTIFACT")
            .expect("MAXC_FUZZ_ARTIFACT names a compiled artifact (scripts/fuzz.sh sets it)"),
    )
}

/// Writes `bytes` to `name` in the scratch directory and returns its path.
pub fn write(name: &str, bytes: &[u8]) -> PathBuf {
    let path = scratch().join(name);
    std::fs::write(&path, bytes).expect("the scratch directory is writable");
    path
}
