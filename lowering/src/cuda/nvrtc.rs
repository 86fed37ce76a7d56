//! NVRTC, loaded at run time through `cudarc`'s dynamic loading.
//!
//! cudarc opens NVRTC by library name (`libnvrtc.so`, ..., `libnvrtc.so.12`) through the
//! dynamic loader, so `LD_LIBRARY_PATH` must name its directory, and it panics when none
//! opens. This module therefore first opens `$MAXC_NVRTC_LIB_DIR/libnvrtc.so.12` by path where
//! that variable is set (the loader then finds it by its soname when cudarc asks), then asks
//! cudarc whether the library opens before calling into it, and still catches a panic as a
//! last resort.

use super::source::numbered;
use super::{CudaError, CudaTarget};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;
use std::sync::OnceLock;

/// PTX produced by NVRTC.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ptx {
    /// The PTX text.
    pub ptx: String,
    /// The `(major, minor)` version of the NVRTC that produced it.
    pub nvrtc_version: (i32, i32),
}

/// The `(major, minor)` version of NVRTC where the library can be loaded, or an error saying
/// what was tried and how to install it. The first call loads the library; later calls
/// return the same answer.
pub fn nvrtc_status() -> Result<(i32, i32), CudaError> {
    static STATUS: OnceLock<Result<(i32, i32), String>> = OnceLock::new();
    STATUS
        .get_or_init(load)
        .clone()
        .map_err(|why| CudaError::NvrtcUnavailable { why })
}

/// The NVRTC options for `target`: `--gpu-architecture=compute_XY`, C++17, device code by
/// default, and `-I$MAXC_CUDA_INCLUDE` (the CUDA headers) where set. No fast math.
pub fn nvrtc_options(target: &CudaTarget) -> Vec<String> {
    let mut options = vec![
        format!("--gpu-architecture={}", target.compute()),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
    ];
    if let Some(include) = std::env::var_os("MAXC_CUDA_INCLUDE") {
        options.push(format!("-I{}", include.to_string_lossy()));
    }
    options
}

/// Compiles a CUDA translation unit (see [`super::module_source`]) to PTX for `target`. A
/// compile error carries NVRTC's log and the source with line numbers.
pub fn compile_ptx(source: &str, target: &CudaTarget) -> Result<Ptx, CudaError> {
    if target.sm() < CudaTarget::MIN_SM {
        return Err(CudaError::Arch {
            arch: target.arch.clone(),
        });
    }
    let nvrtc_version = nvrtc_status()?;
    let options = nvrtc_options(target);
    let src = CString::new(source).map_err(|_| CudaError::Nvrtc {
        call: "nvrtcCreateProgram",
        message: "the source contains a NUL byte".to_string(),
    })?;
    let outcome = catch_unwind(AssertUnwindSafe(|| compile(&src, &options))).map_err(|_| {
        CudaError::Nvrtc {
            call: "nvrtcCompileProgram",
            message: "cudarc panicked (an NVRTC symbol is missing from the loaded library?)"
                .to_string(),
        }
    })?;
    match outcome {
        Ok(ptx) => Ok(Ptx { ptx, nvrtc_version }),
        Err(Failure::Compile { log }) => {
            let mut log = log.trim_end().to_string();
            if std::env::var_os("MAXC_CUDA_INCLUDE").is_none() && log.contains("open source file") {
                log.push_str(&format!(
                    "\n(MAXC_CUDA_INCLUDE is not set: it names the CUDA headers directory; \
                     `{}` sets it)",
                    super::INSTALL_HINT
                ));
            }
            Err(CudaError::Compile {
                arch: target.arch.clone(),
                options: options.join(" "),
                log,
                listing: numbered(source),
            })
        }
        Err(Failure::Call { call, status }) => Err(CudaError::Nvrtc {
            call,
            message: format!("{status:?}"),
        }),
    }
}

/// Why [`compile`] failed.
enum Failure {
    /// NVRTC rejected the source.
    Compile {
        /// NVRTC's log.
        log: String,
    },
    /// Another call failed.
    Call {
        /// The call.
        call: &'static str,
        /// Its status.
        status: result::NvrtcError,
    },
}

