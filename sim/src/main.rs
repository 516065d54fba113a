//! `sim`: the cluster simulator's command line.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::{Args, Parser, Subcommand, ValueEnum};
use engine_sim::{KvTransfer, Preset};
use indicatif::{ProgressBar, ProgressStyle};
use sim::compare::{
    capacities, parallel_map, run_point, sweep, table, write_capacities, write_report, Scenario,
    WorkloadSpec,
};
use sim::tune::{tuned_params, Best, Progress, Tune};
use sim::workload::{AgenticConfig, Arrivals, MooncakeConfig, SyntheticConfig};
use sim::{conditional_policies, Deployment, KvExport, OutboxLimits, Search, SimConfig, Slo};

#[derive(Debug, Parser)]
#[command(
    version,
    about = "Simulate a conditional-disaggregation cluster in virtual time"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run every deployment and policy over a sweep of loads; print the
    /// table and write the report folder (SVG plots, CSV, JSON).
    Compare {
        #[command(flatten)]
        common: Common,
        /// Load points in the sweep.
        #[arg(long, default_value_t = 6)]
        loads: usize,
        /// Lowest and highest load (default: per workload).
        #[arg(long)]
        min_load: Option<f64>,
        #[arg(long)]
        max_load: Option<f64>,
        /// Where to write the report.
        #[arg(long, default_value = "report")]
        out: PathBuf,
        /// Runs in parallel (default: the machine's cores).
        #[arg(long)]
        threads: Option<usize>,
        /// The capacity search bisects until its bracket is narrower than
        /// this share of the load.
        #[arg(long, default_value_t = Search::default().tolerance)]
        capacity_tolerance: f64,
        /// A load passes the capacity search only if its TTFT p99 is within
        /// this too (ms): a capacity with a tail an operator would run, not
        /// only with the most requests within the SLO (default: no bound).
        #[arg(long)]
        ttft_p99_bound_ms: Option<f64>,
    },
    /// For the workload and --workers: search each family's best
    /// configuration by capacity (aggregated; disaggregated at its best
    /// P:D split; C/D with each policy at its best split and thresholds,
    /// the thresholds' grids from the router's policy registry; for every
    /// family the router's decode selection, `decode.overlap_credit`,
    /// unless --router-param sets it); print a table and one JSON line.
    Tune {
        #[command(flatten)]
        common: Common,
        /// Each capacity search bisects until its bracket is narrower than
        /// this share of the load.
        #[arg(long, default_value_t = 0.05)]
        capacity_tolerance: f64,
        /// Runs in parallel (default: the machine's cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Judge each load by the mean SLO attainment over this many seeds
        /// (--seed, --seed + 1, ...; N times the runs): near capacity one
        /// seed's attainment can differ from the next by more than the
        /// families differ.
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        /// Tune only these C/D policies (comma-separated names as the router
        /// takes them, e.g. `isl,sla_dynamic` or Dynamo's `isl_bounding`;
        /// default: all). Aggregated and disaggregated, the baselines, are
        /// always tuned.
        #[arg(long, value_delimiter = ',')]
        policies: Vec<String>,
        /// NAME=VALUE: fix a policy parameter for every tuned C/D policy that
        /// has it (it is then not tuned), e.g. `--param
        /// spare_decodes_up_to=2`; repeatable, the router's names.
        #[arg(long = "param", value_parser = router::parse_param)]
        params: Vec<(String, f64)>,
        /// A load passes only if the mean over the seeds of each run's TTFT
        /// p99 is within this too (ms): each family's best configuration
        /// with a tail an operator would run, not only with the most
        /// requests within the SLO (default: no bound).
        #[arg(long)]
        ttft_p99_bound_ms: Option<f64>,
    },
    /// Run one deployment at one load and print its figures.
    Run {
        #[command(flatten)]
        common: Common,
        /// `aggregated`, `disaggregated`, or C/D with a router policy:
        /// `isl`, `load`, `isl_or_load`, `sla_dynamic` (the router's names).
        #[arg(long, default_value = "isl")]
        deployment: String,
        /// A policy parameter over its default, e.g. `--param
        /// eff_isl_tokens=1024` (repeatable; the router's names).
        #[arg(long = "param", value_parser = router::parse_param)]
        params: Vec<(String, f64)>,
        #[arg(long)]
        load: f64,
        /// Run this many seeds (--seed, --seed + 1, ...) and print each
        /// one's row and the spread of SLO attainment over them: on a
        /// closed-loop workload near capacity one seed's attainment can
        /// differ from the next by more than two policies differ.
        #[arg(long, default_value_t = 1)]
        seeds: u64,
        /// Runs in parallel with --seeds (default: the machine's cores).
        #[arg(long)]
        threads: Option<usize>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum WorkloadArg {
    /// Coding-agent sessions of 4-24 turns, appends of tens to thousands
    /// of tokens.
    Agentic,
    /// Long-context coding-agent sessions: contexts up to 256k with
    /// compaction at 200k, median prompt ~40k, heavy-tailed tool outputs,
    /// 512-token blocks by default.
    LongContext,
    Mooncake,
    Synthetic,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum KvExportArg {
    Ideal,
    VllmOnDemand,
    VllmEveryRequest,
}

#[derive(Debug, Args)]
struct Common {
    #[arg(long, value_enum, default_value_t = WorkloadArg::Agentic)]
    workload: WorkloadArg,
    /// Mooncake JSONL trace (for --workload mooncake), e.g.
    /// ../shared/traces/mooncake_conversation_trace.jsonl
    #[arg(long)]
    trace: Option<PathBuf>,
    /// Replay only the first N trace requests.
    #[arg(long)]
    limit: Option<usize>,
    /// Trace replays: issue every request at its (scaled) timestamp, even
    /// before its predecessor's answer exists. Default: closed loop, a turn
    /// is issued its predecessor's last token plus the trace's gap. The
    /// agentic workload is always closed loop.
    #[arg(long)]
    open_loop: bool,
    /// Seconds during which sessions (or requests) start arriving
    /// (default: 180; 900 for the long-context workload, whose sessions
    /// are few and long).
    #[arg(long)]
    duration_s: Option<f64>,
    /// Engine preset: llama70b_fp8_tp2_h100 or llama8b_h100.
    #[arg(long, default_value = "llama70b_fp8_tp2_h100")]
    preset: String,
    /// Workers (each with the preset's GPUs); equal for every deployment.
    #[arg(long, default_value_t = 8)]
    workers: u32,
    /// Prefill workers of the disaggregated and C/D deployments.
    #[arg(long, default_value_t = 2)]
    prefill_workers: u32,
    /// Tokens per KV block (default: 16; 512 for the Mooncake trace and
    /// the long-context workload).
    #[arg(long)]
    block_size: Option<u32>,
    /// Each worker's KV link bandwidth, GB/s (concurrent transfers at a
    /// worker share it: P -> D handoffs and D -> P prefix pulls).
    #[arg(long, default_value_t = 87.0)]
    link_gb_s: f64,
    /// The third path for the C/D deployments: a remote prefill may pull
    /// the prefix a decode worker holds (`--prefix-fetch false`: never).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    prefix_fetch: bool,
    /// Fewest tokens worth pulling from a decode worker.
    #[arg(long, default_value_t = router::FetchConfig::default().min_tokens)]
    prefix_fetch_min_tokens: u32,
    /// What the third path pins on the decode worker it reads from:
    /// `ideal`, the fetched prefix from the decision until read, nothing
    /// else (the simulated engine; no real engine does this);
    /// `vllm-on-demand`, vLLM's bidirectional transfer as the worker agent
    /// uses it (the fetched prefix exported by a request to the decode
    /// engine that the prefill leg waits for, abandoned after 0.8 s or
    /// beyond 16 at once; pinned from its end until read, and readable
    /// until 5 s before --decoder-kv-blocks-ttl-s; and every remote decode
    /// leg exported as it finishes, pinned until the TTL: nobody reads it);
    /// `vllm-every-request`, every request decoded exported, pinned until
    /// a later turn's fetch reads it or the TTL (a fetch whose export is
    /// gone prefills whole).
    #[arg(long, value_enum, default_value_t = KvExportArg::Ideal)]
    kv_export: KvExportArg,
    /// With `--kv-export vllm-*`: seconds a decode engine keeps an export
    /// nobody read (vLLM's `decoder_kv_blocks_ttl`); a prefill engine reads
    /// it only until 5 s before then (vLLM's safety margin).
    #[arg(long, default_value_t = 480.0)]
    decoder_kv_blocks_ttl_s: f64,
    /// Each worker's host-memory KV tier (G2) in GiB, for every
    /// deployment: evicted blocks are offloaded there and read back over
    /// PCIe instead of recomputed (0: no host tier). Run `sim compare` with
    /// 0 and with, say, 256 to see what offloading changes.
    #[arg(long, default_value_t = 0.0)]
    host_offload_gib: f64,
    /// Engine events reach the router's index after this delay, ms.
    #[arg(long, default_value_t = 5.0)]
    index_delay_ms: f64,
    /// TTFT and ITL targets: the SLO of the goodput figures and of the SLA
    /// policy.
    #[arg(long, default_value_t = 2000.0)]
    ttft_slo_ms: f64,
    #[arg(long, default_value_t = 60.0)]
    itl_slo_ms: f64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// A router setting over its default, for every deployment, e.g.
    /// `--router-param prefill.miss_weight=0` (repeatable; the router's
    /// names, as its decision records list them; the third path's are
    /// --prefix-fetch and --prefix-fetch-min-tokens).
    #[arg(long = "router-param", value_parser = router::parse_param)]
    router_params: Vec<(String, f64)>,
}

impl Common {
    fn workload(&self) -> anyhow::Result<WorkloadSpec> {
        if self.open_loop && self.workload != WorkloadArg::Mooncake {
            bail!("--open-loop is for trace replays (--workload mooncake); this workload is closed loop or single-turn by construction");
        }
        Ok(match self.workload {
            WorkloadArg::Agentic => WorkloadSpec::Agentic(AgenticConfig {
                duration_s: self.duration_s.unwrap_or(180.0),
                seed: self.seed,
                ..AgenticConfig::default()
            }),
            WorkloadArg::LongContext => WorkloadSpec::LongContext(AgenticConfig {
                duration_s: self.duration_s.unwrap_or(900.0),
                seed: self.seed,
                ..AgenticConfig::long_context()
            }),
            WorkloadArg::Synthetic => WorkloadSpec::Synthetic(SyntheticConfig {
                duration_s: self.duration_s.unwrap_or(180.0),
                seed: self.seed,
                ..SyntheticConfig::default()
            }),
            WorkloadArg::Mooncake => {
                let Some(path) = &self.trace else {
                    bail!("--workload mooncake needs --trace FILE (e.g. ../shared/traces/mooncake_conversation_trace.jsonl)");
                };
                let text = std::fs::read_to_string(path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let records = protocol::trace::parse_mooncake(&text)
                    .with_context(|| format!("parsing {}", path.display()))?;
                WorkloadSpec::Mooncake {
                    records: Arc::new(records),
                    config: MooncakeConfig {
                        rate_scale: 1.0,
                        limit: self.limit,
                        arrivals: if self.open_loop {
                            Arrivals::OpenLoop
                        } else {
                            Arrivals::ClosedLoop
                        },
                        seed: self.seed,
                    },
                }
            }
        })
    }

    /// `seeds` scenarios from `--seed` on: the workload's and the router's
    /// seed advanced by one each (the configuration built and a trace read
    /// once).
    fn scenarios(&self, seeds: u64) -> anyhow::Result<Vec<Scenario>> {
        if seeds == 0 {
            bail!("--seeds must be at least 1");
        }
        let Some(last) = self.seed.checked_add(seeds - 1) else {
            bail!(
                "--seed {} with --seeds {seeds} runs past the largest seed",
                self.seed
            );
        };
        let (config, workload) = (self.sim_config()?, self.workload()?);
        Ok((self.seed..=last)
            .map(|seed| Scenario {
                config: SimConfig {
                    seed,
                    ..config.clone()
                },
                workload: workload.with_seed(seed),
            })
            .collect())
    }

    fn sim_config(&self) -> anyhow::Result<SimConfig> {
        let Some(preset) = Preset::by_name(&self.preset) else {
            let names: Vec<_> = Preset::ALL.iter().map(|p| p.name).collect();
            bail!(
                "unknown preset {:?}; known: {}",
                self.preset,
                names.join(", ")
            );
        };
        if !(self.host_offload_gib.is_finite() && self.host_offload_gib >= 0.0) {
            bail!(
                "--host-offload-gib must be a finite number >= 0, not {}",
                self.host_offload_gib
            );
        }
        if !(self.decoder_kv_blocks_ttl_s.is_finite() && self.decoder_kv_blocks_ttl_s > 0.0) {
            bail!(
                "--decoder-kv-blocks-ttl-s must be a finite number > 0, not {}",
                self.decoder_kv_blocks_ttl_s
            );
        }
        if self.prefill_workers >= self.workers {
            bail!(
                "--prefill-workers ({}) must be fewer than --workers ({})",
                self.prefill_workers,
                self.workers
            );
        }
        let default_block = match self.workload {
            WorkloadArg::Mooncake | WorkloadArg::LongContext => 512,
            WorkloadArg::Agentic | WorkloadArg::Synthetic => 16,
        };
        let config = SimConfig {
            preset,
            block_size: self.block_size.unwrap_or(default_block),
            deployment: Deployment::Aggregated {
                workers: self.workers,
            },
            link: KvTransfer {
                bytes_per_s: self.link_gb_s * 1e9,
                ..KvTransfer::default()
            },
            index_delay_us: (self.index_delay_ms * 1e3) as u64,
            kv_outbox: OutboxLimits::default(),
            load_interval_us: 100_000,
            expected_output_tokens: 256,
            slo: Slo {
                ttft_ms: self.ttft_slo_ms,
                itl_ms: self.itl_slo_ms,
            },
            seed: self.seed,
            warmup_fraction: 0.2,
            fetch: router::FetchConfig {
                enabled: self.prefix_fetch,
                min_tokens: self.prefix_fetch_min_tokens,
            },
            kv_export: {
                let ttl_us = (self.decoder_kv_blocks_ttl_s * 1e6) as u64;
                match self.kv_export {
                    KvExportArg::Ideal => KvExport::Ideal,
                    KvExportArg::VllmOnDemand => KvExport::VllmOnDemand { ttl_us },
                    KvExportArg::VllmEveryRequest => KvExport::VllmEveryRequest { ttl_us },
                }
            },
            host_offload_gib: self.host_offload_gib,
            reuse_ceiling: false,
            router_params: self.router_params.clone(),
        };
        // `--router-param`: known names, values in range, none of the third
        // path's, named before anything runs.
        config.router_config().context("--router-param")?;
        Ok(config)
    }

    fn deployments(&self) -> Vec<Deployment> {
        let policies = conditional_policies(self.slo());
        Deployment::all(self.workers, self.prefill_workers, &policies)
    }

    fn slo(&self) -> (f64, f64) {
        (self.ttft_slo_ms, self.itl_slo_ms)
    }

    fn default_loads(&self) -> (f64, f64) {
        match self.workload {
            WorkloadArg::Agentic => (0.25, 1.5),
            WorkloadArg::LongContext => (0.02, 0.12),
            WorkloadArg::Mooncake => (0.5, 3.0),
            WorkloadArg::Synthetic => (1.0, 12.0),
        }
    }
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().command {
        Command::Compare {
            common,
            loads,
            min_load,
            max_load,
            out,
            threads,
            capacity_tolerance,
            ttft_p99_bound_ms,
        } => {
            check_tail_bound(ttft_p99_bound_ms)?;
            let workload = common.workload()?;
            let base = common.sim_config()?;
            let (lo, hi) = common.default_loads();
            let (lo, hi) = (min_load.unwrap_or(lo), max_load.unwrap_or(hi));
            if loads == 0 || !(lo > 0.0 && hi >= lo) {
                bail!("need --loads >= 1 and 0 < --min-load <= --max-load");
            }
            let points: Vec<f64> = (0..loads)
                .map(|i| {
                    if loads == 1 {
                        lo
                    } else {
                        lo + (hi - lo) * i as f64 / (loads - 1) as f64
                    }
                })
                .collect();
            let deployments = common.deployments();
            let threads = threads_or_cores(threads);
            let bar = ProgressBar::new((deployments.len() * points.len()) as u64).with_style(
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} runs, {elapsed}")
                    .expect("valid template"),
            );
            bar.set_message(format!(
                "simulating {} on {threads} threads",
                workload.name()
            ));
            let started = Instant::now();
            let results = sweep(
                &base,
                &deployments,
                &workload,
                &points,
                threads,
                &|done, _| bar.set_position(done as u64),
            )?;
            bar.finish_and_clear();
            let note = format!(
                "{} workload, {} workers of {} ({} GPUs), seed {}",
                workload.name(),
                common.workers,
                base.preset.name,
                common.workers * base.preset.gpus,
                common.seed
            );
            println!(
                "{note}; SLO: TTFT <= {} ms and ITL <= {} ms\n{}\n",
                common.ttft_slo_ms,
                common.itl_slo_ms,
                third_path_note(&base)
            );
            print!("{}", table(&results, workload.load_unit()));
            let search = Search {
                start: hi,
                tolerance: capacity_tolerance,
                ttft_p99_bound_ms,
                ..Search::default()
            };
            let bar = ProgressBar::new(deployments.len() as u64).with_style(
                ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len} deployments, {elapsed}")
                    .expect("valid template"),
            );
            bar.set_message("searching each deployment's capacity");
            let caps = capacities(
                &base,
                &deployments,
                &workload,
                &results,
                &search,
                threads,
                &|done, _| bar.set_position(done as u64),
            )?;
            bar.finish_and_clear();
            println!(
                "\nCapacity: the highest load with >= {:.0}% of requests within the SLO{} (bisected to {:.0}%):",
                100.0 * search.target,
                tail_bound_clause(ttft_p99_bound_ms),
                100.0 * search.tolerance
            );
            for c in &caps {
                let tail = c.ttft_p99_ms.map_or(String::new(), |ms| {
                    format!("  TTFT p99 there {}", describe_tail(&[ms]))
                });
                println!(
                    "  {:<24} {:<36}{tail}",
                    c.deployment,
                    c.capacity.describe(workload.load_unit())
                );
            }
            println!("  (TTFT p99 there: the run at the capacity's load; a capacity at 90% attainment says nothing of the other 10%)");
            write_capacities(&out, &caps, workload.name(), workload.load_unit(), &search)
                .with_context(|| format!("writing the report to {}", out.display()))?;
            write_report(&out, &results, workload.name(), workload.load_unit(), &note)
                .with_context(|| format!("writing the report to {}", out.display()))?;
            println!(
                "\nReport: {}/interactivity.svg, ttft.svg, misses.svg, results.csv, results.json, capacity.json ({:.1} s)",
                out.display(),
                started.elapsed().as_secs_f64()
            );
        }
        Command::Tune {
            common,
            capacity_tolerance,
            threads,
            seeds,
            policies,
            params,
            ttft_p99_bound_ms,
        } => tune(
            &common,
            capacity_tolerance,
            threads,
            seeds,
            &policies,
            &params,
            ttft_p99_bound_ms,
        )?,
        Command::Run {
            common,
            deployment,
            params,
            load,
            seeds,
            threads,
        } if seeds != 1 => run_seeds(&common, &deployment, &params, load, seeds, threads)?,
        Command::Run {
            common,
            deployment,
            params,
            load,
            ..
        } => {
            let workload = common.workload()?;
            let mut config = common.sim_config()?;
            config.deployment = deployment_named(&deployment, &params, &common)?;
            config.reuse_ceiling = true;
            let started = Instant::now();
            let results = sweep(
                &config,
                std::slice::from_ref(&config.deployment),
                &workload,
                &[load],
                1,
                &|_, _| {},
            )?;
            print!("{}", table(&results, workload.load_unit()));
            let s = &results[0].summary;
            println!(
                "decode workers: KV usage {:.1}% (>= 90% in {:.1}% of samples), {:.2} waiting, {} preemptions; host tier: {:.1} GB written, {:.1} GB read back",
                100.0 * s.decode_kv_usage,
                100.0 * s.decode_kv_full_share,
                s.decode_waiting,
                s.preemptions,
                s.host_gb_written,
                s.host_gb_read
            );
            println!(
                "measured {} requests; gate vetoes {}, refused {}; prefix fetched {:.1}% ({:.1} GB pulled, {:.1} GB moved P->D); prefill-side hit rate P {:.1}% D {:.1}%; e2e p50 {:.0} ms ({:.2} s wall)",
                s.measured,
                s.gate_vetoes,
                s.refused,
                100.0 * s.fetch_share,
                s.kv_gb_pulled,
                s.kv_gb_moved,
                100.0 * s.prefill_hit_rate_p,
                100.0 * s.prefill_hit_rate_d,
                s.e2e_ms.p50,
                started.elapsed().as_secs_f64()
            );
            println!("{}", floor_line(s));
            println!("{}", misses_lines(&s.misses, &s.misses_by_rule, ""));
            if s.exports.any() {
                println!("{}", exports_line(&s.exports, ""));
            }
            if let Some(c) = results[0].reuse_ceiling {
                let block_bytes = config.preset.engine_config(config.block_size).block_bytes();
                println!(
                    "prompt blocks any cache could serve (all requests): {:.1}% with unbounded memory, at most {:.1}% with the cluster's {:.0} GB of KV memory (every worker and tier as one pool, optimal eviction)",
                    100.0 * c.unbounded_share(),
                    100.0 * c.pooled_share(),
                    (c.pool_blocks * block_bytes) as f64 / 1e9
                );
            }
            if matches!(config.deployment.policy(), router::Policy::SlaDynamic(_)) {
                let k = results[0].calibration;
                println!(
                    "sla_dynamic calibration at the end (observed / predicted): TTFT x{:.2} local, x{:.2} remote; ITL x{:.2}",
                    k.local_ttft, k.remote_ttft, k.itl
                );
            }
        }
    }
    Ok(())
}

/// The C/D deployments' third path, and what it pins on the decode
/// workers, as the outputs say it.
fn third_path_note(config: &SimConfig) -> String {
    if !config.fetch.enabled {
        return "C/D third path (a prefix fetched from a decode worker): off".into();
    }
    let pins = match config.kv_export {
        KvExport::Ideal => "only the prefix a fetch reads, until read (--kv-export ideal: no engine does this today; vLLM: --kv-export vllm-on-demand)".to_owned(),
        KvExport::VllmOnDemand { ttl_us } => format!(
            "the prefix a fetch reads, exported by a request of it before the leg is sent, and every remote decode leg for {:.0} s (vLLM as the agent uses it)",
            ttl_us as f64 / 1e6
        ),
        KvExport::VllmEveryRequest { ttl_us } => format!(
            "every request decoded, until a fetch reads it or {:.0} s (vLLM with a handle asked of every request)",
            ttl_us as f64 / 1e6
        ),
    };
    format!(
        "C/D third path (a prefix fetched from a decode worker): on; the decode workers pin {pins}"
    )
}

/// What a turn-2+ TTFT floor is, as the outputs say it.
const FLOOR_IS: &str =
    "each later turn alone on an idle worker holding every block an earlier request had";

/// What any router could do at best on this workload: the turn-2+ TTFT
/// p90 against its floor ([`sim::floor`]), and the share of prompt tokens
/// an earlier request held.
fn floor_line(s: &sim::RunSummary) -> String {
    format!(
        "turn-2+ TTFT p90 {:.0} ms; its floor {:.0} ms ({FLOOR_IS}: no router gives less); prompt tokens an earlier request held: {:.1}%",
        s.later_turn_ttft_ms.p90,
        s.later_turn_ttft_floor_ms.p90,
        100.0 * s.reusable_share
    )
}

/// What became of the decode workers' exports (`--kv-export
/// vllm-*`).
fn exports_line(e: &sim::ExportFigures, label: &str) -> String {
    let asked = if e.made + e.abandoned + e.busy > 0 {
        format!(
            "{} made by a request of the prefix for a fetch, {} abandoned at the agent's deadline and {} refused as too many at once (the prompt prefilled whole), ",
            e.made, e.abandoned, e.busy
        )
    } else {
        String::new()
    };
    let margin_s = sim::exports::VLLM_READ_MARGIN_US as f64 / 1e6;
    format!(
        "decode workers' exports{label} (the whole run): {asked}{} taken by a fetch, {} fetches found none (the prompt prefilled whole), {} reads declined less than {margin_s} s before the TTL or after it (the prefix computed), {} expired unread (the declined reads' blocks among them)",
        e.taken, e.missing, e.declined, e.expired
    )
}

/// Where the SLO misses are: per path (or per rule), its requests and
/// those over the TTFT target only, the ITL target only, and both. `label`
/// follows "SLO misses by path" (or "by rule").
fn misses_line<'a>(
    by: &str,
    groups: impl IntoIterator<Item = (&'a str, &'a sim::Misses)>,
    label: &str,
) -> String {
    let groups: Vec<String> = groups
        .into_iter()
        .filter(|(_, m)| m.requests > 0)
        .map(|(name, m)| {
            format!(
                "{name} {} of {} (TTFT only {}, ITL only {}, both {})",
                m.missed(),
                m.requests,
                m.ttft_only,
                m.itl_only,
                m.both
            )
        })
        .collect();
    format!("SLO misses by {by}{label}: {}", groups.join("; "))
}

