//! NVTX ranges for Nsight Systems, from NVTX's C library loaded at run time (a CUDA toolkit's
//! `libnvToolsExt`, or the `nvidia-nvtx-cu12` wheel's `libnvtx3interop`). No library: a
//! warning, no ranges.

use std::ffi::{c_char, c_int, CString};

type PushA = unsafe extern "C" fn(*const c_char) -> c_int;
type Pop = unsafe extern "C" fn() -> c_int;

/// The loaded library's range functions.
pub struct Nvtx {
    push: PushA,
    pop: Pop,
    // Keeps `push` and `pop` valid.
    _lib: libloading::Library,
}

impl std::fmt::Debug for Nvtx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvtx")
    }
}

impl Nvtx {
    /// Loads `MAXC_NVTX_LIBRARY`, else `libnvToolsExt.so.1` or `libnvtx3interop.so.1` from
    /// the loader's path.
    pub fn load() -> Result<Self, String> {
        match std::env::var("MAXC_NVTX_LIBRARY") {
            Ok(p) if !p.is_empty() => Self::load_from(&[p]),
            _ => Self::load_from(&[
                "libnvToolsExt.so.1".into(),
                "libnvToolsExt.so".into(),
                "libnvtx3interop.so.1".into(),
            ]),
        }
    }

    /// Loads the first of `names` that loads and has the range functions; the error says why
    /// each did not.
    pub fn load_from(names: &[String]) -> Result<Self, String> {
        let mut why = Vec::new();
        for name in names {
            // SAFETY: loading NVTX runs no initialisation with preconditions of ours.
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => {
                    // SAFETY: the NVTX C API's signatures for these two symbols.
                    let (push, pop) = unsafe {
                        let push = lib.get::<PushA>(b"nvtxRangePushA\0").map(|s| *s);
                        let pop = lib.get::<Pop>(b"nvtxRangePop\0").map(|s| *s);
                        match (push, pop) {
                            (Ok(a), Ok(b)) => (a, b),
                            _ => {
                                why.push(format!("{name}: no nvtxRangePushA/nvtxRangePop"));
                                continue;
                            }
                        }
                    };
                    return Ok(Nvtx {
                        push,
                        pop,
                        _lib: lib,
                    });
                }
                Err(e) => why.push(format!("{name}: {e}")),
            }
        }
        Err(why.join("; "))
    }

    /// Opens a range named `name` on this thread.
    pub fn push(&self, name: &str) {
        let c = CString::new(name.replace('\0', " ")).unwrap_or_default();
        // SAFETY: a valid NUL-terminated string, copied by NVTX before it returns.
        unsafe { (self.push)(c.as_ptr()) };
    }

    /// Closes this thread's innermost range.
    pub fn pop(&self) {
        // SAFETY: no arguments; a pop without a push is ignored by NVTX.
        unsafe { (self.pop)() };
    }
}

#[cfg(test)]
mod tests {
    use super::Nvtx;

    #[test]
    fn a_missing_library_says_which_paths_it_tried() {
        let e = Nvtx::load_from(&["/nonexistent/libnvToolsExt.so.1".into()]).unwrap_err();
        assert!(e.contains("/nonexistent/libnvToolsExt.so.1"), "{e}");
    }

    /// With the CUDA tools installed (scripts/install-cuda-tools.sh), NVTX loads and its
    /// ranges nest without a GPU (no profiler attached: they are no-ops).
    #[test]
    fn the_wheels_nvtx_loads_and_ranges_nest() {
        let path = match std::env::var("MAXC_NVTX_LIBRARY") {
            Ok(p) if !p.is_empty() => p,
            _ if std::env::var_os("MAXC_REQUIRE_NVRTC").is_some() => {
                panic!("MAXC_NVTX_LIBRARY is unset: eval \"$(bash scripts/install-cuda-tools.sh)\"")
            }
            _ => {
                eprintln!(
                    "skipped: MAXC_NVTX_LIBRARY unset (scripts/install-cuda-tools.sh sets it)"
                );
                return;
            }
        };
        let n = Nvtx::load_from(&[path]).unwrap();
        n.push("max.forward");
        n.push("kernel\0with a nul");
        n.pop();
        n.pop();
    }
}
