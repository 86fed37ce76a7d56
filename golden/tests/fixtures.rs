//! The fixtures carried in the project (`golden/fixtures`) are the team's shared ones: where
//! `../shared/fixtures` sits beside the checkout, both hold the same files with the same bytes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn files(root: &Path) -> BTreeMap<String, String> {
    fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        let mut entries: Vec<_> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let rel = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_string_lossy()
                    .to_string();
                let bytes = std::fs::read(&path).unwrap();
                out.insert(rel, maxc_schema::sha256_hex(&bytes));
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, root, &mut out);
    out
}

#[test]
fn in_repo_fixtures_match_the_shared_ones() {
    let here = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures");
    let ours = files(&here);
    for model in [
        "tiny-llama",
        "tiny-qwen2",
        "tiny-qwen3",
        "tiny-qwen3-moe",
        "tiny-gemma3",
        "tiny-phi3",
        "tiny-mistral-swa",
        "tiny-deepseek-v3",
        "tiny-mixtral",
        "tiny-roles",
        "smollm2-135m",
    ] {
        assert!(
            ours.keys().any(|f| f.starts_with(&format!("{model}/"))),
            "golden/fixtures/{model} is missing"
        );
    }
    let shared = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../shared/fixtures");
    if !shared.is_dir() {
        eprintln!(
            "{} is absent: nothing to compare the in-repo fixtures with",
            shared.display()
        );
        return;
    }
    let theirs = files(&shared);
    let only = |a: &BTreeMap<String, String>, b: &BTreeMap<String, String>| -> Vec<String> {
        a.keys().filter(|k| !b.contains_key(*k)).cloned().collect()
    };
    let changed: Vec<&String> = ours
        .iter()
        .filter(|(k, v)| theirs.get(*k).is_some_and(|t| t != *v))
        .map(|(k, _)| k)
        .collect();
    assert!(
        only(&ours, &theirs).is_empty() && only(&theirs, &ours).is_empty() && changed.is_empty(),
        "golden/fixtures drifted from ../shared/fixtures: only here {:?}, only there {:?}, \
         different {changed:?}; copy ../shared/fixtures over golden/fixtures",
        only(&ours, &theirs),
        only(&theirs, &ours)
    );
}