/// The misses by path, then by rule, as [`misses_line`]s.
fn misses_lines(by_path: &sim::MissesByPath, by_rule: &sim::MissesByRule, label: &str) -> String {
    format!(
        "{}\n{}",
        misses_line("path", by_path.named(), label),
        misses_line("rule", by_rule.ranked(), label)
    )
}

/// `first..=last` of the scenarios' seeds (as [`Common::scenarios`] made
/// them, in order).
fn seed_range(scenarios: &[Scenario]) -> String {
    let seed = |s: Option<&Scenario>| s.map_or(0, |s| s.config.seed);
    format!("{}..={}", seed(scenarios.first()), seed(scenarios.last()))
}

/// `--threads`, or the machine's cores.
fn threads_or_cores(threads: Option<usize>) -> usize {
    threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// `sim run --seeds N`: the same deployment and load under `N` seeds (the
/// workload's and the router's), a row each in seed order, then the spread
/// of SLO attainment.
fn run_seeds(
    common: &Common,
    deployment: &str,
    params: &[(String, f64)],
    load: f64,
    seeds: u64,
    threads: Option<usize>,
) -> anyhow::Result<()> {
    let threads = threads_or_cores(threads);
    let scenarios = common.scenarios(seeds)?;
    let deployment = deployment_named(deployment, params, common)?;
    let bar = ProgressBar::new(scenarios.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} seeds {elapsed}")
            .expect("a valid template"),
    );
    let points = parallel_map(
        &scenarios,
        threads,
        &|done, _| bar.set_position(done as u64),
        |s| run_point(&s.config, &deployment, &s.workload, load),
    )
    .into_iter()
    .collect::<Result<Vec<_>, _>>()?;
    bar.finish_and_clear();
    let unit = scenarios[0].workload.load_unit();
    print!("{}", table(&points, unit));
    let attainment: Vec<f64> = points
        .iter()
        .map(|p| 100.0 * p.summary.slo_attainment)
        .collect();
    let mean = attainment.iter().sum::<f64>() / attainment.len() as f64;
    let (min, max) = attainment
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &a| {
            (lo.min(a), hi.max(a))
        });
    let each: Vec<String> = attainment.iter().map(|a| format!("{a:.1}")).collect();
    println!(
        "rows in seed order {}; SLO attainment: mean {mean:.2}% (min {min:.1}%, max {max:.1}%); each: {}",
        seed_range(&scenarios),
        each.join(" ")
    );
    let floors: Vec<String> = points
        .iter()
        .map(|p| format!("{:.0}", p.summary.later_turn_ttft_floor_ms.p90))
        .collect();
    println!(
        "turn-2+ TTFT p90 floor ({FLOOR_IS}: no router gives less), each: {} ms",
        floors.join(" ")
    );
    let mut by_path = sim::MissesByPath::default();
    let mut by_rule = sim::MissesByRule::default();
    let mut exports = sim::ExportFigures::default();
    for p in &points {
        by_path += &p.summary.misses;
        by_rule += &p.summary.misses_by_rule;
        exports += &p.summary.exports;
    }
    println!("{}", misses_lines(&by_path, &by_rule, ", all seeds"));
    if exports.any() {
        println!("{}", exports_line(&exports, ", all seeds"));
    }
    Ok(())
}

