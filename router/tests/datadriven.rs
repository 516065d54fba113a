//! Data-driven tests of the router core's decisions: scenarios in
//! `tests/data/*.txt` (workers, what their caches hold, their loads, the
//! requests), each command followed by `----` and its output (see
//! `tests::datadriven`; `UPDATE_EXPECT=1` rewrites them).
//!
//! Commands (`key=value` options in any order):
//! - `core [policy=NAME] [PARAM=VALUE ...]`: a new core; a parameter is the
//!   policy's (`eff_isl_tokens=512`) or the router's as decisions record it
//!   (`decode.overlap_credit=10`, `gate.count_reservations=0`);
//! - `worker NAME role=prefill|decode|both capacity=BLOCKS`;
//! - `load NAME [running=N] [waiting=N] [queued=TOKENS] [active=BLOCKS]
//!   [used=BLOCKS] [at=MS]` (the report is received at `at`, default 0);
//! - `prompt NAME SEED×LEN [SEED×LEN ...]` defines a prompt of
//!   deterministic tokens (`x` works for `×`); `extend NAME SEED×LEN ...`
//!   appends to it;
//! - `store WORKER PROMPT [tier=device|host|disk] [blocks=N]`: the worker
//!   now holds the prompt's first N full blocks (default all), through the
//!   real indexer and a delta;
//! - `route LABEL PROMPT [output=N] [at=MS] [avoid=W,W] [explain]`: prints
//!   the decision (and with `explain` every candidate); the decision's
//!   draws are seeded from the request, as replicas seed them;
//! - `finish LABEL`, `prefill-done LABEL`; `expire at=MS`;
//! - `observe LABEL [prefill-at=MS] [decode-ms=MS tokens=N]`: what the
//!   decision was observed to take, fed to the core's calibration; prints
//!   the factors after it;
//! - `held PROMPT`: how many of the prompt's blocks each worker holds;
//! - `ledger`: every worker's charges and effective load.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    DecisionId, HashingContract, KvEvent, KvEventBatch, LoadReport, Role, Tier, WorkerId,
    WorkerRecord,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{
    decision_seed, Explanation, Policy, PolicySpec, RouteOptions, RouteRequest, Routed,
    RouterConfig, RouterCore, Side,
};
use tests::datadriven::{option, options, run_scenarios};

const BLOCK: u32 = 16;

/// A scenario's state.
struct Scenario {
    core: RouterCore,
    indexer: KvIndexer,
    seqs: HashMap<WorkerId, u64>,
    prompts: HashMap<String, Vec<u32>>,
    decisions: HashMap<String, DecisionId>,
    next_id: u64,
}

impl Scenario {
    fn new(policy: Policy, config: RouterConfig) -> Self {
        Self {
            core: RouterCore::new(config, policy).expect("a valid core"),
            indexer: KvIndexer::new(OwnershipIndex::new()),
            seqs: HashMap::new(),
            prompts: HashMap::new(),
            decisions: HashMap::new(),
            next_id: 0,
        }
    }
}

fn contract() -> HashingContract {
    HashingContract::for_model("test-model", BLOCK)
}

fn number<T: std::str::FromStr>(opts: &[(&str, &str)], key: &str, default: T) -> T
where
    T::Err: std::fmt::Debug,
{
    option(opts, key).map_or(default, |v| v.parse().unwrap())
}

fn id(name: &str) -> WorkerId {
    name.parse().unwrap()
}

/// `SEED×LEN` words as tokens.
fn tokens(words: &[&str]) -> Vec<u32> {
    words
        .iter()
        .flat_map(|w| {
            let (seed, len) = w
                .split_once('×')
                .or_else(|| w.split_once('x'))
                .unwrap_or_else(|| panic!("{w}: expected SEED×LEN"));
            tests::tokens(seed.parse().unwrap(), len.parse().unwrap())
        })
        .collect()
}

fn new_core(opts: &[(&str, &str)]) -> Scenario {
    let name = option(opts, "policy").unwrap_or("isl_or_load");
    let mut policy = PolicySpec::find(name).unwrap().spec.default_policy();
    let mut config = RouterConfig::new(contract());
    for (key, value) in opts.iter().filter(|(k, _)| *k != "policy") {
        let value: f64 = value.parse().unwrap();
        if key.contains('.') {
            config.set_param(key, value).unwrap();
        } else {
            policy.set(key, value).unwrap();
        }
    }
    Scenario::new(policy, config)
}

