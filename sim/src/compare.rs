//! The policy comparison: every deployment over a sweep of loads, the
//! table, and the report folder (plots, CSV, JSON).

use std::fmt::Write as _;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use protocol::trace::MooncakeRecord;

use crate::capacity::{self, Capacity, Outcome, Probe, Search};
use crate::cluster::{simulate, SimConfig, SimError};
use crate::deployment::Deployment;
use crate::metrics::{Misses, MissesByPath, MissesByRule, RunSummary};
use crate::plot::{panels_to_svg, Chart, Series};
use crate::workload::{
    Agentic, AgenticConfig, Mooncake, MooncakeConfig, Synthetic, SyntheticConfig, Workload,
};

/// Which workload, at load 1.0; the sweep scales it.
#[derive(Debug, Clone)]
pub enum WorkloadSpec {
    /// Load = sessions per second.
    Agentic(AgenticConfig),
    /// The long-context agentic workload ([`AgenticConfig::long_context`]);
    /// load = sessions per second.
    LongContext(AgenticConfig),
    /// Load = the trace's rate scale.
    Mooncake {
        records: Arc<Vec<MooncakeRecord>>,
        config: MooncakeConfig,
    },
    /// Load = requests per second.
    Synthetic(SyntheticConfig),
}

impl WorkloadSpec {
    pub fn name(&self) -> &'static str {
        match self {
            WorkloadSpec::Agentic(_) => "agentic",
            WorkloadSpec::LongContext(_) => "long-context",
            WorkloadSpec::Mooncake { .. } => "mooncake",
            WorkloadSpec::Synthetic(_) => "synthetic",
        }
    }

    /// What the load axis means.
    pub fn load_unit(&self) -> &'static str {
        match self {
            WorkloadSpec::Agentic(_) | WorkloadSpec::LongContext(_) => "sessions/s",
            WorkloadSpec::Mooncake { .. } => "x trace rate",
            WorkloadSpec::Synthetic(_) => "requests/s",
        }
    }

    /// The same workload under another seed (a trace's records shared,
    /// not read again).
    pub fn with_seed(&self, seed: u64) -> Self {
        let mut spec = self.clone();
        match &mut spec {
            WorkloadSpec::Agentic(c) | WorkloadSpec::LongContext(c) => c.seed = seed,
            WorkloadSpec::Mooncake { config, .. } => config.seed = seed,
            WorkloadSpec::Synthetic(c) => c.seed = seed,
        }
        spec
    }

    /// The workload at one load.
    pub fn at(&self, load: f64) -> Box<dyn Workload> {
        match self {
            WorkloadSpec::Agentic(c) | WorkloadSpec::LongContext(c) => {
                Box::new(Agentic::new(AgenticConfig {
                    sessions_per_s: load,
                    ..c.clone()
                }))
            }
            WorkloadSpec::Mooncake { records, config } => Box::new(Mooncake::new(
                records.as_ref().clone(),
                MooncakeConfig {
                    rate_scale: load,
                    ..config.clone()
                },
            )),
            WorkloadSpec::Synthetic(c) => Box::new(Synthetic::new(SyntheticConfig {
                requests_per_s: load,
                ..c.clone()
            })),
        }
    }
}

/// One deployment at one load.
#[derive(Debug, Clone)]
pub struct Point {
    pub deployment: String,
    pub load: f64,
    pub summary: RunSummary,
    /// The router core's calibration at the end of the run (what the SLA
    /// policy learnt).
    pub calibration: router::Factors,
    /// With [`SimConfig::reuse_ceiling`]: the run's reuse ceiling.
    pub reuse_ceiling: Option<crate::reuse::ReuseCeiling>,
    /// Wall-clock seconds the run took (not part of the comparison).
    pub wall_s: f64,
}

