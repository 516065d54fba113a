//! The SLA-driven policy: predicts time to first token on each path (local
//! on the decode worker; remote from the prefill worker's cache; remote
//! with the prefix fetched from the decode worker that holds it, when the
//! router offers it) and the inter-token latency a local prefill inflicts
//! on the decode worker, or a prefix read on the worker serving it.

use protocol::{Path, WorkerRecord};
use serde::{Deserialize, Serialize};

use super::{
    positive, rules, ConditionalDisaggPolicy, HeldTokens, ParamError, PolicyInput, Verdict,
};
use crate::core::calibrate::{Expected, Factors};

/// Engine timing constants, in milliseconds. The defaults fit Llama-3.3-70B
/// FP8, TP2 on 2 × H100 (see `engine-timing.md` in the project reference):
/// TTFT 48 ms for 500 tokens and 407 ms for 5 000; ITL 18.6 / 38.8 /
/// 59.7 ms at 1 / 25 / 50 running requests of about 5k tokens of context;
/// KV moved at 87 GB/s.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct CostModel {
    /// Fixed cost of a prefill step (launch, weights pass). Default 15.
    pub prefill_c0_ms: f64,
    /// Linear cost per new prompt token (MLP, projections). Default 0.065.
    pub prefill_c1_ms: f64,
    /// Attention cost per new token per attended token: the prefill of
    /// `n_new` tokens after `n_cached` cached ones costs
    /// `c0 + c1 * n_new + c2 * n_new * (n_new + 2 * n_cached)`.
    /// Default 2.75e-6.
    pub prefill_c2_ms: f64,
    /// Fixed cost of a decode step (reading the weights). Default 17.8.
    pub decode_t0_ms: f64,
    /// Cost per sequence in the decode batch. Default 0.6.
    pub decode_per_seq_ms: f64,
    /// Cost per context token of the batch (reading its KV): a step costs
    /// `t0 + per_seq * batch + per_ctx_token * sum_context`. Default 4.4e-5
    /// (80 KB per token per GPU at 56% of 3.35 TB/s).
    pub decode_per_ctx_token_ms: f64,
    /// Fixed cost of one P -> D KV transfer. Default 2.
    pub transfer_setup_ms: f64,
    /// Transfer bandwidth in bytes per millisecond. Default 87e6 (87 GB/s).
    pub transfer_bytes_per_ms: f64,
    /// Share by which a decode step of the worker serving a prefix read
    /// (D -> P, the third path) is longer while the read runs (HBM
    /// contention of the NIXL read). Default 0.03: an assumption, not a
    /// measurement (engine-sim uses the same figure).
    pub read_step_overhead: f64,
    /// Fixed cost of reading a prefix back from a worker's host memory
    /// (an offloaded tier, G2). Default 0.05.
    pub host_read_setup_ms: f64,
    /// Host link bandwidth per GPU of the worker (PCIe), bytes per ms: a
    /// worker reads back at `gpus` times this. Default 50e6 (50 GB/s, an
    /// assumption: PCIe Gen5 x16 at about 80%; engine-sim uses the same
    /// figure). Tokens held only on host (or disk) are neither free nor
    /// recomputed: the request waits for this read before it runs.
    pub host_read_bytes_per_ms: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            prefill_c0_ms: 15.0,
            prefill_c1_ms: 0.065,
            prefill_c2_ms: 2.75e-6,
            decode_t0_ms: 17.8,
            decode_per_seq_ms: 0.6,
            decode_per_ctx_token_ms: 4.4e-5,
            transfer_setup_ms: 2.0,
            transfer_bytes_per_ms: 87e6,
            read_step_overhead: 0.03,
            host_read_setup_ms: 0.05,
            host_read_bytes_per_ms: 50e6,
        }
    }
}

impl CostModel {
    /// One prefill of `n_new` tokens after `n_cached` cached ones (0 when
    /// there is nothing to prefill).
    pub fn prefill_ms(&self, n_new: u64, n_cached: u64) -> f64 {
        if n_new == 0 {
            return 0.0;
        }
        let (n, c) = (n_new as f64, n_cached as f64);
        self.prefill_c0_ms + self.prefill_c1_ms * n + self.prefill_c2_ms * n * (n + 2.0 * c)
    }

    /// The extra time a chunk of `chunk` prefill tokens after `n_cached`
    /// cached ones adds to a decode step it is mixed into (the step's fixed
    /// cost is already paid by the decodes).
    pub fn mixed_chunk_ms(&self, chunk: u64, n_cached: u64) -> f64 {
        let (n, c) = (chunk as f64, n_cached as f64);
        self.prefill_c1_ms * n + self.prefill_c2_ms * n * (n + 2.0 * c)
    }

    /// One decode step of `batch` sequences holding `sum_context` tokens.
    pub fn decode_step_ms(&self, batch: u32, sum_context: u64) -> f64 {
        self.decode_t0_ms
            + self.decode_per_seq_ms * f64::from(batch)
            + self.decode_per_ctx_token_ms * sum_context as f64
    }

    /// Moving `bytes` of KV from a prefill to a decode worker.
    pub fn transfer_ms(&self, bytes: u64) -> f64 {
        self.transfer_setup_ms + bytes as f64 / self.transfer_bytes_per_ms.max(f64::MIN_POSITIVE)
    }

    /// Reading back the KV of `tokens` tokens a worker holds only in an
    /// offloaded tier (host or disk: disk is read at the host link's rate,
    /// a lower bound) before the request can run there: 0 when none.
    pub fn host_read_ms(&self, held: &HeldTokens, isl: u64, record: &WorkerRecord) -> f64 {
        let device = u64::from(held.device).min(isl);
        let offloaded = u64::from(held.any()).min(isl).saturating_sub(device);
        if offloaded == 0 {
            return 0.0;
        }
        let bytes = offloaded.saturating_mul(record.kv_bytes_per_token) as f64;
        let rate = self.host_read_bytes_per_ms * f64::from(record.gpus.max(1));
        self.host_read_setup_ms + bytes / rate.max(f64::MIN_POSITIVE)
    }

    /// Time to work off `queued` prefill tokens in steps of at most
    /// `max_batched` tokens, ignoring their attention term (their context is
    /// unknown): a lower bound of the wait.
    pub fn queue_ms(&self, queued: u64, max_batched: u32) -> f64 {
        if queued == 0 {
            return 0.0;
        }
        let steps = queued.div_ceil(u64::from(max_batched.max(1)));
        steps as f64 * self.prefill_c0_ms + self.prefill_c1_ms * queued as f64
    }
}

