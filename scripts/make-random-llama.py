#!/usr/bin/env python3
"""Writes a Llama-3.2-1B-shaped Hugging Face checkpoint of random bf16 weights (2.5 GB), for
measuring memory and speed at scale: config.json and one model.safetensors, written tensor by
tensor so that the script itself never holds more than one tensor. `--qwen3` writes a
Qwen3-0.6B-shaped one instead (1.2 GB: 28 layers of 1024, 16 query heads of 128 over 8 KV
heads, q/k norms, a 151,936-piece vocabulary).

    python3 scripts/make-random-llama.py OUT_DIR [--layers N] [--qwen3]

Needs numpy (scripts/install-py-test-deps.sh puts it in .tools/py). The values are normal with
std 0.02 (norm weights 1.0), from a fixed seed: the same bytes on every run.
"""
import argparse
import json
import os
import struct

import numpy as np

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--layers", type=int)
p.add_argument("--qwen3", action="store_true")
args = p.parse_args()

if args.qwen3:
    hidden, ffn, heads, kv_heads, vocab, head_dim = 1024, 3072, 16, 8, 151936, 128
    layers = args.layers or 28
else:
    hidden, ffn, heads, kv_heads, vocab = 2048, 8192, 32, 8, 128256
    head_dim = hidden // heads
    layers = args.layers or 16
args.layers = layers
config = {
    "architectures": ["Qwen3ForCausalLM" if args.qwen3 else "LlamaForCausalLM"],
    "model_type": "qwen3" if args.qwen3 else "llama",
    "hidden_size": hidden,
    "intermediate_size": ffn,
    "num_hidden_layers": args.layers,
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "head_dim": head_dim,
    "vocab_size": vocab,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
if args.qwen3:
    config.update({"rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
                   "bos_token_id": 151643, "eos_token_id": 151645})

shapes = {"model.embed_tokens.weight": [vocab, hidden], "model.norm.weight": [hidden]}
for i in range(args.layers):
    pre = f"model.layers.{i}."
    shapes[pre + "input_layernorm.weight"] = [hidden]
    shapes[pre + "post_attention_layernorm.weight"] = [hidden]
    shapes[pre + "self_attn.q_proj.weight"] = [heads * head_dim, hidden]
    shapes[pre + "self_attn.k_proj.weight"] = [kv_heads * head_dim, hidden]
    shapes[pre + "self_attn.v_proj.weight"] = [kv_heads * head_dim, hidden]
    shapes[pre + "self_attn.o_proj.weight"] = [hidden, heads * head_dim]
    shapes[pre + "mlp.gate_proj.weight"] = [ffn, hidden]
    shapes[pre + "mlp.up_proj.weight"] = [ffn, hidden]
    shapes[pre + "mlp.down_proj.weight"] = [hidden, ffn]
    if args.qwen3:
        shapes[pre + "self_attn.q_norm.weight"] = [head_dim]
        shapes[pre + "self_attn.k_norm.weight"] = [head_dim]

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
        else:
            values = rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)
        # bf16: the upper half of the f32 bits, rounded to nearest even.
        bits = values.view(np.uint32)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        f.write(bits.astype(np.uint16).tobytes())
        del values, bits
print(args.out)
