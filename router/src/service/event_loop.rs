//! The router's event loop: the one task that owns the [`RouterCore`].
//!
//! Everything that changes the core arrives as an [`Event`] and is handled
//! in one `select!`: HTTP handlers' commands (routing, their requests'
//! progress, ledger queries) through a channel with oneshot replies; index
//! deltas; worker registrations; load reports; the other replicas'
//! decisions and progress notices; results of background work (a snapshot
//! loaded, the delta stream's head polled); the tick; shutdown. Prompts are
//! hashed by the handlers, so a route command costs the loop one decision.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_nats::jetstream;
use bus::{Bus, BusError, WorkerChange};
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use kv_indexer::{Announced, DeltaError, LiveDeltas, Logged};
use protocol::{
    subjects, BlockHash, DecisionId, DecisionRecord, IndexDelta, LoadReport, LogEntry, Message,
    Path, Presence, Progress, RequestProgress, Role, RouteDecision, RouterHeartbeat, SessionId,
    WorkerId,
};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tokio::sync::{mpsc, oneshot, watch};

use super::decision_log::DecisionLog;
use super::health::{self, ReadinessConfig};
use super::inputs::{Inputs, WorkerEvent};
use super::metrics::Metrics;
use super::replica::{self, LoadError, LoadedIndex};
use crate::core::{
    admission, decision_seed, Admission, BreakerState, Breakers, Charges, EffectiveLoad,
    Explanation, Heard, Offer, PeerGone, Peers, RouteError, RouteOptions, RouteRequest, RouterCore,
};

/// How often a replica missing announced deltas asks the indexer to
/// announce them again.
const REANNOUNCE_ASK_EVERY: Duration = Duration::from_millis(250);

/// A route command's job and where its answer goes.
type RouteReply = oneshot::Sender<Result<Assignment, RouteError>>;

/// The router clock: milliseconds since the Unix epoch (decisions carry it
/// to peers, whose ledgers expire entries against their own clock).
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// A request to route, already hashed.
#[derive(Debug)]
pub struct RouteJob {
    pub request_id: String,
    pub isl_tokens: u32,
    pub hashes: Arc<[BlockHash]>,
    pub expected_output_tokens: u32,
    /// Workers not to choose (a retry after one failed).
    pub avoid: Vec<WorkerId>,
    /// `POST /v1/route`: decide, then release the reservation at once.
    pub dry_run: bool,
    /// Return what the decision looked at (`/v1/route?explain=true`).
    pub explain: bool,
    /// The conversation's session (`x-session-id`, `agent_context`).
    pub session: Option<SessionId>,
}

/// A decision and where to send its legs.
#[derive(Debug, Clone)]
pub struct Assignment {
    pub decision: RouteDecision,
    /// What it looked at, when asked for.
    pub explanation: Option<Explanation>,
    /// The decode worker's generate subject.
    pub decode_subject: String,
    /// The prefill worker's generate subject (remote path).
    pub prefill_subject: Option<String>,
}

/// This replica's ledger and index position, for `/debug/ledger`.
#[derive(Debug, Clone)]
pub struct LedgerView {
    pub in_flight: usize,
    pub applied_delta: u64,
    /// Equal on replicas and the indexer at the same delta.
    pub index_digest: u64,
    pub index_blocks: u64,
    /// Every registered worker, in id order.
    pub workers: Vec<WorkerLedger>,
    /// Whether the ledger holds the decision asked about (in flight or
    /// recently finished).
    pub knows_decision: Option<bool>,
    /// The peer replicas alive, in id order, with how many of their
    /// decisions the ledger holds.
    pub peers: Vec<(Arc<str>, usize)>,
}

/// One worker in a [`LedgerView`].
#[derive(Debug, Clone)]
pub struct WorkerLedger {
    pub worker: WorkerId,
    pub role: Role,
    /// Its circuit breaker.
    pub breaker: BreakerState,
    pub charges: Charges,
    pub load: Option<EffectiveLoad>,
}

/// What HTTP handlers ask the loop.
#[derive(Debug)]
pub enum Command {
    Route {
        job: RouteJob,
        reply: oneshot::Sender<Result<Assignment, RouteError>>,
    },
    /// A request this replica dispatched progressed (also published for
    /// the peers by the dispatcher).
    Progress {
        decision: DecisionId,
        progress: Progress,
    },
    Ledger {
        decision: Option<DecisionId>,
        reply: oneshot::Sender<LedgerView>,
    },
    /// A dispatch to a worker ended: `ok`, or failed by the worker's fault
    /// (the circuit breaker's input).
    Outcome { worker: WorkerId, ok: bool },
    /// What a request this replica dispatched was observed to take, for
    /// the SLA policy's calibration: its first token and last token (ms on
    /// the decisions' clock) and its output tokens.
    Observed {
        decision: DecisionId,
        path: Path,
        first_token_ms: u64,
        finished_ms: u64,
        output_tokens: u32,
    },
}

/// Why a route command got no decision.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error(transparent)]
    Route(#[from] RouteError),
    #[error("the router is shutting down")]
    Stopped,
    #[error("the router's event loop did not decide within {0:?} (overloaded)")]
    Timeout(Duration),
}

impl AskError {
    /// A metrics label.
    pub fn label(&self) -> &'static str {
        match self {
            AskError::Route(e) => e.label(),
            AskError::Stopped => "stopping",
            AskError::Timeout(_) => "overloaded",
        }
    }
}

/// Asks the loop for a decision, waiting at most `timeout` (queueing
/// included).
pub async fn ask_route(
    commands: &mpsc::Sender<Command>,
    job: RouteJob,
    timeout: Duration,
) -> Result<Assignment, AskError> {
    let (reply, answer) = oneshot::channel();
    let ask = async {
        commands
            .send(Command::Route { job, reply })
            .await
            .map_err(|_| AskError::Stopped)?;
        answer
            .await
            .map_err(|_| AskError::Stopped)?
            .map_err(AskError::from)
    };
    tokio::time::timeout(timeout, ask)
        .await
        .map_err(|_| AskError::Timeout(timeout))?
}