/// What [`SlaDynamic`] predicts for one request. Times in ms; "model" times
/// are the cost model's, the others are corrected by the calibration
/// factors ([`Factors`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlaPrediction {
    /// Tokens a bypass prefills on the decode worker (after its overlap).
    pub local_prefill_tokens: u64,
    /// The decode worker's read-back of the part of its overlap it holds
    /// only on host ([`CostModel::host_read_ms`]; 0 when all on device).
    pub local_host_read_ms: f64,
    /// The model's time to a bypass's first token: the decode worker's
    /// prefill queue, the read-back of its host-held overlap, the local
    /// prefill, and the decode batch run in each of the prefill's chunked
    /// steps.
    pub local_model_ms: f64,
    /// `local_model_ms` times the local TTFT factor.
    pub local_ttft_ms: f64,
    /// The model's decode step on the decode worker with this request in its
    /// batch (without any prefill mixed in).
    pub step_model_ms: f64,
    /// The inter-token latency the decode worker reported its decodes saw
    /// lately ([`crate::EffectiveLoad::recent_itl_us`]; 0: unknown or nothing
    /// decoding).
    pub recent_itl_ms: f64,
    /// The decode worker's ITL without this request's prefill:
    /// `step_model_ms` times the ITL factor (which learnt how much the
    /// batch's growth and the prefills mixed in lengthen a request's ITL),
    /// and no less than `recent_itl_ms`: the model knows neither the
    /// prefills now mixed into that worker's steps nor how one worker
    /// differs from the rest, the report does.
    pub itl_base_ms: f64,
    /// The time this local prefill's chunks add to the steps they are mixed
    /// into: every request running there waits that much longer.
    pub prefill_stall_ms: f64,
    /// The decode worker's ITL with this local prefill: the base plus the
    /// stall spread over an answer of the expected length (the ITL target
    /// is a per-request mean).
    pub itl_local_ms: f64,
    /// Requests running on the decode worker (whom a local prefill slows).
    pub running: u32,
    /// Tokens a remote prefill computes on the prefill worker (after its
    /// overlap).
    pub remote_prefill_tokens: u64,
    /// The prefill worker's read-back of its host-held overlap.
    pub remote_host_read_ms: f64,
    /// The model's time to the end of a remote prefill: the prefill worker's
    /// queue, the read-back of its host-held overlap and its prefill.
    pub remote_model_ms: f64,
    /// KV transfer time of the whole prompt to the decode worker.
    pub transfer_ms: f64,
    /// Time to first token on the remote path: `remote_model_ms` times the
    /// remote TTFT factor, plus the transfer.
    pub remote_ttft_ms: f64,
    /// The model's compute for the prefill itself on each path (no queue):
    /// what each path spends of the deployment's prefill capacity.
    pub local_work_ms: f64,
    pub remote_work_ms: f64,
    /// The third path, when the router offered it.
    pub fetch: Option<FetchPrediction>,
    /// The calibration factors used.
    pub factors: Factors,
}

/// What [`SlaDynamic`] predicts for a remote prefill whose prefill worker
/// first pulls the prefix the decode worker holds. Times in ms.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FetchPrediction {
    /// Tokens pulled from the source.
    pub pulled_tokens: u64,
    /// The prefix the prefill worker holds after the pull.
    pub prefix_tokens: u64,
    /// The pull (D -> P) on the KV link.
    pub pull_ms: f64,
    /// Tokens the prefill worker computes after the pull.
    pub prefill_tokens: u64,
    /// The model's time on the prefill worker: its queue and the prefill of
    /// the rest.
    pub model_ms: f64,
    /// Pull, corrected prefill (the remote TTFT factor), and the P -> D
    /// transfer.
    pub ttft_ms: f64,
    /// The prefill compute itself (no queue).
    pub work_ms: f64,
    /// The source's ITL while it serves the read (0 when it runs nothing).
    pub source_itl_ms: f64,
    /// What each request running on the source loses to the read: its
    /// steps are `read_step_overhead` longer for the pull's duration.
    pub source_stall_ms: f64,
}

/// The prefill side of a [`SlaPrediction`] (its `remote_*`, `transfer_ms`
/// and `fetch` fields), predicted once for a decision.
#[derive(Debug, Clone, Copy)]
struct RemotePrediction {
    prefill_tokens: u64,
    host_read_ms: f64,
    model_ms: f64,
    transfer_ms: f64,
    ttft_ms: f64,
    work_ms: f64,
    fetch: Option<FetchPrediction>,
}

/// A cost chooser between the paths, against the SLO (its only
/// required parameters; the cost model's defaults are corrected online by
/// the calibration factors the router core learns, [`Factors`]).
///
/// The bypass is weighed on the decode worker the selection picked, or on
/// the one holding more of the prompt ([`PolicyInput::decode_holder`]) when
/// a bypass there meets the targets and one on the pick does not, or
/// computes more: where an append runs is then the policy's call, not the
/// decode selection's overlap credit. (Until 2026-12-07 it was the pick's
/// alone: at the router's default credit, 1, a later turn moved off its
/// conversation's worker went remote with its prefix fetched, or was
/// computed whole, and `sla_dynamic` held about 3.03 sessions/s on the
/// agentic workload at 2P+6D against about 3.2 now, seeds 1-20.) Then:
///
/// 1. both paths meet the targets (local: TTFT, and the decode worker's
///    ITL with this prefill; remote: TTFT): the one that spends less
///    prefill compute (a bypass reuses the decode worker's prefix, a remote
///    prefill what the prefill worker holds). Equal work: remote when the
///    plain remote prefill (no pull: the prefill worker holds as much of
///    the prompt as the decode worker) fits in the prefill worker's next
///    step (its queue and these tokens within one step's token budget,
///    `max_batched_tokens`): compute nobody waits for, and the decode
///    worker's running requests are spared its stall. Otherwise the
///    sooner first token (ties local).
///
///    Until 2026-12-06 equal work went remote, "which slows no decode": on
///    the agentic workload near its capacity one request in seven (mostly
///    appends to a prompt both sides held) then queued on the two busy
///    prefill workers for nothing, and SLO attainment was 1.2-1.5 points
///    lower at 2.7-2.9 sessions/s (20 seeds). Until 2026-12-07 it went to
///    the sooner first token alone, local once a few hundred tokens were
///    queued on the prefill worker (a remote first token also pays the
///    transfer): on single-turn prompts sharing prefixes every worker
///    holds (`sim --workload synthetic`) the decode workers then took
///    every tie up to their ITL target and 8% of the requests missed it,
///    while the prefill workers had room;
/// 2. only one meets them: that one;
/// 3. neither: remote when the decode worker's running requests would be
///    over the ITL target with the local prefill (it misses them all,
///    remote misses one), whether or not they already are without it (a
///    decode worker past its ITL target takes no more prefill work: letting
///    the sooner first token decide there drove ITL ever further past the
///    target once the prefill workers' queue grew) and, with a limit
///    (`spare_decodes_up_to`), the remote first token is within it;
///    otherwise the sooner first token (ties remote; a bypass past the
///    limit is `sla.local_remote_overloaded`).
///
/// "Remote" is the better of two remote prefills when the router offers
/// the third path ([`PolicyInput::fetch`]): from the prefill worker's own
/// cache, or with the prefix pulled from the decode worker that holds it
/// (the pull's time on the KV link is in its TTFT; the read lengthens the
/// source's steps by `read_step_overhead` while it runs, a stall the
/// explanation names): the one whose first token meets the target, then
/// the one that computes less on the prefill worker.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SlaDynamic {
    /// Time-to-first-token target (ms). Default 2000.
    pub ttft_target_ms: f64,
    /// Inter-token latency target (ms). Default 60.
    pub itl_target_ms: f64,
    /// How long a request that neither path serves in time may be predicted
    /// to wait for its first token on the prefill worker, as a multiple of
    /// the TTFT target, and still be sent there to spare the decode
    /// worker's running requests a local prefill's stall
    /// ([`rules::SLA_REMOTE_SPARES_DECODES`]); past it the sooner first
    /// token wins ([`rules::SLA_LOCAL_REMOTE_OVERLOADED`]). Default 0: no
    /// limit, which keeps the most requests within the SLO but lets the
    /// prefill side's queue grow for as long as an overload lasts (with one
    /// prefill worker, a TTFT p99 of minutes at 90% attainment). A limit
    /// bounds that queue and moves the overload onto the decode workers'
    /// ITL: the README measures the trade.
    pub spare_decodes_up_to: f64,
    /// Engine timing (a prior: the calibration corrects it).
    #[serde(flatten)]
    pub cost: CostModel,
}

