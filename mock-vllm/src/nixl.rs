//! vLLM's bidirectional NIXL KV transfer (`bidirectional_kv_xfer`, from
//! vLLM 0.21 on), as far as mock-vllm emulates it
//! (`--bidirectional-kv-xfer`; read from vLLM's `nixl/pull_scheduler.py`,
//! see `docs/research/d2p-kv-transfer.md`):
//!
//! - **Decode side.** A request that carried any `kv_transfer_params` and
//!   finished (stop or length) exports its computed tokens' blocks: its
//!   response's `kv_transfer_params` are a handle (`do_remote_decode: true`,
//!   `remote_block_ids`, `remote_request_id`, `remote_host`, `remote_port`,
//!   `remote_num_tokens`, `remote_blocks_expiry_time`, ...). Streamed
//!   responses carry it in the final chunk, which vLLM does only with the
//!   still-open PR #40186. The blocks are held until the first read or the
//!   TTL (`decoder_kv_blocks_ttl`): a handle reads once.
//! - **Prefill side.** A prefill whose params have `do_remote_decode` and
//!   a whole handle (`remote_block_ids` not empty, `remote_engine_id`,
//!   `remote_request_id`, `remote_host`, `remote_port`) pulls
//!   `min(remote_num_tokens, prompt)` tokens from that engine (none below
//!   64, `kv_recompute_threshold`), then computes the rest. Params without
//!   a whole handle are a plain prefill, as in vLLM.
//! - **The read.** vLLM reads over NIXL; mock-vllm asks the source's HTTP
//!   API (`POST /switchyard/nixl/read`) for the tokens behind the handle.
//!   The reader declines a handle that expires within
//!   [`READ_EXPIRY_MARGIN`] without asking ([`expires_too_soon`]), as vLLM
//!   does; the source declines one unknown, read already or expired. A
//!   declined read fails the prefill, or is recomputed, as
//!   `--kv-load-failure-policy` says ([`KvLoadFailurePolicy`], vLLM's
//!   `kv_load_failure_policy`). Unlike vLLM, which would use the wrong KV
//!   silently (vllm-project/vllm#43094), mock-vllm fails a prefill whose
//!   pulled tokens are not its prompt's prefix, so that a router relaying
//!   the wrong handle is caught.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::{json, Map, Value};

/// A pull of fewer tokens is recomputed instead (vLLM's
/// `kv_recompute_threshold` default with bidirectional transfer on).
pub const PULL_RECOMPUTE_THRESHOLD: u64 = 64;

/// A prefill engine does not read a handle that expires within this long
/// (vLLM's `_KV_BLOCKS_EXPIRY_SAFETY_MARGIN`, `nixl/pull_worker.py`).
pub const READ_EXPIRY_MARGIN: Duration = Duration::from_secs(5);

/// What a prefill engine does when a pull fails or is declined (vLLM's
/// `kv_load_failure_policy`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvLoadFailurePolicy {
    /// Fail the request (vLLM's default: finish reason `error`, an HTTP
    /// 500).
    Fail,
    /// Compute the prefix instead.
    Recompute,
}

/// Whether a handle whose `remote_blocks_expiry_time` is `expiry` (seconds
/// since the epoch) expires within [`READ_EXPIRY_MARGIN`] of `now`: vLLM's
/// reader then declines it without reading. A handle without one is read.
pub fn expires_too_soon(expiry: Option<f64>, now: SystemTime) -> bool {
    let Some(expiry) = expiry else {
        return false;
    };
    let now = now
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    now + READ_EXPIRY_MARGIN.as_secs_f64() >= expiry
}

/// Where this engine's blocks are read from, as its handles say.
#[derive(Debug, Clone)]
pub struct Endpoint {
    pub engine_id: String,
    pub host: String,
    pub port: u16,
    pub block_size: u32,
}

#[derive(Debug)]
struct Export {
    tokens: Vec<u32>,
    /// Its block ids, as its handle lists them.
    ids: Vec<u64>,
    expires: Instant,
}

/// The blocks this engine exported, by request id, until read or expired.
#[derive(Debug)]
pub struct Exports {
    ttl: Duration,
    block_size: u32,
    by_request: HashMap<String, Export>,
    /// Handles given out, and read.
    pub exported: u64,
    pub read: u64,
}

impl Exports {
    pub fn new(ttl: Duration, block_size: u32) -> Self {
        Self {
            ttl,
            block_size,
            by_request: HashMap::new(),
            exported: 0,
            read: 0,
        }
    }

