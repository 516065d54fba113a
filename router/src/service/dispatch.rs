//! Dispatch over NATS: a prepared request from its first decision to its
//! end — the legs to its workers, the chunks streamed back, a retry, the
//! decision log and progress notices.
//!
//! [`Dispatcher::decide`] is the one way a request is decided: the first
//! decision, a retry's, and a dry run's (`POST /v1/route`). It asks the
//! event loop and logs the decision.
//!
//! A leg is one `GenerateRequest` published to the worker's generate
//! subject with a fresh inbox as the reply subject; the worker streams
//! `GenerateChunk`s (indexed from 0) to the inbox. The first chunk must
//! come within `first_chunk`, each next one within `idle`; a skipped index
//! is an error. Bypass is one leg (`Stage::Local` on the decode worker);
//! remote is a `Stage::Prefill` leg on the prefill worker, which answers
//! `Prefilled { transfer }`, then a `Stage::Decode { transfer }` leg on the
//! decode worker.
//!
//! Dispatched decisions go to the decision log (written by the event loop
//! once their requester has them); `PrefillDone` and `Finished` go to this
//! replica's ledger (through the event loop) and to the peers'
//! (`subjects::progress(replica)`). A failure before any token, when
//! retryable, is retried (up to `retry.attempts` times, after a backoff
//! that doubles) on a new decision that avoids every worker that failed
//! it. Every leg's end is told to the loop's circuit breakers
//! (`Command::Outcome`): a success, or a failure that is the worker's.
//!
//! A leg quiet for `probe` has its worker probed (`subjects::ping`): when
//! no agent listens there any more (NATS answers "no responders" at once
//! for a subject nobody subscribes to: the agent died or left), the leg
//! fails at once ([`DispatchError::WorkerGone`]) instead of at its
//! timeout, and is retried when nothing has streamed. Only a worker seen
//! answering a probe before (each is probed once at its first leg) is
//! taken for gone: an agent too old to answer probes is left to the
//! timeouts. The probe names the leg's decision (`LegProbe`): an agent
//! that answers twice in a row that it does not generate it lost it on
//! the bus (a NATS node died with the request or its chunks while this
//! router's or the agent's connection moved to another node), and the leg
//! fails ([`DispatchError::LegLost`]) and is retried when nothing has
//! streamed; so is a stream that lost a chunk before any token.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bus::Bus;
use futures::{FutureExt, StreamExt};
use protocol::{
    subjects, BlockHash, CancelRequest, DecisionId, FinishReason, GenerateChunk, GenerateEvent,
    GenerateRequest, LegProbe, LegProbeReply, Message, Path, Progress, RequestProgress,
    RouteDecision, Sampling, Stage, WorkerId,
};
use tokio::sync::mpsc;
use tokio::sync::mpsc::error::TrySendError;
use tracing::Instrument;

use protocol::fragment::{self, FRAGMENT_OVERHEAD, MAX_FRAGMENTED_BYTES};

use super::config::{Retry, Timeouts};
use super::event_loop::{ask_route, now_ms, AskError, Assignment, Command, RouteJob};
use super::metrics::Metrics;

/// Why a dispatch failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DispatchError {
    #[error("no agent listens on {worker}'s generate subject {subject}")]
    NoResponders { worker: WorkerId, subject: String },
    #[error("{worker}'s agent is gone: no one answers its probe subject after {after:?} without a chunk of the {stage} leg")]
    WorkerGone {
        worker: WorkerId,
        stage: &'static str,
        after: Duration,
    },
    #[error("{worker}'s agent does not hold the {stage} leg any more, {after:?} without a chunk: the leg was lost on the bus")]
    LegLost {
        worker: WorkerId,
        stage: &'static str,
        after: Duration,
    },
    #[error("{worker} sent no chunk of the {stage} leg within {after:?}")]
    FirstChunkTimeout {
        worker: WorkerId,
        stage: &'static str,
        after: Duration,
    },
    #[error("{worker} sent nothing for {after:?} in the middle of the {stage} leg")]
    IdleTimeout {
        worker: WorkerId,
        stage: &'static str,
        after: Duration,
    },
    #[error("{worker} failed the {stage} leg: {error}")]
    WorkerFailed {
        worker: WorkerId,
        stage: &'static str,
        error: String,
        retryable: bool,
    },
    #[error("{worker}'s {stage} stream lost chunk {expected} (the next one was {got})")]
    MissingChunk {
        worker: WorkerId,
        stage: &'static str,
        expected: u32,
        got: u32,
    },
    #[error("{worker} sent a malformed chunk on the {stage} leg: {error}")]
    Malformed {
        worker: WorkerId,
        stage: &'static str,
        error: String,
    },
    #[error("{worker} broke the protocol on the {stage} leg: {what}")]
    Protocol {
        worker: WorkerId,
        stage: &'static str,
        what: &'static str,
    },
    #[error("sending the {stage} leg to {worker}: {error}")]
    Nats {
        worker: WorkerId,
        stage: &'static str,
        error: String,
    },
    /// The worker's engine refused the request as asked (a field it
    /// cannot honour, a value it rejects): the client's error.
    #[error("{worker} refused the {stage} leg: {error}")]
    Rejected {
        worker: WorkerId,
        stage: &'static str,
        /// The status for the client (4xx).
        status: u16,
        param: Option<String>,
        error: String,
    },
    /// The leg is larger than the most sent in fragments
    /// (`protocol::fragment::MAX_FRAGMENTED_BYTES`).
    #[error("the {stage} leg is {bytes} bytes, more than the {max} bytes a request may have in fragments")]
    TooLarge {
        stage: &'static str,
        bytes: usize,
        max: usize,
    },
    #[error("the client went away")]
    ClientGone,
}

