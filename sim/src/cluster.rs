//! One simulated cluster run: a discrete-event loop in virtual time that
//! drives the real router and indexer cores and the engine model.
//!
//! Events, in time order (ties in the order they were scheduled):
//! - an arrival is routed by [`RouterCore`] and submitted to its prefill
//!   worker (remote) or its decode worker (bypass); on the third path
//!   ([`Path::RemoteFetch`]) the decode worker supplying the prefix pins it
//!   until the prefill is done (as the router's ledger counts it), unless
//!   the prefill worker holds all of it already: pinned at the decision,
//!   or taken from the requests the decode worker exported as they
//!   finished ([`KvExport::VllmEveryRequest`]: none found, the prefill
//!   worker computes the whole prompt). With the prefix exported by a
//!   request ([`KvExport::exports_by_request`]) the source's engine runs
//!   that request first and the leg waits for it, nothing pinned: its
//!   first token pins the prefix and sends the leg on; the agent's
//!   deadline (an event) abandons it, and the leg prefills whole;
//! - an engine step starts: the pulls of supplied prefixes its prefill
//!   worker asks for when it admits their requests ([`engine_sim::Step::pulls`])
//!   start on the links, and their sources' reads with them;
//! - an engine step ends: its outputs take effect (first tokens, prefills
//!   done, finished requests), its KV events go to the worker's agent core
//!   ([`KvCore`], the one the agent runs) which numbers them into batches,
//!   and the engine starts its next step;
//! - a batch the core publishes reaches the [`KvIndexer`] after a
//!   propagation delay (JetStream acknowledges it at once: the simulated
//!   bus never fails), and its delta goes to the router's index replica;
//! - a KV transfer ends on the workers' shared links ([`SharedLinks`]:
//!   concurrent transfers share each worker's link): a prefill's handoff
//!   submits the request to its decode worker; a pulled prefix ends the
//!   read on its source and goes to the prefill worker
//!   ([`Engine::pull_done`]: stored in its cache, its KV events show the
//!   blocks), which computes only the rest;
//! - a request finishes: when its decode engine exports it
//!   ([`KvExport::export_of`]) it pins its blocks until a fetch takes them
//!   or their TTL ends (an event then lets them go);
//! - every load interval each engine's load report reaches the router.

use std::cmp::Ordering;
use std::collections::{BTreeSet, BinaryHeap, HashMap, VecDeque};
use std::convert::Infallible;
use std::time::Duration;

use engine_sim::{
    Engine, EngineRequest, KvTransfer, Mode, PinnedPrefix, Preset, Pull, SharedLinks, StepOutput,
};
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{
    BlockHash, DecisionId, HashingContract, KvEvent, KvEventBatch, Path, RouteDecision, Tier,
    WorkerId, WorkerRecord, WorkerSubjects,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{rules, RouteOptions, RouteRequest, RouterConfig, RouterCore};
use worker_agent::core::{
    Backoff, Effect, Input, KvCore, OutboxLimits, EXPORT_DEADLINE, MAX_EXPORTS,
};
use worker_agent::BlockMirror;

use crate::deployment::Deployment;
use crate::exports::{Exports, KvExport};
use crate::floor::{Floor, TtftFloor};
use crate::metrics::{Counters, RequestRecord, RunSummary, Slo};
use crate::reuse::{ReuseCeiling, ReuseLog};
use crate::workload::{Arrival, RequestSpec, Workload};

/// Everything one run needs besides its workload.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub preset: Preset,
    pub block_size: u32,
    pub deployment: Deployment,
    /// Each worker's KV link (P -> D handoffs and D -> P prefix pulls
    /// share it).
    pub link: KvTransfer,
    /// Engine KV event -> indexer -> router replica.
    pub index_delay_us: u64,
    /// Each worker agent's KV outbox bounds.
    pub kv_outbox: OutboxLimits,
    /// Load reports reach the router this often.
    pub load_interval_us: u64,
    /// Output length the router assumes when it reserves KV.
    pub expected_output_tokens: u32,
    pub slo: Slo,
    /// Seeds the router's tie-breaking.
    pub seed: u64,
    /// Share of the arrival window excluded from the figures while the
    /// cluster fills up.
    pub warmup_fraction: f64,
    /// The third path (prefixes fetched from decode workers) for the C/D
    /// deployments' router; the aggregated and disaggregated ones never
    /// fetch.
    pub fetch: router::FetchConfig,
    /// Where the third path's reads find their blocks on the decode
    /// worker, and how long it pins them.
    pub kv_export: KvExport,
    /// Each worker's host-memory tier (G2) in GiB; 0: none.
    pub host_offload_gib: f64,
    /// Router settings over the core's defaults, by
    /// [`router::RouterConfig::params`] name (e.g. `prefill.miss_weight`),
    /// for every deployment; the third path's come from
    /// [`SimConfig::fetch`].
    pub router_params: Vec<(String, f64)>,
    /// Also find the run's reuse ceiling ([`crate::reuse`]): it keeps every
    /// block access of the run, so only where asked for.
    pub reuse_ceiling: bool,
}