    /// Exports the computed tokens of a finished request (its prompt and
    /// output but the last token, which vLLM has not computed): the
    /// handle its response carries.
    pub fn export(
        &mut self,
        request_id: &str,
        prompt: &[u32],
        output: &[u32],
        at: &Endpoint,
        now: Instant,
    ) -> Value {
        self.by_request.retain(|_, e| e.expires > now);
        let mut tokens = prompt.to_vec();
        tokens.extend_from_slice(output);
        tokens.pop();
        // Ids unique to the export, so that a read names the blocks it
        // means: a handle cut wrong reads other ids.
        let blocks = tokens.len().div_ceil(at.block_size.max(1) as usize) as u64;
        let base = (self.exported + 1) * 1_000_000;
        let ids: Vec<u64> = (base..base + blocks).collect();
        let expiry = SystemTime::now()
            .checked_add(self.ttl)
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        let params = json!({
            "do_remote_prefill": false,
            "do_remote_decode": true,
            "remote_block_ids": [ids.clone()],
            "remote_engine_id": at.engine_id,
            "remote_request_id": request_id,
            "remote_host": at.host,
            "remote_port": at.port,
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": tokens.len(),
            "remote_blocks_expiry_time": expiry,
            "transfer_mode": "pull",
        });
        self.by_request.insert(
            request_id.to_owned(),
            Export {
                tokens,
                ids,
                expires: now + self.ttl,
            },
        );
        self.exported += 1;
        params
    }

    /// The first `n` tokens behind `request_id`'s handle, read once from
    /// the blocks `ids` (which must be its first ones).
    pub fn read(
        &mut self,
        request_id: &str,
        n: usize,
        ids: &[u64],
        now: Instant,
    ) -> Result<Vec<u32>, Declined> {
        let export = self.by_request.remove(request_id).ok_or_else(|| {
            Declined::Gone(format!(
                "no blocks exported for {request_id:?} (never, or read already)"
            ))
        })?;
        if export.expires <= now {
            return Err(Declined::Gone(format!(
                "the blocks of {request_id:?} expired"
            )));
        }
        if n > export.tokens.len() {
            return Err(Declined::Wrong(format!(
                "{n} tokens asked of {request_id:?}, which holds {}",
                export.tokens.len()
            )));
        }
        let needed = n.div_ceil(self.block_size.max(1) as usize);
        if ids.len() != needed || ids != &export.ids[..needed] {
            return Err(Declined::Wrong(format!(
                "{n} tokens read of {request_id:?} from blocks {:?}, which are not its first {needed}",
                &ids[..ids.len().min(4)]
            )));
        }
        self.read += 1;
        Ok(export.tokens[..n].to_vec())
    }
}

/// Why a read was declined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Declined {
    /// Unknown, read already, or expired (vLLM declines; the reader
    /// recomputes).
    Gone(String),
    /// Blocks or tokens the handle does not hold: a reader's bug.
    Wrong(String),
}

/// A prefill's pull, from its `kv_transfer_params`.
#[derive(Debug, Clone, PartialEq)]
pub struct Pull {
    pub engine_id: String,
    pub request_id: String,
    pub host: String,
    pub port: u16,
    /// Tokens to pull: `min(remote_num_tokens, prompt)`.
    pub tokens: u64,
    /// Remote block ids of the first group.
    pub ids: Vec<u64>,
    /// When the source lets the blocks go (`remote_blocks_expiry_time`,
    /// seconds since the epoch), if the handle says.
    pub expiry: Option<f64>,
}