/// `--ttft-p99-bound-ms`, when given, is a time.
fn check_tail_bound(ttft_p99_bound_ms: Option<f64>) -> anyhow::Result<()> {
    match ttft_p99_bound_ms {
        Some(ms) if !(ms.is_finite() && ms > 0.0) => {
            bail!("--ttft-p99-bound-ms must be a finite number > 0, not {ms}")
        }
        _ => Ok(()),
    }
}

/// The capacity's definition's clause for `--ttft-p99-bound-ms`.
fn tail_bound_clause(ttft_p99_bound_ms: Option<f64>) -> String {
    match ttft_p99_bound_ms {
        Some(ms) => format!(" and a TTFT p99 <= {ms:.0} ms"),
        None => String::new(),
    }
}

/// `sim tune`: every family's best, the table, the comparisons the issue
/// asks for, one JSON line.
fn tune(
    common: &Common,
    tolerance: f64,
    threads: Option<usize>,
    seeds: u64,
    only: &[String],
    params: &[(String, f64)],
    ttft_p99_bound_ms: Option<f64>,
) -> anyhow::Result<()> {
    check_tail_bound(ttft_p99_bound_ms)?;
    let scenarios = common.scenarios(seeds)?;
    let (base, workload) = (&scenarios[0].config, &scenarios[0].workload);
    let threads = threads_or_cores(threads);
    let mut policies = conditional_policies(common.slo());
    if !only.is_empty() {
        let known: Vec<&str> = policies.iter().map(|p| p.name()).collect();
        // Dynamo's names and the aliases the router accepts name them too.
        let mut wanted = Vec::new();
        for name in only {
            match router::PolicySpec::find(name) {
                Ok(found) if known.contains(&found.spec.name) => wanted.push(found.spec.name),
                _ => bail!(
                    "--policies: no C/D policy named {name:?}; known: {}",
                    known.join(", ")
                ),
            }
        }
        policies.retain(|p| wanted.contains(&p.name()));
    }
    for (name, _) in params {
        if !policies.iter().any(|p| p.spec().param(name).is_some()) {
            let names: Vec<&str> = policies.iter().map(|p| p.name()).collect();
            bail!(
                "--param {name}: none of the tuned policies ({}) has it",
                names.join(", ")
            );
        }
    }
    let (lo, hi) = common.default_loads();
    let tune = Tune {
        scenarios: &scenarios,
        workers: common.workers,
        policies: &policies,
        policy_params: params,
        search: Search {
            start: (lo + hi) / 2.0,
            growth: 1.25,
            max_doublings: 12,
            tolerance,
            ttft_p99_bound_ms,
            ..Search::default()
        },
        threads,
    };
    tune.tuned_policies()?;
    let bar = ProgressBar::new_spinner().with_style(
        ProgressStyle::with_template("{spinner} {msg} ({elapsed})").expect("valid template"),
    );
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    let progress = Progress::default();
    let started = Instant::now();
    let counts = |p: &Progress| {
        (
            p.searches.load(std::sync::atomic::Ordering::Relaxed),
            p.runs.load(std::sync::atomic::Ordering::Relaxed),
        )
    };
    let best = tune.run(&progress, &|stage| {
        let (searches, runs) = counts(&progress);
        bar.set_message(format!(
            "tuning {stage}: {searches} capacity searches, {runs} runs so far"
        ));
    })?;
    bar.finish_and_clear();
    let unit = workload.load_unit();
    let gpus = common.workers * base.preset.gpus;
    let seeds_named = if seeds == 1 {
        format!("seed {}", common.seed)
    } else {
        format!("seeds {}", seed_range(&scenarios))
    };
    println!(
        "{} workload, {} workers of {} ({gpus} GPUs), {seeds_named}; SLO: TTFT <= {} ms and ITL <= {} ms",
        workload.name(),
        common.workers,
        base.preset.name,
        common.ttft_slo_ms,
        common.itl_slo_ms
    );
    println!("{}", third_path_note(base));
    let over_seeds = if seeds == 1 {
        ""
    } else {
        ", on average over the seeds,"
    };
    println!(
        "capacity: the highest load with{over_seeds} >= 90% of requests within the SLO{} (bisected to {:.0}%)\n",
        tail_bound_clause(ttft_p99_bound_ms),
        100.0 * tolerance
    );
    if !params.is_empty() {
        let fixed: Vec<String> = params.iter().map(|(n, v)| format!("{n}={v}")).collect();
        println!(
            "policy parameters fixed by --param (not tuned): {}\n",
            fixed.join(" ")
        );
    }
    println!(
        "{:<14} {:<26} {:>5}  {:<44} {:<20} tuned settings",
        "family", "best deployment", "tried", "capacity", "TTFT p99 there"
    );
    for b in &best {
        println!(
            "{:<14} {:<26} {:>5}  {:<44} {:<20} {}",
            b.family,
            b.deployment.name(),
            b.tried,
            b.capacity.describe(unit),
            describe_tail(&b.tail),
            tuned_params(b)
        );
    }
    println!("(TTFT p99 there: each seed's run at the family's capacity, lowest-highest; a capacity at 90% attainment says nothing of the other 10%)");
    let of = |family: &str| best.iter().find(|b| b.family == family);
    let cd: Vec<&Best> = best
        .iter()
        .filter(|b| matches!(b.deployment, Deployment::Conditional { .. }))
        .collect();
    let best_cd = cd
        .iter()
        .copied()
        .max_by(|a, b| a.capacity.load().total_cmp(&b.capacity.load()))
        .context("no C/D policy to tune")?;
    let best_static = cd
        .iter()
        .copied()
        .filter(|b| b.family != "sla_dynamic")
        .max_by(|a, b| a.capacity.load().total_cmp(&b.capacity.load()));
    let agg = of("aggregated").context("aggregated was tuned")?;
    let disagg = of("disaggregated").context("disaggregated was tuned")?;
    let baseline = agg.capacity.load().max(disagg.capacity.load());
    let ratio = best_cd.capacity.load() / baseline;
    if baseline > 0.0 {
        println!(
            "\nbest C/D ({}) / max(aggregated, best disaggregated) = {:.3} / {:.3} = {ratio:.2}x (target 1.5x)",
            best_cd.deployment.name(),
            best_cd.capacity.load(),
            baseline
        );
    } else {
        println!(
            "\nneither aggregated nor disaggregated passed at any load searched: no ratio (best C/D: {}, {:.3})",
            best_cd.deployment.name(),
            best_cd.capacity.load()
        );
    }
    let sla = of("sla_dynamic");
    if let (Some(sla), Some(st)) = (sla, best_static) {
        println!(
            "sla_dynamic with its policy's defaults ({}; its split and router settings tuned, as every family's) vs the best tuned static policy ({}): {:.3} vs {:.3}",
            sla.deployment.name(),
            st.deployment.name(),
            sla.capacity.load(),
            st.capacity.load()
        );
    }
    // Turn-2+ TTFT of the best C/D against the best disaggregated split at
    // a load both sustain (the lower capacity). Families tied on capacity
    // are each the best C/D: every one is measured, and the lowest p90
    // compared.
    let load = best_cd.capacity.load().min(disagg.capacity.load());
    let tied: Vec<&Best> = cd
        .iter()
        .copied()
        .filter(|b| b.capacity.load() == best_cd.capacity.load())
        .collect();
    let mut later = None;
    'later: {
        if load <= 0.0 {
            break 'later;
        }
        // Each seed's run of every deployment; the p90s averaged over seeds.
        // Each on the router settings tuned for it.
        let deployments: Vec<(&Deployment, Vec<Scenario>)> = std::iter::once(disagg)
            .chain(tied.iter().copied())
            .map(|b| (&b.deployment, b.scenarios(&scenarios)))
            .collect();
        let jobs: Vec<(&Deployment, &Scenario)> = (0..scenarios.len())
            .flat_map(|i| deployments.iter().map(move |(d, s)| (*d, &s[i])))
            .collect();
        let points = parallel_map(&jobs, threads, &|_, _| {}, |(d, s)| {
            run_point(&s.config, d, &s.workload, load)
        })
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
        // The points of deployment k, seed by seed.
        let of_deployment = |k: usize| -> Vec<&sim::compare::Point> {
            points
                .chunks(deployments.len())
                .map(|row| &row[k])
                .collect()
        };
        let mean = |points: &[&sim::compare::Point], f: &dyn Fn(&sim::RunSummary) -> f64| {
            points.iter().map(|p| f(&p.summary)).sum::<f64>() / points.len() as f64
        };
        let p90 = |s: &sim::RunSummary| s.later_turn_ttft_ms.p90;
        let dis_points = of_deployment(0);
        let b = mean(&dis_points, &p90);
        if b <= 0.0 {
            // Every request's TTFT is > 0: none was a later turn.
            println!(
                "turn-2+ TTFT p90: no request of this workload is a conversation's later turn: nothing to compare"
            );
            break 'later;
        }
        let candidates: Vec<(&Best, Vec<&sim::compare::Point>, f64)> = tied
            .iter()
            .enumerate()
            .map(|(k, &family)| {
                let cd_points = of_deployment(k + 1);
                let a = mean(&cd_points, &p90);
                (family, cd_points, a)
            })
            .collect();
        let (chosen, cd_points, a) = candidates
            .iter()
            .min_by(|x, y| x.2.total_cmp(&y.2))
            .context("the best C/D is among the tied families")?;
        // The floors are the workload's, whichever deployment serves it
        // (up to which requests the window measured).
        let floor = mean(cd_points, &|s| s.later_turn_ttft_floor_ms.p90);
        let each = if seeds == 1 {
            String::new()
        } else {
            let per_seed: Vec<String> = cd_points
                .iter()
                .zip(&dis_points)
                .map(|(c, d)| format!("{:.0}/{:.0}", p90(&c.summary), p90(&d.summary)))
                .collect();
            format!(" (mean over seeds; each: {})", per_seed.join(" "))
        };
        println!(
            "turn-2+ TTFT p90 at {load:.3} {unit}: {} {a:.0} ms, {} {b:.0} ms: {:.2}x (target <= 0.4x){each}",
            chosen.deployment.name(),
            disagg.deployment.name(),
            a / b.max(1e-9)
        );
        if candidates.len() > 1 {
            let all: Vec<String> = candidates
                .iter()
                .map(|(family, _, a)| {
                    format!(
                        "{} {a:.0} ms ({:.2}x)",
                        family.deployment.name(),
                        a / b.max(1e-9)
                    )
                })
                .collect();
            println!(
                "  the C/D families tied on capacity, each: {} (the lowest compared)",
                all.join(", ")
            );
        }
        println!(
            "  prefill-side hit rate there: {} P {:.1}% D {:.1}% (bypass {:.1}%, prefix fetched {:.1}%, {:.1} GB pulled); {} P {:.1}%",
            chosen.deployment.name(),
            100.0 * mean(cd_points, &|s| s.prefill_hit_rate_p),
            100.0 * mean(cd_points, &|s| s.prefill_hit_rate_d),
            100.0 * mean(cd_points, &|s| s.bypass_share),
            100.0 * mean(cd_points, &|s| s.fetch_share),
            mean(cd_points, &|s| s.kv_gb_pulled),
            disagg.deployment.name(),
            100.0 * mean(&dis_points, &|s| s.prefill_hit_rate_p)
        );
        println!(
            "  its floor ({FLOOR_IS}): {floor:.0} ms, {:.2}x {}: no router goes below; prompt tokens an earlier request held: {:.1}%",
            floor / b.max(1e-9),
            disagg.deployment.name(),
            100.0 * mean(cd_points, &|s| s.reusable_share)
        );
        later = Some((chosen.family.clone(), load, *a, b, floor));
    }
    let (searches, runs) = counts(&progress);
    let families: Vec<_> = best
        .iter()
        .map(|b| {
            let mut row = b.capacity.to_json();
            let (prefill, decode) = b.deployment.split();
            row["family"] = b.family.clone().into();
            row["deployment"] = b.deployment.name().into();
            row["prefill"] = prefill.into();
            row["decode"] = decode.into();
            row["policy"] = b.deployment.policy().name().into();
            row["params"] = b
                .deployment
                .policy()
                .params()
                .into_iter()
                .map(|(k, v)| (k.to_owned(), serde_json::Value::from(v)))
                .collect::<serde_json::Map<_, _>>()
                .into();
            // What it was measured at: the --router-param settings, then
            // its tuned ones over them.
            row["router_params"] = base
                .router_params
                .iter()
                .chain(&b.router_params)
                .map(|(k, v)| (k.clone(), serde_json::Value::from(*v)))
                .collect::<serde_json::Map<_, _>>()
                .into();
            row["tried"] = b.tried.into();
            row["ttft_p99_ms_at_capacity"] = b.tail.clone().into();
            row
        })
        .collect();
    let line = serde_json::json!({
        "workload": workload.name(),
        "load_unit": unit,
        "workers": common.workers,
        "gpus": gpus,
        "seed": common.seed,
        "seeds": seeds,
        "slo": {"ttft_ms": common.ttft_slo_ms, "itl_ms": common.itl_slo_ms},
        "ttft_p99_bound_ms": ttft_p99_bound_ms,
        "families": families,
        "best_cd": best_cd.family,
        "cd_over_baseline": (baseline > 0.0).then_some(ratio),
        "later_turn_ttft_p90": later.map(|(family, load, cd, dis, floor)| serde_json::json!({"load": load, "family": family, "best_cd_ms": cd, "disaggregated_ms": dis, "floor_ms": floor})),
        "searches": searches,
        "runs": runs,
        "wall_s": started.elapsed().as_secs_f64(),
    });
    println!("\n{line}");
    Ok(())
}

