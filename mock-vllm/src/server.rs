//! vLLM's HTTP interface over the simulated engines: `/v1/completions`
//! (token-id prompts, streamed or not, `kv_transfer_params` in and out),
//! `/v1/models`, `/metrics` under vLLM's names, `/health`; and mock-only
//! `/switchyard/config` (block size, capacity), `/switchyard/debug` (what
//! the engine was sent, e.g. the `kv_transfer_params` it received) and
//! `/switchyard/nixl/read` (another engine's read of blocks this one
//! exported: [`crate::nixl`]).

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::stream::{self, BoxStream};
use futures::StreamExt;
use protocol::{
    Annotation, DecisionId, FinishReason, GenerateEvent, GenerateRequest, KvTransferParams, Path,
    PrefixFetch, Role, Sampling, Stage, WorkerId,
};
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch};
use worker_agent::{Engine, SimEngine};

use crate::config::Config;
use crate::itl::{self, ItlHistogram, TokenClock};
use crate::nixl::{self, Endpoint, Exports, Pull};
use crate::relabel::Relabeler;

/// One data-parallel rank: an engine, its relabeler, its publisher's count.
#[derive(Debug)]
pub struct RankHandle {
    pub engine: SimEngine,
    pub relabel: Arc<Mutex<Relabeler>>,
    pub published: watch::Receiver<u64>,
    pub stats: Mutex<RankStats>,
}

/// Counters of one rank.
#[derive(Debug, Default, Clone)]
pub struct RankStats {
    pub prompt_tokens: u64,
    pub cached_tokens: u64,
    pub generation_tokens: u64,
    pub itl: ItlHistogram,
}

/// What the engine was asked, for tests (`/switchyard/debug`).
#[derive(Debug, Default)]
struct DebugState {
    local: u64,
    prefill: u64,
    decode: u64,
    kv_transfer_params_received: u64,
    last_kv_transfer_params: Option<Value>,
    /// Prefill requests that pull their prefix from a decode engine first
    /// (vLLM's bidirectional transfer: `do_remote_decode` with a whole
    /// handle).
    prefix_pulls_received: u64,
    last_pull_params: Option<Value>,
    /// Pulls the source declined (recomputed), and pulls whose tokens were
    /// not the prompt's prefix (failed).
    pulls_declined: u64,
    pull_mismatches: u64,
    /// Requests that came with `do_local_prefill: true`.
    do_local_prefill_received: u64,
    errors: u64,
    /// The last requests' sampling fields as received, by request id
    /// (the newest last, at most [`RECEIVED_KEPT`]).
    received: VecDeque<(String, Map<String, Value>)>,
}

/// How many requests' sampling fields `/switchyard/debug` keeps.
const RECEIVED_KEPT: usize = 64;

/// vLLM's sampling and stopping fields of `/v1/completions` (with
/// `cache_salt`; the wire contract's list): mock-vllm accepts each, records
/// it for tests, and honours those the simulated engine models
/// ([`worker_agent::sim_engine::SIM_HONOURS`]).
pub const SAMPLING_FIELDS: [&str; 16] = Sampling::ENGINE_FIELDS;

/// The server's state.
#[derive(Debug)]
pub struct App {
    pub settings: Config,
    pub ranks: Vec<RankHandle>,
    next_rank: AtomicUsize,
    next_request: AtomicU64,
    debug: Mutex<DebugState>,
    /// Blocks exported for other engines to read (bidirectional transfer).
    exports: Mutex<Exports>,
    /// Reads of other engines' exported blocks.
    http: reqwest::Client,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn unix_s() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl App {
    pub fn new(settings: Config, ranks: Vec<RankHandle>) -> Self {
        Self {
            ranks,
            next_rank: AtomicUsize::new(0),
            next_request: AtomicU64::new(0),
            debug: Mutex::new(DebugState::default()),
            exports: Mutex::new(Exports::new(
                settings.decoder_kv_blocks_ttl,
                settings.block_size,
            )),
            http: reqwest::Client::new(),
            settings,
        }
    }
}

pub fn router(app: Arc<App>) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/metrics", get(metrics))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/switchyard/config", get(switchyard_config))
        .route("/switchyard/debug", get(switchyard_debug))
        .route("/switchyard/nixl/read", post(nixl_read))
        // vLLM reads bodies of any size: a 256k-token prompt is about 2 MB
        // of JSON, axum's default limit.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(app)
}

