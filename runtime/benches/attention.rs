//! `cargo bench -p maxc-runtime --bench attention`: batch-1 decode attention over long
//! contexts, SmolLM2-135M's shape (30 layers, 9 query heads over 3 KV heads of 64, pages of
//! 128 tokens), for each KV cache dtype: every layer's attention in turn, as a decode step
//! runs them, over a cache far larger than the last-level cache (so each layer's keys and
//! values come from memory, as they do between the weights' reads).
//!
//! Prints microseconds per layer and the cache read per second, medians of the steps.
//! `MAXC_BENCH_CONTEXT` (default `2048,8192`), `MAXC_BENCH_STEPS` (default 24),
//! `MAXC_BENCH_KV` (default every dtype), `MAXC_BENCH_KV_HEADS` (default 3, each with three
//! query heads); `MAXC_CPU_ISA=avx2` runs the AVX2 kernels.

use maxc_kernels::attention::{attention, available, Seqs, Shape};
use maxc_schema::{KvDtype, KvView};
use std::time::Instant;

fn main() {
    if !available() {
        println!("skipped: the attention kernels need AVX-512 or AVX2 + FMA");
        return;
    }
    let contexts: Vec<usize> = std::env::var("MAXC_BENCH_CONTEXT")
        .unwrap_or_else(|_| "2048,8192".into())
        .split(',')
        .filter_map(|c| c.trim().parse().ok())
        .collect();
    let steps: usize = std::env::var("MAXC_BENCH_STEPS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(24);
    let kinds: Vec<KvDtype> = match std::env::var("MAXC_BENCH_KV") {
        Ok(list) => KvDtype::ALL
            .into_iter()
            .filter(|d| list.split(',').any(|n| n.trim() == d.to_string()))
            .collect(),
        Err(_) => KvDtype::ALL.to_vec(),
    };
    let threads = maxc_kernels::pool::threads();
    let kv_heads: usize = std::env::var("MAXC_BENCH_KV_HEADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(3);
    let (layers, heads, hd, page) = (30usize, 3 * kv_heads, 64usize, 128usize);
    println!("{threads} threads, ISA {:?}", maxc_kernels::isa::isa());
    for &ctx in &contexts {
        let pages = (ctx + 1).div_ceil(page);
        for &dtype in &kinds {
            let view = |layer: usize| KvView {
                layer: layer as u64,
                num_layers: layers as u64,
                planes: 2,
                kv_heads: kv_heads as u64,
                head_dim: hd as u64,
                page_size: page as u64,
                dtype,
            };
            let page_bytes = view(0).page_bytes() as usize;
            // Made-up rows, each stored in the dtype.
            let row_bytes = dtype.row_bytes(hd as u64) as usize;
            // On transparent huge pages where the kernel gives them, as the executor's cache.
            let mut huge = maxc_runtime::hugemem::HugeBuf::zeroed(pages * page_bytes).ok();
            let mut heap = if huge.is_some() {
                Vec::new()
            } else {
                vec![0u8; pages * page_bytes]
            };
            let cache: &mut [u8] = match &mut huge {
                Some(h) => h.as_mut_slice(),
                None => &mut heap,
            };
            let mut row = vec![0f32; hd];
            for (i, out) in cache.chunks_mut(row_bytes).enumerate() {
                for (d, v) in row.iter_mut().enumerate() {
                    *v = ((((i * hd + d) * 2654435761usize) >> 7) % 2001) as f32 / 1000.0 - 1.0;
                }
                dtype.encode_row(&row, out);
            }
            // The pages in a shuffled order, as a long-running server's pool hands them out.
            let lookup: Vec<i32> = (0..pages).map(|i| ((i * 37) % pages) as i32).collect();
            let (offsets, lengths) = ([0i32, 1], [ctx as i32]);
            let seqs = Seqs {
                offsets: &offsets,
                cache_lengths: &lengths,
                lookup: &lookup,
                pages_per_seq: pages,
            };
            let q: Vec<f32> = (0..heads * hd)
                .map(|i| (((i * 40503usize) >> 3) % 1999) as f32 / 400.0 - 2.5)
                .collect();
            let mut out = vec![0f32; heads * hd];
            let mut times = Vec::with_capacity(steps);
            for _ in 0..steps + 2 {
                let t = Instant::now();
                for layer in 0..layers {
                    let shape = Shape {
                        cache: view(layer),
                        heads,
                        scale: 1.0 / (hd as f32).sqrt(),
                        window: None,
                        value_dim: hd,
                    };
                    // SAFETY: the kernels run here (`available`); q and out hold one row of
                    // every head, and every page the lookup names lies in the cache.
                    unsafe {
                        attention(
                            q.as_ptr(),
                            cache.as_ptr(),
                            out.as_mut_ptr(),
                            &seqs,
                            shape,
                            threads,
                        )
                    };
                }
                times.push(t.elapsed().as_secs_f64() / layers as f64);
            }
            assert!(out.iter().all(|v| v.is_finite()), "finite outputs");
            times.drain(..2);
            times.sort_by(f64::total_cmp);
            let med = times[times.len() / 2];
            let read = 2 * kv_heads * (ctx + 1) * row_bytes;
            println!(
                "context {ctx:>6} {dtype:>5}: {:>8.1} us/layer  {:>6.1} GB/s of cache  (min {:.1})",
                med * 1e6,
                read as f64 / med / 1e9,
                times[0] * 1e6
            );
        }
    }
}
