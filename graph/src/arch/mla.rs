//! Multi-head latent attention (DeepSeek-V2 and V3) in the decoder's graph, built in its
//! absorbed form: the cache holds one latent per token, and attention runs in the latent space.
//!
//! Per layer, with `x` the normed hidden state, C the KV LoRA rank, R the rope dims, N the
//! non-rotating query/key dims and V the value dims per head (names are the weights that
//! [`super::deepseek`]'s weight preparation makes of the checkpoint's):
//! 1. `q = q_b(norm(q_a(x)))` (or `q_proj(x)`), computed as its non-rotating part
//!    `q_nope [T, H, N]` and its rope part `q_rope [T, H, R]` (rotated).
//! 2. `latent = norm(kv_a_proj(x)) [T, 1, C]`, `k_rope = rope(kv_a_proj_rope(x)) [T, 1, R]`.
//! 3. The key up-projection absorbed into the query: `q_lat[h] = W_UKᵀ[h] · q_nope[h]`
//!    (`kv_b_proj_k [H, C, N]`), so that `q_nope · k_nope = q_lat · latent`.
//! 4. [`Op::LatentAttention`] of `[q_lat | q_rope]` over the cached `[latent | k_rope]`: every
//!    head reads the one latent as its key and the latent's first C values as its value.
//! 5. The value up-projection after attention: `o[h] = W_UV[h] · a[h]` (`kv_b_proj_v
//!    [H, V, C]`), then `o_proj`.
//!
//! Each step is exact algebra on the checkpoint's weights; the interpreter runs the same
//! graph, and the transformers references check it. With `mla_attention: decompressed` in the
//! deployment, steps 3-5 are one [`Op::DecompressedLatentAttention`] instead (the same cache,
//! the same function, for measuring the two against each other).

use super::decoder::{DecoderBuilder, KeyPath, MlaConfig, StepInputs};
use crate::ir::{names, Dim, Op};
use crate::Result;
use petgraph::graph::NodeIndex;

impl DecoderBuilder<'_> {
    /// Layer `layer`'s latent attention block at `p` (`model.layers.N.self_attn`).
    pub(super) fn latent_attention(
        &mut self,
        p: &KeyPath,
        layer: usize,
        x: NodeIndex,
        s: &StepInputs,
        m: &MlaConfig,
    ) -> Result<NodeIndex> {
        let c = self.cfg;
        let (h, hid) = (c.num_heads, c.hidden_size);
        let (lat, r, n, v) = (
            m.kv_lora_rank,
            m.qk_rope_head_dim,
            m.qk_nope_head_dim,
            m.v_head_dim,
        );
        let bias = c.biases.qkv;
        let t = || Dim::sym(names::TOTAL_SEQ_LEN);
        let table = c.rope.table(r, self.opts.checkpoint_dtype);
        let rope = |this: &mut Self, name: String, y: NodeIndex| {
            this.b.op(
                &name,
                Op::Rope {
                    table: table.clone(),
                },
                &[y, s.positions],
            )
        };

        // Queries: the low-rank path or one projection, split into nope and rope rows.
        let (q_in, q_width, q_name) = match m.q_lora_rank {
            Some(rank) => {
                let a = self.linear(&p.pp("q_a_proj"), x, rank, hid, bias)?;
                let a = self.rms_norm_of(&p.pp("q_a_layernorm"), a, rank)?;
                (a, rank, "q_b_proj")
            }
            None => (x, hid, "q_proj"),
        };
        let q_nope = self.linear(&p.pp(format!("{q_name}_nope")), q_in, h * n, q_width, false)?;
        let q_nope = self.reshape(p.key("q_nope_heads"), q_nope, vec![t(), h.into(), n.into()])?;
        let q_rope = self.linear(&p.pp(format!("{q_name}_rope")), q_in, h * r, q_width, false)?;
        let q_rope = self.reshape(p.key("q_rope_heads"), q_rope, vec![t(), h.into(), r.into()])?;
        let q_rope = rope(self, p.key("q_rope"), q_rope)?;

        // The latent and the shared rope key.
        let latent = self.linear(&p.pp("kv_a_proj"), x, lat, hid, bias)?;
        let latent = self.rms_norm_of(&p.pp("kv_a_layernorm"), latent, lat)?;
        let latent = self.reshape(
            p.key("latent_head"),
            latent,
            vec![t(), 1.into(), lat.into()],
        )?;
        let k_rope = self.linear(&p.pp("kv_a_proj_rope"), x, r, hid, bias)?;
        let k_rope = self.reshape(p.key("k_rope_head"), k_rope, vec![t(), 1.into(), r.into()])?;
        let k_rope = rope(self, p.key("k_rope"), k_rope)?;
        let kv = self
            .b
            .op(&p.key("latent_kv"), Op::Concat, &[latent, k_rope])?;

        let w_uk = self.weight(p.pp("kv_b_proj_k").key("weight"), &[h, lat, n])?;
        let lookup = s.lookups[s.kv.slot(layer).map_or(0, |k| k.group)];
        if self.opts.runtime.mla_attention == crate::MlaAttention::Decompressed {
            let context = s.context_lengths.ok_or_else(|| crate::Error::Setting {
                field: "mla_attention".into(),
                value: "decompressed".into(),
                message: "the deployment does not set takes_batch_context_lengths, which sizes each sequence's expansion".into(),
            })?;
            let w_uv = self.weight(p.pp("kv_b_proj_v").key("weight"), &[h, v, lat])?;
            let o = self.b.op(
                &p.key("attention"),
                Op::DecompressedLatentAttention {
                    layer,
                    scale: m.softmax_scale,
                },
                &[
                    q_nope,
                    q_rope,
                    kv,
                    w_uk,
                    w_uv,
                    s.kv_cache,
                    lookup,
                    s.cache_lengths,
                    s.row_offsets,
                    context,
                ],
            )?;
            let o = self.reshape(p.key("merge_heads"), o, vec![t(), (h * v).into()])?;
            return self.row_split_linear(&p.pp("o_proj"), o, hid, h * v, c.biases.o);
        }
        // The key up-projection absorbed into the query.
        let q_lat = self
            .b
            .op(&p.key("q_absorb"), Op::HeadLinear, &[q_nope, w_uk])?;
        let q = self
            .b
            .op(&p.key("q_latent"), Op::Concat, &[q_lat, q_rope])?;

        let lookup = s.lookups[s.kv.slot(layer).map_or(0, |k| k.group)];
        let a = self.b.op(
            &p.key("attention"),
            Op::LatentAttention {
                layer,
                scale: m.softmax_scale,
                value_dim: lat,
            },
            &[q, kv, s.kv_cache, lookup, s.cache_lengths, s.row_offsets],
        )?;
        // The value up-projection, after attention.
        let w_uv = self.weight(p.pp("kv_b_proj_v").key("weight"), &[h, v, lat])?;
        let o = self.b.op(&p.key("v_expand"), Op::HeadLinear, &[a, w_uv])?;
        let o = self.reshape(p.key("merge_heads"), o, vec![t(), (h * v).into()])?;
        // Each tensor-parallel rank's heads: a partial sum over the ranks.
        self.row_split_linear(&p.pp("o_proj"), o, hid, h * v, c.biases.o)
    }
}