/// An OpenAI-style error response.
fn error(status: StatusCode, message: impl Into<String>) -> Response {
    let kind = if status.is_server_error() {
        "InternalServerError"
    } else if status == StatusCode::NOT_FOUND {
        "NotFoundError"
    } else {
        "BadRequestError"
    };
    (
        status,
        axum::Json(json!({"error": {"message": message.into(), "type": kind, "param": null, "code": status.as_u16()}})),
    )
        .into_response()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let s = &app.settings;
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": s.model,
            "object": "model",
            "created": unix_s(),
            "owned_by": "mock-vllm",
            "root": s.model,
            "parent": null,
            "max_model_len": s.max_model_len,
        }],
    }))
    .into_response()
}

async fn switchyard_config(State(app): State<Arc<App>>) -> Response {
    let s = &app.settings;
    let capacity = app
        .ranks
        .first()
        .map_or(0, |r| r.engine.facts().kv_capacity_blocks);
    axum::Json(json!({
        "model": s.model,
        "block_size": s.block_size,
        "kv_capacity_blocks": capacity,
        "role": s.role.as_str(),
        "data_parallel_size": app.ranks.len(),
        "preset": s.preset.name,
        "encoding": format!("{:?}", s.encoding).to_lowercase(),
        "hash_flavour": format!("{:?}", s.flavour).to_lowercase(),
        "engine_id": s.engine_id,
    }))
    .into_response()
}

async fn switchyard_debug(State(app): State<Arc<App>>) -> Response {
    let d = lock(&app.debug);
    let published: Vec<u64> = app.ranks.iter().map(|r| *r.published.borrow()).collect();
    let blocks: Vec<usize> = app.ranks.iter().map(|r| lock(&r.relabel).len()).collect();
    axum::Json(json!({
        "requests": {"local": d.local, "prefill": d.prefill, "decode": d.decode},
        "kv_transfer_params_received": d.kv_transfer_params_received,
        "last_kv_transfer_params": d.last_kv_transfer_params,
        "prefix_pulls_received": d.prefix_pulls_received,
        "last_pull_params": d.last_pull_params,
        "pulls_declined": d.pulls_declined,
        "pull_mismatches": d.pull_mismatches,
        "handles_exported": lock(&app.exports).exported,
        "handles_read": lock(&app.exports).read,
        "do_local_prefill_received": d.do_local_prefill_received,
        "errors": d.errors,
        "received": d.received.iter().map(|(id, fields)| json!({"request_id": id, "model": fields.get("model"), "fields": fields})).collect::<Vec<_>>(),
        "kv_batches_published": published,
        "blocks_held": blocks,
    }))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let s = &app.settings;
    let model = &s.model;
    let mut out = String::new();
    let usage_name = if s.old_metric_names {
        "vllm:gpu_cache_usage_perc"
    } else {
        "vllm:kv_cache_usage_perc"
    };
    let mut family =
        |name: &str, kind: &str, help: &str, value: &dyn Fn(usize, &RankHandle) -> f64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
            for (rank, r) in app.ranks.iter().enumerate() {
                let _ = writeln!(
                    out,
                    "{name}{{engine=\"{rank}\",model_name=\"{model}\"}} {:?}",
                    value(rank, r)
                );
            }
        };
    family(
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|_, r| f64::from(r.engine.load().running),
    );
    family(
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|_, r| f64::from(r.engine.load().waiting),
    );
    family(
        usage_name,
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|_, r| {
            let l = r.engine.load();
            if l.kv_blocks_total == 0 {
                0.0
            } else {
                l.kv_blocks_used as f64 / l.kv_blocks_total as f64
            }
        },
    );
    family(
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|_, r| lock(&r.stats).prompt_tokens as f64,
    );
    family(
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|_, r| lock(&r.stats).cached_tokens as f64,
    );
    family(
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &|_, r| lock(&r.stats).prompt_tokens as f64,
    );
    family(
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &|_, r| lock(&r.stats).generation_tokens as f64,
    );
    let itl_name = if s.old_metric_names {
        itl::OLD_NAME
    } else {
        itl::NAME
    };
    let _ = writeln!(
        out,
        "# HELP {itl_name} Histogram of inter-token latency in seconds.\n# TYPE {itl_name} histogram"
    );
    for (rank, r) in app.ranks.iter().enumerate() {
        let labels = format!("engine=\"{rank}\",model_name=\"{model}\"");
        lock(&r.stats).itl.write(&mut out, itl_name, &labels);
    }
    let _ = writeln!(out, "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge");
    for (rank, r) in app.ranks.iter().enumerate() {
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"{rank}\",num_gpu_blocks=\"{}\"}} 1.0",
            s.block_size,
            r.engine.facts().kv_capacity_blocks
        );
    }
    let _ = writeln!(out, "# HELP mock_vllm_kv_batches_published_total KV event batches published\n# TYPE mock_vllm_kv_batches_published_total counter");
    for (rank, r) in app.ranks.iter().enumerate() {
        let _ = writeln!(
            out,
            "mock_vllm_kv_batches_published_total{{engine=\"{rank}\"}} {}",
            *r.published.borrow()
        );
    }
    let d = lock(&app.debug);
    let _ = writeln!(out, "# HELP mock_vllm_kv_transfer_params_received_total Decode requests that came with a prefill engine's kv_transfer_params\n# TYPE mock_vllm_kv_transfer_params_received_total counter\nmock_vllm_kv_transfer_params_received_total {}", d.kv_transfer_params_received);
    let _ = writeln!(out, "# HELP mock_vllm_requests_total Completion requests by kind\n# TYPE mock_vllm_requests_total counter");
    for (kind, n) in [
        ("local", d.local),
        ("prefill", d.prefill),
        ("decode", d.decode),
    ] {
        let _ = writeln!(out, "mock_vllm_requests_total{{kind=\"{kind}\"}} {n}");
    }
    drop(d);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}

