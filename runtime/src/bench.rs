//! The machine probes `maxc bench` measures rooflines against, in the same run as the model:
//! memory bandwidth (a streaming read on every core), f32 GEMM throughput (the runtime's own
//! matmul on every core), the f32 FMA peak (independent register FMAs on every core: the
//! compute ceiling no f32 kernel can pass) and the 16-bit integer dot-product peak (`vpmaddwd`
//! and a 32-bit add, the inner step of the 16-bit-activation kernels: their ceiling), each in
//! the instruction set the kernels run (`MAXC_CPU_ISA` included).

use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// A sum in 64 independent lanes (vectorizable, unlike a sequential float sum, and with
/// enough independent adds in flight to keep loads streaming).
#[inline(always)]
fn lanes(a: &[f32]) -> f32 {
    let mut acc = [0.0f32; 64];
    for c in a.chunks_exact(64) {
        for l in 0..64 {
            acc[l] += c[l];
        }
    }
    acc.iter().sum()
}

/// [`lanes`], in 256-bit registers where the CPU has AVX2.
fn lane_sum(a: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn avx2(a: &[f32]) -> f32 {
            lanes(a)
        }
        if std::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2.
            return unsafe { avx2(a) };
        }
    }
    lanes(a)
}

/// The last-level cache's size (Linux: the largest level under `cpu0/cache`), where known.
pub fn llc_bytes() -> Option<u64> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let p = e.ok()?.path();
        let level: u32 = std::fs::read_to_string(p.join("level"))
            .ok()?
            .trim()
            .parse()
            .ok()?;
        let size = std::fs::read_to_string(p.join("size")).ok()?;
        let size = size.trim();
        let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit())?);
        let scale = match unit {
            "K" => 1 << 10,
            "M" => 1 << 20,
            "G" => 1 << 30,
            _ => return None,
        };
        Some((level, digits.parse::<u64>().ok()? * scale))
    })
    .max()
    .map(|(_, bytes)| bytes)
}

/// Bytes per second that a streaming read achieves, split over the executor's threads
/// (median of 5), from memory of the page size the CPU executor keeps weights on (huge pages
/// where the kernel offers them: [`crate::artifact::WeightMemory::for_cpu`]). The buffer is
/// 256 MiB or twice the last-level cache, whichever is larger (at most 4 GiB), so that the
/// read measures memory rather than cache: some server parts have L3 caches of hundreds of MiB
/// (480 MiB on one of the guests we measure on).
pub fn bandwidth() -> f64 {
    let bytes = llc_bytes().map_or(256 << 20, |c| (2 * c).clamp(256 << 20, 4 << 30));
    let len = bytes as usize / 4;
    let mut huge = match crate::artifact::WeightMemory::for_cpu() {
        crate::artifact::WeightMemory::HugePages | crate::artifact::WeightMemory::Staged => {
            crate::hugemem::HugeBuf::zeroed(len * 4).ok()
        }
        crate::artifact::WeightMemory::Mapped => None,
    };
    let mut plain = Vec::new();
    let data: &mut [f32] = match &mut huge {
        // SAFETY: 2 MiB-aligned bytes, len · 4 of them, any bit pattern is an f32.
        Some(b) => unsafe {
            std::slice::from_raw_parts_mut(b.as_mut_slice().as_mut_ptr().cast::<f32>(), len)
        },
        None => {
            plain.resize(len, 0.0f32);
            &mut plain
        }
    };
    data.fill(1.0);
    let data: &[f32] = data;
    let threads = maxc_kernels::pool::threads();
    let part = data.len().div_ceil(threads);
    let sums: Vec<std::sync::atomic::AtomicU32> =
        (0..threads).map(|_| Default::default()).collect();
    let reps = (0..5)
        .map(|_| {
            let t = Instant::now();
            maxc_kernels::pool::run(threads, &|c| {
                let s =
                    lane_sum(&data[(c * part).min(data.len())..((c + 1) * part).min(data.len())]);
                sums[c].store(s.to_bits(), std::sync::atomic::Ordering::Relaxed);
            });
            t.elapsed().as_secs_f64()
        })
        .collect();
    (data.len() * 4) as f64 / median(reps)
}

/// FLOP per second of an f32 GEMM of 1024³ on every core (median of 5).
pub fn gemm_flops() -> f64 {
    let n = 1024;
    let a = vec![1.0f32; n * n];
    let b = vec![0.5f32; n * n];
    let mut c = vec![0.0f32; n * n];
    let reps = (0..5)
        .map(|_| {
            let t = Instant::now();
            maxc_kernels::gemm::matmul(&a, &b, None, &mut c, n, n, n);
            t.elapsed().as_secs_f64()
        })
        .collect();
    std::hint::black_box(&c);
    2.0 * (n * n * n) as f64 / median(reps)
}

/// 32-bit lanes of the vectors the kernels run (`MAXC_CPU_ISA` included), where they are
/// vectors at all.
fn vector_lanes() -> Option<u64> {
    match maxc_kernels::isa::isa() {
        maxc_kernels::isa::Isa::Avx512 => Some(16),
        maxc_kernels::isa::Isa::Avx2 => Some(8),
        maxc_kernels::isa::Isa::Baseline => None,
    }
}

/// Runs `kernel` on every executor thread at once, 5 times: the threads, and the median
/// seconds of a run.
fn on_every_thread(kernel: &(dyn Fn() + Sync)) -> (u64, f64) {
    let threads = maxc_kernels::pool::threads();
    let reps = (0..5)
        .map(|_| {
            let t = Instant::now();
            maxc_kernels::pool::run(threads, &|_| kernel());
            t.elapsed().as_secs_f64()
        })
        .collect();
    (threads as u64, median(reps))
}

