//! `maxc`: compile models ahead of time, inspect them and run them. Built without the default
//! `compile` feature, it is the lean runtime binary: no compiler crate inside.

mod args;
mod commands;
mod report;
#[cfg(feature = "compile")]
mod runtime_args;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// maxc: an ahead-of-time model compiler with a lean serving runtime.
#[derive(Parser, Debug)]
#[command(name = "maxc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// List the registered architectures.
    #[cfg(feature = "compile")]
    Models(commands::models::Args),
    /// Load a checkpoint, build every role's graph and show parameters, ops, inputs and dim bounds.
    #[cfg(feature = "compile")]
    Plan(commands::plan::Args),
    /// Run one prompt through the reference interpreter and print (or dump) its logits.
    #[cfg(feature = "compile")]
    Eval(commands::eval::Args),
    /// Compile a checkpoint into an artifact directory.
    #[cfg(feature = "compile")]
    Compile(commands::compile::Args),
    /// Run one prompt through a compiled artifact and print (or dump) its logits.
    Run(commands::run::Args),
    /// Generate tokens with a compiled artifact.
    Generate(commands::generate::Args),
    /// Show an artifact's roles, dims and bounds, kernels, arena and weights.
    Inspect(commands::inspect::Args),
    /// Time every kernel launch of a prefill and decode steps (CPU); write a trace.
    Profile(commands::profile::Args),
    /// Prefill and decode tokens/s, load time and peak memory, against rooflines measured in
    /// the same run.
    Bench(commands::bench::Args),
    /// Serve an artifact over an OpenAI-compatible HTTP API, with Prometheus metrics.
    Serve(commands::serve::Args),
    /// Tokenize a text with an artifact's tokenizer.
    Tokenize(commands::tokenize::Args),
    /// Write an artifact as reviewable text (manifest, plan, kernels, weights by hash).
    Dump(commands::dump::Args),
    /// Compare two artifacts structurally; exit 0 when identical, 1 when different, 2 on error.
    Diff(commands::diff::Args),
    /// Make an Ed25519 key pair for signing artifacts (PREFIX.key, PREFIX.pub).
    Keygen(commands::sign::KeygenArgs),
    /// Sign an artifact's manifest (which holds every file's sha256) with a key of `maxc keygen`.
    Sign(commands::sign::SignArgs),
}