/// Why a run could not start.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("engine configuration: {0}")]
    Engine(#[from] engine_sim::ConfigError),
    #[error("router configuration: {0}")]
    Router(#[from] router::ConfigError),
    #[error("worker registration: {0}")]
    Registration(#[from] protocol::ContractMismatch),
    #[error("a deployment needs at least one decode-capable worker")]
    NoDecodeWorker,
    #[error("router setting {0}: the third path's settings are SimConfig::fetch (sim: --prefix-fetch, --prefix-fetch-min-tokens)")]
    FetchParam(String),
}

impl SimConfig {
    /// The router core's configuration: the defaults with
    /// [`SimConfig::router_params`] over them, and the third path
    /// ([`SimConfig::fetch`]) for the C/D deployments only; checked.
    pub fn router_config(&self) -> Result<RouterConfig, SimError> {
        let contract = HashingContract::for_model(self.preset.model, self.block_size);
        let mut config = RouterConfig::new(contract);
        for (name, value) in &self.router_params {
            if name.starts_with("fetch.") {
                return Err(SimError::FetchParam(name.clone()));
            }
            config
                .set_param(name, *value)
                .map_err(router::ConfigError::from)?;
        }
        config.fetch = match self.deployment {
            Deployment::Conditional { .. } => self.fetch,
            _ => router::FetchConfig::default(),
        };
        config.validate()?;
        Ok(config)
    }
}

/// The outcome of a run.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub summary: RunSummary,
    pub records: Vec<RequestRecord>,
    /// Virtual time at the end, microseconds.
    pub end_us: u64,
    pub gpus: u32,
    /// The router core's calibration factors at the end (what the SLA
    /// policy learnt from the observations the cluster fed it).
    pub calibration: router::Factors,
    /// With [`SimConfig::reuse_ceiling`]: the most prompt blocks the
    /// cluster's KV memory (every tier) could have served.
    pub reuse_ceiling: Option<ReuseCeiling>,
}

#[derive(Debug)]
enum Event {
    /// `pulled`: from [`Workload::next_arrival`] (whose successor is pulled
    /// when it arrives), not a conversation's next turn.
    Arrival {
        arrival: Arrival,
        pulled: bool,
    },
    StepEnd {
        worker: usize,
        outputs: Vec<StepOutput>,
    },
    KvEvents(KvEventBatch),
    /// The shared links' next change (a transfer ends or starts moving).
    LinkTick,
    LoadTick,
    /// A decode worker's oldest exports may have expired.
    ExportsExpire {
        worker: usize,
    },
    /// The TTL of request `id`'s source pin ends: unless its read started,
    /// the source's engine lets the blocks go (the read is declined).
    SourceExpires {
        id: u64,
    },
    /// The source's agent gives up on request `id`'s export
    /// ([`EXPORT_DEADLINE`]) unless it is done.
    ExportDeadline {
        id: u64,
    },
}

#[derive(Debug)]
struct Scheduled {
    at_us: u64,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        (self.at_us, self.seq) == (other.at_us, other.seq)
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Reversed: the heap pops the earliest event first.
    fn cmp(&self, other: &Self) -> Ordering {
        (other.at_us, other.seq).cmp(&(self.at_us, self.seq))
    }
}

/// A request between its arrival and its last token.
#[derive(Debug)]
struct InFlight {
    spec: RequestSpec,
    arrival_us: u64,
    decision: DecisionId,
    path: Path,
    /// The rule that chose the path.
    rule: String,
    decode: usize,
    /// The prefill worker of a remote path.
    prefill: Option<usize>,
    /// The third path: the prefix's source, from the decision (or the
    /// export's end) until the prefill is done, or until its TTL ends
    /// unread.
    source: Option<Source>,
    /// The source's export by request under way, with the prefill leg it
    /// holds back ([`KvExport::exports_by_request`]).
    export: Option<PendingExport>,
    first_token_us: Option<u64>,
    floor: Floor,
}

/// The worker that supplies a request's prefix, and its pin on it (read
/// while the prefill worker pulls it, which it does when it admits the
/// request; let go unread at its TTL, `Event::SourceExpires`; a read too
/// near the TTL is declined, [`KvExport::readable_until_us`]).
#[derive(Debug)]
struct Source {
    worker: usize,
    pin: PinnedPrefix,
    /// Whether the prefill worker started reading it.
    read: bool,
    /// When the source's engine lets the blocks go unread (`None`: never).
    expires_us: Option<u64>,
}

/// An export a source's engine runs for a request's prefix
/// ([`KvExport::exports_by_request`]), and the prefill leg waiting for it.
#[derive(Debug)]
struct PendingExport {
    source: usize,
    leg: EngineRequest,
}

/// What a transfer on the links carries (its id: the request's id times
/// two, plus this).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Transfer {
    /// P -> D: the prefilled KV to the decode worker.
    Handoff = 0,
    /// D -> P: the prefix to the prefill worker (the third path).
    Pull = 1,
}

fn transfer_id(request: u64, kind: Transfer) -> u64 {
    request * 2 + kind as u64
}

/// The id of the source engine's export request for request `id`'s prefix
/// (request ids stay below it); also the key of a declined read's blocks
/// among its source's [`Exports`].
fn export_request_id(id: u64) -> u64 {
    id | EXPORT_REQUEST
}

/// Whether an engine's request `id` is an export request, not a user's.
fn is_export_request(id: u64) -> bool {
    id & EXPORT_REQUEST != 0
}

/// The request whose prefix export request `id` exports.
fn exported_for(id: u64) -> u64 {
    id & !EXPORT_REQUEST
}

const EXPORT_REQUEST: u64 = 1 << 62;

struct Cluster<'w> {
    config: SimConfig,
    workload: &'w mut dyn Workload,
    now_us: u64,
    queue: BinaryHeap<Scheduled>,
    seq: u64,
    /// Events other than load ticks waiting in the queue.
    pending: usize,
    engines: Vec<Engine>,
    /// Each worker agent's KV core (no resync requests here: nobody to
    /// answer).
    kv: Vec<KvCore<Infallible>>,
    busy: Vec<bool>,
    links: SharedLinks,
    /// Link ticks scheduled, by time.
    link_ticks: BTreeSet<u64>,
    worker_index: HashMap<WorkerId, usize>,
    router: RouterCore,
    indexer: KvIndexer,
    rng: ChaCha8Rng,
    /// The prompt's block hashes, reused from request to request.
    hashes: Vec<BlockHash>,
    /// The chain continued over the answer, and the tokens it covers.
    answer_hashes: Vec<BlockHash>,
    answer_tokens: Vec<u32>,
    /// What no router could improve on: each request's TTFT floor.
    floor: TtftFloor,
    /// With [`SimConfig::reuse_ceiling`]: every block access, in order.
    reuse: Option<ReuseLog>,
    in_flight: HashMap<u64, InFlight>,
    records: Vec<RequestRecord>,
    counters: Counters,
    window: (u64, u64),
    /// Each worker's exported requests ([`KvExport::export_of`]).
    exports: Vec<Exports<PinnedPrefix>>,
    /// The engines run vLLM's bidirectional transfer: this deployment's
    /// router fetches prefixes (the C/D ones, with the third path on).
    bidirectional: bool,
    /// Each worker's export requests under way (at most [`MAX_EXPORTS`]).
    exporting: Vec<usize>,
}

/// The first KV epoch of every worker.
const FIRST_EPOCH: u64 = 1;

/// An engine's block set, as its agent lists it for a resync: its device
/// blocks and its host tier's.
fn block_set(engine: &Engine) -> Vec<KvEvent> {
    let mut mirror = BlockMirror::from_links(engine.cached_block_links(), Tier::Device);
    let host: Vec<KvEvent> = engine
        .host_block_links()
        .map(|(hash, parent)| KvEvent::Stored {
            parent,
            blocks: vec![hash],
            tier: Tier::Host,
        })
        .collect();
    mirror.apply(&host);
    mirror.stored_events()
}