/// Destroys an NVRTC program when dropped.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program was created by `create_program` and is destroyed only here.
        // A failure to free it leaks the program; there is nothing else to do.
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Creates, compiles and reads back one program. NVRTC must be loaded.
fn compile(src: &CStr, options: &[String]) -> Result<String, Failure> {
    let call = |call| move |status| Failure::Call { call, status };
    let prog =
        Program(result::create_program(src, Some(c"maxc.cu")).map_err(call("nvrtcCreateProgram"))?);
    // SAFETY: `prog.0` is a live program (destroyed when `prog` drops, after these calls).
    let compiled = unsafe { result::compile_program(prog.0, options) };
    if compiled.is_err() {
        // SAFETY: as above.
        let log = match unsafe { result::get_program_log(prog.0) } {
            Ok(log) => c_text(&log),
            Err(e) => format!("(NVRTC gave no log: {e:?})"),
        };
        return Err(Failure::Compile { log });
    }
    // SAFETY: as above.
    let ptx = unsafe { result::get_ptx(prog.0) }.map_err(call("nvrtcGetPTX"))?;
    Ok(c_text(&ptx))
}

/// A NUL-terminated C buffer as text (up to the first NUL).
fn c_text(buf: &[c_char]) -> String {
    let bytes: Vec<u8> = buf
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// Loads NVRTC and returns its version, or says what was tried.
fn load() -> Result<(i32, i32), String> {
    let mut notes = Vec::new();
    match std::env::var_os("MAXC_NVRTC_LIB_DIR") {
        Some(dir) => {
            if let Err(e) = preload::from_dir(Path::new(&dir)) {
                notes.push(e);
            }
        }
        None => notes.push("MAXC_NVRTC_LIB_DIR is not set".to_string()),
    }
    // SAFETY: only tries to open candidate library names.
    let present = catch_unwind(|| unsafe { sys::is_culib_present() }).unwrap_or(false);
    if !present {
        notes.push(
            "no NVRTC library opens by the names cudarc tries (libnvrtc.so, libnvrtc.so.12, \
             ...) on the loader's search path (LD_LIBRARY_PATH)"
                .to_string(),
        );
        return Err(notes.join("; "));
    }
    let version = catch_unwind(|| {
        let (mut major, mut minor) = (0, 0);
        // SAFETY: the library opens (checked above); both pointers are valid.
        let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
        (status, major, minor)
    });
    match version {
        Ok((sys::nvrtcResult::NVRTC_SUCCESS, major, minor)) => Ok((major, minor)),
        Ok((status, ..)) => Err(format!("nvrtcVersion returned {status:?}")),
        Err(_) => Err("cudarc panicked while loading `nvrtcVersion`".to_string()),
    }
}

/// Opening NVRTC by path, so the loader later finds it by soname.
#[cfg(target_os = "linux")]
mod preload {
    use std::ffi::{c_char, c_int, c_void, CStr, CString};
    use std::os::unix::ffi::OsStrExt;
    use std::path::Path;

    extern "C" {
        fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
        fn dlerror() -> *mut c_char;
    }

    const RTLD_NOW: c_int = 2;
    const RTLD_GLOBAL: c_int = 0x100;

    /// Opens `dir/libnvrtc.so.12` (else `dir/libnvrtc.so`) and keeps it loaded for the life
    /// of the process.
    pub fn from_dir(dir: &Path) -> Result<(), String> {
        let path = ["libnvrtc.so.12", "libnvrtc.so"]
            .iter()
            .map(|n| dir.join(n))
            .find(|p| p.is_file())
            .ok_or_else(|| {
                format!(
                    "MAXC_NVRTC_LIB_DIR={} holds neither libnvrtc.so.12 nor libnvrtc.so",
                    dir.display()
                )
            })?;
        let c_path = CString::new(path.as_os_str().as_bytes())
            .map_err(|_| format!("{} contains a NUL byte", path.display()))?;
        // SAFETY: `c_path` is NUL-terminated; the handle is never closed on purpose, so the
        // library stays mapped for cudarc's later lookup by name.
        let handle = unsafe { dlopen(c_path.as_ptr(), RTLD_NOW | RTLD_GLOBAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns NULL or a NUL-terminated message.
            let why = unsafe {
                let e = dlerror();
                if e.is_null() {
                    "unknown error".to_string()
                } else {
                    CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            return Err(format!("cannot open {}: {why}", path.display()));
        }
        Ok(())
    }
}

/// Opening NVRTC by path: only on Linux; elsewhere the loader's search path decides.
#[cfg(not(target_os = "linux"))]
mod preload {
    use std::path::Path;

    /// Does nothing.
    pub fn from_dir(_dir: &Path) -> Result<(), String> {
        Ok(())
    }
}
