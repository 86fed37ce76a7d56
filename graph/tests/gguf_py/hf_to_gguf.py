"""A Hugging Face fixture (config.json + bf16 model.safetensors) written as GGUF the way
llama.cpp's convert_hf_to_gguf.py writes it for the Qwen2, Qwen3 and Gemma 3 families, without
torch (which the converter imports and CI does not install): gguf-py's own GGUFWriter, its
tensor-name map for the architecture (the table the converter renames with), the metadata keys
the converter's Qwen2Model/Qwen3Model/Gemma3Model set, the weights kept in bf16, and q/k left
unpermuted (the converter permutes only for `llama`). Gemma's norm weights are written as f32
with their `+ 1` added, as the converter does (it adds in the checkpoint's dtype; here the sum
is exact in f32, so that the file holds the reference's values). `{arch}.vocab_size` stands
in for the tokenizer metadata (the fixtures' test tokenizer has no GGUF form).

Usage: hf_to_gguf.py FIXTURE_DIR OUT.gguf
"""
import json
import struct
import sys

import gguf
import numpy as np

src, dst = sys.argv[1], sys.argv[2]
cfg = json.load(open(f"{src}/config.json"))
arch_name = {
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}[cfg["architectures"][0]]
arch = {
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
}[arch_name]

with open(f"{src}/model.safetensors", "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    data = f.read()

w = gguf.GGUFWriter(dst, arch_name)
w.add_block_count(cfg["num_hidden_layers"])
w.add_context_length(cfg["max_position_embeddings"])
w.add_embedding_length(cfg["hidden_size"])
w.add_feed_forward_length(cfg["intermediate_size"])
w.add_head_count(cfg["num_attention_heads"])
w.add_head_count_kv(cfg["num_key_value_heads"])
rope = cfg.get("rope_parameters") or {}
w.add_rope_freq_base(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
if cfg.get("head_dim"):
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
w.add_vocab_size(cfg["vocab_size"])
if arch_name == "gemma3":
    w.add_sliding_window(cfg["sliding_window"])
    rope = cfg["rope_parameters"]["full_attention"]
    w.add_rope_freq_base(rope["rope_theta"])
w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)

names = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
for key, info in sorted(header.items()):
    if key == "__metadata__":
        continue
    assert info["dtype"] == "BF16", key
    a, b = info["data_offsets"]
    raw = np.frombuffer(data[a:b], dtype=np.uint16).reshape(info["shape"])
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    assert name is not None, key
    if arch_name == "gemma3" and key.endswith("norm.weight"):
        values = (raw.astype(np.uint32) << 16).view(np.float32) + np.float32(1.0)
        w.add_tensor(name, values)
        continue
    w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