/// Runs one deployment on one workload to the end and summarises it.
pub fn simulate(config: &SimConfig, workload: &mut dyn Workload) -> Result<RunResult, SimError> {
    let mut cluster = Cluster::new(config.clone(), workload)?;
    cluster.run();
    let gpus = cluster.engines.len() as u32 * config.preset.gpus;
    cluster.counters.preemptions = cluster.engines.iter().map(|e| e.stats().preemptions).sum();
    for e in &cluster.engines {
        let (st, cfg) = (e.stats(), e.config());
        cluster.counters.host_read_tokens += st.host_read_tokens;
        cluster.counters.host_bytes_read += cfg.kv_bytes(st.host_read_tokens);
        cluster.counters.host_bytes_written += st.host_blocks_written * cfg.block_bytes();
    }
    let reuse_ceiling = cluster.reuse.as_ref().map(|log| {
        let pool_blocks = cluster
            .engines
            .iter()
            .map(|e| {
                let c = e.config();
                u64::from(c.kv_capacity_blocks) + u64::from(c.host.capacity_blocks)
            })
            .sum();
        log.ceiling(pool_blocks)
    });
    let summary = RunSummary::new(
        &cluster.records,
        &cluster.counters,
        cluster.window,
        gpus,
        &config.slo,
    );
    Ok(RunResult {
        summary,
        records: cluster.records,
        end_us: cluster.now_us,
        gpus,
        calibration: cluster.router.calibration().factors(),
        reuse_ceiling,
    })
}

impl<'w> Cluster<'w> {
    fn new(config: SimConfig, workload: &'w mut dyn Workload) -> Result<Self, SimError> {
        let router_config = config.router_config()?;
        let bidirectional = router_config.fetch.enabled;
        let contract = router_config.contract.clone();
        let policy = config.deployment.policy();
        let mut router = RouterCore::new(router_config, policy)?;
        let mut engine_config = config.preset.engine_config(config.block_size);
        engine_config.host.capacity_blocks = engine_sim::HostOffload::blocks_in_gib(
            config.host_offload_gib,
            engine_config.kv_bytes_per_token,
            engine_config.block_size,
        );
        let mut engines = Vec::new();
        let mut kv = Vec::new();
        let mut worker_index = HashMap::new();
        for (i, role) in config.deployment.roles().into_iter().enumerate() {
            let prefix = match role {
                protocol::Role::Prefill => "p",
                protocol::Role::Decode => "d",
                protocol::Role::Both => "w",
            };
            let id = WorkerId::new(&format!("{prefix}{i}"), 0).expect("a valid name");
            router.register(WorkerRecord {
                subjects: WorkerSubjects::for_worker(&id),
                id: id.clone(),
                role,
                contract: HashingContract {
                    salt: engine_config.salt,
                    block_size: engine_config.block_size,
                    ..contract.clone()
                },
                kv_capacity_blocks: u64::from(engine_config.kv_capacity_blocks),
                max_batched_tokens: engine_config.max_batched_tokens,
                kv_bytes_per_token: engine_config.kv_bytes_per_token,
                gpus: engine_config.gpus,
                max_model_len: 0,
                capabilities: Default::default(),
            })?;
            worker_index.insert(id.clone(), i);
            engines.push(Engine::new(id.clone(), role, engine_config)?);
            kv.push(KvCore::new(
                id,
                FIRST_EPOCH,
                config.kv_outbox,
                Backoff::AGENT,
            ));
        }
        if !engines.iter().any(|e| e.role().decodes()) {
            return Err(SimError::NoDecodeWorker);
        }
        let window_end = workload.arrival_window_us();
        let warmup = (window_end as f64 * config.warmup_fraction.clamp(0.0, 0.9)) as u64;
        let busy = vec![false; engines.len()];
        let exports = engines.iter().map(|_| Exports::default()).collect();
        let exporting = vec![0; engines.len()];
        let links = SharedLinks::new(config.link, engines.len());
        let rng = ChaCha8Rng::seed_from_u64(config.seed);
        let floor = TtftFloor::new(engine_config.cost, engine_config.block_size);
        let reuse = config.reuse_ceiling.then(ReuseLog::default);
        Ok(Self {
            config,
            workload,
            now_us: 0,
            queue: BinaryHeap::new(),
            seq: 0,
            pending: 0,
            engines,
            kv,
            busy,
            links,
            link_ticks: BTreeSet::new(),
            worker_index,
            router,
            indexer: KvIndexer::new(OwnershipIndex::new()),
            rng,
            hashes: Vec::new(),
            answer_hashes: Vec::new(),
            answer_tokens: Vec::new(),
            floor,
            reuse,
            in_flight: HashMap::new(),
            records: Vec::new(),
            counters: Counters::default(),
            window: (warmup, window_end.max(warmup + 1)),
            exports,
            bidirectional,
            exporting,
        })
    }

    fn schedule(&mut self, at_us: u64, event: Event) {
        if !matches!(event, Event::LoadTick) {
            self.pending += 1;
        }
        self.seq += 1;
        self.queue.push(Scheduled {
            at_us,
            seq: self.seq,
            event,
        });
    }

    fn run(&mut self) {
        self.pull_arrival();
        self.schedule(0, Event::LoadTick);
        // Each agent publishes its first epoch's `Cleared` at start.
        for worker in 0..self.kv.len() {
            self.kv_step(worker, Input::Tick);
        }
        while let Some(Scheduled { at_us, event, .. }) = self.queue.pop() {
            self.now_us = at_us;
            match event {
                Event::LoadTick => {
                    self.report_loads();
                    assert!(
                        self.pending > 0 || self.in_flight.is_empty(),
                        "simulation stalled at {:.1} s: {} requests in flight and no event \
                         pending (a worker waits for room nothing will free)",
                        at_us as f64 / 1e6,
                        self.in_flight.len()
                    );
                    if self.pending > 0 {
                        self.schedule(at_us + self.config.load_interval_us, Event::LoadTick);
                    }
                    continue;
                }
                Event::Arrival { arrival, pulled } => {
                    self.pending -= 1;
                    if pulled {
                        self.pull_arrival();
                    }
                    self.route(arrival);
                }
                Event::StepEnd { worker, outputs } => {
                    self.pending -= 1;
                    self.step_end(worker, outputs);
                }
                Event::KvEvents(batch) => {
                    self.pending -= 1;
                    if let Some(delta) = self.indexer.apply(batch).delta {
                        self.router
                            .apply_delta(&delta)
                            .expect("deltas reach the replica in order");
                    }
                }
                Event::ExportsExpire { worker } => {
                    self.pending -= 1;
                    let expired = self.exports[worker].expire(at_us);
                    self.counters.exports.expired += expired.len() as u64;
                    for pin in expired {
                        self.unpin(worker, pin);
                    }
                }
                Event::SourceExpires { id } => {
                    self.pending -= 1;
                    let unread = self
                        .in_flight
                        .get_mut(&id)
                        .and_then(|r| r.source.take_if(|s| !s.read));
                    if let Some(s) = unread {
                        self.unpin(s.worker, s.pin);
                    }
                }
                Event::ExportDeadline { id } => {
                    self.pending -= 1;
                    self.export_deadline(id);
                }
                Event::LinkTick => {
                    self.pending -= 1;
                    self.link_ticks.remove(&at_us);
                    let done = self.links.advance(at_us);
                    self.transfers_done(done);
                    self.schedule_link_tick();
                }
            }
        }
        debug_assert!(
            self.exporting.iter().all(|&n| n == 0),
            "export requests left under way: {:?}",
            self.exporting
        );
    }

