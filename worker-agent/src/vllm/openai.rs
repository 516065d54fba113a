//! The engine's OpenAI-compatible completions API: request bodies for each
//! stage, the SSE stream, and the chunks, parsed. Pure; the HTTP calls are
//! in [`super::engine`].
//!
//! - Every request sends the prompt as token ids (`/v1/completions`
//!   accepts them), so the engine's KV events carry exactly the tokens the
//!   router hashed.
//! - Generated token ids: vLLM streams text; newer builds return the ids
//!   too with `"return_token_ids": true` (`choices[].token_ids`), and
//!   mock-vllm always does. An engine that ignores the flag streams text
//!   only: the agent then cannot report token ids (the request still
//!   finishes, with the count from `usage`), counted as
//!   `worker_agent_engine_text_only_chunks_total`.
//! - Remote prefill (vLLM's NIXL connector): the prefill request has
//!   `max_tokens: 1` and `kv_transfer_params: {"do_remote_decode": true}`;
//!   the response's `kv_transfer_params` travel, as JSON, in
//!   `KvTransferParams.engine`, and the decode request sends them back
//!   with `do_remote_prefill: true`.
//! - Log-probabilities (`logprobs: N`): asked with
//!   `return_tokens_as_token_ids: true`, so that vLLM names each token of
//!   `choices[].logprobs` (`tokens`, `top_logprobs`' keys) `token_id:ID`;
//!   they are read back per token ([`parse_logprobs`]).
//! - The third path (a prefix pulled from a decode worker, vLLM's
//!   bidirectional NIXL transfer, `bidirectional_kv_xfer`): a decode
//!   engine returns a handle to a finished request's blocks in its
//!   response's `kv_transfer_params` (`do_remote_decode: true`,
//!   `remote_block_ids`, `remote_request_id`, ...) when the request carried
//!   any. The agent asks for one when a prefill worker needs the prefix:
//!   a one-token request of the prefix with
//!   `{"do_remote_prefill": false}` ([`Kind::Export`], not streamed, so
//!   the handle comes in the body); the prefill request sends that handle
//!   as its `kv_transfer_params`; the rest is as above.

use protocol::{Sampling, TokenLogprob};
use serde_json::{json, Map, Value};

/// What a request is for.
#[derive(Debug, Clone, PartialEq)]
pub enum Kind {
    /// Aggregated: local prefill and decode (bypass).
    Local,
    /// Prefill only, for a remote decode.
    Prefill,
    /// Prefill only, pulling the prefix first from the decode engine
    /// that holds it: its handle, as `kv_transfer_params`.
    PrefillFetch(Map<String, Value>),
    /// Decode of a prompt prefilled elsewhere; the prefill engine's
    /// `kv_transfer_params`.
    Decode(Map<String, Value>),
    /// One token of a prefix the engine holds, so that it exports the
    /// prefix's blocks for another engine's read (vLLM exports a finished
    /// request's blocks only when it came with `kv_transfer_params`).
    Export,
}

/// Asks an SGLang decode server to prefill locally (SGLang builds that
/// accept `do_local_prefill`, draft PR #34773): the bypass.
pub fn ask_local_prefill(body: &mut Value) {
    if let Some(o) = body.as_object_mut() {
        o.insert("do_local_prefill".into(), json!(true));
    }
}

/// The `/v1/completions` body.
pub fn completion_body(
    model: &str,
    prompt: &[u32],
    max_tokens: u32,
    sampling: &Sampling,
    kind: &Kind,
    return_token_ids: bool,
) -> Value {
    let mut body = json!({
        "model": sampling.lora.as_deref().unwrap_or(model),
        "prompt": prompt,
        "max_tokens": max_tokens,
    });
    let o = body.as_object_mut().expect("an object");
    insert_sampling(
        o,
        sampling,
        matches!(kind, Kind::Prefill | Kind::PrefillFetch(_) | Kind::Export),
    );
    match kind {
        Kind::Local | Kind::Decode(_) => {
            o.insert("stream".into(), json!(true));
            o.insert("stream_options".into(), json!({"include_usage": true}));
        }
        Kind::Prefill => {
            o.insert("stream".into(), json!(false));
            o.insert("max_tokens".into(), json!(1));
            o.insert(
                "kv_transfer_params".into(),
                json!({
                    "do_remote_decode": true,
                    "do_remote_prefill": false,
                    "remote_engine_id": null,
                    "remote_block_ids": null,
                    "remote_host": null,
                    "remote_port": null,
                }),
            );
        }
        Kind::PrefillFetch(params) => {
            o.insert("stream".into(), json!(false));
            o.insert("max_tokens".into(), json!(1));
            o.insert("kv_transfer_params".into(), Value::Object(params.clone()));
        }
        Kind::Export => {
            o.insert("stream".into(), json!(false));
            o.insert("max_tokens".into(), json!(1));
            o.insert(
                "kv_transfer_params".into(),
                json!({"do_remote_prefill": false}),
            );
        }
    }
    if let Kind::Decode(params) = kind {
        let mut params = params.clone();
        params.insert("do_remote_prefill".into(), json!(true));
        params.insert("do_remote_decode".into(), json!(false));
        o.insert("kv_transfer_params".into(), Value::Object(params));
    }
    if return_token_ids {
        o.insert("return_token_ids".into(), json!(true));
    }
    body
}

