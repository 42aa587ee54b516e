#!/usr/bin/env python3
"""The independent side of kiln's GGUF tests: llama.cpp's gguf-py (PyPI `gguf`, pinned by
`cargo xtask test`) writes fixture files and reports what its own reader and dequantizer see.

  gguf_ref.py write OUTDIR            write the fixture files (and OUTDIR/fixtures.json naming them)
  gguf_ref.py dump FILE OUT.json [--dequant-dir DIR] [--only NAME,...]
                                      what GGUFReader reads; with --dequant-dir, each tensor as
                                      gguf.quants.dequantize gives it, raw little-endian f32
  gguf_ref.py sizes OUT.json          GGML_QUANT_SIZES, by type id
  gguf_ref.py kquants OUTDIR          random blocks (valid f16 scales) of every K-quant and the
                                      IQ types below, each as raw bytes and as
                                      gguf.quants.dequantize gives it (OUTDIR/kquants.json)
"""
import json
import os
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q, GGUFValueType as V

QUANT_TYPES = [Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]

# One value of every scalar type, at its extremes where that matters.
SCALARS = [
    ("t.uint8", V.UINT8, 255),
    ("t.int8", V.INT8, -128),
    ("t.uint16", V.UINT16, 65535),
    ("t.int16", V.INT16, -32768),
    ("t.uint32", V.UINT32, 4294967295),
    ("t.int32", V.INT32, -2147483648),
    ("t.float32", V.FLOAT32, -1.5e-7),
    ("t.bool", V.BOOL, True),
    ("t.string", V.STRING, "héllo, wörld ✓"),
    ("t.uint64", V.UINT64, 18446744073709551615),
    ("t.int64", V.INT64, -9223372036854775808),
    ("t.float64", V.FLOAT64, 2.718281828459045),
]

ARRAYS = [
    ("a.uint8", V.UINT8, [0, 1, 255]),
    ("a.int8", V.INT8, [-128, 0, 127]),
    ("a.uint16", V.UINT16, [0, 65535]),
    ("a.int16", V.INT16, [-32768, 32767]),
    ("a.uint32", V.UINT32, [0, 4294967295, 7]),
    ("a.int32", V.INT32, [-2147483648, 2147483647]),
    ("a.float32", V.FLOAT32, [0.0, -0.0, 1.25, 3.4028234663852886e38]),
    ("a.bool", V.BOOL, [True, False, True]),
    ("a.string", V.STRING, ["", "a", "Ġ t", "<|im_start|>", "日本語"]),
    ("a.uint64", V.UINT64, [0, 18446744073709551615]),
    ("a.int64", V.INT64, [-9223372036854775808, 9223372036854775807]),
    ("a.float64", V.FLOAT64, [1e-300, -2.5]),
]


