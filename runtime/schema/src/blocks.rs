//! GGUF's quantized block formats as types: each block is a `#[repr(C)]` struct of bytes
//! (alignment 1, so a weight's bytes are a slice of blocks wherever they sit), with its size
//! asserted at compile time, and [`Block::dequantize`] with the format's formulas, the reference
//! the compiler's interpreter and the runtime's kernels agree on.
//!
//! A tensor `[rows, cols]` of a block type stores each row as `cols / Block::ELEMS` blocks, in
//! order; `cols` is always a whole number of blocks.
//!
//! The dequantizers index fixed-size arrays (not zipped slices) so that they compile to vector
//! code wherever they are inlined.
#![allow(clippy::needless_range_loop)]

#[cfg(test)]
use half::f16;

/// Elements of a block of the 32-element formats.
pub const QK: usize = 32;
/// Elements of a K-quant super-block.
pub const QK_K: usize = 256;

/// The f32 value of the IEEE binary16 `bits`, exactly (subnormals, infinities and NaN
/// included), in integer operations that inline and vectorize where a library call would not.
#[inline(always)]
pub fn f16_to_f32(bits: u16) -> f32 {
    let h = bits as u32;
    let sign = (h & 0x8000) << 16;
    let exp = (h >> 10) & 0x1f;
    let man = h & 0x3ff;
    let magnitude = if exp == 0x1f {
        0x7f80_0000 | (man << 13)
    } else if exp == 0 {
        // Subnormal (or zero): man · 2^-24, exact in f32.
        let v = man as f32 * (1.0 / 16_777_216.0);
        return if sign != 0 { -v } else { v };
    } else {
        ((exp + 112) << 23) | (man << 13)
    };
    f32::from_bits(sign | magnitude)
}

#[inline(always)]
fn h(b: [u8; 2]) -> f32 {
    f16_to_f32(u16::from_le_bytes(b))
}

/// A quantized block: `ELEMS` values in `size_of::<Self>()` bytes.
pub trait Block: Copy + Sync + 'static {
    /// Values per block.
    const ELEMS: usize;
    /// Writes the block's values to `out[..ELEMS]`.
    fn dequantize(&self, out: &mut [f32]);
}

/// `d·q`, q an i8.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Values.
    pub qs: [i8; QK],
}

/// `d·(q − 8)`, q a nibble: low nibbles are elements 0..16, high nibbles 16..32.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// `d·q + m`, q a nibble (low nibbles first, as [`BlockQ4_0`]).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Offset (f16).
    pub m: [u8; 2],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// `d·(q − 16)`, q five bits: a nibble as [`BlockQ4_0`] and bit `j` of `qh` (little endian)
/// as element `j`'s fifth bit.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5_0 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Fifth bits.
    pub qh: [u8; 4],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// `d·q + m`, q five bits as [`BlockQ5_0`].
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5_1 {
    /// Scale (f16).
    pub d: [u8; 2],
    /// Offset (f16).
    pub m: [u8; 2],
    /// Fifth bits.
    pub qh: [u8; 4],
    /// Nibbles.
    pub qs: [u8; QK / 2],
}

/// Eight groups of 32: group `g` is `d·sc[g]·q − dmin·m[g]` with 6-bit `sc` and `m` packed in
/// `scales`; each 32 bytes of `qs` hold two groups (low nibbles, then high nibbles).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4K {
    /// Super-scale (f16).
    pub d: [u8; 2],
    /// Super-scale of the mins (f16).
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Nibbles.
    pub qs: [u8; QK_K / 2],
}

/// As [`BlockQ4K`] with a fifth bit per value: bit `2i` and `2i+1` of `qh[l]` are the fifth
/// bits of element `l` of groups `2i` and `2i+1`.
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ5K {
    /// Super-scale (f16).
    pub d: [u8; 2],
    /// Super-scale of the mins (f16).
    pub dmin: [u8; 2],
    /// Packed 6-bit scales and mins.
    pub scales: [u8; 12],
    /// Fifth bits.
    pub qh: [u8; QK_K / 8],
    /// Nibbles.
    pub qs: [u8; QK_K / 2],
}