/// `/readyz`'s answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Readiness {
    pub ready: bool,
    pub status: String,
}

impl Readiness {
    pub fn not_ready(status: impl Into<String>) -> Self {
        Self {
            ready: false,
            status: status.into(),
        }
    }
}

/// Everything the loop reacts to.
enum Event {
    Command(Command),
    /// A delta read from the delta stream.
    Delta(Result<IndexDelta, BusError>),
    DeltasEnded,
    /// A delta the indexer announced as it made it.
    LiveDelta(Result<IndexDelta, BusError>),
    /// The NATS connection was made again: announcements were lost.
    Reconnected,
    IndexLoaded(Result<LoadedIndex, LoadError>),
    DeltaHead(Result<u64, BusError>),
    /// The delta feed opened again after a stall (from the delta after
    /// `from - 1`).
    DeltasReopened {
        from: u64,
        deltas: Result<BoxStream<'static, Result<IndexDelta, BusError>>, BusError>,
    },
    /// Whether an indexer is pulling the KV events.
    IndexerPolled(Result<bool, BusError>),
    Workers(WorkerEvent),
    Load(async_nats::Message),
    Progress(async_nats::Message),
    /// A replica's heartbeat (this one's too).
    Heartbeat(async_nats::Message),
    /// Time to say this replica is alive.
    Beat,
    PeerDecision(Result<jetstream::Message, String>),
    InputEnded(Input),
    Tick,
    Shutdown,
}

/// The inputs of [`Inputs`].
#[derive(Debug, Clone, Copy)]
enum Input {
    Workers,
    Loads,
    Progress,
    Heartbeats,
    LiveDeltas,
    Decisions,
}

/// Where the index stands.
#[derive(Debug)]
enum IndexState {
    /// A snapshot is being loaded (`why`: start, or the gap that caused it).
    Loading {
        why: String,
    },
    /// Applying deltas up to `target`, the stream's end when loading.
    CatchingUp {
        target: u64,
    },
    Ready,
}

/// What the loop needs besides its inputs.
#[derive(Debug)]
pub struct LoopParts {
    pub core: RouterCore,
    /// The deployment's seed of decisions' draws ([`decision_seed`]).
    pub seed: u64,
    /// Seeds this replica's decision ids.
    pub id_seed: u64,
    pub replica: Arc<str>,
    pub bus: Bus,
    pub metrics: Metrics,
    pub readiness: watch::Sender<Readiness>,
    /// The registered workers' smallest context length (0: none said).
    pub context: watch::Sender<u32>,
    pub tick: Duration,
    /// Blocks the index replica is sized for.
    pub reserve_blocks: usize,
    /// Where dispatched decisions are written.
    pub decision_log: DecisionLog,
    /// The bounds of readiness.
    pub readiness_bounds: ReadinessConfig,
    /// The peer replicas (heartbeats, their held decisions).
    pub peers: Peers,
    /// Requests waiting while every decode worker is busy.
    pub admission: Admission<(RouteJob, RouteReply)>,
    /// The workers' circuit breakers.
    pub breakers: Breakers,
}

/// The event loop's state.
pub struct RouterLoop {
    core: RouterCore,
    /// The deployment's seed of decisions' draws ([`decision_seed`]).
    seed: u64,
    ids: ChaCha8Rng,
    replica: Arc<str>,
    own_decisions: String,
    own_progress: String,
    own_heartbeat: String,
    peers: Peers,
    admission: Admission<(RouteJob, RouteReply)>,
    breakers: Breakers,
    bus: Bus,
    metrics: Metrics,
    readiness: watch::Sender<Readiness>,
    context: watch::Sender<u32>,
    tick: Duration,
    reserve_blocks: usize,
    decision_log: DecisionLog,
    index: IndexState,
    deltas: BoxStream<'static, Result<IndexDelta, BusError>>,
    /// Announced deltas applied ahead of the stream, and those waiting for
    /// the ones before them.
    live: LiveDeltas,
    /// The last delta the stream's feed gave (or the loaded position), and
    /// when: the feed stands still when the stream's head is ahead of it.
    logged: u64,
    last_logged_at: Instant,
    /// When the indexer was last asked to announce its deltas again.
    reannounce_asked: Option<Instant>,
    /// Changes when the NATS connection is made again.
    reconnections: watch::Receiver<u64>,
    /// The stream's last delta, as last polled or read.
    head: u64,
    head_poll: bool,
    /// The stalled delta feed is being opened again.
    reopening: bool,
    last_load: Option<Instant>,
    workers_listed: bool,
    /// The index was loaded and the workers listed once: until then a
    /// first decision waits in the admission queue (a restarted replica
    /// would otherwise answer "no decode-capable worker").
    started: bool,
    readiness_bounds: ReadinessConfig,
    /// When the last delta was applied from either feed (or the index
    /// loaded).
    last_delta_at: Instant,
    /// Whether an indexer pulls the KV events, as last polled.
    indexer: health::Indexer,
    indexer_poll: bool,
    nats_connected: bool,
    side_tx: mpsc::UnboundedSender<Event>,
    side_rx: mpsc::UnboundedReceiver<Event>,
}

impl std::fmt::Debug for RouterLoop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterLoop")
            .field("replica", &self.replica)
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

impl RouterLoop {
    pub fn new(parts: LoopParts) -> Self {
        let (side_tx, side_rx) = mpsc::unbounded_channel();
        let LoopParts {
            core,
            seed,
            id_seed,
            replica,
            bus,
            metrics,
            readiness,
            context,
            tick,
            reserve_blocks,
            decision_log,
            readiness_bounds,
            peers,
            admission,
            breakers,
        } = parts;
        let reconnections = bus.reconnections();
        Self {
            core,
            seed,
            ids: ChaCha8Rng::seed_from_u64(id_seed),
            own_decisions: subjects::decisions(&replica),
            own_progress: subjects::progress(&replica),
            own_heartbeat: subjects::router_heartbeat(&replica),
            peers,
            admission,
            breakers,
            replica,
            bus,
            metrics,
            readiness,
            context,
            tick,
            reserve_blocks,
            decision_log,
            index: IndexState::Loading {
                why: "loading the index snapshot".into(),
            },
            deltas: stream::pending().boxed(),
            live: LiveDeltas::new(),
            logged: 0,
            last_logged_at: Instant::now(),
            reannounce_asked: None,
            reconnections,
            head: 0,
            head_poll: false,
            reopening: false,
            last_load: None,
            workers_listed: false,
            started: false,
            readiness_bounds,
            last_delta_at: Instant::now(),
            indexer: health::Indexer::Unknown,
            indexer_poll: false,
            nats_connected: true,
            side_tx,
            side_rx,
        }
    }