    /// Schedules the workload's next self-arriving request (one at a time,
    /// so that only in-flight requests are in memory).
    fn pull_arrival(&mut self) {
        if let Some(next) = self.workload.next_arrival() {
            self.schedule(
                next.at_us,
                Event::Arrival {
                    arrival: next,
                    pulled: true,
                },
            );
        }
    }

    fn now_ms(&self) -> u64 {
        self.now_us / 1000
    }

    fn report_loads(&mut self) {
        let now_ms = self.now_ms();
        let in_window = (self.window.0..self.window.1).contains(&self.now_us);
        for engine in &self.engines {
            let report = engine.load_report(self.now_us);
            if in_window && engine.role().decodes() {
                let c = &mut self.counters;
                let usage = report.kv_blocks_used as f64 / report.kv_blocks_total.max(1) as f64;
                c.decode_kv_usage_sum += usage;
                c.decode_kv_full_samples += u64::from(usage >= 0.9);
                c.decode_waiting_sum += u64::from(report.waiting);
                c.decode_samples += 1;
            }
            self.router.on_load(report, now_ms);
        }
        self.router.expire(now_ms);
    }

    fn route(&mut self, arrival: Arrival) {
        let spec = arrival.request;
        let id = DecisionId(spec.id);
        let now_ms = self.now_ms();
        self.hashes.clear();
        self.router
            .hasher()
            .extend(None, &spec.prompt, &mut self.hashes);
        let floor = self.admit_to_floor(&spec);
        let request_id = spec.id.to_string();
        let request = RouteRequest {
            request_id: &request_id,
            isl_tokens: spec.prompt.len() as u32,
            block_hashes: &self.hashes,
            expected_output_tokens: self.config.expected_output_tokens,
            session: None,
        };
        let routed =
            self.router
                .route(&request, RouteOptions::default(), id, now_ms, &mut self.rng);
        let decision = match routed {
            Ok(routed) => routed.decision,
            Err(_) => {
                self.counters.refused += 1;
                self.finish_session_turn(&spec);
                return;
            }
        };
        self.count_path(&decision);
        let decode = self.worker_index[&decision.decode];
        let prefill = decision
            .prefill
            .as_ref()
            .filter(|_| decision.path.is_remote())
            .map(|p| self.worker_index[p]);
        let (target, mode) = match prefill {
            Some(p) => (p, Mode::PrefillOnly),
            None => (decode, Mode::LocalPrefill),
        };
        // The third path: the prefill worker pulls what it lacks of the
        // prefix when it admits the request (nothing to pull when it has
        // all of it now); pinned on its source from the decision, or, when
        // the source's engine exports it by a request, once that has run.
        let mut source = None;
        let mut export_from = None;
        let mut pull_tokens = 0;
        if let (Some(f), Some(p)) = (&decision.fetch, prefill) {
            let worker = self.worker_index[&f.source];
            let held_by_p = self.engines[p].cached_prefix_tokens(&spec.prompt);
            if self.config.kv_export.exports_by_request() {
                // The source's agent asks for what its engine holds of it.
                let bs = self.config.block_size.max(1);
                let held = self.engines[worker]
                    .cached_prefix_tokens(&spec.prompt)
                    .min(f.prefix_tokens / bs * bs);
                if held > held_by_p {
                    pull_tokens = held;
                    export_from = Some(worker);
                }
            } else if let Some((tokens, pin, expires_us)) =
                self.supplied_prefix(worker, &spec.prompt, f.prefix_tokens)
            {
                if tokens > held_by_p {
                    pull_tokens = tokens;
                    if let Some(at) = expires_us {
                        self.schedule(at, Event::SourceExpires { id: spec.id });
                    }
                    source = Some(Source {
                        worker,
                        pin,
                        read: false,
                        expires_us,
                    });
                } else {
                    // vLLM's prefill engine, holding it all, frees the
                    // source's blocks with a notification when it
                    // schedules the request; here at once.
                    self.unpin(worker, pin);
                }
            }
        }
        debug_assert!(
            !is_export_request(spec.id),
            "request ids stay below export ids"
        );
        let request = EngineRequest {
            id: spec.id,
            prompt: spec.prompt.clone(),
            output_tokens: spec.output.clone(),
            mode,
            pull_tokens,
        };
        let spec_id = spec.id;
        self.in_flight.insert(
            spec.id,
            InFlight {
                spec,
                arrival_us: arrival.at_us,
                decision: id,
                path: decision.path,
                rule: decision.rule.clone(),
                decode,
                prefill,
                source,
                export: None,
                first_token_us: None,
                floor,
            },
        );
        match (export_from, prefill) {
            (Some(worker), Some(p)) => self.request_export(spec_id, worker, p, request),
            _ => self.submit(target, request),
        }
    }

    /// The request's TTFT floor ([`TtftFloor`]); `self.hashes` holds its
    /// prompt's block hashes.
    fn admit_to_floor(&mut self, spec: &RequestSpec) -> Floor {
        let full = self.hashes.len() * self.config.block_size as usize;
        self.answer_tokens.clear();
        self.answer_tokens
            .extend_from_slice(&spec.prompt[full.min(spec.prompt.len())..]);
        self.answer_tokens.extend_from_slice(&spec.output);
        self.answer_hashes.clear();
        self.router.hasher().extend(
            self.hashes.last().copied(),
            &self.answer_tokens,
            &mut self.answer_hashes,
        );
        if let Some(log) = &mut self.reuse {
            log.record(&self.hashes, &self.answer_hashes);
        }
        self.floor
            .admit(spec.prompt.len() as u32, &self.hashes, &self.answer_hashes)
    }

    /// Starts a transfer on the shared links.
    fn start_transfer(&mut self, id: u64, src: usize, dst: usize, bytes: u64) {
        let done = self.links.start(self.now_us, id, src, dst, bytes);
        self.transfers_done(done);
        self.schedule_link_tick();
    }

    fn schedule_link_tick(&mut self) {
        if let Some(at) = self.links.next_event_us() {
            if at != u64::MAX && self.link_ticks.insert(at) {
                self.schedule(at, Event::LinkTick);
            }
        }
    }