/// Sixteen groups of 16: `d·scales[g]·(q − 32)`, q six bits (four from `ql`, two from `qh`).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ6K {
    /// Low four bits.
    pub ql: [u8; QK_K / 2],
    /// High two bits.
    pub qh: [u8; QK_K / 4],
    /// Group scales.
    pub scales: [i8; QK_K / 16],
    /// Super-scale (f16).
    pub d: [u8; 2],
}

const _: () = {
    assert!(std::mem::size_of::<BlockQ8_0>() == 34);
    assert!(std::mem::size_of::<BlockQ4_0>() == 18);
    assert!(std::mem::size_of::<BlockQ4_1>() == 20);
    assert!(std::mem::size_of::<BlockQ5_0>() == 22);
    assert!(std::mem::size_of::<BlockQ5_1>() == 24);
    assert!(std::mem::size_of::<BlockQ4K>() == 144);
    assert!(std::mem::size_of::<BlockQ5K>() == 176);
    assert!(std::mem::size_of::<BlockQ6K>() == 210);
};

impl BlockQ4K {
    /// Scale and min of group `j` (0..8), 6 bits each.
    #[inline(always)]
    pub fn scale_min(&self, j: usize) -> (u8, u8) {
        scale_min_k4(j, &self.scales)
    }
}

impl BlockQ5K {
    /// Scale and min of group `j` (0..8), 6 bits each.
    #[inline(always)]
    pub fn scale_min(&self, j: usize) -> (u8, u8) {
        scale_min_k4(j, &self.scales)
    }
}

/// The first 32 values of `out` as an array (block dequantizers index it without checks).
#[inline(always)]
fn first_32(out: &mut [f32]) -> &mut [f32; QK] {
    (&mut out[..QK]).try_into().expect("32 values")
}

/// Unpacks group `j`'s 6-bit scale and min from a K-quant's 12 scale bytes.
#[inline(always)]
pub fn scale_min_k4(j: usize, q: &[u8; 12]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl Block for BlockQ8_0 {
    const ELEMS: usize = QK;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = h(self.d);
        for (o, &q) in first_32(out).iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

impl Block for BlockQ4_0 {
    const ELEMS: usize = QK;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = h(self.d);
        let out = first_32(out);
        for i in 0..QK / 2 {
            out[i] = ((self.qs[i] & 0xF) as i32 - 8) as f32 * d;
            out[i + QK / 2] = ((self.qs[i] >> 4) as i32 - 8) as f32 * d;
        }
    }
}

impl Block for BlockQ4_1 {
    const ELEMS: usize = QK;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (h(self.d), h(self.m));
        let out = first_32(out);
        for i in 0..QK / 2 {
            out[i] = (self.qs[i] & 0xF) as f32 * d + m;
            out[i + QK / 2] = (self.qs[i] >> 4) as f32 * d + m;
        }
    }
}

impl Block for BlockQ5_0 {
    const ELEMS: usize = QK;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = h(self.d);
        let qh = u32::from_le_bytes(self.qh);
        let out = first_32(out);
        for j in 0..QK / 2 {
            let b0 = ((qh >> j) << 4) & 0x10;
            let b1 = (qh >> (j + 12)) & 0x10;
            out[j] = (((self.qs[j] & 0xF) as u32 | b0) as i32 - 16) as f32 * d;
            out[j + QK / 2] = (((self.qs[j] >> 4) as u32 | b1) as i32 - 16) as f32 * d;
        }
    }
}

impl Block for BlockQ5_1 {
    const ELEMS: usize = QK;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (h(self.d), h(self.m));
        let qh = u32::from_le_bytes(self.qh);
        let out = first_32(out);
        for j in 0..QK / 2 {
            let b0 = ((qh >> j) << 4) & 0x10;
            let b1 = (qh >> (j + 12)) & 0x10;
            out[j] = ((self.qs[j] & 0xF) as u32 | b0) as f32 * d + m;
            out[j + QK / 2] = ((self.qs[j] >> 4) as u32 | b1) as f32 * d + m;
        }
    }
}

