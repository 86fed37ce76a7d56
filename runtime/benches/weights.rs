//! `cargo bench -p maxc-runtime --bench weights`: the weight kernels at SmolLM2's decode and
//! prefill shapes, per storage format: time per call, weight bytes streamed per second, and the
//! ratio to the memory-bandwidth probe of `maxc bench` measured in the same run, and each hand
//! kernel's speed-up over the generic one. Where an executor repacks the format at load
//! (`matmul::repacking`: Q5_0 as Q8_0, bf16 in column panels), the repacked weights' time too.

use maxc_kernels::isa::isa_name;
use maxc_kernels::matmul::{matmul, repack, repacked_len, repacking, MatmulPlan};
use maxc_kernels::options::{Activations, KernelOptions};
use maxc_runtime::bench::bandwidth;
use maxc_runtime::schema::DType;
use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let threads = rayon::current_num_threads();
    let bw = bandwidth();
    println!(
        "isa {}, {threads} threads, bandwidth probe {:.1} GB/s",
        isa_name(),
        bw / 1e9
    );
    let formats = [
        DType::F32,
        DType::BF16,
        DType::F16,
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
        DType::Q4K,
        DType::Q5K,
        DType::Q6K,
    ];
    // A stack of weights larger than the caches, cycled through, so each call streams from
    // memory as decode does.
    // MAXC_BENCH_N and MAXC_BENCH_K change the shape (a launch's fixed costs show at small n).
    let (n, k) = (
        std::env::var("MAXC_BENCH_N")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1536usize),
        std::env::var("MAXC_BENCH_K")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(768usize),
    );
    // MAXC_BENCH_COPIES=1 keeps the weights in cache (compute speed alone).
    let copies = std::env::var("MAXC_BENCH_COPIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48usize);
    // MAXC_BENCH_ROWS=1,8 and MAXC_BENCH_FORMATS=q4_1,bf16 narrow the run.
    let pick = |var: &str| {
        std::env::var(var)
            .ok()
            .map(|v| v.split(',').map(str::to_owned).collect::<Vec<_>>())
    };
    let rows_picked = pick("MAXC_BENCH_ROWS");
    let formats_picked = pick("MAXC_BENCH_FORMATS");
    // MAXC_BENCH_ROWS picks any row counts (default 1, 4, 8, 128).
    let row_counts: Vec<usize> = match &rows_picked {
        Some(p) => p.iter().filter_map(|r| r.trim().parse().ok()).collect(),
        None => vec![1, 4, 8, 128],
    };
    for rows in row_counts {
        println!("rows {rows}: [{n}, {k}] weights, {copies} copies cycled");
        for dtype in formats {
            if formats_picked
                .as_ref()
                .is_some_and(|p| !p.iter().any(|f| f == dtype.name()))
            {
                continue;
            }
            let bytes = dtype.bytes_for((n * k) as u64).unwrap() as usize;
            // The copies in one buffer on huge pages where the runtime keeps weights there.
            let mut store = maxc_runtime::hugemem::HugeBuf::zeroed(copies * bytes).unwrap();
            for (c, w) in store.as_mut_slice().chunks_exact_mut(bytes).enumerate() {
                for (i, b) in w.iter_mut().enumerate() {
                    *b = ((i * 131 + c * 7) % 251) as u8;
                    if matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
                        && i % dtype.size() == dtype.size() - 1
                    {
                        // Small finite values.
                        *b = 0x3c;
                    }
                }
            }
            let ws: Vec<&[u8]> = store.chunks_exact(bytes).collect();
            // The repacked copies, where the format has a repacked form here.
            let repacked = repacking(dtype, &KernelOptions::default()).map(|r| {
                let len = repacked_len(r, n, k).next_multiple_of(64);
                let mut buf = maxc_runtime::hugemem::HugeBuf::zeroed(copies * len).unwrap();
                for (w, dst) in ws.iter().zip(buf.as_mut_slice().chunks_exact_mut(len)) {
                    assert!(repack(dtype, r, w, &mut dst[..repacked_len(r, n, k)], n, k));
                }
                let plan = MatmulPlan::with_layout(r.to, k, r.layout, &KernelOptions::default());
                (buf, len, plan)
            });
            // Activations 64-byte aligned, as the executor's arena lays them out (a vector
            // load that crosses a cache line costs about twice one that does not).
            let mut x_store = vec![0.0f32; rows * k + 16];
            let skip = x_store.as_ptr().align_offset(64);
            let x = &mut x_store[skip..skip + rows * k];
            for (i, v) in x.iter_mut().enumerate() {
                *v = (i % 17) as f32 * 0.01;
            }
            let x = &*x;
            let mut out = vec![0.0f32; rows * n];
            let calls = if rows >= 128 { 24 } else { 240 };
            let mut time = |opts: KernelOptions| {
                let reps: Vec<f64> = (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        for c in 0..calls {
                            matmul(
                                x,
                                ws[c % copies],
                                dtype,
                                &mut out,
                                rows,
                                n,
                                k,
                                threads,
                                &opts,
                            );
                        }
                        t.elapsed().as_secs_f64() / calls as f64
                    })
                    .collect();
                median(reps)
            };
            // Interleaved, so that the machine's drift hits every variant alike.
            let (mut ss, mut gs, mut ps, mut ts, mut ks) = (vec![], vec![], vec![], vec![], vec![]);
            let (mut qs, mut is, mut rs) = (vec![], vec![], vec![]);
            let mut out_repacked = vec![0.0f32; rows * n];
            let best = KernelOptions::default();
            for _ in 0..3 {
                ss.push(time(best));
                gs.push(time(KernelOptions {
                    hand_kernels: false,
                    ..best
                }));
                // Tiles straight on blocks against dequantized panels, where both run.
                ps.push(time(KernelOptions {
                    block_tiles: false,
                    ..best
                }));
                // Register tiles against the packed kernel, whichever the default picks.
                ts.push(time(KernelOptions {
                    packed_min_rows: Some(usize::MAX),
                    ..best
                }));
                ks.push(time(KernelOptions {
                    packed_min_rows: Some(1),
                    ..best
                }));
                // 8-bit activations (block formats of a few rows; the others as before).
                qs.push(time(KernelOptions {
                    activations: Activations::Q8,
                    ..best
                }));
                // 16-bit activations (likewise).
                is.push(time(KernelOptions {
                    activations: Activations::I16,
                    ..best
                }));
                if let Some((buf, len, plan)) = &repacked {
                    let reps: Vec<f64> = (0..5)
                        .map(|_| {
                            let t = Instant::now();
                            for c in 0..calls {
                                let w = &buf.as_slice()[(c % copies) * len..][..*len];
                                plan.run(x, w, &mut out_repacked, rows, n, threads);
                            }
                            t.elapsed().as_secs_f64() / calls as f64
                        })
                        .collect();
                    rs.push(median(reps));
                }
            }
            let (s, generic, panels) = (median(ss), median(gs), median(ps));
            let (tiles, packed, q8, i16) = (median(ts), median(ks), median(qs), median(is));
            let gbs = bytes as f64 / s;
            let repacked = if rs.is_empty() {
                String::new()
            } else {
                let r = median(rs);
                format!("  repacked {:>7.1} us ({:.2}x)", r * 1e6, s / r)
            };
            println!(
                "  {:>5}  {:>8.1} us  {:>6.1} GB/s  {:>5.2} of bandwidth  {:>6.1} GFLOP/s  {:>5.2}x the generic kernel  {:>5.2}x panels  tiles {:>7.1} us  packed {:>7.1} us  q8 activations {:>7.1} us ({:.2}x)  i16 activations {:>7.1} us ({:.2}x){}",
                dtype.name(),
                s * 1e6,
                gbs / 1e9,
                gbs / bw,
                2.0 * (rows * n * k) as f64 / s / 1e9,
                generic / s,
                panels / s,
                tiles * 1e6,
                packed * 1e6,
                q8 * 1e6,
                s / q8,
                i16 * 1e6,
                s / i16,
                repacked
            );
        }
    }
}