/// A parsed completion request.
#[derive(Debug)]
struct Completion {
    prompt: Vec<u32>,
    max_tokens: u32,
    stream: bool,
    include_usage: bool,
    kv_transfer_params: Option<Map<String, Value>>,
    /// SGLang's `do_local_prefill` (draft PR #34773): a decode server
    /// prefills this request itself.
    do_local_prefill: bool,
    /// Every sampling field received (and `model`), as sent.
    received: Map<String, Value>,
    /// What the simulated engine honours of them.
    sampling: Sampling,
    /// `logprobs`: made-up log-probabilities ([`fake_logprobs`]) of this
    /// many top tokens a position.
    logprobs: Option<u32>,
    /// `return_tokens_as_token_ids`: logprobs name tokens `token_id:ID`.
    token_id_names: bool,
}

/// A request the engine refuses: its status and message.
type Refusal = (StatusCode, String);

fn parse_completion(body: &[u8], s: &Config) -> Result<Completion, Refusal> {
    let (model, lora) = (&s.model, &s.lora_modules);
    let v: Value = serde_json::from_slice(body).map_err(|e| {
        refusal(
            StatusCode::BAD_REQUEST,
            format!("the body is not JSON: {e}"),
        )
    })?;
    let o = v
        .as_object()
        .ok_or_else(|| refusal(StatusCode::BAD_REQUEST, "the body is not a JSON object"))?;
    if let Some(m) = o.get("model").and_then(Value::as_str) {
        if m != model && !lora.iter().any(|l| l == m) {
            return Err(refusal(
                StatusCode::NOT_FOUND,
                format!("The model `{m}` does not exist."),
            ));
        }
    }
    let prompt = match o.get("prompt") {
        Some(Value::Array(items)) => {
            // A batch of one prompt is accepted too.
            let items = match &items[..] {
                [Value::Array(inner)] => inner,
                _ => items,
            };
            items
                .iter()
                .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    refusal(
                        StatusCode::BAD_REQUEST,
                        "prompt: token ids must be integers in 0..2^32",
                    )
                })?
        }
        Some(Value::String(_)) => {
            return Err(refusal(
                StatusCode::BAD_REQUEST,
                "mock-vllm has no tokenizer: send the prompt as token ids",
            ))
        }
        _ => return Err(refusal(StatusCode::BAD_REQUEST, "prompt is required")),
    };
    if prompt.is_empty() {
        return Err(refusal(StatusCode::BAD_REQUEST, "the prompt is empty"));
    }
    let max_tokens = match o.get("max_tokens") {
        None | Some(Value::Null) => 16,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .filter(|n| *n >= 1)
            .ok_or_else(|| refusal(StatusCode::BAD_REQUEST, "max_tokens must be at least 1"))?,
    };
    let asked = prompt.len() as u64 + u64::from(max_tokens);
    if asked > u64::from(s.max_model_len) {
        return Err(refusal(
            StatusCode::BAD_REQUEST,
            format!(
                "This model's maximum context length is {} tokens. However, you requested {asked} tokens ({} in the messages, {max_tokens} in the completion).",
                s.max_model_len,
                prompt.len()
            ),
        ));
    }
    let kv_transfer_params = match o.get("kv_transfer_params") {
        None | Some(Value::Null) => None,
        Some(Value::Object(p)) => Some(p.clone()),
        Some(_) => {
            return Err(refusal(
                StatusCode::BAD_REQUEST,
                "kv_transfer_params must be an object",
            ))
        }
    };
    let mut received: Map<String, Value> = SAMPLING_FIELDS
        .iter()
        .filter_map(|&k| Some((k.to_owned(), o.get(k)?.clone())))
        .collect();
    if let Some(m) = o.get("model") {
        received.insert("model".into(), m.clone());
    }
    let sampling = honoured(o, max_tokens)?;
    let logprobs = match o.get("logprobs") {
        None | Some(Value::Null) => None,
        Some(v) => Some(
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .filter(|&n| n <= MAX_LOGPROBS)
                .ok_or_else(|| {
                    refusal(
                        StatusCode::BAD_REQUEST,
                        format!("logprobs: must be an integer in [0, {MAX_LOGPROBS}]"),
                    )
                })?,
        ),
    };
    Ok(Completion {
        logprobs,
        token_id_names: o
            .get("return_tokens_as_token_ids")
            .and_then(Value::as_bool)
            .unwrap_or(false),
        prompt,
        max_tokens,
        received,
        sampling,
        stream: o.get("stream").and_then(Value::as_bool).unwrap_or(false),
        include_usage: o
            .get("stream_options")
            .and_then(|s| s.get("include_usage"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
        kv_transfer_params,
        do_local_prefill: o
            .get("do_local_prefill")
            .and_then(Value::as_bool)
            .unwrap_or(false),
    })
}

/// The fields the simulated engine honours, checked as vLLM checks them.
fn honoured(o: &Map<String, Value>, max_tokens: u32) -> Result<Sampling, Refusal> {
    let bad =
        |field: &str, what: &str| refusal(StatusCode::BAD_REQUEST, format!("{field}: {what}"));
    let min_tokens = match o.get("min_tokens") {
        None | Some(Value::Null) => 0,
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .ok_or_else(|| bad("min_tokens", "must be a non-negative integer"))?,
    };
    if min_tokens > max_tokens {
        return Err(bad("min_tokens", "must be at most max_tokens"));
    }
    let stop_token_ids = match o.get("stop_token_ids") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(ids)) => ids
            .iter()
            .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| bad("stop_token_ids", "token ids must be integers in 0..2^32"))?,
        Some(_) => return Err(bad("stop_token_ids", "must be a list of token ids")),
    };
    let ignore_eos = match o.get("ignore_eos") {
        None | Some(Value::Null) => false,
        Some(v) => v
            .as_bool()
            .ok_or_else(|| bad("ignore_eos", "must be a boolean"))?,
    };
    Ok(Sampling {
        stop_token_ids,
        ignore_eos,
        min_tokens,
        ..Sampling::default()
    })
}

