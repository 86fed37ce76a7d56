"""A Hugging Face fixture (config.json + bf16 model.safetensors) written as GGUF the way
llama.cpp's convert_hf_to_gguf.py writes it for the Llama (q/k rows permuted to adjacent pairs,
as LlamaModel.permute), Qwen2, Qwen3, Qwen3-MoE, Phi-3, Gemma 3 and DeepSeek-V3 families, without torch (which the converter imports and CI does not install): gguf-py's own
GGUFWriter, its tensor-name map for the architecture (the table the converter renames with), the
metadata keys the converter's Qwen2Model/Qwen3Model/Qwen3MoeModel/Phi3MiniModel/Gemma3Model set,
the weights kept in bf16 (1-D ones, norms and biases, in f32 as the converter writes them), and
q/k left unpermuted but for `llama` (as the converter).

Per family, as the converter does:
- Gemma 3: norm weights written as f32 with their `+ 1` added (the converter adds in the
  checkpoint's dtype; here the sum is exact in f32, so that the file holds the reference's
  values).
- Qwen3-MoE (Qwen2MoeModel.modify_tensors): each layer's experts stacked into one 3-D tensor per
  projection, experts outermost (`ffn_{gate,up,down}_exps`); the router is `ffn_gate_inp`.
  A dense layer (`mlp_only_layers`) is something the converter refuses (its Qwen3-MoE name table
  has no dense MLP); it is written under the dense names of the Qwen3 table.
- Phi-3 (Phi3MiniModel): `qkv_proj` and `gate_up_proj` kept fused (`attn_qkv`, `ffn_up`), no
  key_length, `rope.dimension_count` the rotary width `int(partial_rotary_factor * hidden) //
  heads`, the sliding window (0 for none), the original context, and with longrope the
  attention factor and the factors as f32 tensors `rope_factors_long` / `rope_factors_short`.

`{arch}.vocab_size` stands in for the tokenizer metadata (the fixtures' test tokenizer has no
GGUF form). transformers 5 configs keep the rotary fields in `rope_parameters`, where older
configs (the converter's) had `rope_theta` and `rope_scaling`: both are read.

- DeepSeek-V3 (DeepseekV2Model, `deepseek2`): MLA as MQA of one latent head
  (`head_count_kv` 1, `key_length` kv_lora_rank + rope, `value_length` kv_lora_rank, the
  per-head sizes in `key_length_mla` / `value_length_mla`), `kv_b_proj` split into `attn_k_b`
  (each head's key rows, transposed: [heads, kv_lora_rank, nope]) and `attn_v_b`, the experts
  stacked, the shared experts `ffn_*_shexp`, the router's bias `exp_probs_b.bias` (f32), sigmoid
  gating, the group counts, the routed scaling factor and `expert_weights_norm`; rope rows as
  the checkpoint has them (llama.cpp rotates adjacent pairs for deepseek2).

  With `--kv-b`, as older converters wrote it: `attn_kv_b` whole, the per-head sizes in
  `key_length` / `value_length`, `head_count_kv` the head count, no `*_mla` keys.

With `--dummy-vocab`, a placeholder GPT-2 vocabulary of `vocab_size` pieces (one merge), so that
llama.cpp loads a checkpoint without a tokenizer (scripts/bench-mla.sh's random one; llama-bench
feeds token ids).

Usage: hf_to_gguf.py FIXTURE_DIR OUT.gguf [--kv-b] [--dummy-vocab]
"""
import json
import math
import struct
import sys

import gguf
import numpy as np

src, dst = sys.argv[1], sys.argv[2]
legacy_kv_b = "--kv-b" in sys.argv[3:]
dummy_vocab = "--dummy-vocab" in sys.argv[3:]
cfg = json.load(open(f"{src}/config.json"))
arch_name = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "DeepseekV3ForCausalLM": "deepseek2",
}[cfg["architectures"][0]]
arch = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
    "qwen3moe": gguf.MODEL_ARCH.QWEN3MOE,
    "phi3": gguf.MODEL_ARCH.PHI3,
    "gemma3": gguf.MODEL_ARCH.GEMMA3,
    "deepseek2": gguf.MODEL_ARCH.DEEPSEEK2,
}[arch_name]

with open(f"{src}/model.safetensors", "rb") as f:
    (n,) = struct.unpack("<Q", f.read(8))
    header = json.loads(f.read(n))
    data = f.read()

rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
rope_theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
n_layers = cfg["num_hidden_layers"]

w = gguf.GGUFWriter(dst, arch_name)
if arch_name == "phi3":
    # Phi3MiniModel.set_gguf_parameters (it does not call TextModel's).
    hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    rot_pct = cfg.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))
    rope_dims = int(rot_pct * hidden) // heads
    orig = cfg["original_max_position_embeddings"]
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_rope_scaling_orig_ctx_len(orig)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(n_layers)
    w.add_head_count(heads)
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(rope_dims)
    w.add_rope_freq_base(rope_theta)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    # Phi3MiniModel.generate_extra_tensors.
    if rope.get("rope_type", rope.get("type", "default")) in ("longrope", "su"):
        scale = cfg["max_position_embeddings"] / orig
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0
        w.add_rope_scaling_attn_factors(attn)
        long, short = rope["long_factor"], rope["short_factor"]
        assert len(long) == len(short) == rope_dims // 2, (len(long), rope_dims)
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                     np.array(long, dtype=np.float32))
        w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                     np.array(short, dtype=np.float32))