impl DispatchError {
    /// Whether another worker may succeed where this one failed (when no
    /// token was streamed yet).
    pub fn retryable(&self) -> bool {
        match self {
            DispatchError::NoResponders { .. }
            | DispatchError::WorkerGone { .. }
            | DispatchError::LegLost { .. }
            | DispatchError::FirstChunkTimeout { .. }
            | DispatchError::MissingChunk { .. }
            | DispatchError::Nats { .. } => true,
            DispatchError::WorkerFailed { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// Whether the failure is the worker's (the circuit breaker counts
    /// it): not the client's, not this router's connection.
    pub fn blames_worker(&self) -> bool {
        matches!(
            self,
            DispatchError::NoResponders { .. }
                | DispatchError::WorkerGone { .. }
                | DispatchError::FirstChunkTimeout { .. }
                | DispatchError::IdleTimeout { .. }
                | DispatchError::WorkerFailed { .. }
                | DispatchError::MissingChunk { .. }
                | DispatchError::Malformed { .. }
                | DispatchError::Protocol { .. }
        )
    }

    /// Whether the failure is a timeout (504 rather than 502).
    pub fn is_timeout(&self) -> bool {
        matches!(
            self,
            DispatchError::FirstChunkTimeout { .. } | DispatchError::IdleTimeout { .. }
        )
    }

    /// Whether a stream that failed this way after some tokens may go on
    /// on another worker: its worker died, lost the leg, lost a chunk or
    /// stalled, or said another worker may succeed. (Not a refusal, a
    /// malformed chunk or a broken protocol: those would fail again.)
    pub fn resumable(&self) -> bool {
        match self {
            DispatchError::WorkerGone { .. }
            | DispatchError::LegLost { .. }
            | DispatchError::MissingChunk { .. }
            | DispatchError::IdleTimeout { .. } => true,
            DispatchError::WorkerFailed { retryable, .. } => *retryable,
            _ => false,
        }
    }

    /// The worker that failed.
    pub fn worker(&self) -> Option<&WorkerId> {
        match self {
            DispatchError::NoResponders { worker, .. }
            | DispatchError::WorkerGone { worker, .. }
            | DispatchError::LegLost { worker, .. }
            | DispatchError::FirstChunkTimeout { worker, .. }
            | DispatchError::IdleTimeout { worker, .. }
            | DispatchError::WorkerFailed { worker, .. }
            | DispatchError::MissingChunk { worker, .. }
            | DispatchError::Malformed { worker, .. }
            | DispatchError::Protocol { worker, .. }
            | DispatchError::Nats { worker, .. }
            | DispatchError::Rejected { worker, .. } => Some(worker),
            DispatchError::ClientGone | DispatchError::TooLarge { .. } => None,
        }
    }

    /// A metrics label.
    pub fn outcome(&self) -> &'static str {
        match self {
            DispatchError::NoResponders { .. } => "no_responders",
            DispatchError::WorkerGone { .. } => "worker_gone",
            DispatchError::LegLost { .. } => "leg_lost",
            DispatchError::FirstChunkTimeout { .. } => "first_chunk_timeout",
            DispatchError::IdleTimeout { .. } => "idle_timeout",
            DispatchError::WorkerFailed { .. } => "worker_failed",
            DispatchError::MissingChunk { .. } => "missing_chunk",
            DispatchError::Malformed { .. } => "malformed_chunk",
            DispatchError::Protocol { .. } => "protocol_error",
            DispatchError::Nats { .. } => "nats_error",
            DispatchError::Rejected { .. } => "rejected",
            DispatchError::TooLarge { .. } => "too_large",
            DispatchError::ClientGone => "client_gone",
        }
    }
}

/// What the dispatcher tells the HTTP handler, in order: `Refused`, or
/// `Decided` (again for a retry), then tokens and the end.
#[derive(Debug)]
pub enum Out {
    /// No decision could be made; nothing was dispatched.
    Refused(AskError),
    /// The request's decision; with `retry_of`, the decision that retries
    /// a first attempt that failed before any token.
    Decided {
        decision: RouteDecision,
        retry_of: Option<DecisionId>,
    },
    /// Output tokens, in order, with their log-probabilities (one a
    /// token) when the request asked for them.
    Tokens {
        tokens: Vec<u32>,
        logprobs: Option<Vec<protocol::TokenLogprob>>,
    },
    /// The stream ended well.
    Done {
        reason: FinishReason,
        output_tokens: u32,
        /// Prompt tokens the engine that prefilled found cached (the
        /// prefill worker's on the remote path), when it said.
        cached_tokens: Option<u32>,
    },
    /// The stream failed (after a retry, if one was allowed).
    Failed {
        error: DispatchError,
        /// Why no retry was made, when it could have been.
        no_retry: Option<String>,
    },
}

/// Why a stream cut after some tokens cannot go on elsewhere, if it
/// cannot: the rest would not be what the same engine would have sent.
/// Stop strings may span the cut, penalties count the output tokens
/// (which the next engine would read as prompt), and a structured output's
/// grammar would start over. (A seed gives another sample after the cut.)
pub fn not_resumable(sampling: &Sampling) -> Option<&'static str> {
    let set = |v: Option<f64>, neutral: f64| v.is_some_and(|v| v != neutral);
    if !sampling.stop.is_empty() {
        Some("stop strings")
    } else if set(sampling.presence_penalty, 0.0)
        || set(sampling.frequency_penalty, 0.0)
        || set(sampling.repetition_penalty, 1.0)
    {
        Some("penalties")
    } else if sampling.response_format.is_some() {
        Some("response_format")
    } else {
        None
    }
}

/// What every decision of a request is made from: the request id, the
/// prompt's length and block hashes, the output asked for.
#[derive(Debug, Clone)]
pub struct Prepared {
    pub request_id: String,
    pub isl_tokens: u32,
    pub hashes: Arc<[BlockHash]>,
    /// Also the decisions' expected output.
    pub max_tokens: u32,
    /// Passed to the engine with every leg.
    pub sampling: Sampling,
    /// The conversation's session, if the client named one.
    pub session: Option<protocol::SessionId>,
}

/// What a decision is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Purpose {
    /// To be dispatched: reserved in the ledger, logged for replay.
    Dispatch,
    /// `POST /v1/route`: released at once; with `explain`, what the
    /// decision looked at.
    DryRun { explain: bool },
}