/// Runs one command, returning its output.
fn run(scenario: &mut Option<Scenario>, command: &str) -> String {
    let mut words = command.split_whitespace();
    let verb = words.next().unwrap();
    let (opts, plain) = options(words);
    if verb == "core" {
        *scenario = Some(new_core(&opts));
        return String::new();
    }
    let s = scenario.as_mut().expect("`core` comes first");
    let mut out = String::new();
    match verb {
        "worker" => {
            let role: Role = option(&opts, "role").unwrap().parse().unwrap();
            s.core
                .register(WorkerRecord {
                    kv_capacity_blocks: number(&opts, "capacity", 10_000),
                    max_batched_tokens: number(&opts, "mbt", 8192),
                    kv_bytes_per_token: 163_840,
                    gpus: 2,
                    max_model_len: 0,
                    ..tests::fixtures::registration(plain[0], role, contract())
                })
                .unwrap();
        }
        "load" => {
            let worker = id(plain[0]);
            let capacity = s.core.workers().record(&worker).unwrap().kv_capacity_blocks;
            let at = number(&opts, "at", 0);
            s.core.on_load(
                LoadReport {
                    worker,
                    running: number(&opts, "running", 0),
                    waiting: number(&opts, "waiting", 0),
                    queued_prefill_tokens: number(&opts, "queued", 0),
                    active_decode_blocks: number(&opts, "active", 0),
                    kv_blocks_used: number(&opts, "used", 0),
                    kv_blocks_total: capacity,
                    at_ms: at,
                    recent_itl_us: number(&opts, "itl_us", 0),
                },
                at,
            );
        }
        "prompt" => {
            s.prompts.insert(plain[0].to_owned(), tokens(&plain[1..]));
        }
        "extend" => {
            let more = tokens(&plain[1..]);
            s.prompts.get_mut(plain[0]).expect("a prompt").extend(more);
        }
        "store" => store(s, &opts, &plain),
        "route" => route(s, &opts, &plain, &mut out),
        "finish" | "prefill-done" => {
            let decision = s.decisions[plain[0]];
            let released = if verb == "finish" {
                s.core.on_finished(decision)
            } else {
                s.core.on_prefill_done(decision)
            };
            if !released {
                writeln!(out, "unknown decision").unwrap();
            }
        }
        "observe" => {
            let decision = s.decisions[plain[0]];
            if let Some(at) = option(&opts, "prefill-at") {
                let seen = s.core.observe_prefill_done(decision, at.parse().unwrap());
                if !seen {
                    writeln!(out, "prefill not awaited").unwrap();
                }
            }
            if let Some(ms) = option(&opts, "decode-ms") {
                let tokens = number(&opts, "tokens", 2);
                if !s
                    .core
                    .observe_decoded(decision, ms.parse().unwrap(), tokens)
                {
                    writeln!(out, "decode not awaited").unwrap();
                }
            }
            let f = s.core.calibration().factors();
            writeln!(
                out,
                "calibration: local TTFT x{:.3}, remote TTFT x{:.3}, ITL x{:.3}",
                f.local_ttft, f.remote_ttft, f.itl
            )
            .unwrap();
        }
        "expire" => {
            let expired = s.core.expire(number(&opts, "at", 0));
            writeln!(out, "expired {expired}").unwrap();
        }
        "ledger" => ledger(s, &mut out),
        "held" => {
            let hashes = s.core.hasher().hash_prompt(&s.prompts[plain[0]]);
            let index = s.core.replica().index();
            let matches = index.find_matches(&hashes);
            let mut held: Vec<String> = matches
                .iter()
                .filter_map(|(slot, d)| {
                    let w = index.worker(slot)?;
                    Some(format!("{w}={}/{}/{}", d.device, d.host, d.disk))
                })
                .collect();
            held.sort();
            writeln!(out, "{} blocks; held {}", hashes.len(), held.join(" ")).unwrap();
        }
        other => panic!("unknown command {other}"),
    }
    out
}

/// The worker now holds the prompt's first `blocks` blocks: a `Stored`
/// of those it does not hold yet, after those it does.
fn store(s: &mut Scenario, opts: &[(&str, &str)], plain: &[&str]) {
    let worker = id(plain[0]);
    let hashes = s.core.hasher().hash_prompt(&s.prompts[plain[1]]);
    let n = number(opts, "blocks", hashes.len()).min(hashes.len());
    let tier = option(opts, "tier").map_or(Tier::Device, |t| t.parse().unwrap());
    let index = s.core.replica().index();
    let held = index
        .slot(&worker)
        .map_or(0, |slot| index.find_matches(&hashes[..n]).get(slot).device)
        as usize;
    if held >= n && tier == Tier::Device {
        return;
    }
    let from = if tier == Tier::Device { held } else { 0 };
    let seq = s.seqs.entry(worker.clone()).or_insert(0);
    let batch = KvEventBatch {
        worker,
        epoch: 1,
        seq: *seq,
        events: vec![KvEvent::Stored {
            parent: from.checked_sub(1).map(|i| hashes[i]),
            blocks: hashes[from..n].to_vec(),
            tier,
        }],
    };
    *seq += 1;
    if let Some(delta) = s.indexer.apply(batch).delta {
        s.core.apply_delta(&delta).unwrap();
    }
}

