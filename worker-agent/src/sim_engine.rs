//! The built-in simulated engine: [`engine_sim::Engine`] driven in real
//! time on its own tokio task.
//!
//! Virtual time runs `speedup` times faster than the wall clock: a step
//! the cost model says takes 20 ms ends 20 / speedup ms after it starts,
//! and so does a KV transfer (the bytes of the prompt part this worker
//! does not hold, over the link). Output tokens are pseudo-tokens derived
//! from the request id and the position, so that the same request gives
//! the same tokens. Steps shorter than the timer's granularity (1 ms)
//! are applied in bursts, on a virtual timeline that stays exact. The KV
//! events the engine emits (plain, unnumbered: the agent numbers batches)
//! are forwarded as canonical event lists, and mirrored to answer
//! block-set requests.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use engine_sim::{EngineRequest, KvTransfer, Mode, Preset, StepOutput};
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use protocol::{
    FinishReason, GenerateEvent, GenerateRequest, HashingContract, KvTransferParams, Role,
    Sampling, Stage, WorkerId, HASH_SCHEME,
};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::block_set::BlockMirror;
use crate::engine::{Engine, EngineFacts, EngineLoad, KvUpdate};

/// What the simulated engine models.
#[derive(Debug, Clone)]
pub struct SimEngineConfig {
    pub worker: WorkerId,
    pub role: Role,
    pub preset: Preset,
    pub block_size: u32,
    /// KV cache size in blocks (default: the preset's).
    pub kv_capacity_blocks: Option<u32>,
    /// Virtual durations are divided by this.
    pub speedup: f64,
    /// The link KV arrives over for decode requests.
    pub link: KvTransfer,
}

/// The simulated engine's handle; the engine runs on its own task until
/// [`Engine::stop`] or until the handle is dropped.
#[derive(Debug)]
pub struct SimEngine {
    facts: EngineFacts,
    commands: mpsc::UnboundedSender<Command>,
    kv_updates: Mutex<Option<mpsc::UnboundedReceiver<KvUpdate>>>,
    load: watch::Receiver<EngineLoad>,
}

#[derive(Debug)]
enum Command {
    Generate {
        request: GenerateRequest,
        events: mpsc::UnboundedSender<GenerateEvent>,
    },
    BlockSet,
    Stop,
}

impl SimEngine {
    /// Builds the engine and starts its task (call inside a tokio runtime).
    pub fn start(config: SimEngineConfig) -> Result<Self, engine_sim::ConfigError> {
        let mut engine_config = config.preset.engine_config(config.block_size);
        if let Some(blocks) = config.kv_capacity_blocks {
            engine_config.kv_capacity_blocks = blocks;
        }
        let engine = engine_sim::Engine::new(config.worker.clone(), config.role, engine_config)?;
        let facts = EngineFacts {
            contract: HashingContract {
                model: config.preset.model.to_owned(),
                block_size: engine_config.block_size,
                scheme: HASH_SCHEME.to_owned(),
                salt: engine_config.salt,
            },
            kv_capacity_blocks: u64::from(engine_config.kv_capacity_blocks),
            max_batched_tokens: engine_config.max_batched_tokens,
            kv_bytes_per_token: engine_config.kv_bytes_per_token,
            gpus: engine_config.gpus,
            // A request longer than the whole cache can never run.
            max_model_len: engine_config
                .kv_capacity_blocks
                .saturating_mul(engine_config.block_size),
        };
        let (commands_tx, commands) = mpsc::unbounded_channel();
        let (kv_tx, kv_rx) = mpsc::unbounded_channel();
        let initial = EngineLoad::from(&engine.load_report(0));
        let (load_tx, load_rx) = watch::channel(initial);
        let driver = Driver {
            engine,
            worker: config.worker,
            clock: VirtualClock {
                start: Instant::now(),
                speedup: config.speedup,
            },
            link: config.link,
            commands,
            kv: kv_tx,
            load: load_tx,
            live: HashMap::new(),
            transfers: BinaryHeap::new(),
            awaiting_kv: HashMap::new(),
            pulls: HashSet::new(),
            step: None,
            mirror: BlockMirror::new(),
            next_id: 0,
        };
        tokio::spawn(driver.run());
        Ok(Self {
            facts,
            commands: commands_tx,
            kv_updates: Mutex::new(Some(kv_rx)),
            load: load_rx,
        })
    }
}