impl Default for SlaDynamic {
    fn default() -> Self {
        Self::new(2_000.0, 60.0, CostModel::default())
    }
}

impl SlaDynamic {
    /// The policy for the given targets and cost model.
    pub fn new(ttft_target_ms: f64, itl_target_ms: f64, cost: CostModel) -> Self {
        Self {
            ttft_target_ms,
            itl_target_ms,
            spare_decodes_up_to: 0.0,
            cost,
        }
    }

    /// The policy for an SLO, with the cost model's defaults (which the
    /// calibration corrects): all an operator sets.
    pub fn with_slo(ttft_target_ms: f64, itl_target_ms: f64) -> Self {
        Self::new(ttft_target_ms, itl_target_ms, CostModel::default())
    }

    /// Checks what the registry's generic check (every parameter finite and
    /// `>= 0`) does not: the targets and the bandwidth are `> 0`.
    pub fn validate(&self) -> Result<(), ParamError> {
        positive("ttft_target_ms", self.ttft_target_ms)?;
        positive("itl_target_ms", self.itl_target_ms)?;
        positive("transfer_bytes_per_ms", self.cost.transfer_bytes_per_ms)?;
        positive("host_read_bytes_per_ms", self.cost.host_read_bytes_per_ms)
    }

    /// The longest predicted remote TTFT at which a request neither path
    /// serves in time still goes remote to spare the decodes
    /// ([`SlaDynamic::spare_decodes_up_to`]; infinite without a limit).
    pub fn spare_limit_ms(&self) -> f64 {
        if self.spare_decodes_up_to > 0.0 {
            self.spare_decodes_up_to * self.ttft_target_ms
        } else {
            f64::INFINITY
        }
    }

    /// The numbers the policy decides on.
    pub fn predict(&self, input: &PolicyInput<'_>) -> SlaPrediction {
        self.predict_with(input, self.predict_remote(input))
    }

    /// The prediction for `input`'s decode worker, with the prefill side
    /// already predicted (it does not depend on the decode worker, so a
    /// bypass weighed on two of them shares it).
    fn predict_with(&self, input: &PolicyInput<'_>, remote: RemotePrediction) -> SlaPrediction {
        let c = &self.cost;
        let k = input.calibration;
        let isl = u64::from(input.isl_tokens);
        let bs = u64::from(input.block_size);

        let d = &input.decode;
        let d_hit = u64::from(d.held.any()).min(isl);
        let local = (isl - d_hit).max(1);
        let mbt_d = u64::from(d.record.max_batched_tokens.max(1));
        let chunks = local.div_ceil(mbt_d);
        let batch = d.load.running;
        let context = d.load.active_decode_blocks.saturating_mul(bs);
        let step_model = c.decode_step_ms(batch.saturating_add(1), context.saturating_add(isl));
        let step_now = if batch > 0 {
            c.decode_step_ms(batch, context)
        } else {
            0.0
        };
        let local_work = c.prefill_ms(local, isl - local);
        let local_read = c.host_read_ms(&d.held, isl, d.record);
        let local_model = c.queue_ms(d.load.queued_prefill_tokens, mbt_d as u32)
            + local_read
            + local_work
            + chunks as f64 * step_now;
        // Chunk k attends to the cached prefix and the chunks before it.
        let stall: f64 = (0..chunks)
            .map(|i| {
                let start = i * mbt_d;
                let chunk = (local - start).min(mbt_d);
                c.mixed_chunk_ms(chunk, d_hit + start)
            })
            .sum();
        let recent_itl = if batch > 0 {
            f64::from(d.load.recent_itl_us) / 1000.0
        } else {
            0.0
        };
        let itl_base = (k.itl * step_model).max(recent_itl);
        let itl_local = itl_base + stall / f64::from(input.expected_output_tokens.max(1));

        let RemotePrediction {
            prefill_tokens: remote_prefill_tokens,
            host_read_ms: remote_host_read_ms,
            model_ms: remote_model_ms,
            transfer_ms,
            ttft_ms: remote_ttft_ms,
            work_ms: remote_work_ms,
            fetch,
        } = remote;
        SlaPrediction {
            local_prefill_tokens: local,
            local_host_read_ms: local_read,
            local_model_ms: local_model,
            local_ttft_ms: k.local_ttft * local_model,
            step_model_ms: step_model,
            recent_itl_ms: recent_itl,
            itl_base_ms: itl_base,
            prefill_stall_ms: stall,
            itl_local_ms: itl_local,
            running: batch,
            remote_prefill_tokens,
            remote_host_read_ms,
            remote_model_ms,
            transfer_ms,
            remote_ttft_ms,
            local_work_ms: local_work,
            remote_work_ms,
            fetch,
            factors: k,
        }
    }

