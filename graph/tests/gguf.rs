//! GGUF reading on small files written here: dequantization through the whole reader, and the
//! errors for truncated files, unknown tensor types and tensor data past the end.

use half::f16;
use maxc_graph::weights::gguf::GgufFile;
use std::path::Path;

/// A minimal GGUF v3 writer: string metadata, then tensors `(name, dims, type id, data)`.
fn write_gguf(
    path: &Path,
    meta: &[(&str, &str)],
    tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
    data_cut: usize,
) {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend((tensors.len() as u64).to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    let s = |b: &mut Vec<u8>, t: &str| {
        b.extend((t.len() as u64).to_le_bytes());
        b.extend(t.as_bytes());
    };
    for (k, v) in meta {
        s(&mut b, k);
        b.extend(8u32.to_le_bytes());
        s(&mut b, v);
    }
    let mut offset = 0u64;
    for (name, dims, ty, data) in tensors {
        s(&mut b, name);
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(ty.to_le_bytes());
        b.extend(offset.to_le_bytes());
        offset += (data.len() as u64).div_ceil(32) * 32;
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    for (_, _, _, data) in tensors {
        b.extend(data);
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
    }
    b.truncate(b.len() - data_cut);
    std::fs::write(path, b).unwrap();
}

fn q8_0_block(d: f32, start: i8) -> Vec<u8> {
    let mut b = f16::from_f32(d).to_le_bytes().to_vec();
    b.extend((0..32).map(|i| start.wrapping_add(i) as u8));
    b
}

#[test]
fn tensors_are_read_and_dequantized() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    let f16s: Vec<u8> = [1.5f32, -2.0, 0.25, 8.0]
        .iter()
        .flat_map(|&v| f16::from_f32(v).to_le_bytes())
        .collect();
    let mut q = q8_0_block(0.5, -16);
    q.extend(q8_0_block(0.25, 0));
    write_gguf(
        &path,
        &[("general.architecture", "llama")],
        &[("a", vec![2, 2], 1, f16s), ("q", vec![32, 2], 8, q)],
        0,
    );
    let g = GgufFile::open(&path).unwrap();
    assert_eq!(
        g.get("general.architecture").and_then(|v| v.as_str()),
        Some("llama")
    );
    let sd = g.state_dict().unwrap();
    let a = sd.get("a").unwrap();
    assert_eq!(a.shape, vec![2, 2]);
    assert_eq!(a.to_f32("a").unwrap(), vec![1.5, -2.0, 0.25, 8.0]);
    let q = sd.get("q").unwrap();
    assert_eq!(q.shape, vec![2, 32]); // GGUF dims are fastest first
    let v = q.to_f32("q").unwrap();
    assert_eq!((v[0], v[31], v[32], v[63]), (-8.0, 7.5, 0.0, 7.75));
}

#[test]
fn a_truncated_file_names_what_was_being_read() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cut.gguf");
    write_gguf(
        &path,
        &[("general.architecture", "llama"), ("general.name", "tiny")],
        &[],
        0,
    );
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..60]).unwrap();
    let e = GgufFile::open(&path).err().expect("truncated").to_string();
    assert!(
        e.contains("cut.gguf") && e.contains("truncated") && e.contains("general"),
        "{e}"
    );
    std::fs::write(&path, b"GGU").unwrap();
    let e = GgufFile::open(&path).err().expect("no magic").to_string();
    assert!(e.contains("cut.gguf"), "{e}");
}

#[test]
fn an_unknown_tensor_type_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.gguf");
    write_gguf(
        &path,
        &[],
        &[("blk.0.attn_q.weight", vec![256, 4], 10, vec![0; 336])],
        0,
    );
    let e = GgufFile::open(&path)
        .err()
        .expect("Q2_K is not read")
        .to_string();
    assert!(
        e.contains("blk.0.attn_q.weight") && e.contains("tensor type 10"),
        "{e}"
    );
}

#[test]
fn k_quant_tensors_are_kept_as_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("k.gguf");
    write_gguf(
        &path,
        &[],
        &[("blk.0.attn_q.weight", vec![256, 4], 12, vec![0; 576])],
        0,
    );
    let sd = GgufFile::open(&path).unwrap().state_dict().unwrap();
    let w = sd.get("blk.0.attn_q.weight").unwrap();
    assert_eq!(
        (w.dtype, w.shape.clone()),
        (maxc_graph::DType::Q4K, vec![4, 256])
    );
    assert_eq!(w.bytes().len(), 576);
}

#[test]
fn tensor_data_past_the_end_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("p.gguf");
    write_gguf(&path, &[], &[("x", vec![32, 4], 0, vec![0; 512])], 100);
    let e = GgufFile::open(&path)
        .err()
        .expect("data is cut")
        .to_string();
    assert!(e.contains("`x`") && e.contains("past the end"), "{e}");
}

/// Found by fuzzing (`scripts/fuzz.sh gguf`): a tensor offset near `u64::MAX` overflowed while
/// the error message was written.
#[test]
fn a_tensor_offset_near_the_end_of_u64_is_named_not_overflowed() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("o.gguf");
    write_gguf(&path, &[], &[("x", vec![32, 4], 0, vec![0; 512])], 0);
    let mut b = std::fs::read(&path).unwrap();
    // Header (24 bytes), then the tensor info: name (8 + 1), dims count (4), dims (16), type (4).
    let at = 24 + 9 + 4 + 16 + 4;
    assert_eq!(&b[at..at + 8], &0u64.to_le_bytes());
    b[at..at + 8].copy_from_slice(&(u64::MAX - 7).to_le_bytes());
    std::fs::write(&path, b).unwrap();
    let e = GgufFile::open(&path)
        .and_then(|g| g.state_dict().map(|_| ()))
        .expect_err("the offset is past the end")
        .to_string();
    assert!(e.contains("`x`") && e.contains("past the end"), "{e}");
}

#[test]
fn an_architecture_maxc_does_not_read_names_the_key_and_the_ones_it_does() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    write_gguf(&path, &[("general.architecture", "rwkv7")], &[], 0);
    let g = GgufFile::open(&path).unwrap();
    let e = maxc_graph::arch::gguf::config_from_gguf(&g)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("m.gguf")
            && e.contains("general.architecture")
            && e.contains("`rwkv7`")
            && e.contains("llama, qwen2, qwen3, qwen3moe, phi3, gemma3"),
        "{e}"
    );
}

#[test]
fn a_tokenizer_maxc_does_not_build_is_left_out_with_the_reason() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wordpiece.gguf");
    write_gguf(
        &path,
        &[
            ("general.architecture", "gemma3"),
            ("tokenizer.ggml.model", "bert"),
        ],
        &[],
        0,
    );
    let t = maxc_graph::pipeline::read_tokenizer(&path).unwrap();
    assert!(t.json.is_none());
    let why = t.left_out.unwrap();
    assert!(
        why.contains("wordpiece.gguf")
            && why.contains("tokenizer.ggml.model")
            && why.contains("`bert`")
            && why.contains("gpt2 and llama"),
        "{why}"
    );
}