struct Inner {
    client: async_nats::Client,
    replica: Arc<str>,
    progress_subject: String,
    commands: mpsc::Sender<Command>,
    timeouts: Timeouts,
    retry: Retry,
    /// Longest wait in the admission queue (a first decision's ask waits
    /// it on top of the route timeout).
    admission_wait: Duration,
    metrics: Metrics,
    /// Workers whose agent answered a probe (true) or said nothing of
    /// probes (false: no responders at its first leg, an older agent).
    probes: Mutex<HashMap<WorkerId, bool>>,
}

/// What a probe of a worker's agent found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Alive,
    /// No one subscribes to its probe subject.
    NoResponders,
    /// The agent answered, and does not generate the leg probed.
    NotHeld,
    /// No answer in time, or a NATS error: nothing learnt.
    Unknown,
}

/// What a probe found of a quiet leg.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Quiet {
    /// Still served, or nothing learnt: keep waiting.
    Serving,
    /// The agent is gone.
    Gone,
    /// The agent is there and does not generate the leg.
    NotHeld,
}

/// Sends routed requests to workers; cheap to clone.
#[derive(Clone)]
pub struct Dispatcher {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("replica", &self.inner.replica)
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    pub fn new(
        bus: Bus,
        replica: Arc<str>,
        commands: mpsc::Sender<Command>,
        timeouts: Timeouts,
        retry: Retry,
        admission_wait: Duration,
        metrics: Metrics,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                client: bus.client().clone(),
                progress_subject: subjects::progress(&replica),
                replica,
                commands,
                timeouts,
                retry,
                admission_wait,
                metrics,
                probes: Mutex::new(HashMap::new()),
            }),
        }
    }

    /// Asks `worker`'s agent whether it is there (and, with `leg`, whether
    /// it generates that decision's leg), waiting at most the probe period.
    async fn ping(&self, worker: &WorkerId, leg: Option<DecisionId>) -> Probe {
        let inner = &self.inner;
        let payload = leg.map(|decision| LegProbe { decision }.encode());
        let request = inner
            .client
            .request(subjects::ping(worker), payload.unwrap_or_default().into());
        let probe = match tokio::time::timeout(inner.timeouts.probe, request).await {
            Ok(Ok(answer)) => match (leg, LegProbeReply::decode(&answer.payload)) {
                (Some(leg), Ok(reply)) if reply.decision == leg && !reply.in_flight => {
                    Probe::NotHeld
                }
                _ => Probe::Alive,
            },
            Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
                Probe::NoResponders
            }
            Ok(Err(e)) => {
                tracing::debug!(%worker, error = %e, "probing a worker failed");
                Probe::Unknown
            }
            Err(_) => Probe::Unknown,
        };
        if probe != Probe::Unknown {
            let mut probes = inner.probes.lock().expect("no panic while held");
            let answered = probes.entry(worker.clone()).or_insert(false);
            *answered |= matches!(probe, Probe::Alive | Probe::NotHeld);
        }
        probe
    }

    /// Probes a worker not probed yet, in the background (so that a later
    /// silence of it can be told apart from an agent that cannot answer).
    fn first_probe(&self, worker: &WorkerId) {
        let known = self
            .inner
            .probes
            .lock()
            .expect("no panic while held")
            .contains_key(worker);
        if !known {
            let (this, worker) = (self.clone(), worker.clone());
            spawn(async move {
                this.ping(&worker, None).await;
            });
        }
    }

    /// What became of a quiet leg (of `decision`) on `worker`: gone when
    /// no one listens on its probe subject and its agent answered probes
    /// before; not held when the agent says it does not generate it.
    async fn quiet(&self, worker: &WorkerId, decision: DecisionId) -> Quiet {
        let probe = self.ping(worker, Some(decision)).await;
        let answers = self
            .inner
            .probes
            .lock()
            .expect("no panic while held")
            .get(worker)
            .copied()
            .unwrap_or(false);
        let (outcome, quiet) = match probe {
            Probe::Alive => ("alive", Quiet::Serving),
            Probe::NotHeld => ("not_held", Quiet::NotHeld),
            Probe::NoResponders if answers => ("gone", Quiet::Gone),
            Probe::NoResponders => ("unsupported", Quiet::Serving),
            Probe::Unknown => ("no_answer", Quiet::Serving),
        };
        self.inner.metrics.worker_probe(outcome);
        quiet
    }

    /// Asks the decision's workers to stop generating it (only the one
    /// serving its current leg is; the other ignores the cancel).
    fn cancel(&self, decision: &RouteDecision, reason: &str) {
        let payload = CancelRequest {
            decision: decision.id,
            request_id: decision.request_id.clone(),
            reason: reason.to_owned(),
        }
        .encode();
        let client = self.inner.client.clone();
        let workers: Vec<WorkerId> = std::iter::once(decision.decode.clone())
            .chain(decision.prefill.clone())
            .collect();
        spawn(async move {
            for worker in workers {
                if let Err(e) = client
                    .publish(subjects::cancel(&worker), payload.clone().into())
                    .await
                {
                    tracing::warn!(%worker, error = %e, "publishing a cancel failed");
                }
            }
        });
    }

    /// Tells the loop what a request was observed to take (calibration);
    /// dropped when the loop is busy: an observation is not owed.
    fn observed(&self, command: Command) {
        let _ = self.inner.commands.try_send(command);
    }

    /// Tells the loop's circuit breakers how a worker did; dropped when the
    /// loop is busy.
    fn outcome(&self, worker: &WorkerId, ok: bool) {
        let _ = self.inner.commands.try_send(Command::Outcome {
            worker: worker.clone(),
            ok,
        });
    }

    /// Tells this replica's ledger (through the loop) and the peers'.
    fn progress(&self, decision: DecisionId, progress: Progress) {
        let inner = &self.inner;
        match inner
            .commands
            .try_send(Command::Progress { decision, progress })
        {
            Ok(()) | Err(TrySendError::Closed(_)) => {}
            Err(TrySendError::Full(command)) => {
                let commands = inner.commands.clone();
                spawn(async move {
                    let _ = commands.send(command).await;
                });
            }
        }
        let payload = RequestProgress {
            decision,
            progress,
            at_ms: now_ms(),
        }
        .encode();
        let client = inner.client.clone();
        let subject = inner.progress_subject.clone();
        spawn(async move {
            if let Err(e) = client.publish(subject, payload.into()).await {
                tracing::warn!(error = %e, "publishing a progress notice failed");
            }
        });
    }

    /// Decides `request`, avoiding `avoid` (the workers a failed attempt
    /// used): the first decision, a retry's and a dry run's. Logs it.
    pub async fn decide(
        &self,
        request: &Prepared,
        avoid: Vec<WorkerId>,
        purpose: Purpose,
        retry_of: Option<DecisionId>,
    ) -> Result<Assignment, AskError> {
        let inner = &self.inner;
        let started = Instant::now();
        let (dry_run, explain) = match purpose {
            Purpose::Dispatch => (false, false),
            Purpose::DryRun { explain } => (true, explain),
        };
        // A first decision may wait at the door (and the queue is expired
        // on the loop's tick).
        let wait = match (dry_run, avoid.is_empty()) {
            (false, true) => inner.timeouts.route + inner.admission_wait + inner.timeouts.tick,
            _ => inner.timeouts.route,
        };
        let job = RouteJob {
            request_id: request.request_id.clone(),
            isl_tokens: request.isl_tokens,
            hashes: request.hashes.clone(),
            expected_output_tokens: request.max_tokens,
            avoid,
            dry_run,
            explain,
            session: request.session.clone(),
        };
        let assignment = ask_route(&inner.commands, job, wait)
            .await
            .inspect_err(|e| inner.metrics.route_error(e.label()))?;
        inner.metrics.route_latency(started.elapsed());
        let d = &assignment.decision;
        let prefill = d.prefill.as_ref().map(|p| p.to_string());
        if dry_run {
            tracing::debug!(decision = %d.id, path = %d.path, decode = %d.decode, ?prefill, rule = %d.rule, "routed (dry run)");
        } else {
            tracing::info!(
                decision = %d.id,
                retry_of = ?retry_of.map(|r| r.to_string()),
                path = %d.path,
                decode = %d.decode,
                ?prefill,
                decode_overlap_tokens = d.decode_overlap_tokens,
                isl_tokens = d.isl_tokens,
                rule = %d.rule,
                "routed"
            );
        }
        Ok(assignment)
    }

    /// Runs a request (`prompt` is its token ids) from its decision to its
    /// end, sending what happens to `out`. Stops early when `out` is closed
    /// (the client went away).
    pub async fn serve(self, request: Prepared, prompt: Vec<u32>, out: mpsc::Sender<Out>) {
        let mut assignment = match self
            .decide(&request, Vec::new(), Purpose::Dispatch, None)
            .await
        {
            Ok(a) => a,
            Err(e) => {
                let _ = out.send(Out::Refused(e)).await;
                return;
            }
        };
        let decided = Out::Decided {
            decision: assignment.decision.clone(),
            retry_of: None,
        };
        if out.send(decided).await.is_err() {
            // The client left before anything ran.
            self.progress(assignment.decision.id, Progress::Finished);
            self.inner.metrics.dispatch("client_gone");
            return;
        }
        let mut generate = GenerateRequest {
            request_id: request.request_id.clone(),
            annotation: assignment.decision.annotation(),
            stage: Stage::Local,
            prompt,
            max_tokens: request.max_tokens,
            sampling: request.sampling.clone(),
        };
        let mut retries = 0;
        let mut avoid: Vec<WorkerId> = Vec::new();
        // Output tokens sent to the client by earlier attempts (a resumed
        // stream's prompt ends with them).
        let mut sent = 0u32;
        let mut request = request;
        loop {
            generate.annotation = assignment.decision.annotation();
            let mut ticket = Ticket {
                dispatcher: self.clone(),
                decision: assignment.decision.id,
                finished: false,
            };
            let mut streamed = Vec::new();
            let result = tokio::select! {
                r = self.legs(&assignment, &mut generate, &mut ticket, &out, &mut streamed, sent) => r,
                _ = out.closed() => Err(DispatchError::ClientGone),
            };
            ticket.finish();
            let metrics = &self.inner.metrics;
            let error = match result {
                Ok(()) => {
                    metrics.dispatch("ok");
                    let d = &assignment.decision;
                    self.outcome(&d.decode, true);
                    if let Some(prefill) = &d.prefill {
                        self.outcome(prefill, true);
                    }
                    return;
                }
                Err(DispatchError::ClientGone) => {
                    tracing::info!(decision = %assignment.decision.id, "the client went away; request cancelled");
                    metrics.dispatch("client_gone");
                    self.cancel(&assignment.decision, "the client went away");
                    return;
                }
                Err(e) => e,
            };
            if let (Some(worker), true) = (error.worker(), error.blames_worker()) {
                self.outcome(worker, false);
            }
            let mut no_retry = None;
            let retry = &self.inner.retry;
            // After some tokens: go on elsewhere with them appended to the
            // prompt, or say why not.
            let resume = if streamed.is_empty() {
                false
            } else {
                no_retry = if !retry.resume {
                    Some("resuming is off (retry.resume)".to_owned())
                } else if streamed.len() as u32 >= request.max_tokens {
                    Some("every token asked for was sent".to_owned())
                } else if !error.resumable() {
                    Some(format!(
                        "a stream that failed so ({}) is not resumed",
                        error.outcome()
                    ))
                } else {
                    not_resumable(&generate.sampling)
                        .map(|why| format!("not resumed elsewhere: the request has {why}"))
                };
                no_retry.is_none()
            };
            if retries < retry.attempts && no_retry.is_none() && (resume || error.retryable()) {
                let failed = assignment.decision.id;
                let backoff = retry.backoff.saturating_mul(1 << retries.min(16));
                if resume {
                    // Whatever the failed worker still does is wasted.
                    self.cancel(&assignment.decision, "the stream goes on on another worker");
                    let n = streamed.len() as u32;
                    sent += n;
                    generate.prompt.extend_from_slice(&streamed);
                    request.isl_tokens += n;
                    request.max_tokens -= n;
                    generate.max_tokens = request.max_tokens;
                    generate.sampling.min_tokens = generate.sampling.min_tokens.saturating_sub(n);
                    tracing::warn!(decision = %failed, %error, ?backoff, attempt = retries + 1, sent, "the stream failed after {sent} tokens; going on on another worker with them appended to the prompt");
                } else {
                    tracing::warn!(decision = %failed, %error, ?backoff, attempt = retries + 1, "dispatch failed before any token; retrying on another worker");
                }
                if let Some(worker) = error.worker() {
                    if !avoid.contains(worker) {
                        avoid.push(worker.clone());
                    }
                }
                tokio::select! {
                    () = tokio::time::sleep(backoff) => {}
                    _ = out.closed() => {
                        metrics.dispatch("client_gone");
                        return;
                    }
                }
                match self
                    .decide(&request, avoid.clone(), Purpose::Dispatch, Some(failed))
                    .await
                {
                    Ok(next) => {
                        metrics.dispatch(if resume { "resumed" } else { "retried" });
                        let decided = Out::Decided {
                            decision: next.decision.clone(),
                            retry_of: Some(failed),
                        };
                        if out.send(decided).await.is_err() {
                            // The client left: the retry never runs.
                            self.progress(next.decision.id, Progress::Finished);
                            metrics.dispatch("client_gone");
                            return;
                        }
                        assignment = next;
                        retries += 1;
                        continue;
                    }
                    Err(e) => no_retry = Some(format!("no retry: {e}")),
                }
            }
            let sent = sent + streamed.len() as u32;
            tracing::warn!(decision = %assignment.decision.id, %error, sent, no_retry = ?no_retry, "dispatch failed");
            metrics.dispatch(error.outcome());
            let _ = out.send(Out::Failed { error, no_retry }).await;
            return;
        }
    }

    async fn legs(
        &self,
        routed: &Assignment,
        request: &mut GenerateRequest,
        ticket: &mut Ticket,
        out: &mpsc::Sender<Out>,
        streamed: &mut Vec<u32>,
        sent_before: u32,
    ) -> Result<(), DispatchError> {
        let decision = &routed.decision;
        request.stage = Stage::Local;
        let mut prefill_cached = None;
        // Remote, with or without a fetched prefix: the prefill worker's
        // agent reads the fetch (source, tokens) from the annotation.
        if let (true, Some(prefill), Some(subject)) = (
            decision.path.is_remote(),
            &decision.prefill,
            &routed.prefill_subject,
        ) {
            request.stage = Stage::Prefill;
            let mut leg = self.open(prefill, subject, request).await?;
            let transfer = match leg.next().await? {
                GenerateEvent::Prefilled {
                    transfer,
                    cached_tokens,
                } => {
                    prefill_cached = cached_tokens;
                    transfer
                }
                GenerateEvent::Failed { error, retryable } => {
                    return Err(leg.failed(error, retryable))
                }
                GenerateEvent::Rejected {
                    status,
                    param,
                    error,
                } => return Err(leg.rejected(status, param, error)),
                GenerateEvent::Finished { .. } => {
                    return Err(leg.protocol("the prefill leg finished without Prefilled"))
                }
                GenerateEvent::Tokens(_) | GenerateEvent::Scored { .. } => {
                    return Err(leg.protocol("the prefill leg sent output tokens"))
                }
            };
            drop(leg);
            tracing::debug!(decision = %decision.id, source = %transfer.source, "prefill done");
            ticket.prefill_done();
            request.stage = Stage::Decode { transfer };
        }
        let mut leg = self
            .open(&decision.decode, &routed.decode_subject, request)
            .await?;
        let mut first_token_ms = None;
        loop {
            let (tokens, logprobs) = match leg.next().await? {
                GenerateEvent::Tokens(tokens) => (tokens, None),
                GenerateEvent::Scored { tokens, logprobs } => {
                    if logprobs.len() != tokens.len() {
                        return Err(
                            leg.protocol("a chunk's log-probabilities do not match its tokens")
                        );
                    }
                    (tokens, Some(logprobs))
                }
                GenerateEvent::Finished {
                    output_tokens,
                    cached_tokens,
                    reason,
                } => {
                    // A resumed stream's times are not a request's.
                    if let (Some(first_token_ms), 0) = (first_token_ms, sent_before) {
                        self.observed(Command::Observed {
                            decision: decision.id,
                            path: decision.path,
                            first_token_ms,
                            finished_ms: now_ms(),
                            output_tokens,
                        });
                    }
                    let done = Out::Done {
                        reason,
                        output_tokens: sent_before + output_tokens,
                        // A resumed stream's engine read the first tokens
                        // as prompt: its figure is not the request's.
                        cached_tokens: match (decision.path, sent_before) {
                            (_, 1..) => None,
                            (Path::Remote | Path::RemoteFetch, 0) => prefill_cached,
                            (Path::Bypass, 0) => cached_tokens,
                        },
                    };
                    return match out.send(done).await {
                        Ok(()) => Ok(()),
                        Err(_) => Err(DispatchError::ClientGone),
                    };
                }
                GenerateEvent::Failed { error, retryable } => {
                    return Err(leg.failed(error, retryable))
                }
                GenerateEvent::Rejected {
                    status,
                    param,
                    error,
                } => return Err(leg.rejected(status, param, error)),
                GenerateEvent::Prefilled { .. } => {
                    return Err(leg.protocol("a decode leg sent Prefilled"))
                }
            };
            if tokens.is_empty() {
                continue;
            }
            if request.sampling.logprobs.is_some() && logprobs.is_none() {
                // Tokens without what was asked for: never a silent 200.
                return Err(leg.rejected(
                    400,
                    Some("logprobs".into()),
                    "logprobs: the engine sent tokens without their log-probabilities".into(),
                ));
            }
            first_token_ms.get_or_insert_with(now_ms);
            streamed.extend_from_slice(&tokens);
            if out.send(Out::Tokens { tokens, logprobs }).await.is_err() {
                return Err(DispatchError::ClientGone);
            }
        }
    }

    /// Publishes one leg and subscribes to its replies.
    async fn open(
        &self,
        worker: &WorkerId,
        subject: &str,
        request: &GenerateRequest,
    ) -> Result<Leg, DispatchError> {
        let inner = &self.inner;
        let stage = request.stage.as_str();
        let nats = |e: &dyn std::fmt::Display| DispatchError::Nats {
            worker: worker.clone(),
            stage,
            error: e.to_string(),
        };
        let payload = request.encode();
        let max = inner.client.server_info().max_payload;
        // Past the server's payload limit: in fragments, which the agent
        // puts back together (same subject, same reply subject, in order).
        let messages: Vec<Vec<u8>> = if payload.len() <= max {
            vec![payload]
        } else if payload.len() as u64 <= MAX_FRAGMENTED_BYTES && max > FRAGMENT_OVERHEAD {
            let parts = fragment::split(&payload, max - FRAGMENT_OVERHEAD);
            tracing::info!(%worker, stage, bytes = payload.len(), fragments = parts.len(), max_payload = max, "leg larger than the bus's payload limit: sent in fragments");
            parts.iter().map(Message::encode).collect()
        } else {
            return Err(DispatchError::TooLarge {
                stage,
                bytes: payload.len(),
                max: MAX_FRAGMENTED_BYTES as usize,
            });
        };
        let inbox = inner.client.new_inbox();
        // The subscription reaches the server before the request (same
        // connection, in order).
        let replies = inner
            .client
            .subscribe(inbox.clone())
            .await
            .map_err(|e| nats(&e))?;
        for message in messages {
            inner
                .client
                .publish_with_reply(subject.to_owned(), inbox.clone(), message.into())
                .await
                .map_err(|e| nats(&e))?;
        }
        tracing::debug!(%worker, stage, %subject, "leg sent");
        self.first_probe(worker);
        Ok(Leg {
            decision: request.annotation.decision,
            worker: worker.clone(),
            subject: subject.to_owned(),
            stage,
            replies,
            next_index: 0,
            timeouts: inner.timeouts,
            dispatcher: self.clone(),
        })
    }
}