    /// The prefill side of a prediction: the plain remote prefill and,
    /// when offered, the one with the prefix fetched.
    fn predict_remote(&self, input: &PolicyInput<'_>) -> RemotePrediction {
        let c = &self.cost;
        let k = input.calibration;
        let isl = u64::from(input.isl_tokens);
        let bs = u64::from(input.block_size);

        let p = &input.prefill;
        let p_hit = u64::from(p.held.any()).min(isl);
        let remote = (isl - p_hit).max(1);
        let transfer = c.transfer_ms(isl.saturating_mul(p.record.kv_bytes_per_token));
        let remote_work = c.prefill_ms(remote, isl - remote);
        let remote_read = c.host_read_ms(&p.held, isl, p.record);
        let remote_model = c.queue_ms(p.load.queued_prefill_tokens, p.record.max_batched_tokens)
            + remote_read
            + remote_work;

        let fetch = input.fetch.map(|f| {
            let prefix = u64::from(f.prefix_tokens).min(isl - 1);
            let pulled = u64::from(f.pulled_tokens);
            let rest = (isl - prefix).max(1);
            let pull = c.transfer_ms(pulled.saturating_mul(f.source.record.kv_bytes_per_token));
            let work = c.prefill_ms(rest, prefix);
            let model =
                c.queue_ms(p.load.queued_prefill_tokens, p.record.max_batched_tokens) + work;
            let s = f.source.load;
            let source_itl = if s.running > 0 {
                k.itl
                    * c.decode_step_ms(s.running, s.active_decode_blocks.saturating_mul(bs))
                    * (1.0 + c.read_step_overhead)
            } else {
                0.0
            };
            let source_stall = if s.running > 0 {
                c.read_step_overhead * pull
            } else {
                0.0
            };
            FetchPrediction {
                pulled_tokens: pulled,
                prefix_tokens: prefix,
                pull_ms: pull,
                prefill_tokens: rest,
                model_ms: model,
                ttft_ms: pull + k.remote_ttft * model + transfer,
                work_ms: work,
                source_itl_ms: source_itl,
                source_stall_ms: source_stall,
            }
        });

        RemotePrediction {
            prefill_tokens: remote,
            host_read_ms: remote_read,
            model_ms: remote_model,
            transfer_ms: transfer,
            ttft_ms: k.remote_ttft * remote_model + transfer,
            work_ms: remote_work,
            fetch,
        }
    }

    /// What the calibration compares with what is observed: the model's
    /// times, uncorrected, for the path taken.
    pub fn expected(&self, input: &PolicyInput<'_>, path: Path) -> Expected {
        let s = self.predict(input);
        Expected {
            path,
            prefill_ms: match (path, s.fetch) {
                (Path::Bypass, _) => s.local_model_ms,
                (Path::RemoteFetch, Some(f)) => f.pull_ms + f.model_ms,
                (Path::Remote | Path::RemoteFetch, _) => s.remote_model_ms,
            },
            itl_ms: s.step_model_ms,
        }
    }
}

/// The remote option the chooser weighs against the local one: a plain
/// remote prefill, or the one with the prefix fetched.
struct RemoteOption {
    path: Path,
    ttft_ms: f64,
    work_ms: f64,
    ok: bool,
    rules: [&'static str; 4],
    what: String,
}

impl SlaDynamic {
    /// The better of the plain remote prefill and, when offered, the
    /// fetching one: the one whose first token meets the target, then the
    /// one that computes less on the prefill worker (also when neither
    /// meets it: the prefill worker is then the bottleneck, and every
    /// request queued behind this one waits for what it computes).
    ///
    /// The read's cost to its source is not a veto: it lengthens the
    /// source's steps by `read_step_overhead` for the pull's duration (a
    /// stall of a few ms, explained as such), while the plain path
    /// recomputes the whole prefix on the prefill worker. Until 2026-12-06
    /// a source whose ITL with the read was over the target was refused;
    /// on the agentic workload that sent the prefix's compute to the
    /// prefill workers and cost 1-3 points of SLO attainment at 2.4-2.8
    /// sessions/s (3 seeds).
    fn remote_option(&self, input: &PolicyInput<'_>, s: &SlaPrediction) -> RemoteOption {
        let p = input.prefill.id;
        let plain = RemoteOption {
            path: Path::Remote,
            ttft_ms: s.remote_ttft_ms,
            work_ms: s.remote_work_ms,
            ok: s.remote_ttft_ms <= self.ttft_target_ms,
            rules: [
                rules::SLA_REMOTE_NO_MORE_WORK,
                rules::SLA_REMOTE_MEETS_TARGETS,
                rules::SLA_REMOTE_SPARES_DECODES,
                rules::SLA_REMOTE_SOONER,
            ],
            what: format!("remote prefill on {p}"),
        };
        let (Some(f), Some(offer)) = (s.fetch, input.fetch) else {
            return plain;
        };
        let fetch = RemoteOption {
            path: Path::RemoteFetch,
            ttft_ms: f.ttft_ms,
            work_ms: f.work_ms,
            ok: f.ttft_ms <= self.ttft_target_ms,
            rules: [
                rules::SLA_FETCH_LESS_WORK,
                rules::SLA_FETCH_MEETS_TARGETS,
                rules::SLA_FETCH_SPARES_DECODES,
                rules::SLA_FETCH_SOONER,
            ],
            what: format!(
                "remote prefill on {p} with {} tokens fetched from {}",
                f.pulled_tokens, offer.source.id
            ),
        };
        let better = match (fetch.ok, plain.ok) {
            (true, false) => true,
            (false, true) => false,
            (true, true) | (false, false) => fetch.work_ms < plain.work_ms,
        };
        if better {
            fetch
        } else {
            plain
        }
    }
}

/// Whether the prefill worker's next step has room for a prefill of
/// `tokens`: its queue and these fit in one step's token budget. A budget
/// of 0 (not registered) has room for nothing.
fn prefill_has_room(input: &PolicyInput<'_>, tokens: u64) -> bool {
    let budget = u64::from(input.prefill.record.max_batched_tokens);
    let queued = input.prefill.load.queued_prefill_tokens;
    budget > 0 && queued.saturating_add(tokens) <= budget
}

impl SlaDynamic {
    /// Whether a bypass predicted `s` meets both targets.
    fn local_meets_targets(&self, s: &SlaPrediction) -> bool {
        s.local_ttft_ms <= self.ttft_target_ms && s.itl_local_ms <= self.itl_target_ms
    }

    /// Where a bypass is weighed: on the chosen decode worker, or on the
    /// decode worker holding more of the prompt
    /// ([`PolicyInput::decode_holder`]) when a bypass there meets the
    /// targets and one on the chosen worker does not, or computes more.
    fn local_option<'a>(&self, input: &PolicyInput<'a>) -> LocalOption<'a> {
        let remote = self.predict_remote(input);
        let s = self.predict_with(input, remote);
        let Some(h) = input.decode_holder else {
            return LocalOption {
                input: *input,
                prediction: s,
                on_holder: false,
                note: String::new(),
            };
        };
        let on_h = PolicyInput {
            decode: h,
            ..*input
        };
        let sh = self.predict_with(&on_h, remote);
        let (ok, ok_h) = (self.local_meets_targets(&s), self.local_meets_targets(&sh));
        let on_holder = ok_h && (!ok || sh.local_work_ms < s.local_work_ms);
        let d = input.decode.id;
        // The worker weighed and why, then the other one and its numbers.
        let (weighed, why, other, o) = match (on_holder, ok, ok_h) {
            (true, true, _) => (h.id, "which computes less".to_owned(), d, &s),
            (true, false, _) => (h.id, "which meets the targets".to_owned(), d, &s),
            (false, _, true) => (d, format!("as {} computes no less", h.id), h.id, &sh),
            (false, _, false) => (d, format!("as {} misses the targets", h.id), h.id, &sh),
        };
        let note = format!(
            "{} holds {} prompt tokens, {d} {}: local weighed on {weighed}, {why} (a bypass on {other}: {} tokens, TTFT {:.0} ms, ITL {:.1} ms, {:.0} ms of compute); ",
            h.id,
            h.held.any(),
            input.decode.held.any(),
            o.local_prefill_tokens,
            o.local_ttft_ms,
            o.itl_local_ms,
            o.local_work_ms
        );
        let (input, prediction) = if on_holder { (on_h, sh) } else { (*input, s) };
        LocalOption {
            input,
            prediction,
            on_holder,
            note,
        }
    }
}

