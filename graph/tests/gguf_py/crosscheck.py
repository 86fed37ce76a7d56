"""gguf-py's reference quantizers and dequantizers (numpy, independent of maxc) on maxc's
inputs: reads IN (safetensors), writes OUT (safetensors).

IN holds `x` (f32 [rows, cols]); `raw.<type>` (blocks, as f16 pairs, of any content, per GGUF type name);
`ours.<type>` (blocks, as f16 pairs, maxc's quantizer made of `x`). OUT gets `quant.<type>` (gguf-py's
blocks of `x`, for the types gguf-py quantizes), `deq_raw.<type>` and `deq_ours.<type>` (f32).
"""
import sys

import numpy as np
from gguf import GGMLQuantizationType as T
from gguf import quants
from safetensors.numpy import load_file, save_file

src, dst = sys.argv[1], sys.argv[2]
t = load_file(src)
x = t["x"]
out = {}
for name in ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]:
    out[f"quant.{name}"] = np.ascontiguousarray(quants.quantize(x, T[name]))
for key, blocks in t.items():
    kind, _, name = key.partition(".")
    if kind in ("raw", "ours"):
        blocks = blocks.view(np.uint8)
        deq = quants.dequantize(blocks, T[name]).astype(np.float32)
        out[f"deq_{kind}.{name}"] = np.ascontiguousarray(deq)
save_file(out, dst)