/// Every sampling field set, under vLLM's names (`lora` is the `model`).
/// A prefill leg (one discarded token) gets only what shapes the prompt's
/// KV, `cache_salt`; the decode leg gets the rest.
fn insert_sampling(o: &mut Map<String, Value>, s: &Sampling, prefill: bool) {
    if let Some(salt) = &s.cache_salt {
        o.insert("cache_salt".into(), json!(salt));
    }
    if prefill {
        return;
    }
    let numbers = [
        ("temperature", s.temperature),
        ("top_p", s.top_p),
        ("min_p", s.min_p),
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
        ("repetition_penalty", s.repetition_penalty),
    ];
    for (name, value) in numbers {
        if let Some(v) = value {
            o.insert(name.into(), json!(v));
        }
    }
    if let Some(k) = s.top_k {
        o.insert("top_k".into(), json!(k));
    }
    if let Some(seed) = s.seed {
        o.insert("seed".into(), json!(seed));
    }
    if !s.stop.is_empty() {
        o.insert("stop".into(), json!(s.stop));
    }
    if !s.stop_token_ids.is_empty() {
        o.insert("stop_token_ids".into(), json!(s.stop_token_ids));
    }
    if s.ignore_eos {
        o.insert("ignore_eos".into(), json!(true));
    }
    if s.min_tokens > 0 {
        o.insert("min_tokens".into(), json!(s.min_tokens));
    }
    if let Some(n) = s.logprobs {
        o.insert("logprobs".into(), json!(n));
        // The tokens of `logprobs` as `token_id:N`, so that they name
        // ids (not text pieces) on the wire to the router.
        o.insert("return_tokens_as_token_ids".into(), json!(true));
    }
    if !s.logit_bias.is_empty() {
        let bias: Map<String, Value> = s
            .logit_bias
            .iter()
            .map(|(token, bias)| (token.to_string(), json!(bias)))
            .collect();
        o.insert("logit_bias".into(), Value::Object(bias));
    }
    if let Some(format) = &s.response_format {
        let value = serde_json::from_str(format).unwrap_or_else(|_| json!(format));
        o.insert("response_format".into(), value);
    }
}

/// Splits an SSE byte stream into the `data` of its events.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseParser {
    /// Most bytes of one line kept; a longer line is an error.
    pub const MAX_LINE: usize = 16 << 20;

    pub fn new() -> Self {
        Self::default()
    }

    /// Feeds bytes; returns the data of every event completed.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<Vec<String>, SseError> {
        let mut out = Vec::new();
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(nl) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let mut line = &self.buf[start..start + nl];
            start += nl + 1;
            if line.last() == Some(&b'\r') {
                line = &line[..line.len() - 1];
            }
            let line = std::str::from_utf8(line).map_err(|_| SseError::Utf8)?;
            if line.is_empty() {
                if let Some(data) = self.data.take() {
                    out.push(data);
                }
            } else if let Some(value) = line.strip_prefix("data:") {
                let value = value.strip_prefix(' ').unwrap_or(value);
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => self.data = Some(value.to_owned()),
                }
            }
            // Comments (`:`), `event:`, `id:`, `retry:` are not used.
        }
        self.buf.drain(..start);
        if self.buf.len() > Self::MAX_LINE {
            return Err(SseError::LineTooLong);
        }
        Ok(out)
    }

    /// The stream ended: an event not closed by a blank line.
    pub fn finish(&mut self) -> Option<String> {
        let rest = std::mem::take(&mut self.buf);
        if let Some(value) = std::str::from_utf8(&rest)
            .ok()
            .and_then(|l| l.trim_end_matches('\r').strip_prefix("data:"))
        {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match &mut self.data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => self.data = Some(value.to_owned()),
            }
        }
        self.data.take()
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SseError {
    #[error("the event stream is not UTF-8")]
    Utf8,
    #[error("an event stream line is longer than 16 MiB")]
    LineTooLong,
}

