//! Multi-head latent attention computed decompressed (`KernelBody::DecompressedAttention`):
//! per sequence, its cached latents are gathered once and expanded by one matmul per head into
//! that head's keys and values, then every query row attends over them. It costs
//! `heads × (nope + value) × latent` multiply-adds per cached token and step, against the
//! absorbed form's `heads × (latent + rope)` per cached token and query row: cheaper for long
//! prefill chunks, dearer for decode (the form `maxc compile --mla-attention` chooses).

use crate::pool;
use maxc_schema::KvView;

/// The step's sequences, as the executor holds them (i32 step inputs).
pub struct Seqs<'a> {
    /// `kv_lookup_table [B, pages_per_seq]`.
    pub lookup: &'a [i32],
    /// `cache_lengths [B]`.
    pub cache_lengths: &'a [i32],
    /// `input_row_offsets [B+1]`.
    pub offsets: &'a [i32],
    /// `batch_context_lengths [B]`: each sequence's cached plus new tokens.
    pub context_lengths: &'a [i32],
    /// Columns of the lookup table.
    pub pages_per_seq: usize,
}

/// The sizes of one layer's decompressed latent attention.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// The layer's view of the one-plane cache (a slot: the latent, then the rope key).
    pub cache: KvView,
    /// Query heads.
    pub heads: usize,
    /// Rope elements per head (the slot's last ones).
    pub rope: usize,
    /// Non-rotating query/key elements per head.
    pub nope: usize,
    /// Value elements per head.
    pub value: usize,
    /// Score scale.
    pub scale: f32,
}

/// `out[T, heads, value]` of the step's rows (see the module docs). `q_nope [T, heads, nope]`,
/// `q_rope [T, heads, rope]`, `w_uk [heads, latent, nope]`, `w_uv [heads, value, latent]`.
///
/// # Safety
/// `cache` holds every page the lookup table names for positions below each sequence's cache
/// length plus its rows (the step inputs were checked); `q_nope`, `q_rope` and `out` hold the
/// step's rows.
pub unsafe fn decompressed(
    q_nope: *const f32,
    q_rope: *const f32,
    (w_uk, w_uv): (&[f32], &[f32]),
    cache: *const u8,
    out: *mut f32,
    seqs: &Seqs,
    s: Shape,
) {
    let d = s.cache.head_dim as usize;
    let lat = d - s.rope;
    let (h_count, nope, rope, value) = (s.heads, s.nope, s.rope, s.value);
    let ps = s.cache.page_size as usize;
    let out = pool::OutPtr(out);
    let rows = seqs.offsets.last().map_or(0, |&t| t.max(0) as usize);
    // SAFETY: the step's rows of queries (as the caller guarantees).
    let (q_nope, q_rope) = unsafe {
        (
            std::slice::from_raw_parts(q_nope, rows * h_count * nope),
            std::slice::from_raw_parts(q_rope, rows * h_count * rope),
        )
    };
    for b in 0..seqs.cache_lengths.len() {
        let (lo, hi) = (seqs.offsets[b] as usize, seqs.offsets[b + 1] as usize);
        if hi <= lo {
            continue;
        }
        let cached = seqs.cache_lengths[b] as usize;
        // The expansion's size, from the step input the deployment's hook adds (the executor
        // fills it with the same cache lengths and rows).
        let ctx = seqs.context_lengths[b].max(0) as usize;
        debug_assert_eq!(ctx, cached + (hi - lo));
        if ctx < cached + (hi - lo) {
            continue;
        }
        // The sequence's latents [ctx, lat] and rope keys [ctx, rope], gathered once.
        let mut latents = vec![0.0f32; ctx * lat];
        let mut ropes = vec![0.0f32; ctx * rope];
        for j in 0..ctx {
            let page = seqs.lookup[b * seqs.pages_per_seq + j / ps] as u64;
            let at = s.cache.offset(page, 0, (j % ps) as u64, 0) as usize;
            // SAFETY: the slot lies in the cache (as the caller guarantees).
            let bytes =
                unsafe { std::slice::from_raw_parts(cache.add(at), s.cache.row_bytes() as usize) };
            let slot = s.cache.dtype.decode_row(bytes, d);
            latents[j * lat..(j + 1) * lat].copy_from_slice(&slot[..lat]);
            ropes[j * rope..(j + 1) * rope].copy_from_slice(&slot[lat..]);
        }
        let chunks = pool::threads().min(h_count).max(1);
        let (latents, ropes) = (&latents, &ropes);
        pool::run(chunks, &|c| {
            let mut keys = vec![0.0f32; ctx * nope];
            let mut values = vec![0.0f32; ctx * value];
            let mut scores = vec![0.0f32; ctx];
            for h in (h_count * c / chunks)..(h_count * (c + 1) / chunks) {
                // keys = latents · w_uk[h] ([ctx, lat] × [lat, nope]); values = latents ·
                // w_uv[h]ᵀ ([ctx, lat] × [lat, value]).
                let uk = &w_uk[h * lat * nope..(h + 1) * lat * nope];
                let uv = &w_uv[h * value * lat..(h + 1) * value * lat];
                // SAFETY: the slices hold these shapes; strides describe them row-major.
                unsafe {
                    gemm::gemm::<f32>(
                        ctx,
                        nope,
                        lat,
                        keys.as_mut_ptr(),
                        1,
                        nope as isize,
                        false,
                        latents.as_ptr(),
                        1,
                        lat as isize,
                        uk.as_ptr(),
                        1,
                        nope as isize,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                    gemm::gemm::<f32>(
                        ctx,
                        value,
                        lat,
                        values.as_mut_ptr(),
                        1,
                        value as isize,
                        false,
                        latents.as_ptr(),
                        1,
                        lat as isize,
                        uv.as_ptr(),
                        lat as isize,
                        1,
                        0.0,
                        1.0,
                        false,
                        false,
                        false,
                        gemm::Parallelism::None,
                    );
                }
                for r in lo..hi {
                    let p = cached + (r - lo);
                    let qn = &q_nope[(r * h_count + h) * nope..][..nope];
                    let qr = &q_rope[(r * h_count + h) * rope..][..rope];
                    let mut m = f32::NEG_INFINITY;
                    for j in 0..=p {
                        let k = &keys[j * nope..(j + 1) * nope];
                        let kr = &ropes[j * rope..(j + 1) * rope];
                        let dot: f32 = qn.iter().zip(k).map(|(a, b)| a * b).sum::<f32>()
                            + qr.iter().zip(kr).map(|(a, b)| a * b).sum::<f32>();
                        scores[j] = dot * s.scale;
                        m = m.max(scores[j]);
                    }
                    let mut sum = 0.0;
                    for sc in &mut scores[..=p] {
                        *sc = (*sc - m).exp();
                        sum += *sc;
                    }
                    // SAFETY: head h of row r: this chunk's heads only.
                    let o = unsafe {
                        std::slice::from_raw_parts_mut(
                            out.get().add((r * h_count + h) * value),
                            value,
                        )
                    };
                    o.fill(0.0);
                    for (j, &w) in scores[..=p].iter().enumerate() {
                        let w = w / sum;
                        for (o, v) in o.iter_mut().zip(&values[j * value..(j + 1) * value]) {
                            *o += w * v;
                        }
                    }
                }
            }
        });
    }
}
