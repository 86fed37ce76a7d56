//! maxc's block formats against gguf-py's (the reference quantizers and dequantizers that
//! llama.cpp's Python package ships, numpy code independent of ours): for every type, maxc
//! dequantizes the same blocks to the same values; for the types gguf-py quantizes, maxc's
//! quantizer gives the same bytes; maxc's Q4_K blocks dequantize the same in both. The Python
//! packages come pinned from PyPI (`scripts/install-py-test-deps.sh`).

use maxc_graph::weights::quantize::quantize;
use maxc_graph::weights::{write_safetensors, StateDict, WeightTensor};
use maxc_graph::DType;
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn python_path() -> String {
    let out = Command::new("bash")
        .arg("scripts/install-py-test-deps.sh")
        .current_dir(root())
        .output()
        .expect("bash runs");
    assert!(
        out.status.success(),
        "scripts/install-py-test-deps.sh failed (it needs python3 with pip and PyPI): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_string()
}

/// A deterministic stream of values with a few outliers, as trained weights have.
fn values(n: usize) -> Vec<f32> {
    let mut s = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            if i % 97 == 0 {
                u * 8.0
            } else {
                u * (1.0 + (i % 5) as f32 * 0.1)
            }
        })
        .collect()
}

/// Blocks of arbitrary bytes whose f16 scales are set to small finite values.
fn raw_blocks(dtype: DType, blocks: usize) -> Vec<u8> {
    let (_, size) = dtype.block();
    let mut bytes: Vec<u8> = (0..blocks * size)
        .map(|i| ((i * 131 + 7) % 251) as u8)
        .collect();
    let scale = |i: usize| half::f16::from_f32(0.003 + (i % 7) as f32 * 0.001).to_le_bytes();
    for (i, b) in bytes.chunks_exact_mut(size).enumerate() {
        match dtype {
            DType::Q6K => b[size - 2..].copy_from_slice(&scale(i)),
            DType::Q4_1 | DType::Q5_1 | DType::Q4K | DType::Q5K => {
                b[..2].copy_from_slice(&scale(i));
                b[2..4].copy_from_slice(&scale(i + 3));
            }
            _ => b[..2].copy_from_slice(&scale(i)),
        }
    }
    bytes
}

fn gguf_name(d: DType) -> &'static str {
    match d {
        DType::Q8_0 => "Q8_0",
        DType::Q4_0 => "Q4_0",
        DType::Q4_1 => "Q4_1",
        DType::Q5_0 => "Q5_0",
        DType::Q5_1 => "Q5_1",
        DType::Q4K => "Q4_K",
        DType::Q5K => "Q5_K",
        DType::Q6K => "Q6_K",
        other => panic!("{other} is not a GGUF block type"),
    }
}

fn u8_tensor(bytes: Vec<u8>, row: usize) -> WeightTensor {
    let rows = bytes.len() / row;
    // Raw bytes travel as f16 pairs, viewed back as bytes in Python (a U8 tensor would need
    // maxc's block metadata, which is what is being checked).
    WeightTensor::from_bytes(DType::F16, vec![rows, row / 2], bytes).unwrap()
}

#[test]
fn block_formats_agree_with_gguf_py() {
    let py = python_path();
    let (rows, cols) = (16, 512);
    let x = values(rows * cols);
    let blocks_dtypes: Vec<DType> = DType::ALL
        .into_iter()
        .filter(|d| d.is_quantized())
        .collect();
    assert_eq!(
        blocks_dtypes.len(),
        8,
        "every GGUF block type maxc reads is checked"
    );
    let mut input = StateDict::new();
    input.insert("x", WeightTensor::from_f32(vec![rows, cols], &x));
    for &d in &blocks_dtypes {
        let (_, size) = d.block();
        // Every block size is even, so the bytes travel as f16 pairs (see u8_tensor).
        input.insert(
            format!("raw.{}", gguf_name(d)),
            u8_tensor(raw_blocks(d, 12), size),
        );
    }
    let ours_q4k = quantize(DType::Q4K, &x, &[rows, cols]).unwrap();
    input.insert(
        "ours.Q4_K",
        u8_tensor(ours_q4k.clone(), DType::Q4K.block().1),
    );
    let dir = tempfile::tempdir().unwrap();
    let (src, dst) = (
        dir.path().join("in.safetensors"),
        dir.path().join("out.safetensors"),
    );
    write_safetensors(&src, &input, None).unwrap();
    let script = root().join("graph/tests/gguf_py/crosscheck.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg(&src)
        .arg(&dst)
        .env("PYTHONPATH", &py)
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "gguf-py cross-check failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let file = std::fs::read(&dst).unwrap();
    let theirs = safetensors::SafeTensors::deserialize(&file).unwrap();
    let bytes = |key: &str| theirs.tensor(key).unwrap().data().to_vec();
    let floats = |key: &str| -> Vec<f32> {
        bytes(key)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    };

    // The same bytes from both quantizers.
    for d in [
        DType::Q8_0,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q5_0,
        DType::Q5_1,
    ] {
        let ours = quantize(d, &x, &[rows, cols]).unwrap();
        let t = bytes(&format!("quant.{}", gguf_name(d)));
        let differing = ours.iter().zip(&t).filter(|(a, b)| a != b).count();
        assert_eq!(t.len(), ours.len(), "{d}: sizes differ");
        assert_eq!(
            differing,
            0,
            "{d}: {differing} of {} bytes differ",
            ours.len()
        );
    }
    // The same values from both dequantizers, for every type.
    for &d in &blocks_dtypes {
        let raw = raw_blocks(d, 12);
        let ours = maxc_schema::blocks::dequantize(d, &raw).unwrap();
        let t = floats(&format!("deq_raw.{}", gguf_name(d)));
        assert_eq!(ours.len(), t.len(), "{d}");
        for (i, (a, b)) in ours.iter().zip(&t).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                "{d} value {i}: {a} vs {b}"
            );
        }
    }
    // maxc's Q4_K blocks read the same in gguf-py, and stay close to the values.
    let t = floats("deq_ours.Q4_K");
    let ours = maxc_schema::blocks::dequantize(DType::Q4K, &ours_q4k).unwrap();
    let mut worst = 0.0f32;
    for ((a, b), v) in ours.iter().zip(&t).zip(&x) {
        assert!((a - b).abs() <= 1e-6 * (1.0 + b.abs()));
        worst = worst.max((a - v).abs());
    }
    assert!(worst < 0.6, "Q4_K error {worst}");
}