/// Token counts of a response.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    /// `prompt_tokens_details.cached_tokens`, when the engine says.
    pub cached_tokens: Option<u32>,
}

/// What one completion chunk (or a whole response) says.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chunk {
    /// Generated token ids, when the engine returns them.
    pub token_ids: Option<Vec<u32>>,
    /// Generated text (without ids).
    pub text: Option<String>,
    pub finish_reason: Option<String>,
    pub usage: Option<Usage>,
    pub kv_transfer_params: Option<Value>,
    /// `choices[].logprobs`, one entry a generated token, when the engine
    /// sent them.
    pub logprobs: Option<Vec<TokenLogprob>>,
    /// An error object inside the stream: message and HTTP-like code.
    pub error: Option<(String, Option<u16>)>,
}

/// What `data` of an SSE event is.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Chunk(Chunk),
    Done,
}

/// Parses one SSE `data` (or a whole non-streamed response body).
pub fn parse_event(data: &str) -> Result<Event, String> {
    if data.trim() == "[DONE]" {
        return Ok(Event::Done);
    }
    let v: Value = serde_json::from_str(data).map_err(|e| format!("not JSON: {e}"))?;
    parse_chunk(&v).map(Event::Chunk)
}

/// Parses a completion object (a chunk or a response).
pub fn parse_chunk(v: &Value) -> Result<Chunk, String> {
    let o = v.as_object().ok_or("not a JSON object")?;
    let mut chunk = Chunk::default();
    if let Some(e) = o.get("error") {
        let message = e
            .get("message")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .unwrap_or_else(|| e.to_string());
        let code = e
            .get("code")
            .and_then(Value::as_u64)
            .and_then(|c| u16::try_from(c).ok());
        chunk.error = Some((message, code));
        return Ok(chunk);
    }
    if let Some(choice) = o
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
    {
        if let Some(ids) = choice.get("token_ids").filter(|v| !v.is_null()) {
            let ids = ids.as_array().ok_or("token_ids is not an array")?;
            chunk.token_ids = Some(
                ids.iter()
                    .map(|t| {
                        t.as_u64()
                            .and_then(|t| u32::try_from(t).ok())
                            .ok_or_else(|| format!("token id {t} is not a u32"))
                    })
                    .collect::<Result<_, _>>()?,
            );
        }
        chunk.text = choice
            .get("text")
            .and_then(Value::as_str)
            .filter(|t| !t.is_empty())
            .map(str::to_owned);
        chunk.finish_reason = choice
            .get("finish_reason")
            .and_then(Value::as_str)
            .map(str::to_owned);
        if let Some(l) = choice.get("logprobs").filter(|l| !l.is_null()) {
            chunk.logprobs = Some(parse_logprobs(l)?);
        }
    }
    if let Some(u) = o.get("usage").filter(|u| u.is_object()) {
        let n = |v: Option<&Value>| {
            v.and_then(Value::as_u64)
                .map_or(0, |n| u32::try_from(n).unwrap_or(u32::MAX))
        };
        chunk.usage = Some(Usage {
            prompt_tokens: n(u.get("prompt_tokens")),
            completion_tokens: n(u.get("completion_tokens")),
            cached_tokens: u
                .get("prompt_tokens_details")
                .and_then(|d| d.get("cached_tokens"))
                .filter(|c| !c.is_null())
                .map(|c| n(Some(c))),
        });
    }
    chunk.kv_transfer_params = o
        .get("kv_transfer_params")
        .filter(|p| p.is_object())
        .cloned();
    Ok(chunk)
}

