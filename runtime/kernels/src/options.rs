//! How the kernels meet their inputs, where more than one way exists: the choices a caller
//! makes once, when it sets up an executor.

/// How activations meet block-format weights in steps of a few rows (decode).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Activations {
    /// As f32, accumulated in f32: the interpreter's arithmetic in another order (the
    /// default: exact wherever the model's activations range, which 16-bit ones are not for
    /// every model, see [`Activations::I16`]).
    #[default]
    F32,
    /// Quantized to 8 bits per 32 values (one f32 scale each) and multiplied with the weights'
    /// integers in integer arithmetic: faster where the CPU has AVX2, at the cost of
    /// fidelity (measured in the README). Other CPUs, float weights and steps of more than
    /// [`STREAM_MAX_ROWS`](crate::matmul::STREAM_MAX_ROWS) rows keep f32 activations.
    Q8,
    /// Quantized to 16 bits per 32 values (one f32 scale each) and multiplied with the
    /// weights' integers in integer arithmetic: a rounding error of at most `max|x| / 65534`
    /// per value, relative to the group's largest, so a group with one outlier (Gemma 3's
    /// activations have them) rounds its small values coarsely: SmolLM2's logits move
    /// 0.005-0.01 from f32 activations, Gemma 3 270M's 0.06-0.09 (measured in the README).
    /// CPUs without AVX2, float weights and steps of more than
    /// [`STREAM_MAX_ROWS`](crate::matmul::STREAM_MAX_ROWS) rows keep f32 activations.
    I16,
}

impl Activations {
    /// The name the command line takes.
    pub fn name(self) -> &'static str {
        match self {
            Activations::F32 => "f32",
            Activations::Q8 => "q8",
            Activations::I16 => "i16",
        }
    }
}

impl std::str::FromStr for Activations {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(Activations::F32),
            "q8" => Ok(Activations::Q8),
            "i16" => Ok(Activations::I16),
            _ => Err(format!(
                "unknown activation format {s:?}: expected f32, i16 or q8"
            )),
        }
    }
}

/// The kernel choices of one executor, made when it is set up (the defaults are the fastest
/// measured on this CPU family; the others are for comparisons and benchmarks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelOptions {
    /// How activations meet block-format weights in steps of a few rows.
    pub activations: Activations,
    /// Whether the hand-vectorized kernels run where they exist (off: the generic ones).
    pub hand_kernels: bool,
    /// Whether steps of a few rows run register tiles straight on 32-value blocks rather than
    /// on dequantized panels.
    pub block_tiles: bool,
    /// Steps of at least this many rows run the packed kernel, whatever the dtype
    /// (`usize::MAX`: never); `None`: the measured threshold of each dtype.
    pub packed_min_rows: Option<usize>,
}

impl Default for KernelOptions {
    fn default() -> Self {
        KernelOptions {
            activations: Activations::F32,
            hand_kernels: true,
            block_tiles: true,
            packed_min_rows: None,
        }
    }
}

impl KernelOptions {
    /// The options in words, with the instruction set they run in, as `maxc profile` prints
    /// them.
    pub fn describe(&self) -> String {
        let on = |b: bool| if b { "on" } else { "off" };
        format!(
            "{} instruction set, hand kernels {}, block tiles {}, {} activations on block weights, packed kernel from {}",
            crate::isa::isa_name(),
            on(self.hand_kernels),
            on(self.block_tiles),
            self.activations.name(),
            match self.packed_min_rows {
                None => "each format's measured threshold".to_string(),
                Some(usize::MAX) => "never".to_string(),
                Some(n) => format!("{n} rows"),
            }
        )
    }
}
