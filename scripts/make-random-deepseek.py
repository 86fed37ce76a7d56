#!/usr/bin/env python3
"""Writes a DeepSeek-V3-shaped Hugging Face checkpoint of random bf16 weights, for measuring
multi-head latent attention (issue 30): DeepSeek-V3's per-head attention sizes (kv_lora_rank
512, rope 64, nope 128, v 128, a q LoRA), fewer heads, layers and experts:

    python3 scripts/make-random-deepseek.py OUT_DIR [--layers N] [--heads H]

hidden 2048, 16 heads, q_lora_rank 768, a dense first layer (ffn 2048), then 8 routed
experts (width 512) top-2 in 4 groups (2 kept), one shared expert, sigmoid routing with a
score-correction bias; vocab 8192, no tokenizer (prompts are token ids). Needs numpy
(scripts/install-py-test-deps.sh puts it in .tools/py). Normal values with std 0.02 (norm
weights 1.0, biases 0.01 · normal), from a fixed seed: the same bytes on every run.
"""
import argparse
import json
import os
import struct

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--layers", type=int, default=4)
p.add_argument("--heads", type=int, default=16)
args = p.parse_args()

hidden, ffn, vocab, heads = 2048, 2048, 8192, args.heads
q_lora, kv_lora, rope, nope, v_dim = 768, 512, 64, 128, 128
experts, expert_ffn = 8, 512
config = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": hidden,
    "intermediate_size": ffn,
    "moe_intermediate_size": expert_ffn,
    "num_hidden_layers": args.layers,
    "num_attention_heads": heads,
    "num_key_value_heads": heads,
    "q_lora_rank": q_lora,
    "kv_lora_rank": kv_lora,
    "qk_rope_head_dim": rope,
    "qk_nope_head_dim": nope,
    "v_head_dim": v_dim,
    "head_dim": rope,
    "rope_interleave": True,
    "n_routed_experts": experts,
    "num_experts_per_tok": 2,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "vocab_size": vocab,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 0,
    "eos_token_id": 1,
}

shapes = {
    "model.embed_tokens.weight": [vocab, hidden],
    "model.norm.weight": [hidden],
    "lm_head.weight": [vocab, hidden],
}
for i in range(args.layers):
    pre = f"model.layers.{i}."
    a = pre + "self_attn."
    shapes[pre + "input_layernorm.weight"] = [hidden]
    shapes[pre + "post_attention_layernorm.weight"] = [hidden]
    shapes[a + "q_a_proj.weight"] = [q_lora, hidden]
    shapes[a + "q_a_layernorm.weight"] = [q_lora]
    shapes[a + "q_b_proj.weight"] = [heads * (nope + rope), q_lora]
    shapes[a + "kv_a_proj_with_mqa.weight"] = [kv_lora + rope, hidden]
    shapes[a + "kv_a_layernorm.weight"] = [kv_lora]
    shapes[a + "kv_b_proj.weight"] = [heads * (nope + v_dim), kv_lora]
    shapes[a + "o_proj.weight"] = [hidden, heads * v_dim]
    mlps = []
    if i == 0:
        mlps.append((pre + "mlp.", ffn))
    else:
        shapes[pre + "mlp.gate.weight"] = [experts, hidden]
        shapes[pre + "mlp.gate.e_score_correction_bias"] = [experts]
        mlps.append((pre + "mlp.shared_experts.", expert_ffn))
        mlps += [(f"{pre}mlp.experts.{e}.", expert_ffn) for e in range(experts)]
    for m, width in mlps:
        shapes[m + "gate_proj.weight"] = [width, hidden]
        shapes[m + "up_proj.weight"] = [width, hidden]
        shapes[m + "down_proj.weight"] = [hidden, width]

header, offset = {}, 0
for key in sorted(shapes):
    n = int(np.prod(shapes[key])) * 2
    header[key] = {"dtype": "BF16", "shape": shapes[key], "data_offsets": [offset, offset + n]}
    offset += n
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * (-len(text) % 8)

os.makedirs(args.out, exist_ok=True)
with open(os.path.join(args.out, "config.json"), "w") as f:
    json.dump(config, f, indent=2)
rng = np.random.default_rng(0)
with open(os.path.join(args.out, "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for key in sorted(shapes):
        n = int(np.prod(shapes[key]))
        if key.endswith("norm.weight"):
            values = np.ones(n, dtype=np.float32)
        elif key.endswith("e_score_correction_bias"):
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(0.01)
        else:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
        # bf16: the upper half of the f32 bits, rounded to nearest even.
        bits = values.view(np.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        f.write(bits.astype(np.uint16).tobytes())
        del values, bits
print(args.out)