    /// Runs until `stop` turns true (or every command sender is gone).
    pub async fn run(
        mut self,
        mut commands: mpsc::Receiver<Command>,
        mut inputs: Inputs,
        mut stop: watch::Receiver<bool>,
    ) {
        self.load_index("start");
        self.publish_readiness();
        let mut tick = tokio::time::interval(self.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut beat =
            tokio::time::interval(Duration::from_millis(self.peers.config().heartbeat_ms));
        beat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            let event = tokio::select! {
                _ = stop.wait_for(|s| *s) => Event::Shutdown,
                command = commands.recv() => match command {
                    Some(c) => Event::Command(c),
                    None => Event::Shutdown,
                },
                delta = self.deltas.next() => match delta {
                    Some(d) => Event::Delta(d),
                    None => Event::DeltasEnded,
                },
                live = inputs.live_deltas.next() => match live {
                    Some(d) => Event::LiveDelta(d),
                    None => Event::InputEnded(Input::LiveDeltas),
                },
                Some(side) = self.side_rx.recv() => side,
                Ok(()) = self.reconnections.changed() => Event::Reconnected,
                workers = inputs.workers.next() => match workers {
                    Some(w) => Event::Workers(w),
                    None => Event::InputEnded(Input::Workers),
                },
                load = inputs.loads.next() => match load {
                    Some(m) => Event::Load(m),
                    None => Event::InputEnded(Input::Loads),
                },
                progress = inputs.progress.next() => match progress {
                    Some(m) => Event::Progress(m),
                    None => Event::InputEnded(Input::Progress),
                },
                heartbeat = inputs.heartbeats.next() => match heartbeat {
                    Some(m) => Event::Heartbeat(m),
                    None => Event::InputEnded(Input::Heartbeats),
                },
                _ = beat.tick() => Event::Beat,
                decision = inputs.decisions.next() => match decision {
                    Some(m) => Event::PeerDecision(m),
                    None => Event::InputEnded(Input::Decisions),
                },
                _ = tick.tick() => Event::Tick,
            };
            match event {
                Event::Shutdown => break,
                Event::Command(c) => self.on_command(c),
                Event::Delta(d) => self.on_delta(d),
                Event::LiveDelta(d) => self.on_live_delta(d),
                Event::Reconnected => {
                    // The last announcements may have no later one to show
                    // their gap.
                    tracing::info!(
                        "NATS connection made again; asking for the deltas announced meanwhile"
                    );
                    self.ask_reannounce();
                }
                Event::DeltasEnded => {
                    tracing::warn!("the delta stream ended; reloading the index");
                    self.deltas = stream::pending().boxed();
                    self.load_index("stream_ended");
                }
                Event::IndexLoaded(loaded) => self.on_index_loaded(loaded),
                Event::DeltaHead(head) => self.on_head(head),
                Event::DeltasReopened { from, deltas } => self.on_deltas_reopened(from, deltas),
                Event::IndexerPolled(pulling) => self.on_indexer_polled(pulling),
                Event::Workers(w) => self.on_workers(w),
                Event::Load(m) => self.on_load(&m),
                Event::Progress(m) => self.on_progress(&m),
                Event::Heartbeat(m) => self.on_heartbeat(&m),
                Event::Beat => self.beat(),
                Event::PeerDecision(m) => self.on_peer_decision(m),
                Event::InputEnded(input) => {
                    // Subscriptions end only with the NATS connection, the
                    // registry stream never: nothing more will come.
                    tracing::error!(
                        ?input,
                        "an input of the router ended; it is no longer followed"
                    );
                    match input {
                        Input::Workers => inputs.workers = stream::pending().boxed(),
                        Input::Loads => inputs.loads = stream::pending().boxed(),
                        Input::Progress => inputs.progress = stream::pending().boxed(),
                        Input::Heartbeats => inputs.heartbeats = stream::pending().boxed(),
                        Input::LiveDeltas => inputs.live_deltas = stream::pending().boxed(),
                        Input::Decisions => inputs.decisions = stream::pending().boxed(),
                    }
                }
                Event::Tick => self.on_tick(),
            }
        }
        // Drained (the HTTP server stopped first): whatever the peers still
        // hold of this replica's is void.
        self.leave().await;
        tracing::info!(replica = %self.replica, "event loop stopped");
    }