/// A completion choice's `logprobs` (`tokens`, `token_logprobs`,
/// `top_logprobs`), its tokens named `token_id:ID` (as
/// `return_tokens_as_token_ids` makes vLLM name them): one entry a token,
/// each top list most likely first. A token named otherwise is an error
/// (its id is unknown).
pub fn parse_logprobs(v: &Value) -> Result<Vec<TokenLogprob>, String> {
    let list = |key: &str| {
        v.get(key)
            .and_then(Value::as_array)
            .ok_or_else(|| format!("logprobs.{key} is not a list"))
    };
    let id = |name: &str| {
        name.strip_prefix("token_id:")
            .and_then(|n| n.parse::<u32>().ok())
            .ok_or_else(|| {
                format!("logprobs names the token {name:?}, not token_id:ID (does the engine ignore return_tokens_as_token_ids?)")
            })
    };
    let tokens = list("tokens")?;
    let own = list("token_logprobs")?;
    let top = v.get("top_logprobs").and_then(Value::as_array);
    if own.len() != tokens.len() {
        return Err(format!(
            "logprobs has {} tokens but {} token_logprobs",
            tokens.len(),
            own.len()
        ));
    }
    let mut out = Vec::with_capacity(tokens.len());
    for (i, token) in tokens.iter().enumerate() {
        token
            .as_str()
            .ok_or("logprobs: a token is not a string")
            .map_err(str::to_owned)
            .and_then(id)?;
        // vLLM sends -inf as -9999.0; null is a prompt token's.
        let logprob = own[i].as_f64().unwrap_or(f64::NEG_INFINITY) as f32;
        let mut entries: Vec<(u32, f32)> = match top.and_then(|t| t.get(i)) {
            Some(Value::Object(m)) => m
                .iter()
                .map(|(name, lp)| Ok((id(name)?, lp.as_f64().unwrap_or(f64::NEG_INFINITY) as f32)))
                .collect::<Result<_, String>>()?,
            _ => Vec::new(),
        };
        entries.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        out.push(TokenLogprob {
            logprob,
            top: entries,
        });
    }
    Ok(out)
}

/// Whether an HTTP status is worth retrying elsewhere: 5xx, 408 and 429
/// are; other 4xx (a request the engine refuses) are not.
pub fn retryable_status(status: u16) -> bool {
    status >= 500 || status == 408 || status == 429
}

/// The sampling field the client set that an engine's 4xx refuses (its
/// error's `param`, or the first such field its message names; the
/// adapter's name for `lora`), if any: then the refusal is the client's
/// error. Any other 4xx (a bad `kv_transfer_params`, a wrong URL) is the
/// deployment's. Timeouts and overload are neither.
pub fn client_error(status: u16, body: &str, sampling: &Sampling) -> Option<&'static str> {
    if !(400..500).contains(&status) || retryable_status(status) {
        return None;
    }
    let error = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v.get("error").cloned());
    let param = error
        .as_ref()
        .and_then(|e| e.get("param"))
        .and_then(Value::as_str);
    let message = error_message(body);
    sampling.fields_set().into_iter().find(|&field| {
        param == Some(field)
            || message.contains(field)
            || (field == "lora"
                && sampling
                    .lora
                    .as_deref()
                    .is_some_and(|l| message.contains(l)))
    })
}