impl Block for BlockQ4K {
    const ELEMS: usize = QK_K;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (h(self.d), h(self.dmin));
        let out: &mut [f32; QK_K] = (&mut out[..QK_K]).try_into().expect("256 values");
        for c in 0..4 {
            let (sc1, m1) = self.scale_min(2 * c);
            let (sc2, m2) = self.scale_min(2 * c + 1);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            for l in 0..32 {
                let q = self.qs[c * 32 + l];
                out[c * 64 + l] = d1 * (q & 0xF) as f32 - m1;
                out[c * 64 + 32 + l] = d2 * (q >> 4) as f32 - m2;
            }
        }
    }
}

impl Block for BlockQ5K {
    const ELEMS: usize = QK_K;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (h(self.d), h(self.dmin));
        let out: &mut [f32; QK_K] = (&mut out[..QK_K]).try_into().expect("256 values");
        for c in 0..4 {
            let (sc1, m1) = self.scale_min(2 * c);
            let (sc2, m2) = self.scale_min(2 * c + 1);
            let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
            let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
            for l in 0..32 {
                let (q, qh) = (self.qs[c * 32 + l], self.qh[l]);
                let b1 = ((qh >> (2 * c)) & 1) << 4;
                let b2 = ((qh >> (2 * c + 1)) & 1) << 4;
                out[c * 64 + l] = d1 * ((q & 0xF) | b1) as f32 - m1;
                out[c * 64 + 32 + l] = d2 * ((q >> 4) | b2) as f32 - m2;
            }
        }
    }
}

impl Block for BlockQ6K {
    const ELEMS: usize = QK_K;
    #[inline(always)]
    fn dequantize(&self, out: &mut [f32]) {
        let d = h(self.d);
        let out: &mut [f32; QK_K] = (&mut out[..QK_K]).try_into().expect("256 values");
        for n in 0..2 {
            let (ql, qh, sc) = (
                &self.ql[n * 64..],
                &self.qh[n * 32..],
                &self.scales[n * 8..],
            );
            let y = &mut out[n * 128..];
            for l in 0..32 {
                let is = l / 16;
                let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
                let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
                let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
                let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
                y[l] = d * sc[is] as f32 * q1 as f32;
                y[l + 32] = d * sc[is + 2] as f32 * q2 as f32;
                y[l + 64] = d * sc[is + 4] as f32 * q3 as f32;
                y[l + 96] = d * sc[is + 6] as f32 * q4 as f32;
            }
        }
    }
}

/// `bytes` as blocks of `B`; `None` where they are not a whole number of blocks.
pub fn as_blocks<B: Block>(bytes: &[u8]) -> Option<&[B]> {
    let size = std::mem::size_of::<B>();
    if !bytes.len().is_multiple_of(size) {
        return None;
    }
    // SAFETY: every block type is a `repr(C)` struct of byte arrays (alignment 1, no padding,
    // every bit pattern valid), and `bytes` holds exactly `len / size` of them.
    Some(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<B>(), bytes.len() / size) })
}

fn dequantize_as<B: Block>(bytes: &[u8], out: &mut [f32]) -> Option<()> {
    let blocks = as_blocks::<B>(bytes)?;
    if out.len() != blocks.len() * B::ELEMS {
        return None;
    }
    for (b, o) in blocks.iter().zip(out.chunks_exact_mut(B::ELEMS)) {
        b.dequantize(o);
    }
    Some(())
}

/// Something done with a block format's type: [`with_block`] calls it with the type of a
/// dtype.
pub trait BlockFn {
    /// What it gives.
    type Out;
    /// Does it with block type `B`.
    fn call<B: Block>(self) -> Self::Out;
}

/// The one list of the block formats: calls `$then!` with `DType variant => block type` for
/// each, so that every dispatch on them (this crate's [`with_block`], the kernels' per-ISA
/// tables) is generated from it. A format added here and not given a kernel somewhere is a
/// compile error there, not a silent fallback.
#[macro_export]
macro_rules! for_each_block_format {
    ($then:ident) => {
        $then! {
            Q8_0 => BlockQ8_0,
            Q4_0 => BlockQ4_0,
            Q4_1 => BlockQ4_1,
            Q5_0 => BlockQ5_0,
            Q5_1 => BlockQ5_1,
            Q4K => BlockQ4K,
            Q5K => BlockQ5K,
            Q6K => BlockQ6K,
        }
    };
}