/// FLOP per second of independent f32 FMAs in registers on every executor thread (median of
/// 5), where the CPU has AVX-512F or AVX2 + FMA.
pub fn fma_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const ITERS: u64 = 4_000_000;
        /// Twelve chains of FMAs, enough to cover the latency on two FMA units.
        #[target_feature(enable = "avx512f,fma")]
        unsafe fn avx512() -> f32 {
            let m = _mm512_set1_ps(0.999_999_9);
            let c = _mm512_set1_ps(1e-7);
            let mut a = [_mm512_set1_ps(1.0); 12];
            for _ in 0..std::hint::black_box(ITERS / 1024) {
                // Opaque to the optimizer once per 1024 rounds, so that no round is folded.
                a = std::hint::black_box(a);
                for _ in 0..1024 {
                    for v in a.iter_mut() {
                        *v = _mm512_fmadd_ps(*v, m, c);
                    }
                }
            }
            a.iter().map(|v| _mm512_reduce_add_ps(*v)).sum()
        }
        #[target_feature(enable = "avx2,fma")]
        unsafe fn avx2() -> f32 {
            let m = _mm256_set1_ps(0.999_999_9);
            let c = _mm256_set1_ps(1e-7);
            let mut a = [_mm256_set1_ps(1.0); 12];
            for _ in 0..std::hint::black_box(ITERS / 1024) {
                // Opaque to the optimizer once per 1024 rounds, so that no round is folded.
                a = std::hint::black_box(a);
                for _ in 0..1024 {
                    for v in a.iter_mut() {
                        *v = _mm256_fmadd_ps(*v, m, c);
                    }
                }
            }
            let mut out = [0.0f32; 8];
            // SAFETY: AVX2, 8 floats.
            unsafe {
                _mm256_storeu_ps(
                    out.as_mut_ptr(),
                    a.iter()
                        .fold(_mm256_setzero_ps(), |s, v| _mm256_add_ps(s, *v)),
                )
            };
            out.iter().sum()
        }
        let lanes = vector_lanes()?;
        // SAFETY: the kernels' instruction set, which this CPU has.
        let (threads, s) = on_every_thread(&|| unsafe {
            std::hint::black_box(if lanes == 16 { avx512() } else { avx2() });
        });
        return Some((threads * ITERS * 12 * lanes * 2) as f64 / s);
    }
    #[allow(unreachable_code)]
    None
}

/// Integer operations per second (two per multiply-add) of independent 16-bit dot products
/// in registers (`vpmaddwd`, then a 32-bit add: 2 multiply-adds per 32-bit lane) on every
/// executor thread (median of 5), where the kernels run AVX2 or AVX-512: the ceiling of the
/// 16-bit-activation kernels, as [`fma_peak`] is the f32 kernels'.
pub fn int16_peak() -> Option<f64> {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::*;
        const ITERS: u64 = 4_000_000;
        /// Twelve chains of dot products, each added into its own sum.
        #[target_feature(enable = "avx512f,avx512bw")]
        unsafe fn avx512() -> i32 {
            let m = _mm512_set1_epi16(3);
            let mut a = [_mm512_set1_epi16(1); 12];
            let mut s = [_mm512_setzero_si512(); 12];
            for _ in 0..std::hint::black_box(ITERS / 1024) {
                // Opaque to the optimizer once per 1024 rounds, so that no round is folded.
                a = std::hint::black_box(a);
                for _ in 0..1024 {
                    for (s, a) in s.iter_mut().zip(&a) {
                        *s = _mm512_add_epi32(*s, _mm512_madd_epi16(*a, m));
                    }
                }
                s = std::hint::black_box(s);
            }
            s.iter()
                .map(|v| _mm512_reduce_add_epi32(*v))
                .fold(0, i32::wrapping_add)
        }
        #[target_feature(enable = "avx2")]
        unsafe fn avx2() -> i32 {
            let m = _mm256_set1_epi16(3);
            let mut a = [_mm256_set1_epi16(1); 12];
            let mut s = [_mm256_setzero_si256(); 12];
            for _ in 0..std::hint::black_box(ITERS / 1024) {
                // Opaque to the optimizer once per 1024 rounds, so that no round is folded.
                a = std::hint::black_box(a);
                for _ in 0..1024 {
                    for (s, a) in s.iter_mut().zip(&a) {
                        *s = _mm256_add_epi32(*s, _mm256_madd_epi16(*a, m));
                    }
                }
                s = std::hint::black_box(s);
            }
            let v = s
                .iter()
                .fold(_mm256_setzero_si256(), |t, v| _mm256_add_epi32(t, *v));
            _mm256_extract_epi32::<0>(v)
        }
        let lanes = vector_lanes()?;
        // SAFETY: the kernels' instruction set, which this CPU has.
        let (threads, s) = on_every_thread(&|| unsafe {
            std::hint::black_box(if lanes == 16 { avx512() } else { avx2() });
        });
        // Two multiply-adds per 32-bit lane, two operations each.
        return Some((threads * ITERS * 12 * lanes * 2 * 2) as f64 / s);
    }
    #[allow(unreachable_code)]
    None
}

/// The process's peak resident memory in bytes (`VmHWM`), where the system reports it.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the peak resident memory [`peak_rss`] reads to what is resident now (Linux:
/// `/proc/self/clear_refs`), so that a probe's buffer, freed, does not count as the model's.
pub fn reset_peak_rss() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}
