//! `maxc serve --config-file`: the settings a YAML file gives, and the error each bad key or
//! value gives (naming the key, its line and the file).

use maxc_serve::config::{parse, read, GpuProfiling, ProfilingConfig};

fn err(text: &str, section: Option<&str>) -> String {
    let e = parse(text, section).expect_err("a bad config");
    eprintln!("{e}");
    e
}

#[test]
fn a_file_gives_its_settings_and_the_profiling_defaults() {
    let s = parse(
        "port: 9000\nmax_queue_size: 7\nprofiling:\n  gpu_profiling: detailed\n  kernel_trace_max_passes: 3\n",
        None,
    )
    .unwrap();
    assert_eq!(s.port, Some(9000));
    assert_eq!(s.max_queue_size, Some(7));
    assert_eq!(s.host, None);
    let p = s.profiling.unwrap();
    assert_eq!(p.gpu_profiling, GpuProfiling::Detailed);
    assert_eq!(p.kernel_trace_max_passes, 3);
    // The other limits keep MAX's defaults.
    let d = ProfilingConfig::default();
    assert_eq!(
        (
            d.kernel_trace_max_passes,
            d.kernel_trace_max_batch_links,
            d.kernel_trace_max_spans,
            d.kernel_trace_max_capture_bytes
        ),
        (64, 128, 20_000, 64 << 20)
    );
    assert_eq!(p.kernel_trace_max_batch_links, 128);
    assert_eq!(p.kernel_trace_max_spans, 20_000);
    assert_eq!(p.kernel_trace_max_capture_bytes, 64 << 20);
    // An empty file (or comments only) is no settings.
    assert_eq!(parse("# nothing\n\n", None).unwrap(), Default::default());
}

#[test]
fn a_section_is_read_and_the_others_are_not() {
    let text = "dev:\n  port: 1\n  bogus: 3\nprod:\n  port: 2\n  profiling:\n    kernel_trace_max_spans: 10\n";
    let s = parse(text, Some("prod")).unwrap();
    assert_eq!(s.port, Some(2));
    assert_eq!(s.profiling.unwrap().kernel_trace_max_spans, 10);
    let e = err(text, Some("dev"));
    assert!(e.contains("bogus"), "{e}");
    let e = err(text, Some("staging"));
    assert!(
        e.contains("no section `staging`") && e.contains("dev, prod"),
        "{e}"
    );
}

#[test]
fn each_bad_key_and_value_names_itself() {
    let cases: &[(&str, &[&str])] = &[
        // An unknown key, at the top and in the profiling section.
        (
            "prot: 80\n",
            &[
                "key `prot` (line 1): unknown field",
                "expected one of host, port",
            ],
        ),
        (
            "port: 1\nprofiling:\n  kernel_trace_max_pases: 3\n",
            &[
                "key `profiling.kernel_trace_max_pases` (line 3): unknown field",
                "kernel_trace_max_passes",
            ],
        ),
        // Wrong types.
        (
            "port: eighty\n",
            &["key `port` (line 1)", "0 to 65535", "got `eighty`"],
        ),
        ("port: 70000\n", &["key `port` (line 1)", "got `70000`"]),
        (
            "profiling:\n  kernel_trace_max_spans: many\n",
            &[
                "key `profiling.kernel_trace_max_spans` (line 2)",
                "got `many`",
            ],
        ),
        (
            "profiling:\n  gpu_profiling: loud\n",
            &[
                "key `profiling.gpu_profiling` (line 2)",
                "loud",
                "off, on, detailed",
            ],
        ),
        (
            "profiling: 3\n",
            &["key `profiling` (line 1)", "mapping", "got `3`"],
        ),
        (
            "no_prefix_caching: maybe\n",
            &["key `no_prefix_caching`", "got `maybe`"],
        ),
        // Negative limits.
        (
            "profiling:\n  kernel_trace_max_passes: -1\n",
            &[
                "key `profiling.kernel_trace_max_passes` (line 2)",
                ">= 0",
                "got `-1`",
            ],
        ),
        (
            "profiling:\n  kernel_trace_max_batch_links: -5\n",
            &["key `profiling.kernel_trace_max_batch_links`", "got `-5`"],
        ),
        (
            "profiling:\n  kernel_trace_max_spans: -7\n",
            &["key `profiling.kernel_trace_max_spans`", "got `-7`"],
        ),
        (
            "profiling:\n  kernel_trace_max_capture_bytes: -1024\n",
            &[
                "key `profiling.kernel_trace_max_capture_bytes`",
                "got `-1024`",
            ],
        ),
        (
            "max_queue_size: -2\n",
            &["key `max_queue_size`", "got `-2`"],
        ),
        // Not a mapping at all.
        ("- port\n", &["(line 1)", "mapping"]),
    ];
    for (text, want) in cases {
        let e = err(text, None);
        for w in *want {
            assert!(e.contains(w), "{text:?}: the error should name {w:?}: {e}");
        }
    }
}

#[test]
fn read_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("serve.yaml");
    std::fs::write(&f, "profiling:\n  kernel_trace_max_spans: -3\n").unwrap();
    let e = read(&f, None).unwrap_err().to_string();
    assert!(e.contains("serve.yaml") && e.contains("-3"), "{e}");
    let e = read(&dir.path().join("absent.yaml"), None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("absent.yaml") && e.contains("cannot read"),
        "{e}"
    );
}