fn route(s: &mut Scenario, opts: &[(&str, &str)], plain: &[&str], out: &mut String) {
    let label = plain[0];
    let prompt = &s.prompts[plain[1]];
    let hashes = s.core.hasher().hash_prompt(prompt);
    let avoid: Vec<WorkerId> = option(opts, "avoid")
        .map(|a| a.split(',').map(id).collect())
        .unwrap_or_default();
    let request = RouteRequest {
        request_id: label,
        isl_tokens: prompt.len() as u32,
        block_hashes: &hashes,
        expected_output_tokens: number(opts, "output", 100),
        session: None,
    };
    let explain = plain.contains(&"explain");
    let options = RouteOptions {
        avoid: &avoid,
        explain,
    };
    let decision_id = DecisionId(s.next_id);
    s.next_id += 1;
    let mut rng = ChaCha8Rng::seed_from_u64(decision_seed(0, &request));
    let at = number(opts, "at", 0);
    match s.core.route(&request, options, decision_id, at, &mut rng) {
        Ok(Routed {
            decision: d,
            explanation,
        }) => {
            s.decisions.insert(label.to_owned(), d.id);
            let prefill = d.prefill.as_ref().map_or("-".to_owned(), |p| p.to_string());
            writeln!(
                out,
                "{} decode={} prefill={prefill} rule={} held: decode={} prefill={} reserved: {} blocks, {} prefill tokens",
                d.path, d.decode, d.rule, d.decode_overlap_tokens, d.prefill_overlap_tokens,
                d.reserved_decode_blocks, d.reserved_prefill_tokens
            )
            .unwrap();
            writeln!(out, "  {}", d.reason).unwrap();
            if let Some(e) = explanation {
                candidates(&e, out);
            }
        }
        Err(e) => writeln!(out, "refused: {e}").unwrap(),
    }
}

fn candidates(e: &Explanation, out: &mut String) {
    candidate_lines(e, out);
    // The longest prefix's holder, when it is neither chosen worker.
    let picks = [
        Some(Side::Decode).zip(e.decode_pick),
        Some(Side::Prefill).zip(e.prefill_pick),
    ];
    if let Some((side, i)) = e.holder.filter(|h| !picks.contains(&Some(*h))) {
        let c = match side {
            Side::Decode => &e.decode[i],
            Side::Prefill => &e.prefill[i],
        };
        writeln!(
            out,
            "  prefix holder {} ({side:?}) depth={}/{}/{}",
            c.worker, c.depth.device, c.depth.host, c.depth.disk
        )
        .unwrap();
    }
    if let Some(c) = e.decode_holder.and_then(|i| e.decode.get(i)) {
        let on = e.verdict.as_ref().is_some_and(|v| v.on_decode_holder);
        writeln!(out, "  decode holder {} (bypass there: {on})", c.worker).unwrap();
    }
}

fn candidate_lines(e: &Explanation, out: &mut String) {
    let lines = e
        .decode
        .iter()
        .enumerate()
        .map(|(i, c)| ("decode", c, Some(i) == e.decode_pick))
        .chain(
            e.prefill
                .iter()
                .enumerate()
                .map(|(i, c)| ("prefill", c, Some(i) == e.prefill_pick)),
        );
    for (side, c, picked) in lines {
        writeln!(
            out,
            "  {side} {}{} depth={}/{}/{} active={} used={} queued={}{} cost={:.2}",
            c.worker,
            if picked { " (picked)" } else { "" },
            c.depth.device,
            c.depth.host,
            c.depth.disk,
            c.load.active_decode_blocks,
            c.load.kv_blocks_used,
            c.load.queued_prefill_tokens,
            if c.busy { " busy" } else { "" },
            c.cost
        )
        .unwrap();
    }
}

fn ledger(s: &Scenario, out: &mut String) {
    let workers = s.core.workers();
    let mut ids: Vec<&WorkerId> = workers.records().map(|r| &r.id).collect();
    ids.sort();
    for w in ids {
        let c = workers.ledger_charges(w);
        let l = workers.effective_load(w).unwrap_or_default();
        writeln!(
            out,
            "{w}: charged {} requests, {} decode blocks ({} new in its cache), {} prefill tokens; effective used={} active={} queued={}",
            c.requests, c.decode_blocks, c.cache_blocks, c.prefill_tokens, l.kv_blocks_used, l.active_decode_blocks, l.queued_prefill_tokens
        )
        .unwrap();
    }
    writeln!(out, "in flight: {}", workers.in_flight()).unwrap();
}

#[test]
fn scenarios() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    run_scenarios(
        &dir,
        |_| None,
        |scenario, command| run(scenario, command[0]),
    );
}
