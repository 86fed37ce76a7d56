#!/usr/bin/env python3
"""Writes a speculative-decoding draft made from a GGUF decoder: a copy that keeps some of its
transformer blocks (renumbered), every other tensor and all metadata (so the tokenizer, and
maxc's tokenizer.json made from it, stay the same).

    PYTHONPATH=.tools/py python3 scripts/make-gguf-draft.py IN.gguf OUT.gguf --layers 0-3,26-29

gguf-py comes from scripts/install-py-test-deps.sh (.tools/py).
"""

import argparse
import re
import sys

import gguf


def parse_layers(spec, count):
    keep = []
    for part in spec.split(","):
        if "-" in part:
            a, b = part.split("-")
            keep.extend(range(int(a), int(b) + 1))
        else:
            keep.append(int(part))
    bad = [i for i in keep if not 0 <= i < count]
    if bad or len(set(keep)) != len(keep) or not keep:
        sys.exit(f"--layers {spec}: expected distinct blocks within 0..{count - 1}")
    return sorted(keep)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("input")
    ap.add_argument("output")
    ap.add_argument("--layers", required=True, help="blocks to keep, e.g. 0-3,26-29")
    args = ap.parse_args()

    reader = gguf.GGUFReader(args.input, "r")
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    count_key = f"{arch}.block_count"
    count = reader.fields[count_key].contents()
    keep = parse_layers(args.layers, count)
    renumber = {old: new for new, old in enumerate(keep)}

    writer = gguf.GGUFWriter(args.output, arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue
        value = len(keep) if field.name == count_key else field.contents()
        val_type = field.types[0]
        sub_type = field.types[-1] if val_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, val_type, sub_type=sub_type)

    tensors = []
    for t in reader.tensors:
        m = re.match(r"blk\.(\d+)\.(.*)", t.name)
        if m:
            old = int(m.group(1))
            if old not in renumber:
                continue
            name = f"blk.{renumber[old]}.{m.group(2)}"
        else:
            name = t.name
        tensors.append((name, t))
    for name, t in tensors:
        writer.add_tensor_info(name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()
    print(f"{args.output}: blocks {keep} of {count} from {args.input}")


if __name__ == "__main__":
    main()