/// vLLM's default `max_logprobs`.
const MAX_LOGPROBS: u32 = 20;

/// Made-up, deterministic log-probabilities (mock-vllm samples nothing):
/// the `at`-th output token's own is `-(1 + (token + at) % 7) / 8`, and it
/// is the most likely; its `top` alternatives are the next ids, each half
/// a nat less likely. Names are `token_id:ID` (with
/// `return_tokens_as_token_ids`) or the token's text.
fn fake_logprobs(tokens: &[u32], first_at: usize, top: u32, ids: bool) -> Value {
    let name = |t: u32| {
        if ids {
            format!("token_id:{t}")
        } else {
            text_of(&[t])
        }
    };
    let mut names = Vec::new();
    let mut own = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    let mut offset = 0usize;
    for (k, &t) in tokens.iter().enumerate() {
        let at = first_at + k;
        let lp = -f64::from(1 + (t as usize + at) as u32 % 7) / 8.0;
        let mut alternatives = Map::new();
        for j in 0..top {
            let id = if j == 0 { t } else { t.wrapping_add(j) };
            alternatives.insert(name(id), json!(lp - 0.5 * f64::from(j)));
        }
        names.push(name(t));
        own.push(lp);
        tops.push(Value::Object(alternatives));
        offsets.push(offset);
        offset += text_of(&[t]).len();
    }
    json!({"tokens": names, "token_logprobs": own, "top_logprobs": tops, "text_offset": offsets})
}

fn refusal(status: StatusCode, message: impl Into<String>) -> Refusal {
    (status, message.into())
}