impl Drop for SimEngine {
    fn drop(&mut self) {
        let _ = self.commands.send(Command::Stop);
    }
}

impl Engine for SimEngine {
    fn facts(&self) -> EngineFacts {
        self.facts.clone()
    }

    fn take_kv_updates(&self) -> Option<BoxStream<'static, KvUpdate>> {
        let mut rx = self
            .kv_updates
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()?;
        Some(stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed())
    }

    fn request_block_set(&self) {
        let _ = self.commands.send(Command::BlockSet);
    }

    fn load(&self) -> EngineLoad {
        *self.load.borrow()
    }

    fn generate(&self, request: GenerateRequest) -> BoxStream<'static, GenerateEvent> {
        let (events, mut rx) = mpsc::unbounded_channel();
        if self
            .commands
            .send(Command::Generate { request, events })
            .is_err()
        {
            return stream::iter([GenerateEvent::Failed {
                error: "the simulated engine stopped".into(),
                retryable: true,
            }])
            .boxed();
        }
        stream::poll_fn(move |cx| rx.poll_recv(cx)).boxed()
    }

    fn unsupported(&self, sampling: &Sampling) -> Option<&'static str> {
        sampling
            .fields_set()
            .into_iter()
            .find(|f| !SIM_HONOURS.contains(f))
    }

    fn stop(&self) {
        let _ = self.commands.send(Command::Stop);
    }
}

/// The sampling fields the simulated engine models: it has no
/// end-of-sequence token (every request runs to `max_tokens`, as with
/// `ignore_eos`), and stops at the first of `stop_token_ids` it emits at
/// or after `min_tokens` output tokens. It draws no tokens, so it cannot
/// honour temperature, penalties, seeds, logprobs and the like.
pub const SIM_HONOURS: [&str; 3] = ["stop_token_ids", "ignore_eos", "min_tokens"];

/// The tokens a simulated request emits and why it ends: `output`
/// up to and including its first stop token at or after `min_tokens`
/// tokens.
pub fn stop_at(output: Arc<[u32]>, sampling: &Sampling) -> (Arc<[u32]>, FinishReason) {
    let skip = sampling.min_tokens as usize;
    match output
        .iter()
        .enumerate()
        .skip(skip)
        .find(|(_, t)| sampling.stop_token_ids.contains(t))
    {
        Some((at, _)) => (output[..=at].into(), FinishReason::Stop),
        None => (output, FinishReason::Length),
    }
}

/// The output tokens of a request: pseudo-tokens of its id, by position.
pub fn output_tokens(request_id: &str, n: u32) -> Arc<[u32]> {
    let mut out = Vec::with_capacity(n as usize);
    protocol::trace::extend_block_tokens(
        xxhash_rust::xxh3::xxh3_64(request_id.as_bytes()),
        n as usize,
        &mut out,
    );
    out.into()
}

/// Virtual microseconds since the start, `speedup` times the wall clock.
#[derive(Debug, Clone, Copy)]
struct VirtualClock {
    start: Instant,
    speedup: f64,
}

impl VirtualClock {
    fn now_us(&self) -> u64 {
        // `as` saturates.
        (self.start.elapsed().as_secs_f64() * 1e6 * self.speedup) as u64
    }

    /// When virtual time reaches `virtual_us`.
    fn instant(&self, virtual_us: u64) -> Instant {
        let far = || self.start + Duration::from_secs(86_400 * 365);
        Duration::try_from_secs_f64(virtual_us as f64 / 1e6 / self.speedup)
            .ok()
            .and_then(|d| self.start.checked_add(d))
            .unwrap_or_else(far)
    }
}

/// A request the engine serves.
#[derive(Debug)]
struct Live {
    request_id: String,
    events: mpsc::UnboundedSender<GenerateEvent>,
    output: Arc<[u32]>,
    produced: usize,
    reason: FinishReason,
}

impl Live {
    fn send(&self, event: GenerateEvent) {
        // The receiver is gone only when the agent stopped forwarding.
        let _ = self.events.send(event);
    }
}