/// Where [`SlaDynamic`] weighs a bypass, and what it predicts there.
struct LocalOption<'a> {
    /// The policy's input with that worker as its decode worker.
    input: PolicyInput<'a>,
    prediction: SlaPrediction,
    /// The worker is [`PolicyInput::decode_holder`].
    on_holder: bool,
    /// What decided between the two workers (empty when there was no
    /// choice), for the explanation.
    note: String,
}

impl ConditionalDisaggPolicy for SlaDynamic {
    fn decide(&self, chosen: &PolicyInput<'_>) -> Verdict {
        let local = self.local_option(chosen);
        let (input, s) = (&local.input, local.prediction);
        let (tt, it) = (self.ttft_target_ms, self.itl_target_ms);
        let (d, p) = (input.decode.id, input.prefill.id);
        let local_ok = self.local_meets_targets(&s);
        let r = self.remote_option(input, &s);
        let k = s.factors;
        let reported = if s.recent_itl_ms > 0.0 {
            format!(" (its decodes lately {:.1} ms)", s.recent_itl_ms)
        } else {
            String::new()
        };
        let mut numbers = format!(
            "local on {d}: {} tokens, TTFT {:.0} ms, ITL {:.1}{reported} -> {:.1} ms (stall {:.0} ms over {} running); remote on {p}: {} tokens, TTFT {:.0} ms (transfer {:.0} ms)",
            s.local_prefill_tokens,
            s.local_ttft_ms,
            s.itl_base_ms,
            s.itl_local_ms,
            s.prefill_stall_ms,
            s.running,
            s.remote_prefill_tokens,
            s.remote_ttft_ms,
            s.transfer_ms,
        );
        if s.local_host_read_ms > 0.0 || s.remote_host_read_ms > 0.0 {
            numbers.push_str(&format!(
                "; host read-back {:.1} ms local, {:.1} ms remote",
                s.local_host_read_ms, s.remote_host_read_ms
            ));
        }
        if let (Some(f), Some(offer)) = (s.fetch, input.fetch) {
            numbers.push_str(&format!(
                "; fetch: {} of {} prefix tokens from {} (pull {:.0} ms, its ITL {:.1} ms while read, a {:.1} ms stall for each of its running requests), then {} tokens on {p}: TTFT {:.0} ms",
                f.pulled_tokens,
                f.prefix_tokens,
                offer.source.id,
                f.pull_ms,
                f.source_itl_ms,
                f.source_stall_ms,
                f.prefill_tokens,
                f.ttft_ms,
            ));
        }
        numbers.push_str(&format!(
            "; targets {tt:.0} / {it:.1} ms; calibration TTFT x{:.2} local, x{:.2} remote, ITL x{:.2}",
            k.local_ttft, k.remote_ttft, k.itl,
        ));
        let [no_more_work, meets, spares, sooner] = r.rules;
        let harms_decodes = s.running > 0 && s.itl_local_ms > it;
        let spare_limit = self.spare_limit_ms();
        let what = &r.what;
        let (path, rule, why) = match (local_ok, r.ok) {
            (true, true) if s.local_work_ms < r.work_ms => (
                Path::Bypass,
                rules::SLA_LOCAL_SAVES_WORK,
                format!(
                    "both meet the targets; local prefill {:.0} ms < remote {:.0} ms of compute: bypass on {d}",
                    s.local_work_ms, r.work_ms
                ),
            ),
            (true, true) if r.work_ms < s.local_work_ms => (
                r.path,
                no_more_work,
                format!(
                    "both meet the targets; remote prefill {:.0} ms < local {:.0} ms of compute: {what}",
                    r.work_ms, s.local_work_ms
                ),
            ),
            (true, true)
                if r.path == Path::Remote && prefill_has_room(input, s.remote_prefill_tokens) =>
            (
                Path::Remote,
                rules::SLA_REMOTE_HAS_ROOM,
                format!(
                    "both meet the targets with the same compute ({:.0} ms) and {p} needs no pull; its next step has room for the prefill (a queue of {} tokens and these {} fit in one step's {}): {what}, sparing {d}'s running requests the stall",
                    r.work_ms,
                    input.prefill.load.queued_prefill_tokens,
                    s.remote_prefill_tokens,
                    input.prefill.record.max_batched_tokens,
                ),
            ),
            (true, true) if s.local_ttft_ms <= r.ttft_ms => (
                Path::Bypass,
                rules::SLA_LOCAL_SAVES_WORK,
                format!(
                    "both meet the targets with the same compute ({:.0} ms); local's first token is no later ({:.0} <= {:.0} ms): bypass on {d}",
                    s.local_work_ms, s.local_ttft_ms, r.ttft_ms
                ),
            ),
            (true, true) => (
                r.path,
                no_more_work,
                format!(
                    "both meet the targets with the same compute ({:.0} ms); remote's first token is sooner ({:.0} < {:.0} ms): {what}",
                    r.work_ms, r.ttft_ms, s.local_ttft_ms
                ),
            ),
            (true, false) => (
                Path::Bypass,
                rules::SLA_LOCAL_MEETS_TARGETS,
                format!("only local meets the targets: bypass on {d}"),
            ),
            (false, true) => (
                r.path,
                meets,
                format!("only remote meets the targets: {what}"),
            ),
            (false, false) if harms_decodes && r.ttft_ms <= spare_limit => (
                r.path,
                spares,
                format!(
                    "neither meets the targets; local would leave {} running requests over the ITL target{}: {what}",
                    s.running,
                    if spare_limit.is_finite() {
                        format!(
                            ", and remote's first token is within {spare_limit:.0} ms ({} x the TTFT target)",
                            self.spare_decodes_up_to
                        )
                    } else {
                        String::new()
                    }
                ),
            ),
            (false, false) if harms_decodes && s.local_ttft_ms < r.ttft_ms => (
                Path::Bypass,
                rules::SLA_LOCAL_REMOTE_OVERLOADED,
                format!(
                    "neither meets the targets; local would leave {} running requests over the ITL target, but remote's first token ({:.0} ms) is past {:.0} ms ({} x the TTFT target: the prefill side is overloaded) and local's is sooner: bypass on {d}",
                    s.running, r.ttft_ms, spare_limit, self.spare_decodes_up_to
                ),
            ),
            (false, false) if s.local_ttft_ms < r.ttft_ms => (
                Path::Bypass,
                rules::SLA_LOCAL_SOONER,
                format!("neither meets the targets; local's first token is sooner: bypass on {d}"),
            ),
            (false, false) => (
                r.path,
                sooner,
                format!("neither meets the targets; remote's first token is no later: {what}"),
            ),
        };
        let stays = if local.on_holder && path != Path::Bypass {
            format!("; its decode on {}, the selection's pick", chosen.decode.id)
        } else {
            String::new()
        };
        Verdict {
            path,
            rule,
            reason: format!("{}{numbers}: {why}{stays}", local.note),
            on_decode_holder: local.on_holder && path == Path::Bypass,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::core::policy::tests::Fixture;
    use crate::core::policy::{Candidate, HeldTokens};
    use crate::core::workers::EffectiveLoad;

    fn running(batch: u32, blocks: u64) -> EffectiveLoad {
        EffectiveLoad {
            running: batch,
            active_decode_blocks: blocks,
            kv_capacity_blocks: 10_000,
            ..EffectiveLoad::default()
        }
    }

    #[test]
    fn cost_model_reproduces_its_calibration() {
        let c = CostModel::default();
        assert!((c.prefill_ms(500, 0) - 48.0).abs() < 1.0);
        assert!((c.prefill_ms(5_000, 0) - 407.0).abs() < 3.0);
        let ctx = 5_250;
        assert!((c.decode_step_ms(1, ctx) - 18.6).abs() < 0.5);
        assert!((c.decode_step_ms(25, 25 * ctx) - 38.8).abs() < 1.0);
        assert!((c.decode_step_ms(50, 50 * ctx) - 59.7).abs() < 2.0);
        // an 8k-token 70B prefix (2.7 GB) at 87 GB/s: about 31 ms
        assert!((c.transfer_ms(8_192 * 327_680) - 33.0).abs() < 2.0);
    }

    fn decide(policy: &SlaDynamic, input: &PolicyInput<'_>) -> (Path, &'static str, String) {
        let v = policy.decide(input);
        (v.path, v.rule, v.reason)
    }

    /// Both paths meet the targets: the one that spends less prefill
    /// compute; the same work, the prefill worker while its next step has
    /// room for the prefill, else the sooner first token.
    #[test]
    fn both_meet_the_cheaper_path_wins_and_equal_work_goes_where_there_is_room() {
        let f = Fixture::new();
        let policy = SlaDynamic::default();
        let (path, rule, why) = decide(
            &policy,
            &f.input(8_000, 7_800, running(10, 640), EffectiveLoad::default()),
        );
        assert_eq!(
            (path, rule),
            (Path::Bypass, rules::SLA_LOCAL_SAVES_WORK),
            "{why}"
        );
        // A cold prompt of 4000 tokens: the same work on both sides. The
        // prefill worker's next step (8192 tokens) has room for it while
        // its queue is at most 4192 tokens.
        let queued = |tokens| EffectiveLoad {
            queued_prefill_tokens: tokens,
            ..EffectiveLoad::default()
        };
        for p_queue in [0, 4_192] {
            let (path, rule, why) = decide(
                &policy,
                &f.input(4_000, 0, running(10, 640), queued(p_queue)),
            );
            assert_eq!(
                (path, rule),
                (Path::Remote, rules::SLA_REMOTE_HAS_ROOM),
                "{why}"
            );
            assert!(
                why.contains("its next step has room for the prefill"),
                "{why}"
            );
        }
        // A prompt both sides hold 2000 tokens of (a shared system prompt)
        // ties the same way.
        let mut shared = f.input(6_000, 2_000, running(10, 640), queued(4_192));
        shared.prefill.held = shared.decode.held;
        let (path, rule, why) = decide(&policy, &shared);
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_HAS_ROOM),
            "{why}"
        );
        // A tie with the fetching remote prefill (the prefix pulled from
        // the decode worker) is no such case, though the prefill worker's
        // step has room: the sooner first token, local.
        let mut pulled = f.input(6_000, 4_000, running(10, 640), queued(1_000));
        pulled.fetch = Some(crate::core::fetch::FetchOption {
            source: pulled.decode,
            prefix_tokens: 4_000,
            pulled_tokens: 4_000,
        });
        let (path, rule, why) = decide(&policy, &pulled);
        assert_eq!(
            (path, rule),
            (Path::Bypass, rules::SLA_LOCAL_SAVES_WORK),
            "{why}"
        );
        assert!(why.contains("local's first token is no later"), "{why}");
        // A prefill worker that registered no step budget has room for
        // nothing.
        let mut p = f.p.clone();
        p.max_batched_tokens = 0;
        let mut unknown = f.input(4_000, 0, running(10, 640), queued(0));
        unknown.prefill.record = &p;
        let (_, rule, why) = decide(&policy, &unknown);
        assert_ne!(rule, rules::SLA_REMOTE_HAS_ROOM, "{why}");
        // One token more queued: local's first token is sooner, and the
        // prefill worker's queue stays as it is.
        let (path, rule, why) =
            decide(&policy, &f.input(4_000, 0, running(10, 640), queued(4_193)));
        assert_eq!(
            (path, rule),
            (Path::Bypass, rules::SLA_LOCAL_SAVES_WORK),
            "{why}"
        );
        assert!(why.contains("local's first token is no later"), "{why}");
        // Unless the decode worker's own queue is longer still.
        let d_load = EffectiveLoad {
            queued_prefill_tokens: 20_000,
            ..running(10, 640)
        };
        let (path, rule, why) = decide(&policy, &f.input(4_000, 0, d_load, queued(8_192)));
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_NO_MORE_WORK),
            "{why}"
        );
        assert!(why.contains("remote's first token is sooner"), "{why}");
    }

    /// The ITL target binds: just above the predicted ITL the append
    /// bypasses, just below it goes remote (whose TTFT meets the target).
    #[test]
    fn the_itl_target_is_the_threshold() {
        let f = Fixture::new();
        let input = f.input(8_000, 7_800, running(20, 20 * 64), EffectiveLoad::default());
        let itl = SlaDynamic::default().predict(&input).itl_local_ms;
        assert!(itl > 30.0 && itl < 60.0, "{itl}");
        for (target, path) in [
            (itl + 0.01, Path::Bypass),
            (itl, Path::Bypass),
            (itl - 0.01, Path::Remote),
        ] {
            let policy = SlaDynamic::with_slo(2_000.0, target);
            let (got, rule, why) = decide(&policy, &input);
            assert_eq!(got, path, "{why}");
            if path == Path::Remote {
                assert_eq!(rule, rules::SLA_REMOTE_MEETS_TARGETS, "{why}");
            }
        }
    }

    /// The decode worker's reported recent ITL is the floor of the ITL
    /// base: above the model's, it is the base (and can send an append
    /// remote the model alone would bypass); below it, or unknown, or with
    /// nothing running there, the model's stands.
    #[test]
    fn the_reported_itl_is_the_floor_of_the_base() {
        let f = Fixture::new();
        let policy = SlaDynamic::default();
        let with_itl = |us| EffectiveLoad {
            recent_itl_us: us,
            ..running(20, 20 * 64)
        };
        let plain = policy.predict(&f.input(8_000, 7_800, with_itl(0), EffectiveLoad::default()));
        assert_eq!(plain.recent_itl_ms, 0.0);
        let model = plain.itl_base_ms;
        assert!(model < 50.0, "{model}");

        let below = (model * 1000.0) as u32 - 1_000;
        let s = policy.predict(&f.input(8_000, 7_800, with_itl(below), EffectiveLoad::default()));
        assert_eq!(s.itl_base_ms, model);
        assert_eq!(s.recent_itl_ms, f64::from(below) / 1000.0);

        // 200 tokens' stall spread over the answer adds about 0.1 ms.
        let input = f.input(8_000, 7_800, with_itl(59_960), EffectiveLoad::default());
        let s = policy.predict(&input);
        assert_eq!(s.itl_base_ms, 59.96);
        // The stall is added to the base as before.
        let stall = plain.itl_local_ms - model;
        assert!(stall > 0.0 && (s.itl_local_ms - 59.96 - stall).abs() < 1e-9);
        let (path, rule, why) = decide(&policy, &input);
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_MEETS_TARGETS),
            "{why}"
        );
        assert!(
            why.contains("ITL 60.0 (its decodes lately 60.0 ms) -> 60.1 ms"),
            "{why}"
        );
        let (path, _, why) = decide(
            &policy,
            &f.input(8_000, 7_800, with_itl(0), EffectiveLoad::default()),
        );
        assert_eq!(path, Path::Bypass, "{why}");
        assert!(!why.contains("lately"), "{why}");

        // Nothing running: a stale report says nothing of this request's ITL.
        let idle = EffectiveLoad {
            recent_itl_us: 59_000,
            ..EffectiveLoad::default()
        };
        let s = policy.predict(&f.input(8_000, 7_800, idle, EffectiveLoad::default()));
        assert_eq!(s.recent_itl_ms, 0.0);
        assert!(s.itl_base_ms < 59.0);
    }

    /// Neither meets the targets: remote spares the running decodes, else
    /// the sooner first token.
    #[test]
    fn neither_meets() {
        let f = Fixture::new();
        // A cold 8k prompt on a decode worker at its ITL limit: remote,
        // even though its own TTFT misses too.
        let busy_p = EffectiveLoad {
            queued_prefill_tokens: 400_000,
            ..EffectiveLoad::default()
        };
        let policy = SlaDynamic::with_slo(500.0, 40.0);
        let (path, rule, why) = decide(&policy, &f.input(8_000, 0, running(30, 30 * 64), busy_p));
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_SPARES_DECODES),
            "{why}"
        );
        // A decode worker already past its ITL target without the prefill
        // gets no more prefill work, however much sooner its first token.
        let over = SlaDynamic::with_slo(500.0, 20.0);
        let input = f.input(8_000, 0, running(30, 30 * 64), busy_p);
        let s = over.predict(&input);
        assert!(s.itl_base_ms > 20.0 && s.local_ttft_ms < s.remote_ttft_ms);
        let (path, rule, why) = decide(&over, &input);
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_SPARES_DECODES),
            "{why}"
        );
        // An idle decode worker (no one to slow): the sooner first token.
        let (path, rule, why) = decide(
            &SlaDynamic::with_slo(100.0, 1_000.0),
            &f.input(8_000, 0, EffectiveLoad::default(), busy_p),
        );
        assert_eq!(
            (path, rule),
            (Path::Bypass, rules::SLA_LOCAL_SOONER),
            "{why}"
        );
        // The prefill worker holds most of the prompt: its first token is
        // sooner.
        let mut input = f.input(8_000, 0, EffectiveLoad::default(), EffectiveLoad::default());
        input.prefill.held = HeldTokens {
            device: 7_000,
            host: 7_000,
            disk: 7_000,
        };
        let (path, rule, why) = decide(&SlaDynamic::with_slo(100.0, 1_000.0), &input);
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_SOONER),
            "{why}"
        );
    }

    /// With `spare_decodes_up_to`, a request neither path serves in time
    /// goes remote to spare the decodes only while its remote first token
    /// is within that multiple of the TTFT target; past it, the sooner
    /// first token (local, named as such; or remote, if it is sooner
    /// still). Without the limit (0, the default) it goes remote however
    /// deep the prefill worker's queue.
    #[test]
    fn a_spare_limit_bounds_the_prefill_queue() {
        let f = Fixture::new();
        let busy_p = EffectiveLoad {
            queued_prefill_tokens: 400_000,
            ..EffectiveLoad::default()
        };
        let input = f.input(8_000, 0, running(30, 30 * 64), busy_p);
        let unlimited = SlaDynamic::with_slo(500.0, 40.0);
        assert_eq!(unlimited.spare_decodes_up_to, 0.0);
        let s = unlimited.predict(&input);
        assert!(s.remote_ttft_ms > 10.0 * 500.0 && s.local_ttft_ms < s.remote_ttft_ms);
        let (_, rule, why) = decide(&unlimited, &input);
        assert_eq!(rule, rules::SLA_REMOTE_SPARES_DECODES, "{why}");
        assert!(!why.contains("x the TTFT target"), "{why}");

        let limit = |x: f64| SlaDynamic {
            spare_decodes_up_to: x,
            ..unlimited
        };
        // Within the limit: remote, saying so.
        let within = s.remote_ttft_ms / 500.0 + 1.0;
        let (path, rule, why) = decide(&limit(within), &input);
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_SPARES_DECODES),
            "{why}"
        );
        assert!(why.contains("x the TTFT target"), "{why}");
        // Past it: the sooner first token, local here.
        let (path, rule, why) = decide(&limit(2.0), &input);
        assert_eq!(
            (path, rule),
            (Path::Bypass, rules::SLA_LOCAL_REMOTE_OVERLOADED),
            "{why}"
        );
        assert!(why.contains("past 1000 ms (2 x the TTFT target"), "{why}");
        // Past it with a decode worker queued deeper still: remote is sooner.
        let deep_d = EffectiveLoad {
            queued_prefill_tokens: 4_000_000,
            ..running(30, 30 * 64)
        };
        let (path, rule, why) = decide(&limit(2.0), &f.input(8_000, 0, deep_d, busy_p));
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_SOONER),
            "{why}"
        );
    }

    /// A decode worker holding more of the prompt than the chosen one is
    /// weighed for the bypass: there when it meets the targets and computes
    /// less; on the chosen worker when it misses them.
    #[test]
    fn a_bypass_is_weighed_on_the_decode_worker_holding_the_prompt() {
        let f = Fixture::new();
        let h_record = crate::core::policy::tests::record("d1", protocol::Role::Decode);
        let holder = |load: EffectiveLoad| Candidate {
            id: &h_record.id,
            record: &h_record,
            load,
            held: HeldTokens {
                device: 7_800,
                host: 7_800,
                disk: 7_800,
            },
        };
        let policy = SlaDynamic::default();
        let idle = EffectiveLoad::default();
        let mut input = f.input(8_000, 0, running(20, 20 * 64), idle);
        assert!(!policy.decide(&input).on_decode_holder);

        input.decode_holder = Some(holder(running(20, 20 * 64)));
        let v = policy.decide(&input);
        assert_eq!(
            (v.path, v.on_decode_holder),
            (Path::Bypass, true),
            "{}",
            v.reason
        );
        assert!(
            v.reason.starts_with(
                "d1 holds 7800 prompt tokens, d0 0: local weighed on d1, which computes less"
            ),
            "{}",
            v.reason
        );

        // The holder's decodes are past the ITL target: weighed on d0.
        let slow = EffectiveLoad {
            recent_itl_us: 90_000,
            ..running(20, 20 * 64)
        };
        input.decode_holder = Some(holder(slow));
        let v = policy.decide(&input);
        assert!(!v.on_decode_holder, "{}", v.reason);
        assert!(
            v.reason
                .contains("local weighed on d0, as d1 misses the targets"),
            "{}",
            v.reason
        );
    }

    /// A prefix the decode worker holds only in host memory is neither a
    /// free hit nor a recompute: the bypass's TTFT adds its read-back over
    /// the host link (setup + bytes / (gpus x per-GPU rate)), which sits
    /// between the device hit's and the cold prompt's. Same on the prefill
    /// worker's side.
    #[test]
    fn a_host_held_prefix_costs_its_read_back() {
        let f = Fixture::new();
        let policy = SlaDynamic::default();
        let c = policy.cost;
        let idle = EffectiveLoad::default();
        let on_device = policy.predict(&f.input(40_000, 39_000, idle, idle));
        let cold = policy.predict(&f.input(40_000, 0, idle, idle));
        let mut input = f.input(40_000, 39_000, idle, idle);
        input.decode.held = HeldTokens {
            device: 1_000,
            host: 39_000,
            disk: 39_000,
        };
        let on_host = policy.predict(&input);
        // 38,000 tokens x 163,840 B over 2 GPUs at 50 GB/s each.
        let want = c.host_read_setup_ms + 38_000.0 * 163_840.0 / (2.0 * c.host_read_bytes_per_ms);
        assert!(
            (on_host.local_host_read_ms - want).abs() < 1e-9,
            "{on_host:?}"
        );
        assert_eq!(on_device.local_host_read_ms, 0.0);
        assert_eq!(on_host.local_prefill_tokens, on_device.local_prefill_tokens);
        assert!(
            on_device.local_ttft_ms < on_host.local_ttft_ms
                && on_host.local_ttft_ms < cold.local_ttft_ms,
            "device {} < host {} < cold {}",
            on_device.local_ttft_ms,
            on_host.local_ttft_ms,
            cold.local_ttft_ms
        );
        assert!(
            (on_host.local_ttft_ms - on_device.local_ttft_ms - want).abs() < 1e-6,
            "the read-back is the whole difference"
        );
        // The prefill worker's host-held overlap is read back too.
        input.prefill.held = input.decode.held;
        let p = policy.predict(&input);
        assert!((p.remote_host_read_ms - want).abs() < 1e-9);
        assert_eq!(p.remote_prefill_tokens, on_host.local_prefill_tokens);
        let (_, _, why) = decide(&policy, &input);
        assert!(why.contains("host read-back"), "{why}");
    }

    /// The calibration factors scale the predictions they correct, and the
    /// explanation names them with the predicted numbers.
    #[test]
    fn calibration_factors_move_the_decision_and_are_explained() {
        let f = Fixture::new();
        let policy = SlaDynamic::default();
        let mut input = f.input(8_000, 7_800, running(20, 20 * 64), EffectiveLoad::default());
        let plain = policy.predict(&input);
        input.calibration = Factors {
            local_ttft: 2.0,
            remote_ttft: 2.0,
            itl: 1.9,
        };
        let s = policy.predict(&input);
        assert!((s.local_ttft_ms - 2.0 * plain.local_ttft_ms).abs() < 1e-9);
        assert!(
            (s.remote_ttft_ms - (2.0 * plain.remote_model_ms + plain.transfer_ms)).abs() < 1e-9
        );
        assert!((s.itl_base_ms - 1.9 * plain.itl_base_ms).abs() < 1e-9);
        // ITL x1.9 takes the decode worker over 60 ms: the append goes remote.
        let (path, rule, why) = decide(&policy, &input);
        assert_eq!(
            (path, rule),
            (Path::Remote, rules::SLA_REMOTE_MEETS_TARGETS),
            "{why}"
        );
        for needle in [
            "TTFT",
            "ITL",
            "stall",
            "transfer",
            "calibration TTFT x2.00 local, x2.00 remote, ITL x1.90",
        ] {
            assert!(why.contains(needle), "{needle}: {why}");
        }
        assert_eq!(crate::core::Policy::from(policy).params().len(), 14);
    }

    /// The third option: a long append to a conversation the decode worker
    /// holds, with the decode worker near its ITL target. Remote from the
    /// prefill worker's (empty) cache misses the TTFT target; pulling the
    /// prefix from the decode worker meets it and is taken; its explanation
    /// names the source, the tokens pulled and the predicted times. A
    /// source over its ITL target still serves the read.
    #[test]
    fn a_fetched_prefix_is_the_third_option() {
        use crate::core::fetch::FetchOption;
        let f = Fixture::new();
        let policy = SlaDynamic::with_slo(1_000.0, 60.0);
        let mut input = f.input(
            60_000,
            50_000,
            running(30, 30 * 300),
            EffectiveLoad::default(),
        );
        let plain = decide(&policy, &input);
        assert_ne!(plain.0, Path::RemoteFetch, "{}", plain.2);
        input.fetch = Some(FetchOption {
            source: input.decode,
            prefix_tokens: 50_000,
            pulled_tokens: 50_000,
        });
        let s = policy.predict(&input);
        let fp = s.fetch.unwrap();
        assert!(fp.ttft_ms < s.remote_ttft_ms, "{fp:?} vs {s:?}");
        assert_eq!(fp.prefill_tokens, 10_000);
        let (path, rule, why) = decide(&policy, &input);
        assert_eq!(path, Path::RemoteFetch, "{why}");
        assert!(rule.starts_with("sla.fetch"), "{rule}: {why}");
        for needle in [
            "fetch: 50000 of 50000 prefix tokens from d0",
            "pull",
            "while read",
        ] {
            assert!(why.contains(needle), "{needle}: {why}");
        }
        // Its source past its ITL target still serves the read, which
        // costs each of its running requests a stall of the read's
        // overhead for the pull's duration; recomputing the prefix on the
        // prefill worker would cost far more.
        let mut tight = policy;
        tight.itl_target_ms = fp.source_itl_ms - 0.01;
        let (path, _, why) = decide(&tight, &input);
        assert_eq!(path, Path::RemoteFetch, "{why}");
        let stall = policy.cost.read_step_overhead * fp.pull_ms;
        assert!((fp.source_stall_ms - stall).abs() < 1e-9, "{fp:?}");
        assert!(
            why.contains("stall for each of its running requests"),
            "{why}"
        );
    }
}