    fn on_command(&mut self, command: Command) {
        match command {
            // First attempts pass the door; dry runs and retries (already
            // admitted) are decided at once.
            Command::Route { job, reply } if !job.dry_run && job.avoid.is_empty() => {
                let held = self.held();
                let request_id = job.request_id.clone();
                match self.admission.offer((job, reply), held, now_ms()) {
                    Offer::Admit((job, reply)) => {
                        self.metrics.admission("admitted", self.admission.len());
                        self.decide(job, reply);
                    }
                    Offer::Queued(position) => {
                        self.metrics.admission("queued", self.admission.len());
                        tracing::debug!(%request_id, position, why = self.held_why(), "queued");
                    }
                    Offer::Rejected((_, reply)) => {
                        let queued = self.admission.len();
                        self.metrics.admission("rejected", queued);
                        tracing::warn!(%request_id, queued, why = self.held_why(), "the admission queue is full: turned away");
                        let _ = reply.send(Err(self.turned_away(queued, 0)));
                    }
                }
            }
            Command::Route { job, reply } => self.decide(job, reply),
            Command::Progress { decision, progress } => match progress {
                Progress::PrefillDone => {
                    self.core.on_prefill_done(decision);
                    // Our own decision: its prefill time feeds the SLA
                    // policy's calibration (peers' notices do not: the
                    // decision is theirs).
                    self.core.observe_prefill_done(decision, now_ms());
                }
                Progress::Finished => {
                    self.core.on_finished(decision);
                    self.admit();
                }
            },
            Command::Observed {
                decision,
                path,
                first_token_ms,
                finished_ms,
                output_tokens,
            } => {
                // A remote prefill's end was observed with its notice.
                if path == Path::Bypass {
                    self.core.observe_prefill_done(decision, first_token_ms);
                }
                let decode_ms = finished_ms.saturating_sub(first_token_ms) as f64;
                self.core
                    .observe_decoded(decision, decode_ms, output_tokens);
            }
            Command::Ledger { decision, reply } => {
                let _ = reply.send(self.ledger(decision));
            }
            Command::Outcome { worker, ok } => {
                let transition = if ok {
                    self.breakers.on_success(&worker)
                } else {
                    self.breakers.on_failure(&worker, now_ms())
                };
                if let Some(t) = transition {
                    self.breaker_changed(&worker, t);
                }
            }
        }
    }

    /// Decides a job and answers its requester.
    fn decide(&mut self, job: RouteJob, reply: RouteReply) {
        let dry_run = job.dry_run;
        let (result, record) = match self.route(job) {
            Ok((assignment, record)) => (Ok(assignment), record),
            Err(e) => (Err(e), None),
        };
        match reply.send(result) {
            // Dispatched: to the decision log, where the peers
            // charge their ledgers from it.
            Ok(()) => {
                if let Some(record) = record {
                    self.decision_log.write(record);
                }
            }
            // The requester is gone (timed out, client closed):
            // nothing will run, and no peer is told.
            Err(Ok(assignment)) if !dry_run => {
                self.core.on_finished(assignment.decision.id);
            }
            Err(_) => {}
        }
    }

    /// Whether a first decision waits in the admission queue: the replica
    /// has not started, or every decode worker is busy.
    fn held(&self) -> bool {
        !self.started || self.saturated()
    }