/// The message of an error body (OpenAI `{"error": {"message"}}`, FastAPI
/// `{"detail"}`, or the text itself, shortened).
pub fn error_message(body: &str) -> String {
    let from_json = serde_json::from_str::<Value>(body).ok().and_then(|v| {
        v.get("error")
            .and_then(|e| e.get("message").or(Some(e)))
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))
            .map(|m| m.as_str().map_or_else(|| m.to_string(), str::to_owned))
    });
    let mut m = from_json.unwrap_or_else(|| body.trim().to_owned());
    if m.len() > 500 {
        let mut cut = 500;
        while !m.is_char_boundary(cut) {
            cut -= 1;
        }
        m.truncate(cut);
        m.push('…');
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The third path's prefill: the decode engine's handle sent as it
    /// is; one token, not streamed, like any prefill. The export asks the
    /// decode engine for a handle to a prefix: one token of it, not
    /// streamed (the handle comes in the body), with the prefix cache's
    /// salt and nothing that changes the output; a bypass asks for none.
    #[test]
    fn a_pulling_prefill_sends_the_handle_and_an_export_asks_for_one() {
        let Value::Object(handle) = json!({
            "do_remote_decode": true, "do_remote_prefill": false,
            "remote_engine_id": "engine-d", "remote_request_id": "r1",
            "remote_block_ids": [[7, 8]], "remote_num_tokens": 32,
        }) else {
            unreachable!()
        };
        let kind = Kind::PrefillFetch(handle.clone());
        let b = completion_body("m", &[1], 8, &Sampling::default(), &kind, true);
        assert_eq!(
            (b["max_tokens"].clone(), b["stream"].clone()),
            (json!(1), json!(false))
        );
        assert_eq!(b["kv_transfer_params"], Value::Object(handle));

        let salted = Sampling {
            cache_salt: Some("s".into()),
            lora: Some("adapter".into()),
            temperature: Some(0.5),
            ..Sampling::default()
        };
        let b = completion_body("m", &[1, 2], 8, &salted, &Kind::Export, false);
        assert_eq!(
            (b["max_tokens"].clone(), b["stream"].clone()),
            (json!(1), json!(false))
        );
        assert_eq!(b["kv_transfer_params"], json!({"do_remote_prefill": false}));
        assert_eq!(
            (b["model"].clone(), b["cache_salt"].clone()),
            (json!("adapter"), json!("s"))
        );
        assert!(b.get("temperature").is_none());
        let b = completion_body("m", &[1], 8, &Sampling::default(), &Kind::Local, true);
        assert!(b.get("kv_transfer_params").is_none());
    }

    #[test]
    fn bodies_per_stage() {
        let b = completion_body("m", &[1, 2], 8, &Sampling::default(), &Kind::Local, true);
        assert_eq!(b["prompt"], json!([1, 2]));
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["return_token_ids"], json!(true));
        assert!(b.get("kv_transfer_params").is_none());

        let b = completion_body("m", &[1], 8, &Sampling::default(), &Kind::Prefill, false);
        assert_eq!(b["max_tokens"], json!(1));
        assert_eq!(b["stream"], json!(false));
        assert_eq!(b["kv_transfer_params"]["do_remote_decode"], json!(true));
        assert!(b.get("return_token_ids").is_none());

        let params = json!({"remote_engine_id": "e", "remote_block_ids": [1, 2], "do_remote_prefill": false, "do_remote_decode": true});
        let b = completion_body(
            "m",
            &[1],
            8,
            &Sampling::default(),
            &Kind::Decode(params.as_object().unwrap().clone()),
            true,
        );
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["kv_transfer_params"]["remote_block_ids"], json!([1, 2]));
        assert_eq!(b["kv_transfer_params"]["do_remote_prefill"], json!(true));
        assert_eq!(b["kv_transfer_params"]["do_remote_decode"], json!(false));
    }

    /// Each sampling field under vLLM's name; the prefill leg gets only
    /// the salt.
    #[test]
    fn sampling_fields_reach_the_body() {
        let s = Sampling {
            temperature: Some(0.25),
            top_p: Some(0.9),
            top_k: Some(40),
            min_p: Some(0.05),
            seed: Some(-3),
            stop: vec!["\n\n".into()],
            stop_token_ids: vec![7, 8],
            ignore_eos: true,
            min_tokens: 2,
            presence_penalty: Some(0.5),
            frequency_penalty: Some(-0.5),
            repetition_penalty: Some(1.1),
            logprobs: Some(3),
            logit_bias: vec![(5, -100.0), (9, 2.5)],
            response_format: Some(r#"{"type":"json_object"}"#.into()),
            cache_salt: Some("tenant-a".into()),
            lora: Some("sql-adapter".into()),
        };
        let b = completion_body("base", &[1], 8, &s, &Kind::Local, true);
        let expected = json!({
            "model": "sql-adapter", "temperature": 0.25, "top_p": 0.9, "top_k": 40,
            "min_p": 0.05, "seed": -3, "stop": ["\n\n"], "stop_token_ids": [7, 8],
            "ignore_eos": true, "min_tokens": 2, "presence_penalty": 0.5,
            "frequency_penalty": -0.5, "repetition_penalty": 1.1, "logprobs": 3,
            "logit_bias": {"5": -100.0, "9": 2.5},
            "response_format": {"type": "json_object"}, "cache_salt": "tenant-a",
        });
        for (key, value) in expected.as_object().unwrap() {
            assert_eq!(&b[key], value, "{key}");
        }
        let p = completion_body("base", &[1], 8, &s, &Kind::Prefill, false);
        assert_eq!(p["cache_salt"], json!("tenant-a"));
        assert_eq!(p["model"], json!("sql-adapter"));
        assert!(p.get("min_tokens").is_none() && p.get("temperature").is_none());
    }

    #[test]
    fn engine_refusals_of_client_fields() {
        let s = Sampling {
            top_k: Some(-5),
            lora: Some("sql".into()),
            ..Sampling::default()
        };
        let vllm = r#"{"error":{"message":"top_k must be -1 (disable), or at least 1, got -5.","type":"BadRequestError","param":null,"code":400}}"#;
        assert_eq!(client_error(400, vllm, &s), Some("top_k"));
        let lora = r#"{"error":{"message":"The model `sql` does not exist.","param":"model"}}"#;
        assert_eq!(client_error(404, lora, &s), Some("lora"));
        // Not about a field the client set, or not the client's to fix.
        assert_eq!(client_error(404, "Not Found", &s), None);
        assert_eq!(client_error(429, vllm, &s), None);
        assert_eq!(client_error(400, vllm, &Sampling::default()), None);
    }

    #[test]
    fn sse_events_across_chunk_boundaries() {
        let mut p = SseParser::new();
        assert!(p.feed(b"data: {\"a\"").unwrap().is_empty());
        assert_eq!(
            p.feed(b":1}\r\n\r\n: comment\n\ndata:x\ndata: y\n\ndata: [DONE]")
                .unwrap(),
            vec!["{\"a\":1}".to_owned(), "x\ny".to_owned()]
        );
        assert_eq!(p.finish().as_deref(), Some("[DONE]"));
        assert_eq!(p.finish(), None);
        assert_eq!(SseParser::new().feed(b"data: \xff\n"), Err(SseError::Utf8));
    }

    #[test]
    fn chunks() {
        let c = parse_event(r#"{"id":"x","choices":[{"index":0,"text":"hi","token_ids":[5,6],"finish_reason":null}]}"#).unwrap();
        assert_eq!(
            c,
            Event::Chunk(Chunk {
                token_ids: Some(vec![5, 6]),
                text: Some("hi".into()),
                ..Chunk::default()
            })
        );
        let Event::Chunk(c) = parse_event(r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":8}}}"#).unwrap() else {
            panic!()
        };
        assert_eq!(
            c.usage,
            Some(Usage {
                prompt_tokens: 10,
                completion_tokens: 3,
                cached_tokens: Some(8)
            })
        );
        let Event::Chunk(c) = parse_event(r#"{"choices":[{"text":"","finish_reason":"length"}],"kv_transfer_params":{"remote_engine_id":"p"}}"#).unwrap() else {
            panic!()
        };
        assert_eq!(c.finish_reason.as_deref(), Some("length"));
        assert_eq!(c.kv_transfer_params, Some(json!({"remote_engine_id": "p"})));
        let Event::Chunk(c) = parse_event(r#"{"error":{"message":"boom","code":500}}"#).unwrap()
        else {
            panic!()
        };
        assert_eq!(c.error, Some(("boom".into(), Some(500))));
        assert_eq!(parse_event(" [DONE] "), Ok(Event::Done));
        assert!(parse_event("{").is_err());
        assert!(parse_event(r#"{"choices":[{"token_ids":[-1]}]}"#).is_err());
    }

    /// vLLM's completion logprobs with token ids for names: one entry a
    /// token, the top list most likely first; text names are an error.
    #[test]
    fn logprobs_are_read_per_token() {
        let Event::Chunk(c) = parse_event(
            r#"{"choices":[{"text":"","token_ids":[5,6],"logprobs":{"tokens":["token_id:5","token_id:6"],"token_logprobs":[-0.5,-1.25],"top_logprobs":[{"token_id:9":-2.0,"token_id:5":-0.5},{"token_id:6":-1.25}],"text_offset":[0,1]}}]}"#,
        )
        .unwrap() else {
            panic!()
        };
        assert_eq!(
            c.logprobs,
            Some(vec![
                TokenLogprob {
                    logprob: -0.5,
                    top: vec![(5, -0.5), (9, -2.0)]
                },
                TokenLogprob {
                    logprob: -1.25,
                    top: vec![(6, -1.25)]
                },
            ])
        );
        let text = r#"{"choices":[{"logprobs":{"tokens":["hi"],"token_logprobs":[-1.0],"top_logprobs":[null]}}]}"#;
        assert!(parse_event(text)
            .unwrap_err()
            .contains("return_tokens_as_token_ids"));
        let s = Sampling {
            logprobs: Some(2),
            ..Sampling::default()
        };
        let b = completion_body("m", &[1], 8, &s, &Kind::Local, true);
        assert_eq!(
            (
                b["logprobs"].clone(),
                b["return_tokens_as_token_ids"].clone()
            ),
            (json!(2), json!(true))
        );
    }

    #[test]
    fn errors() {
        assert!(retryable_status(503) && retryable_status(429) && !retryable_status(400));
        assert_eq!(
            error_message(r#"{"error":{"message":"bad prompt"}}"#),
            "bad prompt"
        );
        assert_eq!(error_message(r#"{"detail":"Not Found"}"#), "Not Found");
        assert_eq!(error_message(" plain "), "plain");
        assert_eq!(error_message(&"é".repeat(400)).chars().count(), 251);
    }
}
