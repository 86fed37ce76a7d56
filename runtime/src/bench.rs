//! The machine probes `maxc bench` measures rooflines against, in the same run as the model:
//! memory bandwidth (a streaming read on every core) and f32 GEMM throughput (the `gemm`
//! crate on every core).

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

/// Bytes per second that a streaming read of 256 MiB achieves, split over the executor's
/// threads (median of 5).
pub fn bandwidth() -> f64 {
    let data = vec![1.0f32; 64 << 20];
    let threads = crate::cpu::pool::threads();
    let part = data.len().div_ceil(threads);
    let sums: Vec<std::sync::atomic::AtomicU32> =
        (0..threads).map(|_| Default::default()).collect();
    let reps = (0..5)
        .map(|_| {
            let t = Instant::now();
            crate::cpu::pool::run(threads, &|c| {
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
            crate::cpu::library::matmul(&a, &b, None, &mut c, n, n, n);
            t.elapsed().as_secs_f64()
        })
        .collect();
    std::hint::black_box(&c);
    2.0 * (n * n * n) as f64 / median(reps)
}

/// The process's peak resident memory in bytes (`VmHWM`), where the system reports it.
pub fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
