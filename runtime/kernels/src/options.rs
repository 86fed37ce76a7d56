//! How the kernels meet their inputs, where more than one way exists: the choices a caller
//! makes once, when it sets up an executor.

/// How activations meet block-format weights in steps of a few rows (decode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// As f32, accumulated in f32: the interpreter's arithmetic in another order (the default).
    #[default]
    F32,
    /// Quantized to 8 bits per 32 values (one f32 scale each) and multiplied with the weights'
    /// integers in integer arithmetic: faster where the CPU has AVX2, at the cost of
    /// fidelity (measured in the README). Other CPUs, float weights and steps of more than
    /// [`STREAM_MAX_ROWS`] rows keep f32 activations.
    Q8,
}

impl Activations {
    /// The name the command line takes.
    pub fn name(self) -> &'static str {
        match self {
            Activations::F32 => "f32",
            Activations::Q8 => "q8",
        }
    }
}

impl std::str::FromStr for Activations {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Activations::F32),
            "q8" => Ok(Activations::Q8),
            _ => Err(format!(
                "unknown activation format {s:?}: expected f32 or q8"
            )),
        }
    }
}

/// Whether block-format matmuls of a few rows take 8-bit activations (process-wide, like the
/// instruction set the kernels use).
static Q8_ACTIVATIONS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets how activations meet block-format weights from now on, in this process.
pub fn set_activations(a: Activations) {
    Q8_ACTIVATIONS.store(a == Activations::Q8, std::sync::atomic::Ordering::Relaxed);
}

/// How activations meet block-format weights.
pub fn activations() -> Activations {
    if Q8_ACTIVATIONS.load(std::sync::atomic::Ordering::Relaxed) {
        Activations::Q8
    } else {
        Activations::F32
    }
}