    fn transfers_done(&mut self, done: Vec<u64>) {
        for id in done {
            let request = id / 2;
            if id % 2 == Transfer::Pull as u64 {
                self.pull_done(request);
            } else {
                self.transfer_done(request);
            }
        }
    }

    /// What the third path's source supplies of `prompt`'s first
    /// `prefix_tokens`: its leading tokens, the pin that holds them until
    /// the prefill is done, and when the source's engine would let them go
    /// unread (`None`: never). Pinned at the decision
    /// ([`KvExport::pins_at_decision`], the ideal engine, which keeps them
    /// until read), the source pins what it holds now;
    /// taken from the exports kept ([`KvExport::VllmEveryRequest`]), the
    /// fetch takes the export whose blocks continue the
    /// prompt furthest (the export's whole pin: the engine frees it after
    /// the read), and finds none once it is read or expired.
    fn supplied_prefix(
        &mut self,
        worker: usize,
        prompt: &[u32],
        prefix_tokens: u32,
    ) -> Option<(u32, PinnedPrefix, Option<u64>)> {
        if self.config.kv_export.pins_at_decision() {
            let pin = self.engines[worker].pin_prefix(prompt, prefix_tokens);
            return Some((pin.tokens(), pin, None));
        }
        let bs = self.config.block_size.max(1);
        let blocks = ((prefix_tokens / bs) as usize).min(self.hashes.len());
        let Some(taken) = self.exports[worker].take_longest(&self.hashes[..blocks]) else {
            self.counters.exports.missing += 1;
            return None;
        };
        self.counters.exports.taken += 1;
        let tokens = (taken.blocks as u32 * bs).min(taken.pin.tokens());
        Some((tokens, taken.pin, Some(taken.expires_us)))
    }

    /// Has `source`'s engine export the prefix request `id`'s prefill `leg`
    /// pulls (a one-token request of it, under the agent's limits), holding
    /// the leg until the export is done ([`Cluster::export_done`]) or
    /// abandoned ([`Cluster::export_deadline`]). A source running
    /// [`MAX_EXPORTS`] already exports nothing: the leg prefills whole.
    fn request_export(&mut self, id: u64, source: usize, prefill: usize, mut leg: EngineRequest) {
        if self.exporting[source] >= MAX_EXPORTS {
            self.counters.exports.busy += 1;
            leg.pull_tokens = 0;
            self.submit(prefill, leg);
            return;
        }
        let export = EngineRequest {
            id: export_request_id(id),
            prompt: leg.prompt[..leg.pull_tokens as usize].into(),
            output_tokens: [leg.output_tokens.first().copied().unwrap_or(0)].into(),
            mode: Mode::LocalPrefill,
            pull_tokens: 0,
        };
        if self.engines[source].submit(export).is_err() {
            debug_assert!(false, "a decode engine refused a prefix it holds");
            leg.pull_tokens = 0;
            self.submit(prefill, leg);
            return;
        }
        self.exporting[source] += 1;
        if let Some(r) = self.in_flight.get_mut(&id) {
            r.export = Some(PendingExport { source, leg });
        }
        let deadline = self.now_us + EXPORT_DEADLINE.as_micros() as u64;
        self.schedule(deadline, Event::ExportDeadline { id });
        self.wake(source);
    }

    /// Request `id`'s export under way, taken (none once it was done or
    /// abandoned), and the prefill worker its leg goes to.
    fn take_pending_export(&mut self, id: u64) -> Option<(PendingExport, usize)> {
        let r = self.in_flight.get_mut(&id)?;
        let prefill = r.prefill?;
        Some((r.export.take()?, prefill))
    }

    /// The source's engine exported request `id`'s prefix (its export's
    /// first token): it pins the blocks, which it just computed or hit, its
    /// TTL starts, and the held leg goes to the prefill worker. Nothing
    /// once the export was abandoned.
    fn export_done(&mut self, id: u64) {
        let Some((PendingExport { source, mut leg }, prefill)) = self.take_pending_export(id)
        else {
            return;
        };
        self.counters.exports.made += 1;
        let pin = self.engines[source].pin_prefix(&leg.prompt, leg.pull_tokens);
        leg.pull_tokens = pin.tokens();
        let expires_us = self.config.kv_export.ttl_us().map(|ttl| self.now_us + ttl);
        if let Some(at) = expires_us {
            self.schedule(at, Event::SourceExpires { id });
        }
        if let Some(r) = self.in_flight.get_mut(&id) {
            r.source = Some(Source {
                worker: source,
                pin,
                read: false,
                expires_us,
            });
        }
        self.submit(prefill, leg);
    }

    /// The source's agent gives up on request `id`'s export unless it is
    /// done: the source's engine drops the export request, and the leg
    /// prefills whole.
    fn export_deadline(&mut self, id: u64) {
        let Some((PendingExport { source, mut leg }, prefill)) = self.take_pending_export(id)
        else {
            return;
        };
        self.counters.exports.abandoned += 1;
        // The source's step may still run: an export it finishes is out of
        // its scheduler already (not aborted; its `Finished` comes at the
        // step's end and ends it), one it has not is dropped now.
        if self.engines[source].abort(export_request_id(id)) {
            self.exporting[source] -= 1;
            self.wake(source);
        }
        leg.pull_tokens = 0;
        self.submit(prefill, leg);
    }

    /// A prefill worker admitted a request whose prefix it pulls: the read
    /// of its source's pin starts, and the blocks it lacks go over the
    /// links.
    fn start_pull(&mut self, worker: usize, pull: Pull) {
        let (now, kv_export) = (self.now_us, self.config.kv_export);
        let readable = |s: &Source| {
            s.expires_us
                .is_none_or(|at| now < kv_export.readable_until_us(at))
        };
        let declined = self
            .in_flight
            .get(&pull.id)
            .is_some_and(|r| !r.source.as_ref().is_some_and(readable));
        if declined {
            // The source's engine let the blocks go at their TTL, or will
            // soon: the prefill worker declines the read and computes the
            // prefix.
            self.counters.exports.declined += 1;
            self.keep_declined_source(pull.id);
            self.engines[worker].pull_declined(pull.id);
            self.wake(worker);
            return;
        }
        let Some(r) = self.in_flight.get_mut(&pull.id) else {
            debug_assert!(false, "a pull of a request no longer in flight");
            self.engines[worker].pull_declined(pull.id);
            return;
        };
        let Some(s) = r.source.as_mut() else {
            unreachable!("a pull without its source's pin is declined above");
        };
        s.read = true;
        let source = s.worker;
        self.engines[source].start_read(&mut s.pin);
        let bytes = self.engines[source]
            .config()
            .kv_bytes(u64::from(pull.tokens));
        self.counters.kv_bytes_pulled += bytes;
        self.start_transfer(transfer_id(pull.id, Transfer::Pull), source, worker, bytes);
    }

