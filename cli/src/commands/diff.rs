//! `maxc diff A B`: what changed between two artifacts, structurally. Exit 0 when identical,
//! 1 when different, 2 on error (like `diff`).

use anyhow::Result;
use maxc_runtime::diff::{diff_dumps, report};
use maxc_runtime::dump::dump;
use maxc_runtime::Artifact;
use std::path::PathBuf;

/// Arguments of `maxc diff`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The first artifact.
    a: PathBuf,
    /// The second artifact.
    b: PathBuf,
    /// Print the changes as JSON.
    #[arg(long)]
    json: bool,
}

/// Compares; returns the exit code (0 identical, 1 different).
pub fn run(args: Args) -> Result<u8> {
    let a = Artifact::open(&args.a)?;
    let b = Artifact::open(&args.b)?;
    let changes = diff_dumps(&dump(&a), &dump(&b), "a", "b");
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({"identical": changes.is_empty(), "changes": changes})
            )?
        );
    } else if changes.is_empty() {
        println!("identical: {} and {}", args.a.display(), args.b.display());
    } else {
        print!("{}", report(&changes));
        let files: Vec<&str> = changes.iter().map(|c| c.file.as_str()).collect();
        println!("\n{} file(s) differ: {}", files.len(), files.join(", "));
    }
    Ok(u8::from(!changes.is_empty()))
}