fn flag(params: &Map<String, Value>, key: &str) -> bool {
    params.get(key).and_then(Value::as_bool).unwrap_or(false)
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    let s = &app.settings;
    let c = match parse_completion(&body, s) {
        Ok(c) => c,
        Err((status, message)) => {
            lock(&app.debug).errors += 1;
            return error(status, message);
        }
    };
    let rank = match headers
        .get("x-data-parallel-rank")
        .and_then(|v| v.to_str().ok())
    {
        Some(r) => match r.parse::<usize>() {
            Ok(r) if r < app.ranks.len() => r,
            _ => {
                return error(
                    StatusCode::BAD_REQUEST,
                    format!(
                        "x-data-parallel-rank {r:?} is not below the data-parallel size {}",
                        app.ranks.len()
                    ),
                )
            }
        },
        None => app.next_rank.fetch_add(1, Ordering::Relaxed) % app.ranks.len(),
    };
    let n = app.next_request.fetch_add(1, Ordering::Relaxed);
    let request_id = headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .map_or_else(|| format!("cmpl-{n}"), str::to_owned);
    let remote_decode = c
        .kv_transfer_params
        .as_ref()
        .is_some_and(|p| flag(p, "do_remote_decode"));
    let remote_prefill = c
        .kv_transfer_params
        .as_ref()
        .is_some_and(|p| flag(p, "do_remote_prefill"));
    if c.do_local_prefill {
        lock(&app.debug).do_local_prefill_received += 1;
    }
    if s.sglang_decode {
        // An SGLang decode-mode server: no NIXL (its bootstrap handshake
        // instead), and a local prefill only when asked with
        // `do_local_prefill`.
        if c.kv_transfer_params.is_some() {
            return error(StatusCode::BAD_REQUEST, "this SGLang decode server takes remote prefills through its bootstrap handshake, not kv_transfer_params");
        }
        if !c.do_local_prefill {
            return error(
                StatusCode::BAD_REQUEST,
                "this SGLang decode server cannot prefill locally without do_local_prefill",
            );
        }
    }
    // vLLM's bidirectional pull: a prefill whose params are a decode
    // engine's handle to the prefix's blocks.
    let mut fetch = None;
    let stage = if remote_decode {
        if s.role == Role::Decode {
            return error(StatusCode::BAD_REQUEST, "this engine is a decode instance (kv_consumer): it does not prefill for remote decodes");
        }
        let params = c.kv_transfer_params.clone().unwrap_or_default();
        let pull = nixl::pull_of(&params, c.prompt.len()).filter(|_| s.bidirectional_kv_xfer);
        if let Some(pull) = pull {
            {
                let mut d = lock(&app.debug);
                d.prefix_pulls_received += 1;
                d.last_pull_params = Some(Value::Object(params));
            }
            match pulled(&app, &pull, &c.prompt).await {
                Ok(tokens) => {
                    let source = pull
                        .engine_id
                        .parse()
                        .unwrap_or_else(|_| WorkerId::new("remote", 0).expect("a valid name"));
                    fetch = Some(PrefixFetch {
                        source,
                        prefix_tokens: tokens,
                        pulled_tokens: tokens,
                    });
                }
                Err(Pulled::Declined(why)) => {
                    let mut d = lock(&app.debug);
                    d.pulls_declined += 1;
                    if s.kv_load_failure_policy == nixl::KvLoadFailurePolicy::Fail {
                        d.errors += 1;
                        tracing::warn!(%request_id, reason = %why, "the read was declined: the request fails (kv_load_failure_policy fail)");
                        return error(
                            StatusCode::INTERNAL_SERVER_ERROR,
                            format!("KV load failed for {request_id}: {why}"),
                        );
                    }
                    tracing::warn!(%request_id, reason = %why, "the read was declined: recomputed");
                }
                Err(Pulled::Wrong(why)) => {
                    let mut d = lock(&app.debug);
                    d.pull_mismatches += 1;
                    d.errors += 1;
                    return error(StatusCode::INTERNAL_SERVER_ERROR, why);
                }
            }
        }
        Stage::Prefill
    } else if remote_prefill {
        if s.role == Role::Prefill {
            return error(StatusCode::BAD_REQUEST, "this engine is a prefill instance (kv_producer): it does not decode remote prefills");
        }
        let params = c.kv_transfer_params.clone().unwrap_or_default();
        if params
            .get("remote_engine_id")
            .and_then(Value::as_str)
            .is_none()
        {
            return error(StatusCode::BAD_REQUEST, "kv_transfer_params with do_remote_prefill lack the prefill engine's remote_engine_id");
        }
        let mut d = lock(&app.debug);
        d.kv_transfer_params_received += 1;
        d.last_kv_transfer_params = Some(Value::Object(params.clone()));
        drop(d);
        Stage::Decode {
            transfer: KvTransferParams {
                source: WorkerId::new("remote", 0).expect("a valid name"),
                prompt_tokens: c.prompt.len() as u32,
                engine: Some(Value::Object(params).to_string()),
            },
        }
    } else {
        Stage::Local
    };
    {
        let mut d = lock(&app.debug);
        match &stage {
            Stage::Local => d.local += 1,
            Stage::Prefill => d.prefill += 1,
            Stage::Decode { .. } => d.decode += 1,
        }
    }
    {
        let mut d = lock(&app.debug);
        if d.received.len() == RECEIVED_KEPT {
            d.received.pop_front();
        }
        d.received
            .push_back((request_id.clone(), c.received.clone()));
    }
    let r = &app.ranks[rank];
    // The tokens of every block the engine may store for this request.
    let output = worker_agent::sim_engine::output_tokens(&request_id, c.max_tokens);
    {
        let mut all = c.prompt.clone();
        if !matches!(stage, Stage::Prefill) {
            all.extend_from_slice(&output);
        }
        lock(&r.relabel).register(&all);
    }
    let is_prefill = matches!(stage, Stage::Prefill);
    let worker = WorkerId::new("mock", rank as u32).expect("a valid name");
    let request = GenerateRequest {
        request_id: request_id.clone(),
        annotation: Annotation {
            decision: DecisionId(n),
            path: if is_prefill {
                Path::Remote
            } else {
                Path::Bypass
            },
            decode: worker.clone(),
            prefill: None,
            decode_overlap_tokens: 0,
            prefill_overlap_tokens: 0,
            fetch,
        },
        stage,
        prompt: c.prompt.clone(),
        max_tokens: c.max_tokens,
        sampling: c.sampling.clone(),
    };
    let mut events = r.engine.generate(request);
    // The first event decides the status.
    let Some(first) = events.next().await else {
        lock(&app.debug).errors += 1;
        return error(StatusCode::INTERNAL_SERVER_ERROR, "the engine stopped");
    };
    if let GenerateEvent::Failed {
        error: e,
        retryable,
    } = &first
    {
        lock(&app.debug).errors += 1;
        let status = if *retryable {
            StatusCode::INTERNAL_SERVER_ERROR
        } else {
            StatusCode::BAD_REQUEST
        };
        return error(status, e.clone());
    }
    let meta = Meta {
        id: format!("cmpl-{request_id}"),
        created: unix_s(),
        model: s.model.clone(),
        prompt_tokens: c.prompt.len() as u32,
        at: Endpoint {
            engine_id: s.engine_id.clone(),
            host: s.listen.ip().to_string(),
            port: s.listen.port(),
            block_size: s.block_size,
        },
        // A bidirectional engine exports the blocks of a request that came
        // with any kv_transfer_params (a decode leg, or a bypass asking).
        handle_for: (s.bidirectional_kv_xfer
            && !is_prefill
            && c.kv_transfer_params.as_ref().is_some_and(|p| !p.is_empty()))
        .then(|| c.prompt.clone()),
    };
    let events = stream::once(async move { first }).chain(events).boxed();
    let app2 = app.clone();
    if c.stream {
        let (tx, mut rx) = mpsc::unbounded_channel::<Result<Bytes, std::io::Error>>();
        tokio::spawn(async move {
            let logprobs = c.logprobs.map(|k| (k, c.token_id_names));
            stream_events(
                app2,
                rank,
                meta,
                events,
                (c.include_usage, is_prefill, logprobs),
                tx,
            )
            .await;
        });
        let body = Body::from_stream(stream::poll_fn(move |cx| rx.poll_recv(cx)));
        return Response::builder()
            .header(header::CONTENT_TYPE, "text/event-stream")
            .header(header::CACHE_CONTROL, "no-cache")
            .body(body)
            .unwrap_or_else(|_| error(StatusCode::INTERNAL_SERVER_ERROR, "building the response"));
    }
    let outcome = collect(&app, rank, events).await;
    if let Some((e, retryable)) = outcome.failed {
        lock(&app.debug).errors += 1;
        return error(
            if retryable {
                StatusCode::INTERNAL_SERVER_ERROR
            } else {
                StatusCode::BAD_REQUEST
            },
            e,
        );
    }
    account(&app2, rank, &outcome, meta.prompt_tokens);
    let mut body = json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "text": text_of(&outcome.tokens),
            "token_ids": outcome.tokens,
            "logprobs": c.logprobs.map(|k| fake_logprobs(&outcome.tokens, 0, k, c.token_id_names)),
            "finish_reason": outcome.finish,
            "stop_reason": null,
        }],
        "usage": usage(meta.prompt_tokens, outcome.tokens.len() as u32, outcome.cached),
    });
    if is_prefill {
        body["kv_transfer_params"] = meta.transfer_params(outcome.cached);
    } else if let Some(handle) = meta.exported(&app, &outcome.tokens) {
        body["kv_transfer_params"] = handle;
    }
    axum::Json(body).into_response()
}

