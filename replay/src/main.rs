//! `replay`: export a window of the cluster's logs, explain a decision,
//! verify that the log reproduces every decision and the index, and see
//! what other settings would have changed.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand};
use engine_sim::Preset;
use replay::{explain, flips, live, replay, simulate, Export};
use router::Overrides;
use router::Policy;
use sim::Slo;

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Replay Switchyard's event log to explain, verify and what-if routing decisions"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// Where the window comes from: an export file, or a live cluster.
#[derive(Debug, Args)]
struct Source {
    /// An export file written by `replay export`.
    #[arg(long, conflicts_with = "nats")]
    file: Option<PathBuf>,
    /// A live cluster's NATS server.
    #[arg(long, env = "SWITCHYARD_NATS_URL")]
    nats: Option<String>,
    /// From a live cluster: only the last N decisions.
    #[arg(long)]
    last: Option<usize>,
    /// The live cluster's NATS credentials and TLS.
    #[command(flatten)]
    auth: bus::AuthArgs,
}

impl Source {
    async fn load(&self) -> anyhow::Result<Export> {
        match (&self.file, &self.nats) {
            (Some(path), _) => {
                let bytes =
                    std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
                Export::from_bytes(&bytes)
                    .with_context(|| format!("{} is not a readable export", path.display()))
            }
            (None, Some(url)) => live::export(url, &self.auth.nats, self.last).await,
            (None, None) => bail!("give --file FILE or --nats URL"),
        }
    }
}

/// Other settings to re-decide with.
#[derive(Debug, Args)]
struct Alternative {
    /// Another policy, by the router's name: always_disagg, never_disagg,
    /// isl, load, isl_or_load, sla_dynamic.
    #[arg(long)]
    policy: Option<String>,
    /// A policy parameter, e.g. `--param eff_isl_tokens=1024` (repeatable).
    #[arg(long = "param", value_parser = router::parse_param)]
    params: Vec<(String, f64)>,
    /// A router setting, e.g. `--router-param gate.budget_fraction=0.9`.
    #[arg(long = "router-param", value_parser = router::parse_param)]
    router_params: Vec<(String, f64)>,
}