/// What wakes the engine task.
#[derive(Debug)]
enum DriverEvent {
    Command(Command),
    CommandsClosed,
    StepEnded,
    TransferDone,
}

/// The engine task's state.
#[derive(Debug)]
struct Driver {
    engine: engine_sim::Engine,
    worker: WorkerId,
    clock: VirtualClock,
    link: KvTransfer,
    commands: mpsc::UnboundedReceiver<Command>,
    kv: mpsc::UnboundedSender<KvUpdate>,
    load: watch::Sender<EngineLoad>,
    live: HashMap<u64, Live>,
    /// KV transfers in progress: (virtual end, request).
    transfers: BinaryHeap<Reverse<(u64, u64)>>,
    awaiting_kv: HashMap<u64, EngineRequest>,
    /// Prefill legs whose supplied prefix is on the link (the third path:
    /// the engine asked for it when it admitted them, [`Step::pulls`]).
    pulls: HashSet<u64>,
    /// The step running; its outputs apply when it ends.
    step: Option<engine_sim::Step>,
    mirror: BlockMirror,
    next_id: u64,
}

impl Driver {
    async fn run(mut self) {
        loop {
            if self.step.is_none() {
                self.start_step(self.clock.now_us());
            }
            match self.next_event().await {
                DriverEvent::Command(Command::Generate { request, events }) => {
                    self.accept(request, events)
                }
                DriverEvent::Command(Command::BlockSet) => {
                    self.forward_kv_events();
                    let _ = self
                        .kv
                        .send(KvUpdate::BlockSet(self.mirror.stored_events()));
                }
                DriverEvent::Command(Command::Stop) | DriverEvent::CommandsClosed => {
                    tracing::debug!(worker = %self.worker, "simulated engine stopped");
                    return;
                }
                DriverEvent::StepEnded => self.end_step(),
                DriverEvent::TransferDone => self.transfers_done(),
            }
            self.drop_abandoned();
            self.update_load();
        }
    }

    async fn next_event(&mut self) -> DriverEvent {
        let step_end = self.step.as_ref().map(|s| self.clock.instant(s.end_us()));
        let transfer_end = self
            .transfers
            .peek()
            .map(|Reverse((end, _))| self.clock.instant(*end));
        tokio::select! {
            command = self.commands.recv() => match command {
                Some(command) => DriverEvent::Command(command),
                None => DriverEvent::CommandsClosed,
            },
            _ = tokio::time::sleep_until(step_end.unwrap_or_else(Instant::now)), if step_end.is_some() => {
                DriverEvent::StepEnded
            }
            _ = tokio::time::sleep_until(transfer_end.unwrap_or_else(Instant::now)), if transfer_end.is_some() => {
                DriverEvent::TransferDone
            }
        }
    }

    fn accept(&mut self, request: GenerateRequest, events: mpsc::UnboundedSender<GenerateEvent>) {
        let id = self.next_id;
        self.next_id += 1;
        let (mode, full) = match &request.stage {
            Stage::Local => (
                Mode::LocalPrefill,
                output_tokens(&request.request_id, request.max_tokens),
            ),
            Stage::Prefill => (Mode::PrefillOnly, Arc::from(Vec::new())),
            Stage::Decode { .. } => (
                Mode::KvReceived,
                output_tokens(&request.request_id, request.max_tokens),
            ),
        };
        let (output, reason) = stop_at(full, &request.sampling);
        let pull = match (&request.stage, &request.annotation.fetch) {
            (Stage::Prefill, Some(f)) => Some(f.prefix_tokens),
            _ => None,
        };
        let prompt: Arc<[u32]> = request.prompt.into();
        let engine_request = EngineRequest {
            id,
            // The third path: the engine pulls the prefix the source holds
            // (what it lacks of it) when it admits the request, and computes
            // only the rest.
            pull_tokens: pull.map_or(0, |prefix| prefix.min(prompt.len() as u32)),
            prompt,
            output_tokens: output.clone(),
            mode,
        };
        self.live.insert(
            id,
            Live {
                request_id: request.request_id,
                events,
                output,
                produced: 0,
                reason,
            },
        );
        if mode == Mode::KvReceived {
            // The prompt's KV moves here first: what this worker does not
            // hold, over the link.
            let prompt = &engine_request.prompt;
            let held = u64::from(self.engine.cached_prefix_tokens(prompt));
            let bytes = self
                .engine
                .config()
                .kv_bytes((prompt.len() as u64).saturating_sub(held));
            let end = self
                .clock
                .now_us()
                .saturating_add(self.link.duration_us(bytes));
            self.transfers.push(Reverse((end, id)));
            self.awaiting_kv.insert(id, engine_request);
        } else {
            self.submit(engine_request);
        }
    }

