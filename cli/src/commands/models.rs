//! `maxc models`: the registered architectures.

use anyhow::Result;
use maxc_graph::Registry;

/// Arguments of `maxc models`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

/// Lists every registered architecture with its roles.
pub fn run(args: Args) -> Result<()> {
    let registry = Registry::builtin();
    if args.json {
        let list: Vec<serde_json::Value> = registry
            .iter()
            .map(|a| {
                serde_json::json!({
                    "name": a.name(),
                    "roles": a.roles().iter().map(|r| r.name()).collect::<Vec<_>>(),
                    "description": a.description(),
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&list)?);
        return Ok(());
    }
    for a in registry.iter() {
        let roles: Vec<&str> = a.roles().iter().map(|r| r.name()).collect();
        println!(
            "{:<28} roles: {:<16} {}",
            a.name(),
            roles.join(","),
            a.description()
        );
    }
    Ok(())
}
