//! `maxc generate ARTIFACT (--tokens ... | --prompt TEXT | --chat TEXT)`: generation from a
//! compiled artifact, the text streamed as it is generated.

use crate::args::parse_tokens;
use anyhow::{bail, Context, Result};
use maxc_runtime::sampling::SamplingParams;
use maxc_runtime::Engine;
use maxc_serve::chat::ChatMessage;
use maxc_serve::scheduler::{generate, GenerateOptions, Scheduler, Speculation};
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `maxc generate`.
#[derive(clap::Args, Debug)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["tokens", "prompt", "chat"])))]
pub struct Args {
    /// The artifact directory.
    pub(crate) artifact: PathBuf,
    /// The prompt's token ids, comma separated.
    #[arg(long)]
    tokens: Option<String>,
    /// The prompt as text, tokenized with the artifact's tokenizer.
    #[arg(long)]
    prompt: Option<String>,
    /// A user message, rendered with the artifact's chat template.
    #[arg(long)]
    chat: Option<String>,
    /// A system message for --chat (the template's default otherwise).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Tokens to generate at most.
    #[arg(long, default_value = "64")]
    max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy.
    #[arg(long, default_value = "0")]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value = "1")]
    top_p: f32,
    /// Sampling seed.
    #[arg(long, default_value = "0")]
    seed: u64,
    /// Keep going past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// The role to run.
    #[arg(long, default_value = "decoder")]
    pub(crate) role: String,
    /// Where to run: `cpu`, or `cuda` (GPU 0; the artifact needs --target cuda or all).
    #[arg(long, default_value = "cpu")]
    device: maxc_runtime::engine::Device,
    /// Print the prompt and generated ids (and text) as JSON.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    signature: crate::commands::sign::RequireSignature,
    #[command(flatten)]
    expert_parallel: crate::args::ExpertParallelArgs,
    #[command(flatten)]
    pub(crate) activations: crate::args::ActivationArgs,
    #[command(flatten)]
    speculative: crate::args::SpeculativeArgs,
}