    /// Request `id`'s read was declined: its source, told nothing, keeps
    /// the blocks until their TTL (an unkeyed export then).
    fn keep_declined_source(&mut self, id: u64) {
        let Some(s) = self.in_flight.get_mut(&id).and_then(|r| r.source.take()) else {
            return;
        };
        match s.expires_us {
            Some(at) if at > self.now_us => {
                let replaced =
                    self.exports[s.worker].insert(export_request_id(id), s.pin, Vec::new(), at);
                debug_assert!(replaced.is_none(), "one declined read a request");
                self.schedule(at, Event::ExportsExpire { worker: s.worker });
            }
            _ => self.unpin(s.worker, s.pin),
        }
    }

    /// A pulled prefix arrived on the prefill worker: the source's read ends
    /// (its pin stays until the prefill is done) and the request goes back
    /// to the prefill worker's queue, whose head it takes.
    fn pull_done(&mut self, id: u64) {
        let Some(r) = self.in_flight.get_mut(&id) else {
            return;
        };
        let Some(p) = r.prefill else {
            return;
        };
        if let Some(s) = r.source.as_mut() {
            self.engines[s.worker].end_read(&mut s.pin);
        }
        if self.engines[p].pull_done(id) {
            // The pulled blocks are stored now: the router hears of them
            // now, not at the end of the next step.
            self.publish_kv_events(p);
            self.wake(p);
        }
    }

    /// The third path's source lets its pinned prefix go (the request's
    /// prefill is done, or it was refused). A prefill engine that found
    /// nothing to pull at admission frees the source's blocks then too
    /// (vLLM's sends the source a notification without a read); here when
    /// its prefill is done.
    fn release_source(&mut self, id: u64) {
        if let Some(s) = self.in_flight.get_mut(&id).and_then(|r| r.source.take()) {
            self.unpin(s.worker, s.pin);
        }
    }

    /// Lets a pinned prefix go on `worker`. Its blocks become evictable, so
    /// a request that waited for room there may now be admitted: an idle
    /// worker is woken (nothing else would: its next step comes only with
    /// its next submission).
    fn unpin(&mut self, worker: usize, pin: PinnedPrefix) {
        self.engines[worker].unpin(pin);
        self.wake(worker);
    }

    /// Starts `worker`'s next step unless one is running.
    fn wake(&mut self, worker: usize) {
        if !self.busy[worker] {
            self.start_step(worker);
        }
    }

    fn count_path(&mut self, decision: &RouteDecision) {
        match decision.path {
            Path::Bypass => self.counters.bypassed += 1,
            Path::Remote => self.counters.remote += 1,
            Path::RemoteFetch => {
                self.counters.remote += 1;
                self.counters.fetched += 1;
            }
        }
        if decision.rule == rules::GATE_KV_BUDGET || decision.rule == rules::GATE_NO_SIGNAL {
            self.counters.gate_vetoes += 1;
        }
    }

    fn submit(&mut self, worker: usize, request: EngineRequest) {
        let id = request.id;
        if self.engines[worker].submit(request).is_err() {
            self.counters.refused += 1;
            self.release_source(id);
            if let Some(r) = self.in_flight.remove(&id) {
                self.router.on_finished(r.decision);
                self.finish_session_turn(&r.spec);
            }
            return;
        }
        self.wake(worker);
    }

    fn start_step(&mut self, worker: usize) {
        match self.engines[worker].step(self.now_us) {
            Some(mut step) => {
                self.busy[worker] = true;
                for pull in std::mem::take(&mut step.pulls) {
                    self.start_pull(worker, pull);
                }
                self.schedule(
                    step.end_us(),
                    Event::StepEnd {
                        worker,
                        outputs: step.outputs,
                    },
                );
            }
            None => self.busy[worker] = false,
        }
    }

    fn step_end(&mut self, worker: usize, outputs: Vec<StepOutput>) {
        let now = self.now_us;
        let in_window = (self.window.0..self.window.1).contains(&now);
        for output in outputs {
            match output {
                StepOutput::FirstToken { id, .. } if is_export_request(id) => {
                    self.export_done(exported_for(id));
                }
                StepOutput::Finished { id, .. } if is_export_request(id) => {
                    self.exporting[worker] -= 1;
                }
                StepOutput::FirstToken { id, cached_tokens } => {
                    self.counters.window_tokens += u64::from(in_window);
                    if let Some(r) = self.in_flight.get_mut(&id) {
                        r.first_token_us = Some(now);
                        if r.path == Path::Bypass {
                            self.counters.d_prompt_tokens += r.spec.prompt.len() as u64;
                            self.counters.d_cached_tokens += u64::from(cached_tokens);
                            self.router.on_prefill_done(r.decision);
                            self.router.observe_prefill_done(r.decision, now / 1000);
                        }
                    }
                }
                StepOutput::Token { .. } => self.counters.window_tokens += u64::from(in_window),
                StepOutput::PrefillDone {
                    id,
                    prompt_tokens,
                    cached_tokens,
                } => {
                    self.counters.p_prompt_tokens += u64::from(prompt_tokens);
                    self.counters.p_cached_tokens += u64::from(cached_tokens);
                    self.prefill_done(id);
                }
                StepOutput::Finished { id, .. } => self.finished(id),
                StepOutput::Preempted { .. } => {}
            }
        }
        self.publish_kv_events(worker);
        self.start_step(worker);
    }

    /// Hands `worker`'s new KV events to its agent core.
    fn publish_kv_events(&mut self, worker: usize) {
        let events = self.engines[worker].take_kv_events();
        if !events.is_empty() {
            self.kv_step(worker, Input::EngineEvents(events));
        }
    }

    /// Feeds `worker`'s KV core and carries out its effects at once: a
    /// published batch reaches the indexer after the propagation delay and
    /// is acknowledged now; a block set is the engine's now (every event
    /// it emitted was fed before).
    fn kv_step(&mut self, worker: usize, input: Input<Infallible>) {
        let now = Duration::from_micros(self.now_us);
        let mut inputs = VecDeque::from([input]);
        while let Some(input) = inputs.pop_front() {
            for effect in self.kv[worker].step(input, now) {
                match effect {
                    Effect::Publish { batch, .. } => {
                        inputs.push_back(Input::Acked {
                            epoch: batch.epoch,
                            seq: batch.seq,
                            duplicate: false,
                        });
                        let at = self.now_us + self.config.index_delay_us;
                        self.schedule(at, Event::KvEvents(batch));
                    }
                    Effect::RequestBlockSet => {
                        inputs.push_back(Input::BlockSet(block_set(&self.engines[worker])));
                    }
                    Effect::Reply { to, .. } => match to {},
                    // Publishes never fail nor stay in flight here (so the
                    // indexer needs no announcement ahead of them).
                    Effect::Announce(_)
                    | Effect::CancelPublish
                    | Effect::RetryAt(_)
                    | Effect::Note(_) => {}
                }
            }
        }
    }