/// A tail's seeds as `lowest-highest s` (one seed: its figure).
fn describe_tail(p99s: &[f64]) -> String {
    let lo = p99s.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = p99s.iter().copied().fold(0.0, f64::max);
    match p99s.len() {
        0 => "-".into(),
        1 => format!("{:.1} s", hi / 1000.0),
        _ => format!("{:.1}-{:.1} s", lo / 1000.0, hi / 1000.0),
    }
}

/// `--deployment` and `--param`: aggregated, disaggregated, or C/D with a
/// policy of the router's registry (the SLA policy's targets are the SLO
/// and its cost model the registry's defaults, corrected online by the
/// router core's calibration, unless `--param` says otherwise).
fn deployment_named(
    name: &str,
    params: &[(String, f64)],
    common: &Common,
) -> anyhow::Result<Deployment> {
    let (w, p) = (common.workers, common.prefill_workers);
    let fixed = match name {
        "aggregated" | "agg" => Some(Deployment::Aggregated { workers: w }),
        "disaggregated" | "disagg" => Some(Deployment::Disaggregated {
            prefill: p,
            decode: w - p,
        }),
        _ => None,
    };
    if let Some(deployment) = fixed {
        if !params.is_empty() {
            bail!("--param is for a C/D deployment's policy, not for {name}");
        }
        return Ok(deployment);
    }
    let found = router::PolicySpec::find(name)?;
    if found.deprecated {
        eprintln!(
            "note: --deployment {name} is an earlier spelling: use {}",
            found.spec.name
        );
    }
    let mut policy = match found.spec.default_policy() {
        router::Policy::SlaDynamic(_) => {
            router::SlaDynamic::with_slo(common.ttft_slo_ms, common.itl_slo_ms).into()
        }
        other => other,
    };
    for (key, value) in params {
        policy.set(key, *value)?;
    }
    policy.validate()?;
    Ok(Deployment::Conditional {
        prefill: p,
        decode: w - p,
        policy,
    })
}
