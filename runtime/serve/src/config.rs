//! `maxc serve --config-file F [--section-name S]`: a YAML file of serve settings, as MAX's
//! config files. Its keys are the serve flags' long names with `_` for `-` (`max_queue_size`,
//! `port`, ...), and its `profiling` section is MAX's `ProfilingConfig`. Command-line flags and
//! their environment variables override the file. Unknown keys, wrong types and negative
//! limits are errors that name the key (and its line) and the file.

use serde::Deserialize;
use std::path::{Path, PathBuf};

pub use maxc_runtime::profile::GpuProfiling;

/// MAX's `ProfilingConfig`: GPU profiling and the limits of kernel traces. As in MAX, the
/// `kernel_trace_*` limits are set only here, never by a flag.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ProfilingConfig {
    /// NVTX ranges (spans on the CPU) around passes (`on`) and launches too (`detailed`).
    pub gpu_profiling: GpuProfiling,
    /// Passes a request's kernel capture records before it stops.
    pub kernel_trace_max_passes: u64,
    /// Request links a `max.batch` span holds; the rest are counted in an attribute.
    pub kernel_trace_max_batch_links: u64,
    /// Spans a capture's replay exports at most (pass summaries first, then kernels).
    pub kernel_trace_max_spans: u64,
    /// A capture file larger than this stays on disk and exports nothing.
    pub kernel_trace_max_capture_bytes: u64,
}

impl Default for ProfilingConfig {
    fn default() -> Self {
        ProfilingConfig {
            gpu_profiling: GpuProfiling::Off,
            kernel_trace_max_passes: 64,
            kernel_trace_max_batch_links: 128,
            kernel_trace_max_spans: 20_000,
            kernel_trace_max_capture_bytes: 64 << 20,
        }
    }
}

/// The serve settings a config file may hold: every one optional, each named as its flag.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
#[allow(missing_docs)]
pub struct ServeSettings {
    pub host: Option<String>,
    pub port: Option<u16>,
    pub metrics_port: Option<u16>,
    pub served_model_name: Option<String>,
    pub no_prefix_caching: Option<bool>,
    pub device: Option<String>,
    pub activations: Option<String>,
    pub threads: Option<u32>,
    pub max_request_bytes: Option<usize>,
    pub max_queue_size: Option<usize>,
    pub graceful_shutdown_timeout_s: Option<f64>,
    pub max_connections: Option<usize>,
    pub header_read_timeout_s: Option<f64>,
    pub body_read_timeout_s: Option<f64>,
    pub require_signature: Option<PathBuf>,
    pub speculative: Option<bool>,
    pub draft: Option<PathBuf>,
    pub num_speculative_tokens: Option<usize>,
    pub kernel_trace_level: Option<String>,
    pub kernel_trace_headers: Option<bool>,
    pub trace_file: Option<PathBuf>,
    pub expert_parallel_degree: Option<usize>,
    /// MAX's ProfilingConfig.
    pub profiling: Option<ProfilingConfig>,
}

/// A config file that cannot be used: the file, and what is wrong (the key and its line).
#[derive(Debug, thiserror::Error)]
#[error("config file {}: {msg}", file.display())]
pub struct ConfigError {
    /// The file.
    pub file: PathBuf,
    /// What is wrong.
    pub msg: String,
}

/// Config files larger than this are refused (a config is a few hundred bytes).
const MAX_FILE_BYTES: u64 = 1 << 20;

/// Reads `file` and takes its settings: the whole file, or the top-level section `section`.
pub fn read(file: &Path, section: Option<&str>) -> Result<ServeSettings, ConfigError> {
    let err = |msg: String| ConfigError {
        file: file.to_path_buf(),
        msg,
    };
    let len = std::fs::metadata(file)
        .map_err(|e| err(format!("cannot read it: {e}")))?
        .len();
    if len > MAX_FILE_BYTES {
        return Err(err(format!(
            "{len} bytes; a config file holds at most {MAX_FILE_BYTES}"
        )));
    }
    let text = std::fs::read_to_string(file).map_err(|e| err(format!("cannot read it: {e}")))?;
    parse(&text, section).map_err(err)
}