/// What a response says about itself.
#[derive(Debug, Clone)]
struct Meta {
    id: String,
    created: u64,
    model: String,
    prompt_tokens: u32,
    /// Where this engine's blocks are read from.
    at: Endpoint,
    /// The prompt of a request whose blocks are exported when it
    /// finishes: its response carries the handle.
    handle_for: Option<Vec<u32>>,
}

impl Meta {
    /// The handle to the blocks of this finished request (of `output`),
    /// if it exports them.
    fn exported(&self, app: &App, output: &[u32]) -> Option<Value> {
        let prompt = self.handle_for.as_ref()?;
        Some(lock(&app.exports).export(&self.id, prompt, output, &self.at, Instant::now()))
    }

    /// Made-up NIXL transfer parameters for a prefill's response.
    fn transfer_params(&self, cached: u32) -> Value {
        let blocks = self.prompt_tokens.div_ceil(self.at.block_size.max(1));
        json!({
            "do_remote_prefill": true,
            "do_remote_decode": false,
            "remote_engine_id": self.at.engine_id,
            "remote_block_ids": (0..blocks).collect::<Vec<u32>>(),
            "remote_host": self.at.host,
            "remote_port": self.at.port,
            "tp_size": 1,
            "mock_prompt_tokens": self.prompt_tokens,
            "mock_cached_tokens": cached,
        })
    }
}

