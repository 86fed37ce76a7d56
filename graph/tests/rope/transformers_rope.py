"""The reference for graph/tests/rope.rs: transformers' own rotary functions
(`_compute_yarn_parameters`, `_compute_dynamic_ntk_parameters`, `yarn_get_mscale`, their source
read from a transformers wheel's modeling_rope_utils.py) run with numpy standing in for the few
torch calls they make (arange, clamp, dtype casts: float32 as torch computes them).

Remake reference.json (needs numpy; no torch):
    pip download transformers==5.25.0 --no-deps -d /tmp/tf && unzip -o /tmp/tf/*.whl \
        'transformers/modeling_rope_utils.py' -d /tmp/tf
    python3 transformers_rope.py /tmp/tf/transformers/modeling_rope_utils.py cases.json > reference.json
"""
import ast, math, sys, types, json
import numpy as np

src = open(sys.argv[1]).read()
tree = ast.parse(src)
wanted = {"_compute_yarn_parameters", "yarn_get_mscale", "_compute_dynamic_ntk_parameters"}
mod = ast.Module(body=[n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted], type_ignores=[])

class T(np.ndarray):
    def to(self, device=None, dtype=None):
        return (self.astype(dtype) if dtype is not None else self).view(T)
torch = types.SimpleNamespace(
    float32=np.float32, float=np.float32, int64=np.int64, Tensor=T,
    arange=lambda *a, dtype=None: np.arange(*a, dtype=dtype if dtype is not None else np.int64).view(T),
    clamp=lambda x, lo, hi: np.clip(x, np.float32(lo), np.float32(hi)).astype(np.float32).view(T),
)
ns = {"torch": torch, "math": math, "Optional": __import__("typing").Optional}
exec(compile(mod, "modeling_rope_utils.py", "exec"), ns)

class Config(types.SimpleNamespace):
    def standardize_rope_params(self):
        pass

out = []
for case in json.load(open(sys.argv[2])):
    cfg = Config(hidden_size=0, num_attention_heads=1, **case)
    fn = ns["_compute_" + case["rope_parameters"]["rope_type"] + ("_ntk" if case["rope_parameters"]["rope_type"] == "dynamic" else "") + "_parameters"]
    inv, att = fn(cfg, None)
    inv = np.asarray(inv, dtype=np.float32)
    out.append({"config": case, "inv_freq": [float(x) for x in inv], "attention_factor": float(att)})
print(json.dumps({"transformers": "5.25.0", "cases": out}, indent=1))