def write_file(path, alignment, seed):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, vt, val in SCALARS:
        w.add_key_value(key, val, vt)
    for key, vt, val in ARRAYS:
        w.add_key_value(key, val, V.ARRAY, sub_type=vt)
    # Shapes are numpy order (slowest first); the file stores them reversed (ne0 first).
    shapes = [(4, 64), (2, 3, 32), (96,), (1, 1, 2, 32)]
    for qt in QUANT_TYPES:
        for i, shape in enumerate(shapes):
            x = rng.standard_normal(shape).astype(np.float32) * np.float32(rng.uniform(0.01, 10))
            if i == 0:
                x[0, :8] = 0.0  # an all-small block, and exact zeros
            q = gguf.quants.quantize(x, qt)
            if qt in (Q.F32, Q.F16):
                w.add_tensor(f"{qt.name.lower()}.{i}", q)
            else:
                w.add_tensor(f"{qt.name.lower()}.{i}", q, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def cmd_write(outdir):
    os.makedirs(outdir, exist_ok=True)
    files = []
    for name, alignment, seed in [("default_align.gguf", None, 1), ("align128.gguf", 128, 2)]:
        p = os.path.join(outdir, name)
        write_file(p, alignment, seed)
        files.append(p)
    with open(os.path.join(outdir, "fixtures.json"), "w") as f:
        json.dump({"files": files, "quant_types": [int(t) for t in QUANT_TYPES],
                   "scalar_types": [int(v) for _, v, _ in SCALARS],
                   "array_types": [int(v) for _, v, _ in ARRAYS]}, f)


def field_value(field):
    main = field.types[0]
    if main == V.ARRAY:
        return field.contents()
    v = field.contents()
    return v


def cmd_dump(path, out, dequant_dir=None, only=None):
    r = gguf.GGUFReader(path)
    meta = []
    pseudo = {}
    for key, field in r.fields.items():
        if key.startswith("GGUF."):
            pseudo[key] = int(field.parts[-1][0])
            continue
        types = [int(t) for t in field.types]
        meta.append({"key": key, "types": types, "value": field_value(field)})
    tensors = []
    for i, t in enumerate(r.tensors):
        entry = {
            "name": t.name,
            "type": int(t.tensor_type),
            "shape": [int(d) for d in t.field.parts[3]],
            "n_dims": int(t.field.parts[2][0]),
            "data_offset": int(t.data_offset),
            "n_bytes": int(t.n_bytes),
        }
        if dequant_dir is not None and (only is None or t.name in only):
            x = gguf.quants.dequantize(t.data, t.tensor_type)
            p = os.path.join(dequant_dir, f"{i}.f32")
            np.ascontiguousarray(x, dtype="<f4").reshape(-1).tofile(p)
            entry["dequant"] = p
        tensors.append(entry)
    doc = {
        "version": pseudo.get("GGUF.version"),
        "tensor_count": pseudo.get("GGUF.tensor_count"),
        "kv_count": pseudo.get("GGUF.kv_count"),
        "alignment": int(r.alignment),
        "data_offset": int(r.data_offset),
        "metadata": meta,
        "tensors": tensors,
    }
    with open(out, "w") as f:
        json.dump(doc, f)


# K-quants and the IQ types whose blocks hold plain f16 scales: (type, byte offsets of the f16
# fields in a block). Every other byte is random; the f16 fields are set to finite values so a
# random NaN/inf scale does not make the comparison vacuous.
KQUANT_SCALES = [
    (Q.Q2_K, [80, 82]),
    (Q.Q3_K, [108]),
    (Q.Q4_K, [0, 2]),
    (Q.Q5_K, [0, 2]),
    (Q.Q6_K, [208]),
    (Q.IQ4_NL, [0]),
    (Q.IQ4_XS, [0]),
    (Q.IQ2_XXS, [0]),
    (Q.IQ2_XS, [0]),
    (Q.IQ2_S, [0]),
    (Q.IQ3_XXS, [0]),
    (Q.IQ3_S, [0]),
    (Q.IQ1_S, [0]),
]


def cmd_kquants(outdir, n_blocks=64, seed=3):
    os.makedirs(outdir, exist_ok=True)
    rng = np.random.default_rng(seed)
    entries = []
    for qt, scale_at in KQUANT_SCALES:
        _, type_size = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
        for off in scale_at:
            # Both signs, magnitudes over six decades, a few exact zeros and subnormals.
            mag = 10.0 ** rng.uniform(-6, 0, size=n_blocks)
            sign = np.where(rng.integers(0, 2, size=n_blocks) == 0, -1.0, 1.0)
            d = (mag * sign).astype(np.float16)
            d[:2] = 0.0
            raw[:, off:off + 2] = d.view(np.uint8).reshape(n_blocks, 2)
        x = gguf.quants.dequantize(raw, qt)
        assert np.isfinite(x).all(), qt.name
        base = os.path.join(outdir, qt.name)
        raw.tofile(base + ".bin")
        np.ascontiguousarray(x, dtype="<f4").reshape(-1).tofile(base + ".f32")
        entries.append({"type": int(qt), "name": qt.name, "blocks": n_blocks,
                        "bytes": base + ".bin", "f32": base + ".f32"})
    with open(os.path.join(outdir, "kquants.json"), "w") as f:
        json.dump(entries, f)


def cmd_sizes(out):
    with open(out, "w") as f:
        json.dump({str(int(t)): {"name": t.name, "block": b, "bytes": s}
                   for t, (b, s) in gguf.GGML_QUANT_SIZES.items()}, f)


def main(argv):
    if len(argv) >= 2 and argv[0] == "write":
        cmd_write(argv[1])
    elif len(argv) >= 3 and argv[0] == "dump":
        dq, only = None, None
        rest = argv[3:]
        while rest:
            if rest[0] == "--dequant-dir":
                dq = rest[1]
                os.makedirs(dq, exist_ok=True)
            elif rest[0] == "--only":
                only = set(rest[1].split(","))
            else:
                raise SystemExit(f"unknown option {rest[0]}")
            rest = rest[2:]
        cmd_dump(argv[1], argv[2], dq, only)
    elif len(argv) >= 2 and argv[0] == "kquants":
        cmd_kquants(argv[1])
    elif len(argv) >= 2 and argv[0] == "sizes":
        cmd_sizes(argv[1])
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