fn usage(prompt: u32, completion: u32, cached: u32) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// No tokenizer: a token's "text" is its id.
fn text_of(tokens: &[u32]) -> String {
    tokens.iter().map(|t| format!(" <{t}>")).collect()
}

#[derive(Debug, Default)]
struct Outcome {
    tokens: Vec<u32>,
    cached: u32,
    finish: Option<&'static str>,
    failed: Option<(String, bool)>,
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::Prefilled => "length",
    }
}

fn account(app: &App, rank: usize, outcome: &Outcome, prompt_tokens: u32) {
    let mut s = lock(&app.ranks[rank].stats);
    s.prompt_tokens += u64::from(prompt_tokens);
    s.cached_tokens += u64::from(outcome.cached);
    s.generation_tokens += outcome.tokens.len() as u64;
}

/// `tokens` of a request came now: observed in its rank's ITL histogram.
fn tokens_came(app: &App, rank: usize, clock: &mut TokenClock, tokens: usize) {
    if let Some((interval, n)) = clock.tick(Instant::now(), tokens) {
        lock(&app.ranks[rank].stats).itl.observe(interval, n);
    }
}

async fn collect(app: &App, rank: usize, mut events: BoxStream<'static, GenerateEvent>) -> Outcome {
    let mut o = Outcome::default();
    let mut clock = TokenClock::default();
    while let Some(event) = events.next().await {
        match event {
            GenerateEvent::Tokens(t) | GenerateEvent::Scored { tokens: t, .. } => {
                tokens_came(app, rank, &mut clock, t.len());
                o.tokens.extend(t)
            }
            GenerateEvent::Prefilled { cached_tokens, .. } => o.cached = cached_tokens.unwrap_or(0),
            GenerateEvent::Finished {
                cached_tokens,
                reason,
                ..
            } => {
                o.cached = cached_tokens.unwrap_or(0);
                o.finish = Some(finish_reason(reason));
                break;
            }
            GenerateEvent::Failed { error, retryable } => {
                o.failed = Some((error, retryable));
                break;
            }
            GenerateEvent::Rejected { error, .. } => {
                o.failed = Some((error, false));
                break;
            }
        }
    }
    if o.finish.is_none() && o.failed.is_none() {
        o.failed = Some(("the engine stopped".into(), true));
    }
    o
}

async fn stream_events(
    app: Arc<App>,
    rank: usize,
    meta: Meta,
    mut events: BoxStream<'static, GenerateEvent>,
    (include_usage, is_prefill, logprobs): (bool, bool, Option<(u32, bool)>),
    tx: mpsc::UnboundedSender<Result<Bytes, std::io::Error>>,
) {
    let send = |v: &Value| tx.send(Ok(Bytes::from(format!("data: {v}\n\n")))).is_ok();
    let chunk = |choice: Value| {
        json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [choice],
        })
    };
    let mut o = Outcome::default();
    let mut clock = TokenClock::default();
    while let Some(event) = events.next().await {
        match event {
            GenerateEvent::Tokens(t) | GenerateEvent::Scored { tokens: t, .. } => {
                tokens_came(&app, rank, &mut clock, t.len());
                let lp = logprobs.map(|(k, ids)| fake_logprobs(&t, o.tokens.len(), k, ids));
                let c = chunk(
                    json!({"index": 0, "text": text_of(&t), "token_ids": t, "logprobs": lp, "finish_reason": null, "stop_reason": null}),
                );
                o.tokens.extend(t);
                if !send(&c) {
                    return;
                }
            }
            GenerateEvent::Prefilled { cached_tokens, .. } => o.cached = cached_tokens.unwrap_or(0),
            GenerateEvent::Finished {
                cached_tokens,
                reason,
                ..
            } => {
                o.cached = cached_tokens.unwrap_or(0);
                let mut c = chunk(
                    json!({"index": 0, "text": "", "token_ids": [], "logprobs": null, "finish_reason": finish_reason(reason), "stop_reason": null}),
                );
                if is_prefill {
                    c["kv_transfer_params"] = meta.transfer_params(o.cached);
                } else if let Some(handle) = meta.exported(&app, &o.tokens) {
                    // In the final chunk: vLLM with PR #40186.
                    c["kv_transfer_params"] = handle;
                }
                send(&c);
                o.finish = Some(finish_reason(reason));
                break;
            }
            GenerateEvent::Failed { error, .. } | GenerateEvent::Rejected { error, .. } => {
                // Headers are out: an error object in the stream, then the end.
                send(
                    &json!({"error": {"message": error, "type": "InternalServerError", "code": 500}}),
                );
                lock(&app.debug).errors += 1;
                return;
            }
        }
    }
    if o.finish.is_none() {
        send(
            &json!({"error": {"message": "the engine stopped", "type": "InternalServerError", "code": 500}}),
        );
        return;
    }
    account(&app, rank, &o, meta.prompt_tokens);
    if include_usage {
        send(&json!({
            "id": meta.id,
            "object": "text_completion",
            "created": meta.created,
            "model": meta.model,
            "choices": [],
            "usage": usage(meta.prompt_tokens, o.tokens.len() as u32, o.cached),
        }));
    }
    let _ = tx.send(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
}