/// The settings in `text` (YAML): the whole document, or its top-level section `section`
/// (the other sections are not looked at).
pub fn parse(text: &str, section: Option<&str>) -> Result<ServeSettings, String> {
    let blank = text
        .lines()
        .all(|l| l.trim().is_empty() || l.trim_start().starts_with('#'));
    match section {
        None if blank => Ok(ServeSettings::default()),
        None => serde_saphyr::from_str(text).map_err(|e| explain(text, &e)),
        Some(name) => {
            let found: Sections = if blank {
                Sections::default()
            } else {
                SECTION.with(|s| *s.borrow_mut() = name.to_string());
                serde_saphyr::from_str(text).map_err(|e| explain(text, &e))?
            };
            match found.chosen {
                Some(s) => Ok(s),
                None if found.names.is_empty() => {
                    Err(format!("no section `{name}`: the file has no sections"))
                }
                None => Err(format!(
                    "no section `{name}` (it has {})",
                    found.names.join(", ")
                )),
            }
        }
    }
}

/// A YAML error as one line that names the key (its dotted path), the line and the value.
fn explain(text: &str, e: &serde_saphyr::Error) -> String {
    let rendered = e.to_string();
    let first = rendered.lines().next().unwrap_or_default();
    let first = first.strip_prefix("error: ").unwrap_or(first);
    let Some(loc) = e.location().filter(|l| l.line() > 0) else {
        return first.to_string();
    };
    // "line L column C: what" -> "what".
    let what = first.split_once(": ").map_or(first, |(_, w)| w);
    let what = match what {
        "invalid u64" | "invalid usize" => "expected a whole number >= 0",
        "invalid u16" => "expected a whole number from 0 to 65535",
        "invalid f64" => "expected a number",
        "invalid bool" | "invalid boolean" => "expected true or false",
        "expected mapping start" => "expected a mapping of keys",
        w => w,
    };
    let line = text
        .lines()
        .nth(loc.line() as usize - 1)
        .unwrap_or_default();
    let value: String = line
        .chars()
        .skip(loc.column().saturating_sub(1) as usize)
        .collect();
    let value = value.split(" #").next().unwrap_or_default().trim();
    let key = key_path(text, loc.line() as usize);
    let mut out = String::new();
    if !key.is_empty() {
        out.push_str(&format!("key `{key}` "));
    }
    out.push_str(&format!("(line {}): {what}", loc.line()));
    if !value.is_empty() && !what.contains(value) && !what.starts_with("unknown field") {
        out.push_str(&format!(", got `{value}`"));
    }
    out
}

/// The dotted path of the block-mapping key on (or enclosing) line `line` (1-based), from
/// indentation; empty where there is none.
fn key_path(text: &str, line: usize) -> String {
    let mut stack: Vec<(usize, String)> = Vec::new();
    for l in text.lines().take(line) {
        let body = l.trim_start();
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        let indent = l.len() - body.len();
        let key = body.split_once(':').map(|(k, _)| k.trim()).filter(|k| {
            !k.is_empty()
                && k.chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        });
        while stack.last().is_some_and(|(i, _)| *i >= indent) {
            stack.pop();
        }
        if let Some(k) = key {
            stack.push((indent, k.to_string()));
        }
    }
    stack
        .into_iter()
        .map(|(_, k)| k)
        .collect::<Vec<_>>()
        .join(".")
}

thread_local! {
    /// The section [`Sections`] deserializes (serde has no way to hand a derive a name).
    static SECTION: std::cell::RefCell<String> = const { std::cell::RefCell::new(String::new()) };
}

/// A file of sections: the one named in [`SECTION`] read as [`ServeSettings`], the others
/// skipped unread.
#[derive(Default)]
struct Sections {
    chosen: Option<ServeSettings>,
    names: Vec<String>,
}

impl<'de> Deserialize<'de> for Sections {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V(String);
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Sections;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                write!(f, "a mapping of sections, one of them `{}`", self.0)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<Sections, A::Error> {
                let mut out = Sections::default();
                while let Some(key) = map.next_key::<String>()? {
                    if key == self.0 {
                        if out.chosen.is_some() {
                            return Err(serde::de::Error::custom(format!("section `{key}` twice")));
                        }
                        out.chosen = Some(map.next_value()?);
                    } else {
                        map.next_value::<serde::de::IgnoredAny>()?;
                    }
                    out.names.push(key);
                }
                Ok(out)
            }
        }
        let name = SECTION.with(|s| s.borrow().clone());
        d.deserialize_map(V(name))
    }
}