/// `f` over `items` on `threads` threads; results in `items`' order,
/// whatever the threads did. `progress` is called after each item with
/// (done, total).
pub fn parallel_map<T: Sync, R: Send>(
    items: &[T],
    threads: usize,
    progress: &(dyn Fn(usize, usize) + Sync),
    f: impl Fn(&T) -> R + Sync,
) -> Vec<R> {
    let next = AtomicUsize::new(0);
    let done = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<R>>> = Mutex::new((0..items.len()).map(|_| None).collect());
    std::thread::scope(|scope| {
        for _ in 0..threads.max(1).min(items.len().max(1)) {
            scope.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else {
                    break;
                };
                let r = f(item);
                results.lock().expect("no thread panicked")[i] = Some(r);
                progress(done.fetch_add(1, Ordering::Relaxed) + 1, items.len());
            });
        }
    });
    results
        .into_inner()
        .expect("no thread panicked")
        .into_iter()
        .map(|r| r.expect("every item ran"))
        .collect()
}

/// One seed's simulator configuration and workload: `--seeds N` runs N of
/// them (the seed of both advanced by one each).
#[derive(Debug, Clone)]
pub struct Scenario {
    pub config: SimConfig,
    pub workload: WorkloadSpec,
}

/// The mean SLO attainment of `deployment` at `load` over `scenarios`, run
/// one after another (in order: the same scenarios give the same mean).
pub fn mean_attainment(
    scenarios: &[Scenario],
    deployment: &Deployment,
    load: f64,
) -> Result<f64, SimError> {
    Ok(mean_slo_attainment(&run_scenarios(
        scenarios, deployment, load,
    )?))
}

/// `deployment` at `load` on each of `scenarios`, one after another, in
/// their order.
pub fn run_scenarios(
    scenarios: &[Scenario],
    deployment: &Deployment,
    load: f64,
) -> Result<Vec<Point>, SimError> {
    scenarios
        .iter()
        .map(|s| run_point(&s.config, deployment, &s.workload, load))
        .collect()
}

/// The mean SLO attainment of `points`.
pub fn mean_slo_attainment(points: &[Point]) -> f64 {
    points.iter().map(|p| p.summary.slo_attainment).sum::<f64>() / points.len().max(1) as f64
}

/// What `points`, one load's runs (a seed each), measured: their mean SLO
/// attainment and mean TTFT p99, for the capacity search.
pub fn outcome(points: &[Point]) -> Outcome {
    let n = points.len().max(1) as f64;
    Outcome {
        attainment: mean_slo_attainment(points),
        ttft_p99_ms: points.iter().map(|p| p.summary.ttft_ms.p99).sum::<f64>() / n,
    }
}

/// One deployment at one load.
pub fn run_point(
    base: &SimConfig,
    deployment: &Deployment,
    workload: &WorkloadSpec,
    load: f64,
) -> Result<Point, SimError> {
    let config = SimConfig {
        deployment: deployment.clone(),
        ..base.clone()
    };
    let started = Instant::now();
    let mut run = workload.at(load);
    simulate(&config, run.as_mut()).map(|result| Point {
        deployment: deployment.name(),
        load,
        summary: result.summary,
        calibration: result.calibration,
        reuse_ceiling: result.reuse_ceiling,
        wall_s: started.elapsed().as_secs_f64(),
    })
}