/// The pull `params` ask of a prefill of `prompt_len` tokens: `None`
/// without a whole handle (a plain prefill, as vLLM takes it) or below
/// the recompute threshold.
pub fn pull_of(params: &Map<String, Value>, prompt_len: usize) -> Option<Pull> {
    let text = |k: &str| params.get(k).and_then(Value::as_str).map(str::to_owned);
    if params.get("do_remote_decode").and_then(Value::as_bool) != Some(true) {
        return None;
    }
    let ids = params.get("remote_block_ids").and_then(Value::as_array)?;
    let ids: Vec<u64> = match ids.first() {
        Some(Value::Array(group)) => group.iter().filter_map(Value::as_u64).collect(),
        Some(_) => ids.iter().filter_map(Value::as_u64).collect(),
        None => return None,
    };
    let port = params
        .get("remote_port")
        .and_then(Value::as_u64)
        .and_then(|p| u16::try_from(p).ok())?;
    let tokens = params
        .get("remote_num_tokens")
        .and_then(Value::as_u64)?
        .min(prompt_len as u64);
    (tokens >= PULL_RECOMPUTE_THRESHOLD && !ids.is_empty()).then_some(Pull {
        engine_id: text("remote_engine_id")?,
        request_id: text("remote_request_id")?,
        host: text("remote_host")?,
        port,
        tokens,
        ids,
        expiry: params
            .get("remote_blocks_expiry_time")
            .and_then(Value::as_f64),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at() -> Endpoint {
        Endpoint {
            engine_id: "engine-d".into(),
            host: "127.0.0.1".into(),
            port: 9,
            block_size: 16,
        }
    }

    #[test]
    fn an_exported_handle_is_read_once_and_names_its_computed_tokens() {
        let now = Instant::now();
        let mut exports = Exports::new(Duration::from_secs(480), 16);
        let prompt: Vec<u32> = (0..100).collect();
        let params = exports.export("r1", &prompt, &[500, 501, 502], &at(), now);
        // 102 computed tokens in 7 blocks of 16.
        assert_eq!(params["remote_num_tokens"], 102);
        assert_eq!(params["remote_block_ids"][0].as_array().unwrap().len(), 7);
        let Value::Object(params) = params else {
            unreachable!()
        };
        let pull = pull_of(&params, 200).unwrap();
        assert_eq!((pull.tokens, pull.ids.len(), pull.port), (102, 7, 9));
        // Blocks other than its first are refused (and the read spent).
        assert!(exports.read("r1", 102, &pull.ids[1..], now).is_err());
        exports.export("r1", &prompt, &[500, 501, 502], &at(), now);
        let ids: Vec<u64> = (2_000_000..2_000_007).collect();
        let tokens = exports.read("r1", 102, &ids, now).unwrap();
        assert_eq!(&tokens[..100], &prompt[..]);
        assert_eq!(&tokens[100..], &[500, 501]);
        assert!(exports.read("r1", 102, &ids, now).is_err(), "read once");
    }

    #[test]
    fn expired_or_short_handles_are_declined() {
        let now = Instant::now();
        let mut exports = Exports::new(Duration::from_secs(1), 16);
        exports.export("r1", &[1, 2, 3], &[4], &at(), now);
        let first = [1_000_000];
        assert!(exports
            .read("r1", 3, &first, now + Duration::from_secs(2))
            .is_err());
        exports.export("r2", &[1, 2, 3], &[4], &at(), now);
        assert!(exports.read("r2", 4, &[2_000_000], now).is_err());
    }

    #[test]
    fn a_handle_expiring_within_the_margin_is_not_read() {
        let now = SystemTime::now();
        let secs = |t: SystemTime| t.duration_since(UNIX_EPOCH).unwrap().as_secs_f64();
        let at = |d: Duration| Some(secs(now + d));
        assert!(!expires_too_soon(None, now), "no deadline: read");
        assert!(!expires_too_soon(at(Duration::from_secs(6)), now));
        assert!(expires_too_soon(at(Duration::from_secs(4)), now));
        assert!(expires_too_soon(Some(secs(now) - 1.0), now), "expired");
    }

    #[test]
    fn params_without_a_whole_handle_or_below_the_threshold_pull_nothing() {
        let mut exports = Exports::new(Duration::from_secs(480), 16);
        let prompt: Vec<u32> = (0..100).collect();
        let Value::Object(whole) = exports.export("r1", &prompt, &[1], &at(), Instant::now())
        else {
            unreachable!()
        };
        assert!(pull_of(&whole, 1_000).is_some());
        for key in [
            "remote_request_id",
            "remote_host",
            "remote_port",
            "remote_engine_id",
            "remote_block_ids",
        ] {
            let mut p = whole.clone();
            p.remove(key);
            assert_eq!(pull_of(&p, 1_000), None, "without {key}");
        }
        let mut p = whole.clone();
        p.insert("do_remote_decode".into(), json!(false));
        assert_eq!(pull_of(&p, 1_000), None);
        // A prompt of 63 tokens pulls at most 63: recomputed.
        assert_eq!(pull_of(&whole, 63), None);
        assert_eq!(pull_of(&whole, 64).map(|p| p.tokens), Some(64));
    }
}