/// Spawns on the current runtime, if there is one (not during a runtime's
/// teardown from outside it).
fn spawn(future: impl std::future::Future<Output = ()> + Send + 'static) {
    if let Ok(handle) = tokio::runtime::Handle::try_current() {
        handle.spawn(future.in_current_span());
    }
}

/// A decision's ledger entry: `Finished` is sent exactly once, also when
/// the dispatch is dropped half-way.
struct Ticket {
    dispatcher: Dispatcher,
    decision: DecisionId,
    finished: bool,
}

impl Ticket {
    fn prefill_done(&mut self) {
        self.dispatcher
            .progress(self.decision, Progress::PrefillDone);
    }

    fn finish(&mut self) {
        if !std::mem::replace(&mut self.finished, true) {
            self.dispatcher.progress(self.decision, Progress::Finished);
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.finish();
    }
}

/// One leg's reply stream.
struct Leg {
    decision: DecisionId,
    worker: WorkerId,
    subject: String,
    stage: &'static str,
    replies: async_nats::Subscriber,
    next_index: u32,
    timeouts: Timeouts,
    /// Probes the worker when the leg is quiet.
    dispatcher: Dispatcher,
}

impl Leg {
    fn protocol(&self, what: &'static str) -> DispatchError {
        DispatchError::Protocol {
            worker: self.worker.clone(),
            stage: self.stage,
            what,
        }
    }

