//! Recompiles every golden case and diffs its dump against the checked-in one.

use maxc_golden::{cases, check, golden_dir, BLESS};

#[test]
fn compiled_artifacts_match_their_golden_dumps() {
    let bless = std::env::var_os("MAXC_BLESS").is_some_and(|v| v == "1");
    let work = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    let nvrtc = maxc_lowering::cuda::nvrtc_status();
    for case in cases() {
        if case.needs_nvrtc() {
            if let Err(e) = &nvrtc {
                assert!(
                    std::env::var("MAXC_REQUIRE_NVRTC").as_deref() != Ok("1"),
                    "{}: {e}",
                    case.name
                );
                eprintln!("skipped {}: {e}", case.name);
                continue;
            }
        }
        let diff = check(&case, work.path(), bless).unwrap_or_else(|e| panic!("{e}"));
        if !diff.is_empty() {
            failures.push(format!(
                "== {} (golden: {})\n{diff}",
                case.name,
                golden_dir(&case).display()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{} golden case(s) differ:\n\n{}\nReview the changes above; if they are intended, bless them with:\n    {BLESS}\n",
        failures.len(),
        failures.join("\n")
    );
}