elif arch_name == "deepseek2":
    # DeepseekV2Model.set_gguf_parameters (TextModel's with num_key_value_heads = 1, then its
    # own; head_dim's key_length left out, which the MLA sizes replace).
    kv_lora, rope_dim = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_attention_heads"] if legacy_kv_b else 1)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n_experts = cfg["n_routed_experts"]
    w.add_expert_count(n_experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    if cfg.get("q_lora_rank") is not None:
        w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(kv_lora)
    if legacy_kv_b:
        w.add_key_length(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length(cfg["v_head_dim"])
    else:
        w.add_key_length(kv_lora + rope_dim)
        w.add_value_length(kv_lora)
        w.add_key_length_mla(cfg["qk_nope_head_dim"] + rope_dim)
        w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg.get("n_shared_experts", 0))
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_rope_dimension_count(rope_dim)
else:
    # TextModel.set_gguf_parameters, then the family's.
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    n_experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if n_experts is not None:
        w.add_expert_count(n_experts)
    if cfg.get("num_experts_per_tok") is not None:
        w.add_expert_used_count(cfg["num_experts_per_tok"])
    if cfg.get("head_dim"):
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    if arch_name == "qwen3moe":
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch_name == "llama":
        # LlamaModel.set_gguf_parameters.
        w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    if arch_name == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        rope = cfg["rope_parameters"]["full_attention"]
        w.add_rope_freq_base(rope["rope_theta"])
w.add_vocab_size(cfg["vocab_size"])
if dummy_vocab:
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    pieces = [f"<t{i}>" for i in range(cfg["vocab_size"])]
    pieces[2:5] = ["a", "b", "ab"]
    w.add_token_list(pieces)
    w.add_token_types([gguf.TokenType.NORMAL] * cfg["vocab_size"])
    w.add_token_merges(["a b"])
    w.add_bos_token_id(cfg.get("bos_token_id", 0))
    w.add_eos_token_id(cfg.get("eos_token_id", 1))
w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)


def tensor(key):
    """The bf16 bits of checkpoint tensor `key`, shaped."""
    info = header[key]
    assert info["dtype"] == "BF16", key
    a, b = info["data_offsets"]
    return np.frombuffer(data[a:b], dtype=np.uint16).reshape(info["shape"])


def add_bf16(name, raw):
    if raw.ndim <= 1:
        # The converter keeps 1-D tensors (norms, biases) in f32: exact for bf16 values.
        w.add_tensor(name, (raw.astype(np.uint32) << 16).view(np.float32))
        return
    w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)


names = gguf.get_tensor_name_map(arch, n_layers)
dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n_layers)
experts = {}
for key in sorted(header):
    if key == "__metadata__":
        continue
    if arch_name == "deepseek2" and key.endswith("kv_b_proj.weight") and not legacy_kv_b:
        # DeepseekV2Model.modify_tensors: per head [nope rows | v rows], keys transposed.
        heads, nope, v_dim = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        kv_b = tensor(key).reshape(heads, nope + v_dim, -1)
        k_b = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))
        v_b = np.ascontiguousarray(kv_b[:, nope:, :])
        for part, raw in (("k_b_proj", k_b), ("v_b_proj", v_b)):
            name = names.get_name(key.replace("kv_b_proj", part), try_suffixes=(".weight",))
            assert name is not None, key
            add_bf16(name, raw)
        continue
    if arch_name == "deepseek2" and key.endswith("e_score_correction_bias"):
        name = names.get_name(key.replace("e_score_correction_bias", "e_score_correction.bias"),
                              try_suffixes=(".bias",))
        assert name is not None, key
        w.add_tensor(name, (tensor(key).astype(np.uint32) << 16).view(np.float32))
        continue
    if arch_name in ("qwen3moe", "deepseek2") and ".mlp.experts." in key:
        # model.layers.L.mlp.experts.E.PROJ.weight, gathered and stacked below.
        parts = key.split(".")
        layer, expert, proj = int(parts[2]), int(parts[5]), parts[6]
        experts.setdefault((layer, proj), {})[expert] = tensor(key)
        continue
    raw = tensor(key)
    name = names.get_name(key, try_suffixes=(".weight", ".bias"))
    if name is None and arch_name == "qwen3moe":
        name = dense_names.get_name(key, try_suffixes=(".weight", ".bias"))
    assert name is not None, key
    if arch_name == "llama" and key.endswith(("q_proj.weight", "k_proj.weight")):
        # LlamaModel.permute: each head's rows from rotate-half to adjacent pairs.
        n_head = cfg["num_attention_heads"]
        if key.endswith("k_proj.weight"):
            n_head = cfg["num_key_value_heads"]
        raw = (raw.reshape(n_head, 2, raw.shape[0] // n_head // 2, *raw.shape[1:])
               .swapaxes(1, 2).reshape(raw.shape))
    if arch_name == "gemma3" and key.endswith("norm.weight"):
        values = (raw.astype(np.uint32) << 16).view(np.float32) + np.float32(1.0)
        w.add_tensor(name, values)
        continue
    add_bf16(name, raw)
for (layer, proj), by_expert in sorted(experts.items()):
    assert sorted(by_expert) == list(range(n_experts)), (layer, proj, sorted(by_expert))
    stacked = np.stack([by_expert[e] for e in range(n_experts)], axis=0)
    name = names.get_name(f"model.layers.{layer}.mlp.experts.{proj}.weight", try_suffixes=(".weight",))
    assert name is not None, (layer, proj)
    add_bf16(name, stacked)

w.write_header_to_file()
w.write_kv_data_to_file()
w.write_tensors_to_file()
w.close()