/// Runs every (deployment, load) pair on `threads` threads; `progress` is
/// called after each run with (done, total). Results are in deployment,
/// then load order, whatever the threads did: the comparison is
/// deterministic for a seed.
pub fn sweep(
    base: &SimConfig,
    deployments: &[Deployment],
    workload: &WorkloadSpec,
    loads: &[f64],
    threads: usize,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Vec<Point>, SimError> {
    let jobs: Vec<(&Deployment, f64)> = deployments
        .iter()
        .flat_map(|d| loads.iter().map(move |l| (d, *l)))
        .collect();
    parallel_map(&jobs, threads, progress, |&(d, load)| {
        run_point(base, d, workload, load)
    })
    .into_iter()
    .collect()
}

/// One deployment's capacity, and its TTFT p99 there.
#[derive(Debug, Clone, PartialEq)]
pub struct DeploymentCapacity {
    pub deployment: String,
    pub capacity: Capacity,
    /// The TTFT p99 of the run at the capacity's load (`None` when no load
    /// passed).
    pub ttft_p99_ms: Option<f64>,
}

/// Each deployment's capacity (see [`crate::capacity`]), searched from the
/// sweep's `points` of that deployment, deployments in parallel;
/// `progress` is called with (deployments done, total).
pub fn capacities(
    base: &SimConfig,
    deployments: &[Deployment],
    workload: &WorkloadSpec,
    points: &[Point],
    s: &Search,
    threads: usize,
    progress: &(dyn Fn(usize, usize) + Sync),
) -> Result<Vec<DeploymentCapacity>, SimError> {
    parallel_map(deployments, threads, progress, |d| {
        let name = d.name();
        let known: Vec<Probe> = points
            .iter()
            .filter(|p| p.deployment == name)
            .map(|p| (p.load, outcome(std::slice::from_ref(p))))
            .collect();
        let (capacity, ran) = capacity::search(s, &known, |load| {
            run_point(base, d, workload, load).map(|p| outcome(&[p]))
        })?;
        let ttft_p99_ms = known
            .iter()
            .chain(&ran)
            .find(|(load, o)| *load == capacity.load() && s.passes(o))
            .map(|(_, o)| o.ttft_p99_ms);
        Ok(DeploymentCapacity {
            deployment: name,
            capacity,
            ttft_p99_ms,
        })
    })
    .into_iter()
    .collect()
}

/// The comparison as a fixed-width text table.
pub fn table(points: &[Point], load_unit: &str) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:>10} | {:>8} {:>8} {:>8} {:>8} | {:>6} {:>6} {:>6} | {:>8} {:>6} {:>6} | {:>6} {:>6} {:>6} {:>6} | {:>7} {:>5} | {:>5} {:>5} {:>5} {:>6}",
        "deployment",
        "load",
        "TTFT p50",
        "p90",
        "p99",
        "t2+ p90",
        "ITL50",
        "p90",
        "p99",
        "tok/s/G",
        "int50",
        "int90",
        "SLO%",
        "bypas%",
        "hitP%",
        "hitD%",
        "KV GB",
        "preem",
        "kvD%",
        "full%",
        "waitD",
        "hostGB"
    );
    let _ = writeln!(
        out,
        "{:<24} {:>10} | {:>35} | {:>20} | {:>22} | {:>27} | {:>13} | {:>24}",
        "", load_unit, "ms", "ms", "", "", "", "decode saturation, G2"
    );
    for p in points {
        let s = &p.summary;
        let _ = writeln!(
            out,
            "{:<24} {:>10.3} | {:>8.0} {:>8.0} {:>8.0} {:>8.0} | {:>6.1} {:>6.1} {:>6.1} | {:>8.1} {:>6.1} {:>6.1} | {:>6.1} {:>6.1} {:>6.1} {:>6.1} | {:>7.1} {:>5} | {:>5.1} {:>5.1} {:>5.2} {:>6.1}",
            p.deployment,
            p.load,
            s.ttft_ms.p50,
            s.ttft_ms.p90,
            s.ttft_ms.p99,
            s.later_turn_ttft_ms.p90,
            s.itl_ms.p50,
            s.itl_ms.p90,
            s.itl_ms.p99,
            s.throughput_per_gpu,
            s.interactivity_p50,
            s.interactivity_p90,
            100.0 * s.slo_attainment,
            100.0 * s.bypass_share,
            100.0 * s.prefill_hit_rate_p,
            100.0 * s.prefill_hit_rate_d,
            s.kv_gb_moved,
            s.preemptions,
            100.0 * s.decode_kv_usage,
            100.0 * s.decode_kv_full_share,
            s.decode_waiting,
            s.host_gb_read
        );
    }
    out
}

fn series(
    points: &[Point],
    y: impl Fn(&RunSummary) -> f64,
    x: impl Fn(&Point) -> f64,
) -> Vec<Series> {
    let mut out: Vec<Series> = Vec::new();
    for p in points {
        let point = (x(p), y(&p.summary));
        match out.iter_mut().find(|s| s.name == p.deployment) {
            Some(s) => s.points.push(point),
            None => out.push(Series {
                name: p.deployment.clone(),
                points: vec![point],
            }),
        }
    }
    out
}

