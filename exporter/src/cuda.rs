//! The CUDA half of a compile: each kernel's CUDA C, the module's PTX from NVRTC, and ptxas's
//! register and spill report per kernel.

use crate::ExportError;
use maxc_lowering::cuda::{
    compile_ptx, emit_kernel, module_source, nvrtc_status, ptxas_check, CudaTarget,
};
use maxc_schema::{CudaKernelEntry, CudaModule, Program};

fn err(e: impl std::fmt::Display) -> ExportError {
    ExportError::Other(e.to_string())
}

/// The target for `arch`, once NVRTC is known to load (the error says how to install it).
pub fn check_tools(arch: &str) -> Result<CudaTarget, ExportError> {
    let target = CudaTarget::parse(arch).map_err(err)?;
    nvrtc_status().map_err(err)?;
    Ok(target)
}

/// The program's CUDA module: entries, source text and PTX.
pub fn cuda_module(
    program: &Program,
    target: &CudaTarget,
) -> Result<(CudaModule, String, String), ExportError> {
    let kernels = program
        .kernels
        .iter()
        .map(|k| emit_kernel(&k.name, &k.body, target).map_err(err))
        .collect::<Result<Vec<_>, _>>()?;
    let source = module_source(&kernels);
    let ptx = compile_ptx(&source, target).map_err(err)?;
    let resources = ptxas_check(&ptx.ptx, target).map_err(err)?;
    let entries = kernels
        .iter()
        .zip(&program.kernels)
        .map(|(k, pk)| {
            let r = resources.iter().find(|r| r.name == k.name).ok_or_else(|| {
                ExportError::Other(format!(
                    "kernel `{}`: ptxas reported no resources for it",
                    k.name
                ))
            })?;
            Ok(CudaKernelEntry {
                name: k.name.clone(),
                kernel_digest: pk.body.digest(),
                launch: k.launch,
                registers: r.registers,
                spill_stores: r.spill_stores,
                spill_loads: r.spill_loads,
                shared_bytes: r.shared_bytes,
            })
        })
        .collect::<Result<Vec<_>, ExportError>>()?;
    let (major, minor) = ptx.nvrtc_version;
    let module = CudaModule {
        target: maxc_schema::CudaTarget {
            arch: target.arch.clone(),
            nvrtc_version: format!("{major}.{minor}"),
        },
        kernels: entries,
    };
    Ok((module, source, ptx.ptx))
}
