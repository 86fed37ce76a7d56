//! Rotary kinds against transformers' own functions (`graph/tests/rope/transformers_rope.py`
//! ran them to make `reference.json`): YaRN's ramped frequencies and attention factor, and
//! dynamic NTK's frequencies within the context, from the same configs.

use maxc_graph::arch::config::ConfigReader;
use maxc_graph::arch::rope::RopeConfig;
use maxc_graph::DType;
use std::path::Path;

fn reference() -> serde_json::Value {
    let text = include_str!("rope/reference.json");
    serde_json::from_str(text).expect("reference.json")
}

#[test]
fn yarn_and_dynamic_ntk_give_transformers_frequencies_and_attention_factor() {
    let reference = reference();
    let cases = reference["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 5);
    for (i, case) in cases.iter().enumerate() {
        let config = &case["config"];
        let rope = RopeConfig::read(&ConfigReader::new(Path::new("config.json"), config).unwrap())
            .unwrap_or_else(|e| panic!("case {i}: {e}"));
        let dim = config["head_dim"].as_u64().unwrap() as usize;
        let table = rope.table(dim, DType::F32);
        let want: Vec<f32> = case["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect();
        assert_eq!(table.inv_freq.len(), want.len(), "case {i}");
        for (j, (g, w)) in table.inv_freq.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 2e-7 * w.abs(),
                "case {i} frequency {j}: {g} against transformers' {w}"
            );
        }
        let factor = case["attention_factor"].as_f64().unwrap() as f32;
        assert_eq!(table.scale, factor, "case {i}: attention factor");
        assert!(table.long.is_none());
    }
}

#[test]
fn dynamic_ntk_is_compiled_within_its_context_and_refused_past_it() {
    let config = &reference()["cases"][4]["config"];
    let rope =
        RopeConfig::read(&ConfigReader::new(Path::new("config.json"), config).unwrap()).unwrap();
    assert!(rope.check_context(4096).is_ok());
    let err = rope.check_context(4097).unwrap_err();
    assert!(
        err.contains("4097") && err.contains("dynamic") && err.contains("4096"),
        "{err}"
    );
}

#[test]
fn yarn_reads_the_same_from_transformers_4s_rope_scaling() {
    let case = &reference()["cases"][0];
    let v5 = &case["config"];
    let mut scaling = v5["rope_parameters"].clone();
    let theta = scaling
        .as_object_mut()
        .unwrap()
        .remove("rope_theta")
        .unwrap();
    let kind = scaling
        .as_object_mut()
        .unwrap()
        .remove("rope_type")
        .unwrap();
    scaling["type"] = kind;
    let v4 = serde_json::json!({
        "head_dim": v5["head_dim"], "max_position_embeddings": v5["max_position_embeddings"],
        "rope_theta": theta, "rope_scaling": scaling
    });
    let read = |v: &serde_json::Value| {
        RopeConfig::read(&ConfigReader::new(Path::new("config.json"), v).unwrap()).unwrap()
    };
    assert_eq!(read(&v4), read(v5));
}