/// Writes `interactivity.svg`, `ttft.svg`, `misses.svg` (the shares of
/// requests over each target: which side a deployment loses on),
/// `results.csv` and `results.json` into `dir`.
pub fn write_report(
    dir: &Path,
    points: &[Point],
    workload: &str,
    load_unit: &str,
    note: &str,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let throughput = |p: &Point| p.summary.throughput_per_gpu;
    let interactivity = panels_to_svg(&[
        Chart {
            title: "Interactivity at p50 vs throughput".into(),
            x_label: "output tokens/s per GPU".into(),
            y_label: "tokens/s per user (1000 / ITL p50)".into(),
            series: series(points, |s| s.interactivity_p50, throughput),
            subtitle: Some(note.to_owned()),
        },
        Chart {
            title: "Interactivity at p90 vs throughput".into(),
            x_label: "output tokens/s per GPU".into(),
            y_label: "tokens/s per user (1000 / ITL p90)".into(),
            series: series(points, |s| s.interactivity_p90, throughput),
            subtitle: Some(note.to_owned()),
        },
    ]);
    std::fs::write(dir.join("interactivity.svg"), interactivity)?;
    // A chart of one figure of every point against its load.
    let vs_load = |title: &str, y_label: &str, y: fn(&RunSummary) -> f64| Chart {
        title: title.into(),
        x_label: format!("load ({load_unit})"),
        y_label: y_label.into(),
        series: series(points, y, |p| p.load),
        subtitle: Some(note.to_owned()),
    };
    let ttft = panels_to_svg(&[
        vs_load("TTFT p90 vs load", "TTFT p90 (ms)", |s| s.ttft_ms.p90),
        vs_load(
            "SLO attainment vs load",
            "share of requests meeting TTFT and ITL targets",
            |s| s.slo_attainment,
        ),
    ]);
    std::fs::write(dir.join("ttft.svg"), ttft)?;
    let misses = panels_to_svg(&[
        vs_load(
            "Requests over the TTFT target vs load",
            "share of requests (any path)",
            |s| s.misses.over_shares().0,
        ),
        vs_load(
            "Requests over the ITL target vs load",
            "share of requests (any path)",
            |s| s.misses.over_shares().1,
        ),
    ]);
    std::fs::write(dir.join("misses.svg"), misses)?;

    let mut csv = String::from(
        "workload,deployment,load,measured,ttft_p50_ms,ttft_p90_ms,ttft_p99_ms,later_turn_ttft_p90_ms,itl_p50_ms,itl_p90_ms,itl_p99_ms,\
         e2e_p50_ms,throughput_per_gpu,interactivity_p50,interactivity_p90,slo_attainment,bypass_share,\
         prefill_hit_rate_p,prefill_hit_rate_d,kv_gb_moved,preemptions,gate_vetoes,refused,\
         decode_kv_usage,decode_kv_full_share,decode_waiting,host_gb_read,host_gb_written,\
         later_turn_ttft_floor_p90_ms,reusable_share\n",
    );
    let mut json = Vec::new();
    for p in points {
        let s = &p.summary;
        let _ = writeln!(
            csv,
            "{workload},{},{},{},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.3},{:.4},{:.4},{:.4},{:.4},{:.3},{},{},{},{:.4},{:.4},{:.3},{:.3},{:.3},{:.3},{:.4}",
            p.deployment,
            p.load,
            s.measured,
            s.ttft_ms.p50,
            s.ttft_ms.p90,
            s.ttft_ms.p99,
            s.later_turn_ttft_ms.p90,
            s.itl_ms.p50,
            s.itl_ms.p90,
            s.itl_ms.p99,
            s.e2e_ms.p50,
            s.throughput_per_gpu,
            s.interactivity_p50,
            s.interactivity_p90,
            s.slo_attainment,
            s.bypass_share,
            s.prefill_hit_rate_p,
            s.prefill_hit_rate_d,
            s.kv_gb_moved,
            s.preemptions,
            s.gate_vetoes,
            s.refused,
            s.decode_kv_usage,
            s.decode_kv_full_share,
            s.decode_waiting,
            s.host_gb_read,
            s.host_gb_written,
            s.later_turn_ttft_floor_ms.p90,
            s.reusable_share
        );
        json.push(serde_json::json!({
            "workload": workload,
            "deployment": p.deployment,
            "load": p.load,
            "measured": s.measured,
            "ttft_ms": {"p50": s.ttft_ms.p50, "p90": s.ttft_ms.p90, "p99": s.ttft_ms.p99},
            "later_turn_ttft_ms": {"p50": s.later_turn_ttft_ms.p50, "p90": s.later_turn_ttft_ms.p90, "p99": s.later_turn_ttft_ms.p99},
            "later_turn_ttft_floor_ms": {"p50": s.later_turn_ttft_floor_ms.p50, "p90": s.later_turn_ttft_floor_ms.p90, "p99": s.later_turn_ttft_floor_ms.p99},
            "reusable_share": s.reusable_share,
            "itl_ms": {"p50": s.itl_ms.p50, "p90": s.itl_ms.p90, "p99": s.itl_ms.p99},
            "e2e_ms": {"p50": s.e2e_ms.p50, "p90": s.e2e_ms.p90, "p99": s.e2e_ms.p99},
            "throughput_per_gpu": s.throughput_per_gpu,
            "interactivity": {"p50": s.interactivity_p50, "p90": s.interactivity_p90},
            "slo_attainment": s.slo_attainment,
            "bypass_share": s.bypass_share,
            "fetch_share": s.fetch_share,
            "kv_gb_pulled": s.kv_gb_pulled,
            "prefill_hit_rate": {"prefill_workers": s.prefill_hit_rate_p, "decode_workers": s.prefill_hit_rate_d},
            "kv_gb_moved": s.kv_gb_moved,
            "preemptions": s.preemptions,
            "gate_vetoes": s.gate_vetoes,
            "refused": s.refused,
            "decode_saturation": {"kv_usage": s.decode_kv_usage, "kv_full_share": s.decode_kv_full_share, "waiting": s.decode_waiting},
            "host_offload": {"gb_read": s.host_gb_read, "gb_written": s.host_gb_written},
            "misses_by_path": misses_json(&s.misses),
            "misses_by_rule": rule_misses_json(&s.misses_by_rule),
        }));
    }
    std::fs::write(dir.join("results.csv"), csv)?;
    let json = serde_json::to_string_pretty(&serde_json::Value::Array(json))
        .expect("JSON values serialise");
    std::fs::write(dir.join("results.json"), json + "\n")?;
    Ok(())
}