impl Alternative {
    fn overrides(&self) -> Overrides {
        if let Some(found) = self
            .policy
            .as_deref()
            .and_then(|name| router::PolicySpec::find(name).ok())
            .filter(|found| found.deprecated)
        {
            eprintln!(
                "note: --policy {} is an earlier spelling: use {}",
                self.policy.as_deref().unwrap_or_default(),
                found.spec.name
            );
        }
        Overrides {
            policy: self.policy.clone(),
            policy_params: self.params.clone(),
            router_params: self.router_params.clone(),
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Copy a window of a live cluster's logs into one file.
    Export {
        #[arg(
            long,
            env = "SWITCHYARD_NATS_URL",
            default_value = "nats://127.0.0.1:4222"
        )]
        nats: String,
        /// NATS credentials and TLS.
        #[command(flatten)]
        auth: bus::AuthArgs,
        #[arg(long)]
        out: PathBuf,
        /// Only the last N decisions (and what they need).
        #[arg(long)]
        last: Option<usize>,
    },
    /// Rebuild the index at one decision and show what it looked at and
    /// the rule that decided; with --policy/--param, what would change.
    Explain {
        /// The decision id (16 hex digits) or the request id.
        decision: String,
        #[command(flatten)]
        source: Source,
        #[command(flatten)]
        what_if: Alternative,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Replay the window: the rebuilt index must match the live indexer's
    /// digest and every decision must come out the same. Exits 1 otherwise.
    Verify {
        #[command(flatten)]
        source: Source,
        #[arg(long)]
        json: bool,
    },
    /// Re-decide every request of the window with other settings and count
    /// what flips; --simulate also runs both on the simulator.
    WhatIf {
        #[command(flatten)]
        source: Source,
        #[command(flatten)]
        what_if: Alternative,
        /// Estimate the effect on TTFT, ITL and goodput with the simulator.
        #[arg(long)]
        simulate: bool,
        /// Engine preset for --simulate.
        #[arg(long, default_value = "llama70b_fp8_tp2_h100")]
        preset: String,
        #[arg(long)]
        json: bool,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Export {
            nats,
            auth,
            out,
            last,
        } => {
            let export = live::export(&nats, &auth.nats, last).await?;
            let bytes = export.to_bytes();
            std::fs::write(&out, &bytes).with_context(|| format!("writing {}", out.display()))?;
            let per_decision: usize = export
                .decisions
                .iter()
                .map(|d| protocol::Message::encode(d).len())
                .sum::<usize>()
                / export.decisions.len().max(1);
            println!(
                "{}: {} decisions (mean {per_decision} bytes each on the log; {} contexts, {} earlier prompts they begin with), {} deltas{}, {} KV batches, {} bytes",
                out.display(),
                export.decisions.len(),
                export.contexts.len(),
                export.prompts.len(),
                export.deltas.len(),
                export
                    .snapshot
                    .as_ref()
                    .map(|s| format!(" after a snapshot at delta {}", s.delta_seq))
                    .unwrap_or_default(),
                export.kv_batches.len(),
                bytes.len()
            );
        }
        Command::Explain {
            decision,
            source,
            what_if,
            json,
        } => {
            let export = source.load().await?;
            let (record, replayed) = explain(&export, &decision, &Overrides::default())?;
            let replayed = replayed.with_context(|| format!("re-deciding {decision}"))?;
            let bs = record.inputs.block_size;
            let overrides = what_if.overrides();
            let alternative = if overrides.is_empty() {
                None
            } else {
                Some(
                    explain(&export, &decision, &overrides)?
                        .1
                        .context("re-deciding with the what-if settings")?,
                )
            };
            if json {
                let value = serde_json::json!({
                    "recorded": { "path": record.decision.path.as_str(), "decode": record.decision.decode.to_string(), "rule": record.decision.rule, "reason": record.decision.reason },
                    "delta_seq": record.inputs.delta_seq,
                    "reproduced": replay::Outcome { decision: record.decision.clone(), replayed: Ok(replayed.clone()) }.mismatch().is_none(),
                    "explanation": router::explain::to_json(&replayed.decision, &replayed.explanation, bs),
                    "what_if": alternative.as_ref().map(|a| router::explain::to_json(&a.decision, &a.explanation, bs)),
                });
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                println!(
                    "as recorded (index rebuilt at delta {}):",
                    record.inputs.delta_seq
                );
                print!(
                    "{}",
                    router::explain::to_text(&replayed.decision, &replayed.explanation, bs)
                );
                if let Some(m) = (replay::Outcome {
                    decision: record.decision.clone(),
                    replayed: Ok(replayed.clone()),
                })
                .mismatch()
                {
                    println!("  !! the replay differs from the log: {m}");
                }
                if let Some(a) = alternative {
                    println!("\nwith the what-if settings:");
                    print!(
                        "{}",
                        router::explain::to_text(&a.decision, &a.explanation, bs)
                    );
                }
            }
        }
        Command::Verify { source, json } => {
            let export = source.load().await?;
            let started = Instant::now();
            let report = replay(&export, &Overrides::default())?;
            let elapsed = started.elapsed();
            let mismatches: Vec<_> = report
                .outcomes
                .iter()
                .filter_map(|o| o.mismatch().map(|m| (o, m)))
                .collect();
            let digest_ok = report.digest.is_none_or(|d| d.live == d.rebuilt);
            let rate = report.outcomes.len() as f64 / report.decide_time.as_secs_f64().max(1e-9);
            if json {
                println!(
                    "{}",
                    serde_json::json!({
                        "decisions": report.outcomes.len(),
                        "reproduced": report.outcomes.len() - mismatches.len(),
                        "mismatches": mismatches.iter().map(|(o, m)| serde_json::json!({"decision": o.decision.id.to_string(), "difference": m})).collect::<Vec<_>>(),
                        "digest": report.digest.map(|d| serde_json::json!({"delta_seq": d.delta_seq, "live": format!("{:016x}", d.live), "rebuilt": format!("{:016x}", d.rebuilt)})),
                        "decisions_per_s": rate.round(),
                        "seconds": elapsed.as_secs_f64(),
                    })
                );
            } else {
                for (o, m) in &mismatches {
                    println!(
                        "MISMATCH {} (request {}): {m}",
                        o.decision.id, o.decision.request_id
                    );
                    println!(
                        "  logged:   {} on {} ({}): {}",
                        o.decision.path, o.decision.decode, o.decision.rule, o.decision.reason
                    );
                    if let Ok(r) = &o.replayed {
                        println!(
                            "  replayed: {} on {} ({}): {}",
                            r.decision.path, r.decision.decode, r.decision.rule, r.decision.reason
                        );
                    }
                }
                match report.digest {
                    Some(d) => println!(
                        "index at delta {}: rebuilt {:016x}, live {:016x}: {}",
                        d.delta_seq,
                        d.rebuilt,
                        d.live,
                        if d.live == d.rebuilt {
                            "equal"
                        } else {
                            "DIFFERENT"
                        }
                    ),
                    None => println!("index: no live checkpoint in this export"),
                }
                println!(
                    "{} of {} decisions reproduced exactly; {:.0} decisions re-decided per second ({:.2} s in all)",
                    report.outcomes.len() - mismatches.len(),
                    report.outcomes.len(),
                    rate,
                    elapsed.as_secs_f64()
                );
            }
            if !mismatches.is_empty() || !digest_ok {
                std::process::exit(1);
            }
        }
        Command::WhatIf {
            source,
            what_if,
            simulate: run_sim,
            preset,
            json,
        } => {
            let export = source.load().await?;
            let overrides = what_if.overrides();
            if overrides.is_empty() {
                bail!("give --policy and/or --param/--router-param");
            }
            let report = replay(&export, &overrides)?;
            let f = flips(&report);
            let mut value = serde_json::json!({
                "decisions": f.decisions,
                "bypass_to_remote": f.bypass_to_remote,
                "remote_to_bypass": f.remote_to_bypass,
                "fetch_changed": f.fetch_changed,
                "other_decode_worker": f.other_decode_worker,
                "failed": f.failed,
                "examples": f.examples.iter().map(|(id, a, b)| serde_json::json!({"decision": id, "before": a, "after": b})).collect::<Vec<_>>(),
            });
            if run_sim {
                let preset =
                    Preset::by_name(&preset).with_context(|| format!("unknown preset {preset}"))?;
                let records: Vec<protocol::DecisionRecord> = export
                    .records()
                    .into_iter()
                    .filter_map(Result::ok)
                    .collect();
                let recorded = records
                    .first()
                    .context("no decision of the window reads back")?;
                let before = Policy::with_params(
                    &recorded.decision.policy,
                    recorded
                        .inputs
                        .policy_params
                        .iter()
                        .map(|(k, v)| (k.as_str(), *v)),
                )?;
                let mut after_params = match &what_if.policy {
                    Some(_) => Vec::new(),
                    None => recorded.inputs.policy_params.clone(),
                };
                after_params.extend(what_if.params.iter().cloned());
                let after_name = what_if
                    .policy
                    .as_deref()
                    .unwrap_or(&recorded.decision.policy);
                let after = Policy::with_params(
                    after_name,
                    after_params.iter().map(|(k, v)| (k.as_str(), *v)),
                )?;
                let slo = Slo {
                    ttft_ms: 2_000.0,
                    itl_ms: 60.0,
                };
                let a = simulate::run(&records, preset, before, slo)?;
                let b = simulate::run(&records, preset, after, slo)?;
                let side = |s: &sim::RunSummary| {
                    serde_json::json!({
                        "ttft_p50_ms": s.ttft_ms.p50, "ttft_p90_ms": s.ttft_ms.p90,
                        "itl_p50_ms": s.itl_ms.p50, "itl_p90_ms": s.itl_ms.p90,
                        "slo_attainment": s.slo_attainment, "bypass_share": s.bypass_share,
                    })
                };
                value["simulated"] = serde_json::json!({"recorded": side(&a), "what_if": side(&b)});
            }
            if json {
                println!("{}", serde_json::to_string_pretty(&value)?);
            } else {
                println!(
                    "{} decisions: {} bypass -> remote, {} remote -> bypass, {} remote with a fetched prefix gained or lost, {} to another decode worker, {} could not be re-decided",
                    f.decisions, f.bypass_to_remote, f.remote_to_bypass, f.fetch_changed, f.other_decode_worker, f.failed
                );
                for (id, a, b) in &f.examples {
                    println!("  {id}: {a}  =>  {b}");
                }
                if let Some(s) = value.get("simulated") {
                    println!(
                        "simulated on the window (recorded vs what-if): {}",
                        serde_json::to_string_pretty(s)?
                    );
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    #[test]
    fn the_command_line_is_well_formed() {
        super::Cli::command().debug_assert();
    }
}