macro_rules! with_block_fn {
    ($($dt:ident => $block:ident,)*) => {
        /// `f` called with the block type of `dtype`, or `None` where `dtype` is not a block
        /// format (generated from [`for_each_block_format`]).
        pub fn with_block<F: BlockFn>(dtype: crate::DType, f: F) -> Option<F::Out> {
            match dtype {
                $(crate::DType::$dt => Some(f.call::<$block>()),)*
                _ => None,
            }
        }
    };
}
for_each_block_format!(with_block_fn);

/// Dequantizes `bytes` of block type `dtype` into `out` (which must hold exactly their values);
/// `None` where `dtype` is not a block type or the sizes disagree.
pub fn dequantize_into(dtype: crate::DType, bytes: &[u8], out: &mut [f32]) -> Option<()> {
    struct Into<'a>(&'a [u8], &'a mut [f32]);
    impl BlockFn for Into<'_> {
        type Out = Option<()>;
        fn call<B: Block>(self) -> Option<()> {
            dequantize_as::<B>(self.0, self.1)
        }
    }
    with_block(dtype, Into(bytes, out)).flatten()
}

/// The values of `bytes` of block type `dtype`; `None` as [`dequantize_into`].
pub fn dequantize(dtype: crate::DType, bytes: &[u8]) -> Option<Vec<f32>> {
    let (n, b) = dtype.block();
    let mut out = vec![0.0; bytes.len() / b * n];
    dequantize_into(dtype, bytes, &mut out)?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;

    #[test]
    fn block_formulas() {
        let d = f16::from_f32(0.5).to_le_bytes();
        let m = f16::from_f32(-1.0).to_le_bytes();
        let mut b = d.to_vec();
        b.extend((0..32).map(|i| (i as i8 - 16) as u8));
        let y = dequantize(DType::Q8_0, &b).unwrap();
        assert_eq!((y[0], y[31]), (-8.0, 7.5));
        let mut b = d.to_vec();
        b.extend((0..16).map(|i| (i as u8) | (15 - i as u8) << 4));
        let y = dequantize(DType::Q4_0, &b).unwrap();
        assert_eq!((y[0], y[15], y[16], y[31]), (-4.0, 3.5, 3.5, -4.0));
        let mut b = d.to_vec();
        b.extend(m);
        b.extend((0..16).map(|i| (i as u8) | 3 << 4));
        let y = dequantize(DType::Q4_1, &b).unwrap();
        assert_eq!((y[0], y[15], y[16]), (-1.0, 6.5, 0.5));
        // Q5_0: element 0 has its fifth bit set (16 + 0 - 16 = 0), element 16 (bit 16) too.
        let mut b = d.to_vec();
        b.extend(((1u32) | (1 << 16)).to_le_bytes());
        b.extend([0x21u8; 16]);
        let y = dequantize(DType::Q5_0, &b).unwrap();
        assert_eq!((y[0], y[1], y[16], y[17]), (0.5, -7.5, 1.0, -7.0));
    }

    #[test]
    fn f16_conversion_is_exact_for_every_value() {
        for bits in 0..=u16::MAX {
            let want = f16::from_bits(bits).to_f32();
            let got = f16_to_f32(bits);
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn sizes_and_shapes() {
        assert_eq!(DType::Q4_1.bytes_for(64), Some(40));
        assert_eq!(DType::Q4_1.bytes_for(48), None);
        assert_eq!(DType::Q6K.bytes_for(512), Some(420));
        assert_eq!(DType::Q4K.stored_shape(&[3, 512]), Some(vec![3, 288]));
        assert_eq!(DType::Q4K.logical_shape(&[3, 288]), Some(vec![3, 512]));
        assert_eq!(DType::F32.stored_shape(&[3, 5]), Some(vec![3, 5]));
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>(), Ok(d));
        }
    }
}