/// Generates, streaming text (or ids) to stdout.
pub fn run(args: Args) -> Result<()> {
    let valid = args.temperature >= 0.0 && args.top_p > 0.0 && args.top_p <= 1.0;
    if !valid {
        bail!(
            "--temperature must be >= 0 and --top-p in (0, 1]; got {} and {}",
            args.temperature,
            args.top_p
        );
    }
    let key = args.signature.key()?;
    let speculation = args.speculative.options();
    if speculation.is_some() && args.role != "decoder" {
        bail!(
            "--speculative runs the decoder role; got --role {}",
            args.role
        );
    }
    let engine = Engine::open_verified(
        &args.artifact,
        &args.role,
        args.device,
        key.as_ref(),
        args.activations.kernels(),
    )?;
    args.expert_parallel.check(&engine)?;
    let artifact = engine.artifact().clone();
    let tokenizer = maxc_serve::tokenizer::Tokenizer::of_artifact(&artifact)?;
    let need_tokenizer = || {
        tokenizer.as_ref().with_context(|| {
            format!(
                "{} has no tokenizer.json; pass --tokens",
                args.artifact.display()
            )
        })
    };
    let prompt: Vec<i64> = match (&args.tokens, &args.prompt, &args.chat) {
        (Some(t), _, _) => parse_tokens(t)?,
        (None, Some(text), _) => need_tokenizer()?
            .encode(text, true)?
            .into_iter()
            .map(i64::from)
            .collect(),
        (None, None, Some(user)) => {
            let tok = need_tokenizer()?;
            let template = maxc_serve::chat::ChatTemplate::of_artifact(&artifact, tok)?
                .with_context(|| format!("{} has no chat template", args.artifact.display()))?;
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage::new("system", system.as_str()));
            }
            messages.push(ChatMessage::new("user", user.as_str()));
            let text = template.render(&messages, true)?;
            tok.encode(&text, false)?
                .into_iter()
                .map(i64::from)
                .collect()
        }
        (None, None, None) => bail!("pass --tokens, --prompt or --chat"),
    };
    let opts = GenerateOptions {
        max_new_tokens: args.max_new_tokens,
        sampling: SamplingParams {
            temperature: args.temperature,
            top_p: args.top_p,
            seed: args.seed,
            ..Default::default()
        },
        stop_at_eos: !args.ignore_eos,
    };
    let eos = artifact.manifest.eos_token_ids.clone();
    let stream_text = !args.json && args.tokens.is_none() && tokenizer.is_some();
    let mut stream = tokenizer.as_ref().map(|t| t.decode_stream(true));
    let mut stdout = std::io::stdout();
    let mut stream_err = None;
    let started = Instant::now();
    let mut first_token = None;
    let on_token = |id: i64| {
        first_token.get_or_insert_with(Instant::now);
        if !stream_text || eos.contains(&id) {
            return;
        }
        if let Some(s) = stream.as_mut() {
            match s.push(id as u32) {
                Ok(Some(piece)) => {
                    let _ = write!(stdout, "{piece}");
                    let _ = stdout.flush();
                }
                Ok(None) => {}
                Err(e) => stream_err = Some(e),
            }
        }
    };
    let spec = match &speculation {
        Some(so) => Some(Speculation::open(&engine, so, args.device, key.as_ref())?),
        None => None,
    };
    let mut sched = Scheduler::alone(engine);
    if let Some(spec) = spec {
        sched = sched.with_speculation(spec);
    }
    let out = generate(&mut sched, &prompt, &opts, on_token)?;
    let stats = sched.speculation().map(|s| (s.depth(), s.stats().clone()));
    let done = Instant::now();
    if let Some(e) = stream_err {
        return Err(e.into());
    }
    if stream_text {
        if let Some(Ok(Some(rest))) = stream.as_mut().map(|s| s.flush()) {
            print!("{rest}");
        }
        println!();
    } else if args.json {
        // Text where the tokenizer can decode the ids (a test tokenizer may not cover them).
        let ids: Vec<u32> = out.iter().map(|&i| i as u32).collect();
        let text = tokenizer.as_ref().and_then(|t| t.decode(&ids, true).ok());
        println!(
            "{}",
            serde_json::json!({"prompt": prompt, "generated": out, "text": text})
        );
    } else {
        println!(
            "{}",
            out.iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .join(",")
        );
    }
    if let Some(first) = first_token {
        let decode_s = done.duration_since(first).as_secs_f64();
        eprintln!(
            "maxc generate: {} tokens; first after {:.1} ms, then {:.1} tokens/s; CPU: {}; \
             {} at the end ({} changes of width)",
            out.len(),
            first.duration_since(started).as_secs_f64() * 1e3,
            (out.len() - 1) as f64 / decode_s.max(1e-9),
            maxc_runtime::kernels::pool::choice(),
            maxc_runtime::kernels::pool::width(),
            maxc_runtime::kernels::pool::width_changes()
        );
        let co = maxc_runtime::kernels::pool::codriving();
        if co.steps > 0 {
            let (_, helpers) = maxc_serve::scheduler::loop_steps();
            eprintln!(
                "maxc generate: {} steps co-driven by the kernels' threads beside busy processes \
                 ({} begun by a helper while this thread waited for a CPU); {} chunks taken \
                 over from a descheduled thread",
                co.steps, helpers, co.taken_over
            );
        }
        let spec = maxc_runtime::kernels::pool::speculation();
        if spec.jobs > 0 {
            eprintln!(
                "maxc generate: a helper thread beside busy processes: {} matmuls split into {} \
                 chunks, {} done by the helper, {} taken back from it; the caller moved CPUs {} \
                 times",
                spec.jobs,
                spec.chunks,
                spec.helped,
                spec.taken_back,
                maxc_runtime::kernels::pool::lead_moves()
            );
        }
    }
    if let Some((depth, st)) = stats {
        let rates: Vec<String> = st
            .rates()
            .iter()
            .map(|r| format!("{:.0}%", 100.0 * r))
            .collect();
        eprintln!(
            "maxc generate: speculative, {depth} draft tokens per step; accepted by position {}; \
             {:.2} accepted per step",
            rates.join(" "),
            st.mean_accepted()
        );
    }
    Ok(())
}