    /// A remote prefill is done: move what the decode worker lacks.
    fn prefill_done(&mut self, id: u64) {
        self.release_source(id);
        let Some(r) = self.in_flight.get(&id) else {
            return;
        };
        self.router.on_prefill_done(r.decision);
        self.router
            .observe_prefill_done(r.decision, self.now_us / 1000);
        let decode = &self.engines[r.decode];
        let held = u64::from(decode.cached_prefix_tokens(&r.spec.prompt));
        let bytes = decode
            .config()
            .kv_bytes((r.spec.prompt.len() as u64).saturating_sub(held));
        self.counters.kv_bytes_moved += bytes;
        let (Some(p), d) = (r.prefill, r.decode) else {
            return;
        };
        self.start_transfer(transfer_id(id, Transfer::Handoff), p, d, bytes);
    }

    fn transfer_done(&mut self, id: u64) {
        let Some(r) = self.in_flight.get(&id) else {
            return;
        };
        let request = EngineRequest {
            id,
            prompt: r.spec.prompt.clone(),
            output_tokens: r.spec.output.clone(),
            mode: Mode::KvReceived,
            pull_tokens: 0,
        };
        let decode = r.decode;
        self.submit(decode, request);
    }

    fn finished(&mut self, id: u64) {
        let Some(r) = self.in_flight.remove(&id) else {
            return;
        };
        self.router.on_finished(r.decision);
        // The engines export only where the third path is on (vLLM's
        // bidirectional transfer).
        let export = self.config.kv_export.export_of(r.path);
        if let Some((ttl_us, keyed)) = export.filter(|_| self.bidirectional) {
            self.export(id, r.decode, &r.spec, ttl_us, keyed);
        }
        if let Some(first) = r.first_token_us {
            let decode_ms = self.now_us.saturating_sub(first) as f64 / 1e3;
            self.router
                .observe_decoded(r.decision, decode_ms, r.spec.output.len() as u32);
        }
        self.records.push(RequestRecord {
            id,
            session: r.spec.session,
            turn: r.spec.turn,
            arrival_us: r.arrival_us,
            first_token_us: r.first_token_us.unwrap_or(self.now_us),
            finish_us: self.now_us,
            prompt_tokens: r.spec.prompt.len() as u32,
            output_tokens: r.spec.output.len() as u32,
            path: r.path,
            rule: r.rule,
            reusable_tokens: r.floor.reusable_tokens,
            ttft_floor_ms: r.floor.ttft_ms,
        });
        self.finish_session_turn(&r.spec);
    }

    /// The decode worker pins finished request `id`'s computed blocks (its
    /// prompt and its output but the last token) for `ttl_us`, or until a
    /// fetch reads them: when `keyed`, found by each whole block from its
    /// prompt's end on.
    fn export(&mut self, id: u64, decode: usize, spec: &RequestSpec, ttl_us: u64, keyed: bool) {
        let mut computed = spec.prompt.to_vec();
        computed.extend_from_slice(&spec.output[..spec.output.len().saturating_sub(1)]);
        let pin = self.engines[decode].pin_prefix(&computed, computed.len() as u32);
        let bs = self.config.block_size.max(1) as usize;
        let blocks = pin.tokens() as usize / bs;
        let first = (spec.prompt.len() / bs).saturating_sub(1);
        if blocks == 0 || (keyed && blocks <= first) {
            // Nothing pinned, or nothing a later prompt could find.
            self.unpin(decode, pin);
            return;
        }
        let mut hashes = Vec::new();
        if keyed {
            self.router
                .hasher()
                .extend(None, &computed[..blocks * bs], &mut hashes);
            hashes.drain(..first);
        }
        let at = self.now_us + ttl_us;
        let replaced = self.exports[decode].insert(id, pin, hashes, at);
        debug_assert!(replaced.is_none(), "one export a request");
        self.schedule(at, Event::ExportsExpire { worker: decode });
    }