/// Writes `capacity.json` into `dir`: each deployment's capacity and its
/// TTFT p99 there, with what the search counted as passing.
pub fn write_capacities(
    dir: &Path,
    capacities: &[DeploymentCapacity],
    workload: &str,
    load_unit: &str,
    search: &Search,
) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let rows: Vec<_> = capacities
        .iter()
        .map(|c| {
            let mut row = c.capacity.to_json();
            row["deployment"] = c.deployment.clone().into();
            row["ttft_p99_ms_at_capacity"] = c.ttft_p99_ms.into();
            row["workload"] = workload.into();
            row["load_unit"] = load_unit.into();
            row["attainment_target"] = search.target.into();
            row["ttft_p99_bound_ms"] = search.ttft_p99_bound_ms.into();
            row
        })
        .collect();
    let json = serde_json::to_string_pretty(&rows).expect("JSON values serialise");
    std::fs::write(dir.join("capacity.json"), json + "\n")
}

/// [`MissesByPath`] as the report's JSON: per path, its requests and its
/// misses by target.
fn misses_json(m: &MissesByPath) -> serde_json::Value {
    serde_json::json!({"bypass": one_misses_json(&m.bypass), "remote": one_misses_json(&m.remote), "remote_fetch": one_misses_json(&m.fetch)})
}

/// [`MissesByRule`] as the report's JSON: per rule (by name), as
/// [`misses_json`]'s per path.
fn rule_misses_json(m: &MissesByRule) -> serde_json::Value {
    m.by_name()
        .map(|(rule, misses)| (rule.to_owned(), one_misses_json(misses)))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// One path's or rule's [`Misses`] as JSON.
fn one_misses_json(m: &Misses) -> serde_json::Value {
    serde_json::json!({"requests": m.requests, "ttft_only": m.ttft_only, "itl_only": m.itl_only, "both": m.both})
}
