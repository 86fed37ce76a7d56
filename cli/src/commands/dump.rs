//! `maxc dump ARTIFACT DIR`: the artifact as reviewable text.

use anyhow::{Context, Result};
use maxc_runtime::dump::{dump, write_dump};
use maxc_runtime::Artifact;
use std::path::PathBuf;

/// Arguments of `maxc dump`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The artifact directory.
    artifact: PathBuf,
    /// Where to write the text files.
    out: PathBuf,
}

/// Writes the dump.
pub fn run(args: Args) -> Result<()> {
    let a = Artifact::open(&args.artifact)?;
    let d = dump(&a);
    write_dump(&d, &args.out)
        .with_context(|| format!("writing the dump to {}", args.out.display()))?;
    println!("{} files written to {}", d.len(), args.out.display());
    Ok(())
}