fn main() -> ExitCode {
    let matches = <Cli as clap::CommandFactory>::command().get_matches();
    let cli = match <Cli as clap::FromArgMatches>::from_arg_matches(&matches) {
        Ok(c) => c,
        Err(e) => e.exit(),
    };
    #[cfg(unix)]
    if !matches!(cli.command, Command::Serve(_)) {
        // SAFETY: before any thread starts; restores the default action, so that a closed pipe
        // (`maxc inspect A | head`) ends the process as it does any Unix filter instead of
        // panicking in `println!`. The server keeps Rust's default (ignored).
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    // `serve` logs one line per request at info; other commands only warnings.
    let default = if matches!(cli.command, Command::Serve(_)) {
        "info"
    } else {
        "warn"
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("MAXC_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    match mpi_rank(&cli.command) {
        Ok(None) => {}
        Ok(Some(code)) => return code,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            return ExitCode::FAILURE;
        }
    }
    if let Command::Diff(a) = cli.command {
        return match commands::diff::run(a) {
            Ok(code) => ExitCode::from(code),
            Err(e) => {
                eprintln!("error: {}", report(&e));
                ExitCode::from(2)
            }
        };
    }
    let result = match cli.command {
        #[cfg(feature = "compile")]
        Command::Models(a) => commands::models::run(a),
        #[cfg(feature = "compile")]
        Command::Plan(a) => commands::plan::run(a),
        #[cfg(feature = "compile")]
        Command::Eval(a) => commands::eval::run(a),
        #[cfg(feature = "compile")]
        Command::Compile(a) => commands::compile::run(a),
        Command::Run(a) => commands::run::run(a),
        Command::Generate(a) => commands::generate::run(a),
        Command::Inspect(a) => commands::inspect::run(a),
        Command::Dump(a) => commands::dump::run(a),
        Command::Tokenize(a) => commands::tokenize::run(a),
        Command::Serve(a) => commands::serve::run(a, matches.subcommand_matches("serve")),
        Command::Keygen(a) => commands::sign::keygen(a),
        Command::Sign(a) => commands::sign::sign(a),
        Command::Profile(a) => commands::profile::run(a),
        Command::Bench(a) => commands::bench::run(a),
        Command::Diff(_) => unreachable!("handled above"),
    };
    // Under mpirun, the other ranks stop following once rank 0 is done.
    maxc_runtime::engine::end_group();
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {}", report(&e));
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, `: `-joined, leaving out a cause whose words the message before
/// it already holds (errors that name a file usually quote the OS's reason too).
fn report(e: &anyhow::Error) -> String {
    let mut out = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        if !out.contains(&c) {
            out.push_str(": ");
            out.push_str(&c);
        }
    }
    out
}

/// Under `mpirun`: joins the launcher's group. Rank 0 goes on to run the command, its
/// tensor- or expert-parallel engine taking the group; every other rank follows rank 0's steps for the
/// artifact the command names, and its exit code is returned. `None` where the process was not
/// launched so, or is rank 0.
#[cfg(feature = "mpi")]
fn mpi_rank(command: &Command) -> anyhow::Result<Option<ExitCode>> {
    use maxc_runtime::comm::{Communicator, MpiComm};
    if !MpiComm::launched() {
        return Ok(None);
    }
    // How long a collective waits for its peers before the rank ends the job.
    let timeout = match std::env::var("MAXC_COMM_TIMEOUT_S") {
        Err(_) => maxc_runtime::comm::DEFAULT_TIMEOUT,
        Ok(v) => v
            .parse::<f64>()
            .ok()
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(std::time::Duration::from_secs_f64)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "MAXC_COMM_TIMEOUT_S is `{v}`; expected a positive number of seconds"
                )
            })?,
    };
    let world = MpiComm::init(timeout)?;
    if world.size() == 1 {
        return Ok(None);
    }
    let (artifact, kernels) = match command {
        Command::Run(a) => (&a.artifact, a.activations.kernels()),
        Command::Generate(a) => (&a.artifact, a.activations.kernels()),
        Command::Profile(a) => (&a.artifact, a.activations.kernels()),
        Command::Bench(a) => (&a.artifact, a.activations.kernels()),
        Command::Serve(a) => (&a.artifact, a.activations.kernels()),
        _ => anyhow::bail!(
            "launched as {} ranks by mpirun: tensor- and expert-parallel ranks across processes run `run`, `generate`, `profile`, `bench` and `serve`",
            world.size()
        ),
    };
    if world.rank() == 0 {
        maxc_runtime::comm::set_world(Box::new(world));
        return Ok(None);
    }
    // `mpirun` passes SIGTERM and SIGINT to every rank: a following rank keeps running until
    // rank 0, which drains its requests first, stops its steps.
    #[cfg(unix)]
    // SAFETY: before this rank starts any thread of its own; ignoring a signal is async-safe.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
        libc::signal(libc::SIGINT, libc::SIG_IGN);
    }
    let artifact = std::sync::Arc::new(maxc_runtime::Artifact::open_verified(
        artifact,
        None,
        maxc_runtime::engine::Device::Cpu.weight_memory(),
    )?);
    maxc_runtime::engine::follow(artifact, kernels, Box::new(world))?;
    Ok(Some(ExitCode::SUCCESS))
}

/// Without the `mpi` feature, several ranks under `mpirun` would each run the whole command:
/// refused, naming the feature.
#[cfg(not(feature = "mpi"))]
fn mpi_rank(_: &Command) -> anyhow::Result<Option<ExitCode>> {
    let ranks = std::env::var("OMPI_COMM_WORLD_SIZE")
        .ok()
        .and_then(|v| v.parse::<usize>().ok());
    match ranks {
        Some(n) if n > 1 => anyhow::bail!(
            "launched as {n} ranks by mpirun, but this maxc was built without MPI: build it with `--features mpi` (scripts/install-mpi.sh installs Open MPI)"
        ),
        _ => Ok(None),
    }
}
