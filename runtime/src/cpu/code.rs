//! Native kernel code loaded into executable memory.
//!
//! Code from the artifact is position independent and relocation free (the compiler checks
//! that); loading it is a copy into an anonymous mapping that is then made executable.

use memmap2::{Mmap, MmapMut};

/// The signature of a generated CPU kernel; see [`crate::schema::kernel`]. System V on x86-64
/// whatever the OS (the artifact's `CpuTarget::abi` says `sysv64`, and the runtime checks it).
#[cfg(target_arch = "x86_64")]
pub type KernelFn =
    unsafe extern "sysv64" fn(bufs: *const *mut u8, dims: *const u64, start: u64, end: u64);

/// The signature of a generated CPU kernel; see [`crate::schema::kernel`]: the platform's C
/// convention (`CpuTarget::abi`, checked by the runtime, names which).
#[cfg(not(target_arch = "x86_64"))]
pub type KernelFn =
    unsafe extern "C" fn(bufs: *const *mut u8, dims: *const u64, start: u64, end: u64);

/// Executable memory holding one or more kernels' code.
pub struct ExecutableCode {
    map: Mmap,
}

impl ExecutableCode {
    /// Copies `code` into executable memory.
    pub fn new(code: &[u8]) -> std::io::Result<Self> {
        let mut map = MmapMut::map_anon(code.len().max(1))?;
        map[..code.len()].copy_from_slice(code);
        Ok(ExecutableCode {
            map: map.make_exec()?,
        })
    }

    /// The kernel whose code starts at `offset`.
    ///
    /// # Safety
    /// `offset` must be the start of a function compiled with the kernel calling convention
    /// for this machine's architecture, within the code given to [`ExecutableCode::new`].
    pub unsafe fn kernel(&self, offset: usize) -> KernelFn {
        assert!(
            offset < self.map.len(),
            "kernel offset {offset} outside the code ({} bytes)",
            self.map.len()
        );
        // SAFETY: the caller guarantees a function of this signature starts here.
        unsafe { std::mem::transmute::<*const u8, KernelFn>(self.map.as_ptr().add(offset)) }
    }
}