    fn submit(&mut self, request: EngineRequest) {
        let id = request.id;
        if let Err(e) = self.engine.submit(request) {
            if let Some(live) = self.live.remove(&id) {
                live.send(GenerateEvent::Failed {
                    error: format!(
                        "the simulated engine refused request {:?}: {e}",
                        live.request_id
                    ),
                    retryable: false,
                });
            }
        }
    }

    /// The transfer the timer was set for is done, and any other due.
    fn transfers_done(&mut self) {
        let now = self.clock.now_us();
        let mut first = true;
        while let Some(&Reverse((end, id))) = self.transfers.peek() {
            if !first && end > now {
                break;
            }
            first = false;
            self.transfers.pop();
            if self.pulls.remove(&id) {
                // The pulled blocks are stored now: their events go out now.
                self.engine.pull_done(id);
                self.forward_kv_events();
            } else if let Some(request) = self.awaiting_kv.remove(&id) {
                self.submit(request);
            }
        }
    }

    fn end_step(&mut self) {
        let Some(step) = self.step.take() else {
            return;
        };
        for &output in &step.outputs {
            match output {
                StepOutput::FirstToken { id, .. } | StepOutput::Token { id } => {
                    if let Some(live) = self.live.get_mut(&id) {
                        if let Some(&token) = live.output.get(live.produced) {
                            live.produced += 1;
                            live.send(GenerateEvent::Tokens(vec![token]));
                        }
                    }
                }
                StepOutput::Finished {
                    id,
                    output_tokens,
                    cached_tokens,
                } => {
                    if let Some(live) = self.live.remove(&id) {
                        live.send(GenerateEvent::Finished {
                            output_tokens,
                            cached_tokens: Some(cached_tokens),
                            reason: live.reason,
                        });
                    }
                }
                StepOutput::PrefillDone {
                    id,
                    prompt_tokens,
                    cached_tokens,
                } => {
                    if let Some(live) = self.live.remove(&id) {
                        live.send(GenerateEvent::Prefilled {
                            transfer: KvTransferParams {
                                source: self.worker.clone(),
                                prompt_tokens,
                                engine: None,
                            },
                            cached_tokens: Some(cached_tokens),
                        });
                        live.send(GenerateEvent::Finished {
                            output_tokens: 0,
                            cached_tokens: Some(cached_tokens),
                            reason: FinishReason::Prefilled,
                        });
                    }
                }
                StepOutput::Preempted { id } => {
                    if let Some(live) = self.live.get(&id) {
                        tracing::debug!(request_id = %live.request_id, "preempted");
                    }
                }
            }
        }
        self.forward_kv_events();
        // A busy engine starts its next step when this one ended, not when
        // the timer woke us (which may be up to a timer tick later): the
        // virtual timeline stays exact and catches up with the wall clock.
        self.start_step(step.start_us + step.duration_us);
    }

    /// Starts the engine's next step at virtual time `at_us` (when there is
    /// work), and the pulls of supplied prefixes it asks for.
    fn start_step(&mut self, at_us: u64) {
        self.step = self.engine.step(at_us);
        let Some(step) = &mut self.step else {
            return;
        };
        for pull in std::mem::take(&mut step.pulls) {
            let bytes = self.engine.config().kv_bytes(u64::from(pull.tokens));
            let end = step.start_us.saturating_add(self.link.duration_us(bytes));
            tracing::debug!(worker = %self.worker, tokens = pull.tokens, bytes, "pulling a prefix");
            self.transfers.push(Reverse((end, pull.id)));
            self.pulls.insert(pull.id);
        }
    }