    /// The worker failed this leg.
    fn failed(&self, error: String, retryable: bool) -> DispatchError {
        DispatchError::WorkerFailed {
            worker: self.worker.clone(),
            stage: self.stage,
            error,
            retryable,
        }
    }

    /// The engine refused a field of the request on this leg.
    fn rejected(&self, status: u16, param: Option<String>, error: String) -> DispatchError {
        DispatchError::Rejected {
            worker: self.worker.clone(),
            stage: self.stage,
            status,
            param,
            error,
        }
    }

    /// The next event, in order, within the timeouts.
    async fn next(&mut self) -> Result<GenerateEvent, DispatchError> {
        let first = self.next_index == 0;
        let wait = if first {
            self.timeouts.first_chunk
        } else {
            self.timeouts.idle
        };
        let started = Instant::now();
        let deadline = started + wait;
        // Probes in a row whose agent said it does not hold the leg (two
        // make it lost: the first may have overtaken the request on its
        // way into the agent's loop).
        let mut not_held = 0;
        // Quiet for a probe period: is the worker still there?
        let message = loop {
            let now = Instant::now();
            let quiet = self
                .timeouts
                .probe
                .min(deadline.saturating_duration_since(now));
            match tokio::time::timeout(quiet, self.replies.next()).await {
                Ok(Some(message)) => break message,
                Ok(None) => {
                    return Err(DispatchError::Nats {
                        worker: self.worker.clone(),
                        stage: self.stage,
                        error: "the reply subscription ended (connection closed)".into(),
                    })
                }
                Err(_) if Instant::now() < deadline => {
                    match self.dispatcher.quiet(&self.worker, self.decision).await {
                        Quiet::Gone => {
                            return Err(DispatchError::WorkerGone {
                                worker: self.worker.clone(),
                                stage: self.stage,
                                after: started.elapsed(),
                            })
                        }
                        Quiet::NotHeld => not_held += 1,
                        Quiet::Serving => not_held = 0,
                    }
                    if not_held >= 2 {
                        // A last chunk may have come in meanwhile (the
                        // agent sends it before it forgets the leg).
                        if let Some(Some(message)) = self.replies.next().now_or_never() {
                            break message;
                        }
                        return Err(DispatchError::LegLost {
                            worker: self.worker.clone(),
                            stage: self.stage,
                            after: started.elapsed(),
                        });
                    }
                }
                Err(_) if first => {
                    return Err(DispatchError::FirstChunkTimeout {
                        worker: self.worker.clone(),
                        stage: self.stage,
                        after: wait,
                    })
                }
                Err(_) => {
                    return Err(DispatchError::IdleTimeout {
                        worker: self.worker.clone(),
                        stage: self.stage,
                        after: wait,
                    })
                }
            }
        };
        if message.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
            return Err(DispatchError::NoResponders {
                worker: self.worker.clone(),
                subject: self.subject.clone(),
            });
        }
        let chunk =
            GenerateChunk::decode(&message.payload).map_err(|e| DispatchError::Malformed {
                worker: self.worker.clone(),
                stage: self.stage,
                error: e.to_string(),
            })?;
        if chunk.index != self.next_index {
            return Err(DispatchError::MissingChunk {
                worker: self.worker.clone(),
                stage: self.stage,
                expected: self.next_index,
                got: chunk.index,
            });
        }
        self.next_index += 1;
        Ok(chunk.event)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_resumes_elsewhere_only_when_the_rest_would_be_the_same() {
        assert_eq!(not_resumable(&Sampling::default()), None);
        let plain = Sampling {
            temperature: Some(0.7),
            seed: Some(3),
            logprobs: Some(2),
            stop_token_ids: vec![7],
            presence_penalty: Some(0.0),
            repetition_penalty: Some(1.0),
            min_tokens: 10,
            ..Sampling::default()
        };
        assert_eq!(not_resumable(&plain), None, "neutral values resume");
        for (sampling, why) in [
            (
                Sampling {
                    stop: vec!["\n\n".into()],
                    ..Sampling::default()
                },
                "stop strings",
            ),
            (
                Sampling {
                    frequency_penalty: Some(0.5),
                    ..Sampling::default()
                },
                "penalties",
            ),
            (
                Sampling {
                    repetition_penalty: Some(1.1),
                    ..Sampling::default()
                },
                "penalties",
            ),
            (
                Sampling {
                    response_format: Some(r#"{"type":"json_object"}"#.into()),
                    ..Sampling::default()
                },
                "response_format",
            ),
        ] {
            assert_eq!(not_resumable(&sampling), Some(why));
        }
    }

    #[test]
    fn only_a_dead_lost_or_stalled_stream_resumes() {
        let worker = WorkerId::new("d0", 0).unwrap();
        let gone = DispatchError::WorkerGone {
            worker: worker.clone(),
            stage: "local",
            after: Duration::from_secs(1),
        };
        let idle = DispatchError::IdleTimeout {
            worker: worker.clone(),
            stage: "local",
            after: Duration::from_secs(30),
        };
        let malformed = DispatchError::Malformed {
            worker: worker.clone(),
            stage: "local",
            error: "bad".into(),
        };
        let refused = DispatchError::Rejected {
            worker,
            stage: "local",
            status: 400,
            param: None,
            error: "no".into(),
        };
        assert!(gone.resumable() && idle.resumable());
        assert!(!malformed.resumable() && !refused.resumable());
        assert!(!DispatchError::ClientGone.resumable());
    }
}
