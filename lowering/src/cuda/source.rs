//! Pieces of CUDA C every kernel emitter shares: the kernel signature (buffers, then the step
//! dims), C spellings of sizes, dtypes and f32 constants, template filling and field checks.

use super::CudaError;
use maxc_schema::{DType, GridExtent, Rows, StepDim};

/// Threads in a warp.
pub(crate) const WARP: u32 = 32;

/// What an emitter needs to name errors.
#[derive(Clone, Copy)]
pub(crate) struct Ctx<'a> {
    /// The kernel's name (its C identifier).
    pub name: &'a str,
    /// The kernel kind.
    pub kind: &'static str,
}

impl Ctx<'_> {
    /// A [`CudaError::Invalid`] for this kernel.
    pub fn invalid(&self, what: String) -> CudaError {
        CudaError::Invalid {
            name: self.name.to_string(),
            kind: self.kind,
            what,
        }
    }

    /// `value`, or an error when it is zero.
    pub fn size(&self, field: &str, value: u64) -> Result<u64, CudaError> {
        if value == 0 {
            return Err(self.invalid(format!("`{field}` is 0, expected at least 1")));
        }
        Ok(value)
    }

    /// Checks that the product of `factors` (a tensor's element count) fits in 2^62, so that
    /// every index computed in `unsigned long long` is exact.
    pub fn product(&self, what: &str, factors: &[u64]) -> Result<u64, CudaError> {
        factors
            .iter()
            .try_fold(1u64, |acc, &f| acc.checked_mul(f).filter(|&p| p < 1 << 62))
            .ok_or_else(|| self.invalid(format!("{what} ({factors:?}) overflows")))
    }

    /// The C element type of a float buffer of `dtype` (`field` names it in errors).
    pub fn float_type(&self, field: &str, dtype: DType) -> Result<&'static str, CudaError> {
        match dtype {
            DType::F32 => Ok("float"),
            DType::BF16 => Ok("__nv_bfloat16"),
            DType::F16 => Ok("__half"),
            other if other.is_quantized() => Err(self.invalid(format!(
                "`{field}` is {}: the CUDA backend has no kernels on GGUF blocks yet; compile \
                 with `--weights bf16` (or f16, f32) for `--target cuda`",
                other.name()
            ))),
            other => Err(self.invalid(format!(
                "`{field}` is {}, expected f32, f16 or bf16",
                other.name()
            ))),
        }
    }
}

/// A kernel parameter: a device pointer to `ty`.
pub(crate) struct Buf {
    /// The C element type.
    pub ty: String,
    /// The parameter name.
    pub name: String,
    /// Whether the kernel writes through it.
    pub written: bool,
}

impl Buf {
    /// A buffer the kernel only reads.
    pub fn input(ty: &str, name: &str) -> Buf {
        Buf {
            ty: ty.to_string(),
            name: name.to_string(),
            written: false,
        }
    }

    /// A buffer the kernel writes (and may read).
    pub fn output(ty: &str, name: &str) -> Buf {
        Buf {
            ty: ty.to_string(),
            name: name.to_string(),
            written: true,
        }
    }
}

/// A complete kernel: `extern "C" __global__`, `__launch_bounds__(threads)`, the buffers as
/// `__restrict__` pointers in `bufs` order, then the step dims as `unsigned long long` in
/// [`StepDim`] slot order (named as the graph names them), then `body` (already indented).
pub(crate) fn kernel(name: &str, threads: u32, bufs: &[Buf], body: &str) -> String {
    let mut params: Vec<String> = bufs
        .iter()
        .map(|b| {
            let constness = if b.written { "" } else { "const " };
            format!("{constness}{}* __restrict__ {}", b.ty, b.name)
        })
        .collect();
    params.extend(
        StepDim::ALL
            .iter()
            .map(|d| format!("const unsigned long long {}", d.name())),
    );
    let mut s = format!("extern \"C\" __global__ void __launch_bounds__({threads}) {name}(\n");
    for (i, p) in params.iter().enumerate() {
        let sep = if i + 1 == params.len() { ")" } else { "," };
        s.push_str(&format!("    {p}{sep}\n"));
    }
    s.push_str("{\n");
    s.push_str(body.trim_start_matches('\n'));
    if !s.ends_with('\n') {
        s.push('\n');
    }
    s.push_str("}\n");
    s
}

/// The C expression of a row count: a step dim's parameter, or a constant.
pub(crate) fn rows_expr(rows: Rows) -> String {
    match rows {
        Rows::Step(d) => d.name().to_string(),
        Rows::Fixed(n) => format!("{n}ULL"),
    }
}

/// An `unsigned long long` constant.
pub(crate) fn ull(v: u64) -> String {
    format!("{v}ULL")
}

/// An exact f32 literal: the shortest decimal that reads back as `v` (finite values), or the
/// bit pattern.
pub(crate) fn f32_lit(v: f32) -> String {
    if v.is_finite() {
        let s = format!("{v:?}");
        if s.contains(['.', 'e', 'E']) {
            format!("{s}f")
        } else {
            format!("{s}.0f")
        }
    } else {
        format!("__int_as_float(0x{:08x})", v.to_bits())
    }
}

/// `template` with every `${KEY}` replaced by its value. Every placeholder must be given.
pub(crate) fn fill(template: &str, vars: &[(&str, String)]) -> String {
    let mut s = template.to_string();
    for (key, value) in vars {
        s = s.replace(&format!("${{{key}}}"), value);
    }
    debug_assert!(!s.contains("${"), "unfilled placeholder in:\n{s}");
    s
}

/// Threads per block for a row-parallel kernel over `cols` columns: `cols` rounded up to a
/// warp, at least one warp and at most `max`.
pub(crate) fn row_threads(cols: u64, max: u32) -> u32 {
    let warps = cols
        .div_ceil(u64::from(WARP))
        .clamp(1, u64::from(max / WARP));
    warps as u32 * WARP
}

/// One block per row: `ceil(rows / 1)` blocks in x.
pub(crate) fn per_row(rows: Rows) -> GridExtent {
    GridExtent::CeilDiv { rows, by: 1 }
}

/// A source with 1-based line numbers, for error messages.
pub(crate) fn numbered(source: &str) -> String {
    source
        .lines()
        .enumerate()
        .map(|(i, l)| format!("{:5} | {l}\n", i + 1))
        .collect()
}