    /// Sends the engine's new KV events on, and mirrors them.
    fn forward_kv_events(&mut self) {
        let events = self.engine.take_kv_events();
        if events.is_empty() {
            return;
        }
        self.mirror.apply(&events);
        let _ = self.kv.send(KvUpdate::Events(events));
    }

    /// Aborts the requests whose stream the agent dropped (the router
    /// cancelled them): they leave the engine and free their KV.
    fn drop_abandoned(&mut self) {
        let abandoned: Vec<u64> = self
            .live
            .iter()
            .filter(|(_, live)| live.events.is_closed())
            .map(|(&id, _)| id)
            .collect();
        for id in abandoned {
            if let Some(live) = self.live.remove(&id) {
                let waiting_for_kv = self.awaiting_kv.remove(&id).is_some();
                self.pulls.remove(&id);
                let aborted = self.engine.abort(id);
                tracing::debug!(request_id = %live.request_id, waiting_for_kv, aborted, "request abandoned");
            }
        }
    }

    fn update_load(&mut self) {
        let mut load = EngineLoad::from(&self.engine.load_report(self.clock.now_us()));
        // Requests waiting for their KV are waiting too.
        load.waiting += self.awaiting_kv.len() as u32;
        self.load.send_if_modified(|current| {
            let changed = *current != load;
            *current = load;
            changed
        });
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use ::tests::fixtures::{generate_request as request, output_tokens as tokens_of};

    /// The simulated engine stops at the first stop token at or after
    /// `min_tokens`, and runs to `max_tokens` without one.
    #[test]
    fn stop_token_ids_and_min_tokens() {
        let out = output_tokens("r", 12);
        let stop = out[3];
        let sampling = |min_tokens| Sampling {
            stop_token_ids: vec![stop],
            min_tokens,
            ..Sampling::default()
        };
        let first = out.iter().position(|&t| t == stop).unwrap();
        let (got, reason) = stop_at(out.clone(), &sampling(0));
        assert_eq!((&got[..], reason), (&out[..=first], FinishReason::Stop));
        let (got, reason) = stop_at(out.clone(), &sampling(12));
        assert_eq!((&got[..], reason), (&out[..], FinishReason::Length));
        let (got, _) = stop_at(out.clone(), &Sampling::default());
        assert_eq!(got.len(), 12);
    }
    use protocol::{BlockHasher, KvEvent};

    use super::*;

    fn worker() -> WorkerId {
        WorkerId::new("sim", 0).unwrap()
    }

    fn start(role: Role, link_gb_s: f64) -> SimEngine {
        SimEngine::start(SimEngineConfig {
            worker: worker(),
            role,
            preset: Preset::llama8b_h100(),
            block_size: 16,
            kv_capacity_blocks: None,
            speedup: 100.0,
            link: KvTransfer {
                setup_us: 0,
                bytes_per_s: link_gb_s * 1e9,
            },
        })
        .unwrap()
    }

    async fn collect(s: BoxStream<'static, GenerateEvent>) -> Vec<GenerateEvent> {
        tokio::time::timeout(Duration::from_secs(10), s.collect())
            .await
            .expect("the stream ends")
    }

    /// The third path's prefill leg: the engine pulls the prefix named by
    /// the annotation's fetch over the link when it admits the leg (only the
    /// rest is computed: the engine reports it cached).
    #[tokio::test]
    async fn a_fetching_prefill_receives_its_prefix_first() {
        let engine = start(Role::Prefill, 87.0);
        let prompt: Vec<u32> = (0..640).collect();
        let mut r = request("f", Stage::Prefill, prompt, 3);
        r.annotation.fetch = Some(protocol::PrefixFetch {
            source: "d0".parse().unwrap(),
            prefix_tokens: 512,
            pulled_tokens: 512,
        });
        let events = collect(engine.generate(r)).await;
        assert!(
            matches!(
                events.first(),
                Some(GenerateEvent::Prefilled {
                    cached_tokens: Some(512),
                    ..
                })
            ),
            "{events:?}"
        );
    }

    #[tokio::test]
    async fn serves_each_stage_and_reports_its_blocks() {
        let engine = start(Role::Both, 87.0);
        let mut kv = engine.take_kv_updates().unwrap();
        assert!(engine.take_kv_updates().is_none(), "one KV stream");
        let prompt: Vec<u32> = (0..64).collect();

        let events = collect(engine.generate(request("a", Stage::Local, prompt.clone(), 3))).await;
        assert_eq!(tokens_of(&events), output_tokens("a", 3).to_vec());
        assert_eq!(
            events.last(),
            Some(&GenerateEvent::Finished {
                output_tokens: 3,
                cached_tokens: Some(0),
                reason: FinishReason::Length
            })
        );

        let events =
            collect(engine.generate(request("b", Stage::Prefill, prompt.clone(), 3))).await;
        assert_eq!(
            events,
            vec![
                GenerateEvent::Prefilled {
                    transfer: KvTransferParams {
                        source: worker(),
                        prompt_tokens: 64,
                        engine: None
                    },
                    cached_tokens: Some(48),
                },
                GenerateEvent::Finished {
                    output_tokens: 0,
                    cached_tokens: Some(48),
                    reason: FinishReason::Prefilled
                },
            ]
        );

        let transfer = KvTransferParams {
            source: WorkerId::new("p0", 0).unwrap(),
            prompt_tokens: 64,
            engine: None,
        };
        let events =
            collect(engine.generate(request("c", Stage::Decode { transfer }, prompt.clone(), 2)))
                .await;
        assert!(matches!(
            events.last(),
            Some(GenerateEvent::Finished {
                output_tokens: 2,
                ..
            })
        ));

        // The blocks of the prompt were reported, and the block set holds
        // every reported block.
        engine.request_block_set();
        let mut reported = BlockMirror::new();
        let set = loop {
            match tokio::time::timeout(Duration::from_secs(5), kv.next())
                .await
                .unwrap()
                .unwrap()
            {
                KvUpdate::Events(events) => {
                    assert!(!events.contains(&KvEvent::Cleared));
                    reported.apply(&events);
                }
                KvUpdate::BlockSet(set) => break set,
            }
        };
        let hasher = BlockHasher::new(16, Preset::llama8b_h100().salt()).unwrap();
        for hash in hasher.hash_prompt(&prompt) {
            assert!(reported.contains(hash));
        }
        assert_eq!(set, reported.stored_events());
        assert_eq!(
            engine.facts().contract,
            HashingContract::for_model(Preset::llama8b_h100().model, 16)
        );
        assert_eq!(engine.load().running, 0);
    }

    #[tokio::test]
    async fn bad_requests_fail_and_stop_ends_streams() {
        let engine = start(Role::Both, 87.0);
        let events = collect(engine.generate(request("e", Stage::Local, vec![], 3))).await;
        assert!(
            matches!(
                &events[..],
                [GenerateEvent::Failed { retryable: false, error }] if error.contains("\"e\"") && error.contains("empty prompt")
            ),
            "{events:?}"
        );

        // A long decode, interrupted.
        let stream = engine.generate(request("long", Stage::Local, (0..64).collect(), 100_000));
        tokio::time::sleep(Duration::from_millis(50)).await;
        engine.stop();
        let events = collect(stream).await;
        assert!(!events.last().unwrap().is_last(), "the stream just ends");
        assert!(matches!(
            collect(engine.generate(request("late", Stage::Local, vec![1], 1))).await[..],
            [GenerateEvent::Failed {
                retryable: true,
                ..
            }]
        ));
    }

    #[tokio::test]
    async fn a_decode_waits_for_its_kv_transfer() {
        // 1 MB/s: 64 tokens of 131,072 B take 8.4 s virtual, 84 ms real.
        let engine = start(Role::Decode, 0.001);
        let transfer = KvTransferParams {
            source: WorkerId::new("p0", 0).unwrap(),
            prompt_tokens: 64,
            engine: None,
        };
        let started = Instant::now();
        let events = collect(engine.generate(request(
            "d",
            Stage::Decode { transfer },
            (0..64).collect(),
            1,
        )))
        .await;
        assert!(
            started.elapsed() >= Duration::from_millis(80),
            "{:?}",
            started.elapsed()
        );
        assert!(matches!(
            events.last(),
            Some(GenerateEvent::Finished { .. })
        ));
    }
}