/// Why a pull gave no prefix.
enum Pulled {
    /// The read was declined (the handle expires within the margin, or the
    /// source no longer knows it): the request fails or is recomputed, as
    /// `kv_load_failure_policy` says.
    Declined(String),
    /// What was pulled is not this prompt's prefix, or the handle lists
    /// too few blocks (vLLM would use the wrong KV, or fail an assertion).
    Wrong(String),
}

/// Reads `pull`'s tokens from the source engine; the tokens pulled.
async fn pulled(app: &App, pull: &Pull, prompt: &[u32]) -> Result<u32, Pulled> {
    if nixl::expires_too_soon(pull.expiry, SystemTime::now()) {
        return Err(Pulled::Declined(format!(
            "the handle of {:?} expires within {:?} (declining expired remote read)",
            pull.request_id,
            nixl::READ_EXPIRY_MARGIN
        )));
    }
    let n = pull.tokens as usize;
    let needed = n.div_ceil(app.settings.block_size.max(1) as usize);
    if pull.ids.len() < needed {
        return Err(Pulled::Wrong(format!(
            "the handle lists {} remote blocks for {n} tokens, which take {needed} (vLLM asserts num_local_blocks <= len(remote_block_ids))",
            pull.ids.len()
        )));
    }
    let url = format!("http://{}:{}/switchyard/nixl/read", pull.host, pull.port);
    let body = json!({
        "remote_request_id": pull.request_id,
        "tokens": n,
        "block_ids": &pull.ids[..needed],
    });
    let response = app
        .http
        .post(&url)
        .json(&body)
        .timeout(std::time::Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| Pulled::Declined(format!("reading {url}: {e}")))?;
    let status = response.status();
    let answer: Value = response
        .json()
        .await
        .map_err(|e| Pulled::Declined(format!("reading {url}: {e}")))?;
    if status == StatusCode::CONFLICT {
        return Err(Pulled::Wrong(format!("{url} refused the read: {answer}")));
    }
    if !status.is_success() {
        return Err(Pulled::Declined(format!(
            "{url} answered {status}: {answer}"
        )));
    }
    let tokens: Vec<u32> = serde_json::from_value(answer["tokens"].clone())
        .map_err(|e| Pulled::Declined(format!("{url}: {e}")))?;
    if tokens.as_slice() != &prompt[..n] {
        let at = tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        return Err(Pulled::Wrong(format!(
            "the KV pulled from {} ({:?}) is not this prompt's prefix: they differ at token {at} of {n} (vLLM would use it silently)",
            pull.engine_id, pull.request_id
        )));
    }
    Ok(n as u32)
}

/// Another engine reads blocks this one exported (vLLM: a NIXL read).
async fn nixl_read(State(app): State<Arc<App>>, body: Bytes) -> Response {
    let asked: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return error(StatusCode::BAD_REQUEST, format!("not JSON: {e}")),
    };
    let ids: Option<Vec<u64>> = asked["block_ids"]
        .as_array()
        .and_then(|ids| ids.iter().map(Value::as_u64).collect());
    let (Some(id), Some(n), Some(ids)) = (
        asked["remote_request_id"].as_str(),
        asked["tokens"].as_u64(),
        ids,
    ) else {
        return error(
            StatusCode::BAD_REQUEST,
            "a read names remote_request_id, tokens and block_ids",
        );
    };
    match lock(&app.exports).read(id, n as usize, &ids, Instant::now()) {
        Ok(tokens) => axum::Json(json!({"tokens": tokens})).into_response(),
        Err(nixl::Declined::Gone(why)) => error(StatusCode::GONE, why),
        Err(nixl::Declined::Wrong(why)) => error(StatusCode::CONFLICT, why),
    }
}