    /// Why a first decision waits (logs).
    fn held_why(&self) -> &'static str {
        if self.started {
            "every decode worker is busy"
        } else {
            "the replica is starting"
        }
    }

    /// What a request turned away from the admission queue is told.
    fn turned_away(&self, queued: usize, waited_ms: u64) -> RouteError {
        let retry_after_s = self.admission.config().retry_after_s;
        if self.started {
            RouteError::Saturated {
                queued,
                waited_ms,
                retry_after_s,
            }
        } else {
            RouteError::Starting {
                waited_ms,
                retry_after_s,
            }
        }
    }

    /// Whether every decode worker is busy (see [`admission::saturated`]),
    /// those out of rotation left out.
    fn saturated(&self) -> bool {
        let out = self.out_of_rotation(&[]);
        admission::saturated(self.core.workers(), &self.core.config().decode, &out)
    }

    /// The workers the breakers keep out of a decision besides `avoid`:
    /// none when that would leave no decode-capable worker (a failing
    /// worker beats none).
    fn out_of_rotation(&self, avoid: &[WorkerId]) -> Vec<WorkerId> {
        let excluded = self.breakers.excluded(now_ms());
        if excluded.is_empty() {
            return excluded;
        }
        let left = self
            .core
            .workers()
            .records()
            .filter(|r| r.role.decodes())
            .any(|r| !avoid.contains(&r.id) && !excluded.contains(&r.id));
        if left {
            excluded
        } else {
            Vec::new()
        }
    }

    fn breaker_changed(&mut self, worker: &WorkerId, transition: crate::core::Transition) {
        self.metrics.breaker(transition.label());
        match transition {
            crate::core::Transition::Opened { failures } => tracing::warn!(
                %worker,
                failures,
                open_for_ms = self.breakers.config().open_for_ms,
                "circuit breaker open: the worker failed {failures} dispatches in a row; out of rotation"
            ),
            crate::core::Transition::HalfOpened => tracing::info!(
                %worker,
                "circuit breaker half-open: one trial request may go to the worker"
            ),
            crate::core::Transition::Closed => {
                tracing::info!(%worker, "circuit breaker closed: the worker is back in rotation")
            }
        }
        self.metrics
            .breakers_open(self.breakers.excluded(now_ms()).len());
    }

    /// Decides the queued requests while a decode worker is free (after
    /// anything that may have freed one: a finish, a load report, a
    /// worker, a tick).
    fn admit(&mut self) {
        if self.admission.is_empty() {
            return;
        }
        while let Some((job, reply)) = self.admission.next(self.held()) {
            if !reply.is_closed() {
                self.decide(job, reply);
            }
        }
        self.metrics.admission_queued(self.admission.len());
    }

    /// Turns away the requests that waited in the queue their longest, and
    /// forgets those whose requester left.
    fn expire_queue(&mut self) {
        for ((job, reply), waited_ms) in self.admission.expire(now_ms()) {
            let queued = self.admission.len();
            self.metrics.admission("timed_out", queued);
            tracing::warn!(request_id = %job.request_id, waited_ms, queued, why = self.held_why(), "turned away after waiting in the admission queue its longest");
            let _ = reply.send(Err(self.turned_away(queued, waited_ms)));
        }
        self.admission.retain(|(_, reply)| !reply.is_closed());
        self.metrics.admission_queued(self.admission.len());
    }

    /// A decision, and its record when it is to be dispatched.
    fn route(&mut self, job: RouteJob) -> Result<(Assignment, Option<DecisionRecord>), RouteError> {
        let now = now_ms();
        let request = RouteRequest {
            request_id: &job.request_id,
            isl_tokens: job.isl_tokens,
            block_hashes: &job.hashes,
            expected_output_tokens: job.expected_output_tokens,
            session: job.session.as_ref(),
        };
        // A dry run leaves the session's binding as it found it.
        let bound_before = job
            .session
            .as_ref()
            .and_then(|s| self.core.sessions().bound(s, now).cloned());
        let started = Instant::now();
        // Draws depend on the request only: replicas at the same state
        // decide alike, and a logged decision replays exactly.
        let seed = decision_seed(self.seed, &request);
        // The workers out of rotation are avoided like a retry's failed
        // ones, and recorded with them: a replay leaves them out too.
        let mut avoid = job.avoid.clone();
        for worker in self.out_of_rotation(&job.avoid) {
            if !avoid.contains(&worker) {
                avoid.push(worker);
            }
        }
        // The explanation is the record's (candidates' loads and depths).
        let options = RouteOptions {
            avoid: &avoid,
            explain: true,
        };
        let mut attempts = 0;
        let routed = loop {
            let id = DecisionId(self.ids.random());
            let mut rng = ChaCha8Rng::seed_from_u64(seed);
            match self.core.route(&request, options, id, now, &mut rng) {
                // A random 64-bit id met a live one: draw another.
                Err(RouteError::DuplicateDecision(_)) if attempts < 3 => attempts += 1,
                other => break other?,
            }
        };
        let decision = routed.decision;
        let explanation = routed.explanation.unwrap_or_default();
        if !job.dry_run {
            self.breakers.on_routed(&decision.decode);
            if let Some(prefill) = &decision.prefill {
                self.breakers.on_routed(prefill);
            }
        }
        self.metrics.decision(&decision, started.elapsed());
        let record = if job.dry_run {
            // Nothing will run and no peer hears of it: release the
            // reservation at once, leaving nothing behind.
            self.core.forget(decision.id);
            if let Some(session) = &job.session {
                self.core
                    .restore_session(session, bound_before.as_ref(), now);
            }
            None
        } else {
            // Dispatched decisions go to the decision log with their inputs.
            let record = self
                .core
                .record(&decision, &explanation, &request, seed, &avoid);
            Some(record)
        };
        let subject = |id: &WorkerId| {
            self.core
                .workers()
                .record(id)
                .map_or_else(|| subjects::generate(id), |r| r.subjects.generate.clone())
        };
        let assignment = Assignment {
            decode_subject: subject(&decision.decode),
            prefill_subject: decision.prefill.as_ref().map(subject),
            decision,
            explanation: job.explain.then_some(explanation),
        };
        Ok((assignment, record))
    }

    fn ledger(&self, decision: Option<DecisionId>) -> LedgerView {
        let workers = self.core.workers();
        let mut list: Vec<WorkerLedger> = workers
            .records()
            .map(|r| WorkerLedger {
                worker: r.id.clone(),
                role: r.role,
                breaker: self.breakers.state(&r.id),
                charges: workers.ledger_charges(&r.id),
                load: workers.effective_load(&r.id),
            })
            .collect();
        list.sort_by(|a, b| a.worker.cmp(&b.worker));
        let index = self.core.replica().index();
        LedgerView {
            in_flight: workers.in_flight(),
            applied_delta: self.core.replica().applied(),
            index_digest: index.digest(),
            index_blocks: index.stats().blocks,
            workers: list,
            knows_decision: decision.map(|d| workers.knows_decision(d)),
            peers: self.peers.list(),
        }
    }

    // --- The index -------------------------------------------------------

    /// Loads the latest snapshot in the background (at most one load at a
    /// time; repeated loads are spaced by a second).
    fn load_index(&mut self, reason: &'static str) {
        self.metrics.index_reload(reason);
        self.deltas = stream::pending().boxed();
        self.live.reset();
        self.index = IndexState::Loading {
            why: match reason {
                "start" => "loading the index snapshot".into(),
                other => format!("reloading the index snapshot ({other})"),
            },
        };
        self.publish_readiness();
        let delay = match self.last_load {
            Some(at) if at.elapsed() < Duration::from_secs(1) => {
                Duration::from_secs(1) - at.elapsed()
            }
            _ => Duration::ZERO,
        };
        self.last_load = Some(Instant::now() + delay);
        let (bus, reserve_blocks) = (self.bus.clone(), self.reserve_blocks);
        let tx = self.side_tx.clone();
        tokio::spawn(async move {
            tokio::time::sleep(delay).await;
            let loaded = replica::load(&bus, reserve_blocks).await;
            let _ = tx.send(Event::IndexLoaded(loaded));
        });
    }

    fn on_index_loaded(&mut self, loaded: Result<LoadedIndex, LoadError>) {
        let loaded = match loaded {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "loading the index failed; retrying");
                self.load_index("load_failed");
                return;
            }
        };
        let applied = loaded.replica.applied();
        self.last_delta_at = Instant::now();
        self.logged = applied;
        self.last_logged_at = Instant::now();
        self.live.reset();
        *self.core.replica_mut() = loaded.replica;
        self.deltas = loaded.deltas;
        self.head = self.head.max(loaded.head);
        tracing::info!(
            snapshot = ?loaded.snapshot_seq,
            applied,
            head = loaded.head,
            "index loaded; following deltas from {}",
            applied + 1
        );
        self.index = if loaded.head > applied {
            IndexState::CatchingUp {
                target: loaded.head,
            }
        } else {
            IndexState::Ready
        };
        self.metrics.index_position(applied, self.head);
        self.publish_readiness();
    }

    /// A delta read from the stream: applied, or the check of one applied
    /// from its announcement.
    fn on_delta(&mut self, delta: Result<IndexDelta, BusError>) {
        let delta = match delta {
            Ok(d) => d,
            Err(e) => {
                // A delta we cannot read is a delta we miss: the next one
                // shows the gap and reloads.
                tracing::error!(error = %e, "unreadable index delta");
                self.metrics.delta("error");
                return;
            }
        };
        self.logged = self.logged.max(delta.seq);
        self.last_logged_at = Instant::now();
        self.head = self.head.max(delta.seq);
        match self.live.logged(self.core.replica_mut(), &delta) {
            Ok(Logged::Applied { through }) => {
                self.metrics.delta("applied");
                self.advanced(through);
            }
            Ok(Logged::Confirmed) => self.metrics.delta("confirmed"),
            // (`logged` gives a duplicate as `Logged::Duplicate`.)
            Ok(Logged::Duplicate) | Err(DeltaError::AlreadyApplied { .. }) => {
                tracing::debug!(seq = delta.seq, "delta already applied");
                self.metrics.delta("duplicate");
            }
            Ok(Logged::Superseded { seq }) => self.superseded(seq),
            Err(DeltaError::Gap { at, got }) => {
                tracing::warn!(
                    at,
                    got,
                    "delta stream gap: deltas {} to {} are gone; reloading the latest snapshot",
                    at + 1,
                    got - 1
                );
                self.metrics.delta("gap");
                self.load_index("gap");
            }
        }
    }

    /// A delta the indexer announced: applied ahead of the stream when it
    /// follows the replica's position (not while a snapshot loads).
    fn on_live_delta(&mut self, delta: Result<IndexDelta, BusError>) {
        let delta = match delta {
            Ok(d) => d,
            Err(e) => {
                // The stream still gives it.
                tracing::warn!(error = %e, "unreadable delta announcement");
                self.metrics.delta("live_error");
                return;
            }
        };
        if matches!(self.index, IndexState::Loading { .. }) {
            return;
        }
        match self.live.heard(self.core.replica_mut(), delta) {
            Announced::Applied { through } => {
                self.metrics.delta("live_applied");
                self.advanced(through);
            }
            Announced::Early => {
                self.metrics.delta("live_early");
                self.ask_reannounce();
            }
            Announced::Duplicate => self.metrics.delta("live_duplicate"),
            Announced::Skipped => self.metrics.delta("live_skipped"),
            Announced::Superseded { seq } => self.superseded(seq),
        }
    }

    /// Announcements were missed (held early past a gap): the indexer is
    /// asked to announce its unconfirmed deltas again, at most every
    /// [`REANNOUNCE_ASK_EVERY`] (the stream gives them too, once it can).
    fn ask_reannounce(&mut self) {
        let now = Instant::now();
        if self
            .reannounce_asked
            .is_some_and(|at| now - at < REANNOUNCE_ASK_EVERY)
        {
            return;
        }
        self.reannounce_asked = Some(now);
        let client = self.bus.client().clone();
        tokio::spawn(async move {
            if let Err(e) = client
                .publish(subjects::INDEX_REANNOUNCE, Vec::new().into())
                .await
            {
                tracing::debug!(error = %e, "asking the indexer to announce its deltas again failed");
            }
        });
    }

    /// The replica moved to delta `through`.
    fn advanced(&mut self, through: u64) {
        self.last_delta_at = Instant::now();
        if let IndexState::CatchingUp { target } = self.index {
            if through >= target {
                self.index = IndexState::Ready;
                tracing::info!(applied = through, "caught up with the index deltas");
            }
            self.publish_readiness();
        }
    }

    /// The replica applied an announced delta `seq` that the record does
    /// not hold (its indexer died before the stream stored it, and another
    /// made a different one): the index is loaded again.
    fn superseded(&mut self, seq: u64) {
        tracing::warn!(
            seq,
            "announced delta {seq} differs from the delta stream's (a new indexer made another); reloading the latest snapshot"
        );
        self.metrics.delta("superseded");
        self.load_index("superseded");
    }

    /// Opens the delta feed again when the stream's head is ahead of the
    /// index and no delta came for `max_delta_stall`: its consumer is gone
    /// (it lived on a NATS node that died) though this replica's own
    /// connection is not. Duplicates after the reopening are dropped.
    fn reopen_stalled_deltas(&mut self) {
        let logged = self.logged;
        let quiet = self.last_logged_at.elapsed();
        if self.reopening
            || matches!(self.index, IndexState::Loading { .. })
            || self.head <= logged
            || quiet < self.readiness_bounds.max_delta_stall
        {
            return;
        }
        tracing::warn!(
            logged,
            applied = self.core.replica().applied(),
            head = self.head,
            quiet_ms = quiet.as_millis() as u64,
            "the delta feed is stalled behind the stream's head (its consumer may have died with a NATS node); opening it again from delta {}",
            logged + 1
        );
        self.metrics.delta("stalled");
        self.reopening = true;
        let (bus, tx, from) = (self.bus.clone(), self.side_tx.clone(), logged + 1);
        tokio::spawn(async move {
            let deltas = bus.deltas_from(from).await;
            let _ = tx.send(Event::DeltasReopened { from, deltas });
        });
    }

    fn on_deltas_reopened(
        &mut self,
        from: u64,
        deltas: Result<BoxStream<'static, Result<IndexDelta, BusError>>, BusError>,
    ) {
        self.reopening = false;
        // Not while a reload replaced the feed meanwhile.
        if matches!(self.index, IndexState::Loading { .. }) {
            return;
        }
        match deltas {
            Ok(deltas) => {
                tracing::info!(from, "delta feed opened again");
                self.deltas = deltas;
                self.last_logged_at = Instant::now();
            }
            Err(e) => tracing::warn!(error = %e, "opening the delta feed again failed; retrying"),
        }
    }

    fn on_head(&mut self, head: Result<u64, BusError>) {
        self.head_poll = false;
        match head {
            Ok(head) => {
                self.head = self.head.max(head);
                self.metrics
                    .index_position(self.core.replica().applied(), self.head);
                self.reopen_stalled_deltas();
            }
            Err(e) => tracing::warn!(error = %e, "polling the delta stream's head failed"),
        }
    }

    fn on_indexer_polled(&mut self, pulling: Result<bool, BusError>) {
        self.indexer_poll = false;
        self.indexer = match pulling {
            Ok(true) => health::Indexer::Pulling,
            Ok(false) => health::Indexer::Gone,
            Err(e) => {
                tracing::debug!(error = %e, "polling the indexer's KV consumer failed");
                health::Indexer::Unknown
            }
        };
        self.publish_readiness();
    }

    fn publish_readiness(&mut self) {
        if !self.started && matches!(self.index, IndexState::Ready) && self.workers_listed {
            self.started = true;
            tracing::info!(
                queued = self.admission.len(),
                "started: index loaded and workers listed; routing"
            );
            self.admit();
        }
        let applied = self.core.replica().applied();
        let readiness = match &self.index {
            IndexState::Loading { why } => Readiness::not_ready(why.clone()),
            IndexState::CatchingUp { target } => {
                Readiness::not_ready(format!("catching up: applied {applied} of {target} deltas"))
            }
            IndexState::Ready if !self.workers_listed => {
                Readiness::not_ready("listing the registered workers")
            }
            IndexState::Ready => health::readiness(
                &health::Observed {
                    nats_connected: self.nats_connected,
                    applied,
                    head: self.head,
                    quiet: self.last_delta_at.elapsed(),
                    indexer: self.indexer,
                    decode_workers: self
                        .core
                        .workers()
                        .records()
                        .filter(|r| r.role.decodes())
                        .count(),
                    store_full: self.decision_log.store_full(),
                },
                &self.readiness_bounds,
            ),
        };
        self.readiness.send_if_modified(|r| {
            let changed = *r != readiness;
            *r = readiness;
            changed
        });
    }

    // --- Workers ---------------------------------------------------------

    fn on_workers(&mut self, event: WorkerEvent) {
        match event {
            WorkerEvent::Listed(changes) => {
                let listed: HashSet<WorkerId> = changes
                    .iter()
                    .filter_map(|c| match c {
                        WorkerChange::Up(r) => Some(r.id.clone()),
                        _ => None,
                    })
                    .collect();
                let gone: Vec<WorkerId> = self
                    .core
                    .workers()
                    .records()
                    .map(|r| r.id.clone())
                    .filter(|id| !listed.contains(id))
                    .collect();
                for id in gone {
                    self.on_worker_change(WorkerChange::Down(id));
                }
                for change in changes {
                    self.on_worker_change(change);
                }
                if !self.workers_listed {
                    tracing::info!(
                        workers = self.core.workers().len(),
                        "registered workers listed"
                    );
                }
                self.workers_listed = true;
                self.publish_readiness();
            }
            WorkerEvent::Changed(changes) => {
                for change in changes {
                    self.on_worker_change(change);
                }
            }
            WorkerEvent::Lost(error) => {
                tracing::warn!(%error, "the worker watch was lost; listing the workers again");
            }
        }
        self.metrics.workers_registered(self.core.workers().len());
        self.metrics.sessions_bound(self.core.sessions().len());
        self.publish_context();
        self.admit();
    }

    /// The smallest context length the registered workers said, for the
    /// HTTP layer's checks before routing.
    fn publish_context(&self) {
        let smallest = self
            .core
            .workers()
            .records()
            .map(|r| r.max_model_len)
            .filter(|&n| n > 0)
            .min()
            .unwrap_or(0);
        self.context.send_if_modified(|c| {
            let changed = *c != smallest;
            *c = smallest;
            changed
        });
    }

    fn on_worker_change(&mut self, change: WorkerChange) {
        match change {
            WorkerChange::Up(record) => {
                let id = record.id.clone();
                let role = record.role;
                let known = self.core.workers().record(&id) == Some(&record);
                match self.core.register(record) {
                    Ok(()) if !known => {
                        tracing::info!(worker = %id, %role, "worker registered");
                    }
                    Ok(()) => {}
                    Err(mismatch) => {
                        tracing::error!(
                            worker = %id,
                            %role,
                            reason = mismatch.label(),
                            "refusing worker {id}: {mismatch}"
                        );
                        self.metrics.worker_refused(mismatch.label());
                    }
                }
            }
            WorkerChange::Down(id) => {
                self.breakers.forget(&id);
                if self.core.deregister(&id) {
                    tracing::info!(worker = %id, "worker deregistered");
                }
            }
            WorkerChange::Malformed { key, error } => {
                tracing::warn!(%key, %error, "malformed worker record in etcd; ignored");
                self.metrics.worker_malformed();
            }
        }
    }

    // --- Peers and workers on the bus -----------------------------------

    fn on_load(&mut self, message: &async_nats::Message) {
        match LoadReport::decode(&message.payload) {
            Ok(report) => {
                let applied = self.core.on_load(report, now_ms());
                self.metrics
                    .peer_message("load", if applied { "applied" } else { "ignored" });
                if applied {
                    self.admit();
                }
            }
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "malformed load report");
                self.metrics.peer_message("load", "malformed");
            }
        }
    }

    fn on_progress(&mut self, message: &async_nats::Message) {
        if message.subject.as_str() == self.own_progress {
            return; // applied directly by this replica's dispatcher
        }
        match RequestProgress::decode(&message.payload) {
            Ok(p) => {
                let released = match p.progress {
                    Progress::PrefillDone => self.core.on_prefill_done(p.decision),
                    Progress::Finished => {
                        self.peers.on_finished(p.decision);
                        self.core.on_finished(p.decision)
                    }
                };
                self.metrics
                    .peer_message("progress", if released { "applied" } else { "ignored" });
                if released {
                    self.admit();
                }
            }
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "malformed progress notice");
                self.metrics.peer_message("progress", "malformed");
            }
        }
    }

    fn on_peer_decision(&mut self, message: Result<jetstream::Message, String>) {
        let message = match message {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "decision log consumer error");
                self.metrics.peer_message("decision", "error");
                return;
            }
        };
        if message.subject.as_str() == self.own_decisions {
            return; // charged when decided
        }
        match LogEntry::decode(&message.payload) {
            Ok(LogEntry::Context { .. }) => self.metrics.peer_message("decision", "context"),
            Ok(LogEntry::Decision(logged)) => {
                if let Some((last, blocks)) = logged.prompt.end() {
                    self.decision_log.peer_prompt(last, blocks);
                }
                let decision = logged.decision;
                if let Ok(info) = message.info() {
                    let published = info.published.unix_timestamp_nanos();
                    let now = SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos() as i128);
                    let lag = (now - published).max(0) as u64;
                    self.metrics.decision_log_lag(Duration::from_nanos(lag));
                }
                let charged = self.core.on_decision(&decision);
                if charged {
                    let replica = message
                        .subject
                        .as_str()
                        .strip_prefix(subjects::DECISIONS_ALL.trim_end_matches('>'))
                        .unwrap_or(message.subject.as_str());
                    self.peers.on_decision(replica, decision.id, now_ms());
                }
                // The peer's session binding: its turns go where it sent them.
                if let Some(session) = &logged.session {
                    self.core
                        .bind_session(&session.id, &decision.decode, now_ms());
                }
                tracing::debug!(
                    decision = %decision.id,
                    request_id = %decision.request_id,
                    subject = %message.subject,
                    charged,
                    "peer decision"
                );
                self.metrics
                    .peer_message("decision", if charged { "applied" } else { "ignored" });
            }
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "malformed decision in the decision log");
                self.metrics.peer_message("decision", "malformed");
            }
        }
    }

    /// This replica's heartbeat (or its leaving notice), encoded.
    fn heartbeat(&self, state: Presence) -> Vec<u8> {
        RouterHeartbeat {
            replica: self.replica.to_string(),
            state,
            every_ms: self.peers.config().heartbeat_ms,
            at_ms: now_ms(),
        }
        .encode()
    }

    /// Publishes this replica's heartbeat without waiting for it: a lost
    /// beat is covered by the next one.
    fn beat(&self) {
        let payload = self.heartbeat(Presence::Alive);
        let client = self.bus.client().clone();
        let subject = self.own_heartbeat.clone();
        tokio::spawn(async move {
            if let Err(e) = client.publish(subject, payload.into()).await {
                tracing::debug!(error = %e, "publishing the heartbeat failed");
            }
        });
    }

    /// Tells the peers this replica leaves; the future ends once the notice
    /// has reached the server (or after 1 s). Published in line, not in a
    /// task that the connection's close could overtake.
    fn leave(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        tracing::info!(replica = %self.replica, "telling the peers this replica leaves");
        let client = self.bus.client().clone();
        let subject = self.own_heartbeat.clone();
        let payload = self.heartbeat(Presence::Leaving);
        async move {
            let sent = async {
                client
                    .publish(subject, payload.into())
                    .await
                    .map_err(|e| e.to_string())?;
                client.flush().await.map_err(|e| e.to_string())
            };
            match tokio::time::timeout(Duration::from_secs(1), sent).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(
                    error = %e,
                    "the leaving notice was not sent; peers will time this replica out"
                ),
                Err(_) => tracing::warn!(
                    "the leaving notice was not flushed in time; peers will time this replica out"
                ),
            }
        }
    }

    fn on_heartbeat(&mut self, message: &async_nats::Message) {
        if message.subject.as_str() == self.own_heartbeat {
            return;
        }
        let heartbeat = match RouterHeartbeat::decode(&message.payload) {
            Ok(h) => h,
            Err(e) => {
                tracing::warn!(subject = %message.subject, error = %e, "malformed router heartbeat");
                self.metrics.peer_message("heartbeat", "malformed");
                return;
            }
        };
        if message.subject.as_str() != subjects::router_heartbeat(&heartbeat.replica) {
            tracing::warn!(subject = %message.subject, replica = %heartbeat.replica, "a heartbeat names another replica than its subject; ignored");
            self.metrics.peer_message("heartbeat", "ignored");
            return;
        }
        let heard = self.peers.on_heartbeat(&heartbeat, now_ms());
        let outcome = if heard == Heard::Stale {
            "ignored"
        } else {
            "applied"
        };
        self.metrics.peer_message("heartbeat", outcome);
        match heard {
            Heard::Joined => {
                tracing::info!(peer = %heartbeat.replica, every_ms = heartbeat.every_ms, "peer replica heard")
            }
            Heard::Alive => {}
            Heard::Stale => {
                tracing::debug!(peer = %heartbeat.replica, at_ms = heartbeat.at_ms, "a heartbeat the peer sent before its leaving notice; ignored")
            }
            Heard::Left(gone) => self.release_peer(gone),
        }
        self.metrics.peers(self.peers.list().len());
    }

    /// Releases what a peer that left or fell silent still held here.
    fn release_peer(&mut self, gone: PeerGone) {
        let released = gone
            .decisions
            .iter()
            .filter(|id| self.core.on_finished(**id))
            .count();
        let why = if gone.left { "left" } else { "silent" };
        self.metrics.peer_released(why, released);
        if gone.left {
            tracing::info!(peer = %gone.replica, released, "peer replica left; its reservations are released");
        } else {
            tracing::warn!(
                peer = %gone.replica,
                released,
                silent_ms = gone.silent_ms,
                "peer replica fell silent (crashed?); its reservations are released"
            );
        }
    }

    fn on_tick(&mut self) {
        for worker in self.breakers.tick(now_ms()) {
            self.breaker_changed(&worker, crate::core::Transition::HalfOpened);
        }
        for gone in self.peers.expire(now_ms()) {
            self.release_peer(gone);
        }
        self.metrics.peers(self.peers.list().len());
        let expired = self.core.expire(now_ms());
        self.metrics
            .ledger(self.core.workers().in_flight(), expired);
        self.admit();
        self.expire_queue();
        self.metrics.calibration(&self.core.calibration().factors());
        self.metrics.workers_registered(self.core.workers().len());
        self.metrics
            .index_position(self.core.replica().applied(), self.head);
        if !self.head_poll {
            self.head_poll = true;
            let bus = self.bus.clone();
            let tx = self.side_tx.clone();
            tokio::spawn(async move {
                let head = bus.last_delta_seq().await;
                let _ = tx.send(Event::DeltaHead(head));
            });
        }
        if !self.indexer_poll {
            self.indexer_poll = true;
            let bus = self.bus.clone();
            let tx = self.side_tx.clone();
            tokio::spawn(async move {
                let pulling = bus.kv_consumer_pulling(subjects::KV_INDEXER_CONSUMER).await;
                let _ = tx.send(Event::IndexerPolled(pulling));
            });
        }
        self.nats_connected =
            self.bus.client().connection_state() == async_nats::connection::State::Connected;
        self.metrics.store_full(self.decision_log.store_full());
        self.publish_readiness();
    }
}
