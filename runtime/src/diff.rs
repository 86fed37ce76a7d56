//! Structural comparison of two artifacts through their text dumps: files only in one, and a
//! unified diff of each changed file (manifest fields, plan, kernels, weights by hash).

use crate::dump::Dump;
use serde::Serialize;

/// How one dump file differs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct FileChange {
    /// The dump file (`manifest.json`, `decoder/plan.txt`, `decoder/kernels/k003_matmul.txt`, ...).
    pub file: String,
    /// `added`, `removed` or `changed`.
    pub status: &'static str,
    /// A unified diff (changed files), or the file's text (added or removed).
    pub diff: String,
}

/// Every difference between dumps `a` and `b`, sorted by file.
pub fn diff_dumps(a: &Dump, b: &Dump, label_a: &str, label_b: &str) -> Vec<FileChange> {
    let mut out = Vec::new();
    let names: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for name in names {
        match (a.get(name), b.get(name)) {
            (Some(x), Some(y)) if x == y => {}
            (Some(x), Some(y)) => out.push(FileChange {
                file: name.clone(),
                status: "changed",
                diff: unified(
                    x,
                    y,
                    &format!("{label_a}/{name}"),
                    &format!("{label_b}/{name}"),
                ),
            }),
            (Some(x), None) => out.push(FileChange {
                file: name.clone(),
                status: "removed",
                diff: x.clone(),
            }),
            (None, Some(y)) => out.push(FileChange {
                file: name.clone(),
                status: "added",
                diff: y.clone(),
            }),
            (None, None) => {}
        }
    }
    out
}

/// A unified diff of `a` and `b` with 3 lines of context.
pub fn unified(a: &str, b: &str, name_a: &str, name_b: &str) -> String {
    similar::TextDiff::from_lines(a, b)
        .unified_diff()
        .context_radius(3)
        .header(name_a, name_b)
        .to_string()
}

/// A readable report: one section per changed file.
pub fn report(changes: &[FileChange]) -> String {
    let mut t = String::new();
    for c in changes {
        match c.status {
            "changed" => t.push_str(&c.diff),
            status => {
                t.push_str(&format!("{status}: {}\n", c.file));
            }
        }
    }
    t
}