    /// Lets a closed-loop workload issue the conversation's next turn.
    fn finish_session_turn(&mut self, spec: &RequestSpec) {
        if let Some(next) = self.workload.on_finished(spec, self.now_us) {
            self.schedule(
                next.at_us,
                Event::Arrival {
                    arrival: next,
                    pulled: false,
                },
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::deployment::Deployment;
    use crate::metrics::Slo;
    use crate::workload::{Agentic, AgenticConfig};

    fn config(kv_outbox: OutboxLimits) -> SimConfig {
        SimConfig {
            preset: Preset::llama8b_h100(),
            block_size: 16,
            deployment: Deployment::Conditional {
                prefill: 1,
                decode: 2,
                policy: router::IslBased::default().into(),
            },
            link: KvTransfer::default(),
            index_delay_us: 5_000,
            kv_outbox,
            load_interval_us: 100_000,
            expected_output_tokens: 256,
            slo: Slo {
                ttft_ms: 2_000.0,
                itl_ms: 60.0,
            },
            seed: 1,
            warmup_fraction: 0.0,
            fetch: router::FetchConfig::default(),
            kv_export: Default::default(),
            host_offload_gib: 0.0,
            reuse_ceiling: false,
            router_params: Vec::new(),
        }
    }

    /// A decode worker whose waiting request needs the room a pinned
    /// prefix holds goes idle (it cannot admit); the prefix's release must
    /// start its next step, or nothing would until its next submission (at
    /// the end of an overloaded run: never, and the run spun on its load
    /// ticks forever).
    #[test]
    fn releasing_a_pinned_prefix_wakes_the_worker_that_waited_for_room() {
        let mut workload = Agentic::new(AgenticConfig {
            duration_s: 1.0,
            ..AgenticConfig::default()
        });
        let mut cluster = Cluster::new(config(OutboxLimits::default()), &mut workload).unwrap();
        let d = (0..cluster.engines.len())
            .find(|&i| cluster.engines[i].role() == protocol::Role::Decode)
            .unwrap();
        let small = engine_sim::EngineConfig {
            kv_capacity_blocks: 8,
            ..*cluster.engines[d].config()
        };
        let engine = &mut cluster.engines[d];
        *engine = Engine::new(engine.worker().clone(), engine.role(), small).unwrap();
        let bs = engine.config().block_size;
        let held: Vec<u32> = (0..6 * bs).collect();
        let served = EngineRequest {
            id: 2,
            prompt: held.clone().into(),
            output_tokens: vec![1].into(),
            mode: Mode::LocalPrefill,
            pull_tokens: 0,
        };
        engine.submit(served).unwrap();
        let mut now = 0;
        while let Some(step) = engine.step(now) {
            now = step.end_us();
        }
        let pin = engine.pin_prefix(&held, 6 * bs);
        assert_eq!(pin.tokens(), 6 * bs);

        // Five blocks' prompt: two are free while the prefix is pinned.
        cluster.submit(
            d,
            EngineRequest {
                id: 1,
                prompt: (10_000..10_000 + 5 * bs).collect(),
                output_tokens: vec![1; 4].into(),
                mode: Mode::LocalPrefill,
                pull_tokens: 0,
            },
        );
        assert!(
            !cluster.busy[d],
            "it cannot admit while the prefix is pinned"
        );
        assert_eq!(cluster.engines[d].waiting(), 1);

        cluster.unpin(d, pin);
        assert!(cluster.busy[d], "the release woke it");
        assert_eq!(cluster.engines[d].running(), 1);
    }

    /// A source runs at most [`MAX_EXPORTS`] exports at once: the next
    /// fetch's leg goes to the prefill worker whole at once. The agent's
    /// deadline abandons the exports not done: those still queued on the
    /// source are dropped there, the one its running step finishes ends
    /// with that step, and every held leg goes to the prefill worker whole.
    #[test]
    fn a_source_runs_at_most_max_exports_and_drops_the_abandoned_ones() {
        let mut workload = Agentic::new(AgenticConfig {
            duration_s: 1.0,
            ..AgenticConfig::default()
        });
        let mut c = config(OutboxLimits::default());
        c.kv_export = KvExport::VllmOnDemand { ttl_us: 60_000_000 };
        let mut cluster = Cluster::new(c, &mut workload).unwrap();
        let first = |cluster: &Cluster<'_>, role| {
            (0..cluster.engines.len())
                .find(|&i| cluster.engines[i].role() == role)
                .unwrap()
        };
        let (p, d) = (
            first(&cluster, protocol::Role::Prefill),
            first(&cluster, protocol::Role::Decode),
        );
        let bs = cluster.engines[d].config().block_size;
        let prefix: Vec<u32> = (0..4 * bs).collect();
        let source = &mut cluster.engines[d];
        source
            .submit(EngineRequest {
                id: 1_000,
                prompt: prefix.clone().into(),
                output_tokens: vec![1].into(),
                mode: Mode::LocalPrefill,
                pull_tokens: 0,
            })
            .unwrap();
        let mut now = 0;
        while let Some(step) = source.step(now) {
            now = step.end_us();
        }
        cluster.now_us = now;
        let fetches = MAX_EXPORTS as u64 + 1;
        for id in 1..=fetches {
            let mut prompt = prefix.clone();
            prompt.extend(10_000 * id as u32..10_000 * id as u32 + bs);
            let spec = RequestSpec {
                id,
                session: id,
                turn: 1,
                prompt: prompt.into(),
                output: vec![1; 4].into(),
            };
            let leg = EngineRequest {
                id,
                prompt: spec.prompt.clone(),
                output_tokens: spec.output.clone(),
                mode: Mode::PrefillOnly,
                pull_tokens: 4 * bs,
            };
            cluster.in_flight.insert(
                id,
                InFlight {
                    spec,
                    arrival_us: now,
                    decision: DecisionId(id),
                    path: Path::RemoteFetch,
                    rule: String::new(),
                    decode: d,
                    prefill: Some(p),
                    source: None,
                    export: None,
                    first_token_us: None,
                    floor: Floor {
                        reusable_tokens: 0,
                        ttft_ms: 0.0,
                    },
                },
            );
            cluster.request_export(id, d, p, leg);
        }
        let holding = |cluster: &Cluster<'_>| {
            (1..=fetches)
                .filter(|id| cluster.in_flight[id].export.is_some())
                .count()
        };
        assert_eq!(cluster.exporting[d], MAX_EXPORTS);
        assert_eq!(holding(&cluster), MAX_EXPORTS);
        assert_eq!(cluster.counters.exports.busy, 1);
        let legs_at_p = |cluster: &Cluster<'_>| {
            let e = &cluster.engines[p];
            e.stats().prefills_done as usize + e.running() + e.waiting()
        };
        assert_eq!(legs_at_p(&cluster), 1, "the one past the bound, whole");

        // The first export runs in the source's step; the others queue.
        for id in 1..=fetches {
            cluster.export_deadline(id);
        }
        assert_eq!(cluster.counters.exports.abandoned, MAX_EXPORTS as u64);
        assert_eq!(holding(&cluster), 0);
        assert_eq!(legs_at_p(&cluster), fetches as usize);
        assert_eq!(cluster.engines[d].waiting(), 0, "the queued ones dropped");
        assert_eq!(cluster.engines[d].stats().aborted, MAX_EXPORTS as u64 - 1);
        assert_eq!(
            cluster.exporting[d], 1,
            "the running one ends with its step"
        );
        assert!(cluster.in_flight.values().all(|r| r.source.is_none()));
    }

    /// The index the engines' own block sets make.
    fn engines_index(engines: &[Engine]) -> OwnershipIndex {
        let mut index = OwnershipIndex::new();
        for engine in engines {
            for event in block_set(engine) {
                if let KvEvent::Stored {
                    parent,
                    blocks,
                    tier,
                } = event
                {
                    index.store(engine.worker(), parent, &blocks, tier);
                }
            }
        }
        index
    }

    /// The agents' cores number the batches: the indexer ends holding
    /// exactly the engines' blocks, also when outboxes too small for a
    /// step's events overflow and resynchronise from the block sets.
    #[test]
    fn the_index_ends_as_the_engines_are_through_resyncs() {
        for (limits, resyncs) in [
            (OutboxLimits::default(), false),
            (
                OutboxLimits {
                    max_queued_events: 1,
                    max_batch_events: 1,
                },
                true,
            ),
        ] {
            let mut workload = Agentic::new(AgenticConfig {
                sessions_per_s: 0.5,
                duration_s: 10.0,
                seed: 1,
                ..AgenticConfig::default()
            });
            let mut cluster = Cluster::new(config(limits), &mut workload).unwrap();
            cluster.run();
            assert!(
                cluster.records.len() > 10,
                "{} requests",
                cluster.records.len()
            );
            let held: usize = cluster.engines.iter().map(Engine::cached_block_count).sum();
            assert!(held > 0);
            assert_eq!(
                cluster.indexer.index().digest(),
                engines_index(&cluster.engines).digest(),
                "{limits:?}"
            );
            let new_epochs = cluster.kv.iter().any(|kv| kv.epoch() > FIRST_EPOCH);
            assert_eq!(new_epochs, resyncs, "{limits:?}");
        }
    }
}
