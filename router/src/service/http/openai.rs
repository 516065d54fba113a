//! The HTTP API's JSON: OpenAI-compatible completion requests and
//! responses, the `switchyard` annotation, errors. These are the router's
//! HTTP types, not the bus contract (that is `protocol`), so they derive
//! serde here, in this one module.

use std::fmt;

use protocol::RouteDecision;
use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize};

use super::fields::{FieldError, Fields, Members};

/// `POST /v1/completions` and `POST /v1/route`: the prompt, and every
/// other field read and checked by name ([`super::fields`]). `model` is
/// accepted whatever it says: a router serves the one model of its
/// hashing contract.
#[derive(Debug, Clone)]
pub struct CompletionRequest {
    pub prompt: Prompt,
    pub fields: Fields,
}

impl CompletionRequest {
    /// Parses a request body; the error is the message (and field) for a
    /// 400.
    ///
    /// A prompt of token ids, the common and the long case, is read by a
    /// dedicated scanner (about 5 times faster than serde's generic path
    /// on an 8k-token prompt); serde reads the rest. Anything the scanner
    /// does not expect goes through serde whole, which also words every
    /// error.
    pub fn parse(body: &[u8]) -> Result<Self, FieldError> {
        if body.is_empty() {
            return Err(FieldError::body(
                "the request body is empty: expected a JSON completion request",
            ));
        }
        if let Some((tokens, start, end)) = scan_prompt(body) {
            let mut head = Vec::with_capacity(body.len() - (end - start) + 1);
            head.extend_from_slice(&body[..start]);
            head.push(b'0');
            head.extend_from_slice(&body[end..]);
            if let Ok(Members(members)) = serde_json::from_slice::<Members>(&head) {
                return Ok(Self {
                    prompt: Prompt::Tokens(tokens),
                    fields: Fields::read(members)?,
                });
            }
        }
        Self::parse_whole(body)
    }

    /// The body, all of it through serde: text prompts, and the messages
    /// of every malformed one.
    fn parse_whole(body: &[u8]) -> Result<Self, FieldError> {
        let Members(mut members) = serde_json::from_slice(body)
            .map_err(|e| FieldError::body(format!("invalid request body: {e}")))?;
        let at = members
            .iter()
            .position(|(k, _)| k == "prompt")
            .ok_or_else(|| FieldError::field("prompt", "missing field `prompt`"))?;
        let (_, prompt) = members.remove(at);
        let prompt = Prompt::deserialize(prompt).map_err(|e| FieldError::field("prompt", e))?;
        Ok(Self {
            prompt,
            fields: Fields::read(members)?,
        })
    }
}

fn skip_ws(json: &[u8], mut i: usize) -> usize {
    while i < json.len() && matches!(json[i], b' ' | b'\t' | b'\n' | b'\r') {
        i += 1;
    }
    i
}

/// After the string opening at `i` (its closing quote included).
fn skip_string(json: &[u8], mut i: usize) -> Option<usize> {
    i += 1;
    while i < json.len() {
        match json[i] {
            b'\\' => i += 2,
            b'"' => return Some(i + 1),
            _ => i += 1,
        }
    }
    None
}

/// After the value starting at `i` (not validated: serde reads it later).
fn skip_value(json: &[u8], i: usize) -> Option<usize> {
    match json.get(i)? {
        b'"' => skip_string(json, i),
        b'{' | b'[' => {
            let mut depth = 0usize;
            let mut i = i;
            while i < json.len() {
                match json[i] {
                    b'"' => {
                        i = skip_string(json, i)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            return Some(i + 1);
                        }
                    }
                    _ => {}
                }
                i += 1;
            }
            None
        }
        _ => {
            let mut i = i;
            while i < json.len()
                && !matches!(json[i], b',' | b'}' | b']' | b' ' | b'\t' | b'\n' | b'\r')
            {
                i += 1;
            }
            Some(i)
        }
    }
}

/// The top-level `"prompt"` of a JSON object when it is a list of token
/// ids: the ids and the value's byte range. `None` when it is anything
/// else, or when the body is unusual in any way.
fn scan_prompt(json: &[u8]) -> Option<(Vec<u32>, usize, usize)> {
    let mut i = skip_ws(json, 0);
    if json.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    loop {
        i = skip_ws(json, i);
        if json.get(i) != Some(&b'"') {
            return None; // `}` (no prompt) or not JSON
        }
        let key_end = skip_string(json, i)?;
        let key = &json[i + 1..key_end - 1];
        i = skip_ws(json, key_end);
        if json.get(i) != Some(&b':') {
            return None;
        }
        i = skip_ws(json, i + 1);
        if key == b"prompt" {
            let (tokens, end) = token_ids(json, i)?;
            // The array must end the value: `[1,2].5` or `[1,2]E3` is not
            // JSON, but with the array replaced by `0` it would read as a
            // number (found by `scripts/fuzz`).
            return matches!(json.get(skip_ws(json, end)), Some(b',' | b'}'))
                .then_some((tokens, i, end));
        }
        i = skip_ws(json, skip_value(json, i)?);
        match json.get(i) {
            Some(b',') => i += 1,
            _ => return None,
        }
    }
}

/// A JSON array of integers in `0..2^32` starting at `i`: the ids and the
/// index after the array; `None` for anything else.
fn token_ids(json: &[u8], mut i: usize) -> Option<(Vec<u32>, usize)> {
    if json.get(i) != Some(&b'[') {
        return None;
    }
    let start = i;
    i = skip_ws(json, i + 1);
    if json.get(i) == Some(&b']') {
        return Some((Vec::new(), i + 1));
    }
    // At most one id per two bytes ("1,"); the estimate avoids regrowing.
    let mut out = Vec::with_capacity((json.len() - start) / 5 + 1);
    loop {
        i = skip_ws(json, i);
        let (value, end) = json_u32(json, i)?;
        out.push(value);
        i = skip_ws(json, end);
        match json.get(i) {
            Some(b',') => i += 1,
            Some(b']') => return Some((out, i + 1)),
            _ => return None,
        }
    }
}

/// The JSON integer in `0..2^32` at `i`, and the index after it.
///
/// Token ids have at most 7 digits in practice (vocabularies of up to
/// 10M), so 8 bytes are read at once: the digits are found and converted
/// with a few word operations instead of a branch per byte. Longer numbers
/// and the last bytes of the body take the byte loop.
fn json_u32(json: &[u8], i: usize) -> Option<(u32, usize)> {
    if let Some(&word) = json.get(i..).and_then(|rest| rest.first_chunk::<8>()) {
        let word = u64::from_le_bytes(word);
        // Per byte: the digit's value (when it is one), and whether it is
        // not a digit (below '0': the subtraction sets the high bit; above
        // '9': the addition does). Borrows and carries only move upwards,
        // so every byte up to the first non-digit is exact.
        let values = word.wrapping_sub(0x3030_3030_3030_3030);
        let non_digits =
            (values | word.wrapping_add(0x4646_4646_4646_4646)) & 0x8080_8080_8080_8080;
        let len = (non_digits.trailing_zeros() / 8) as usize;
        if len < 8 {
            if len == 0 || (len > 1 && json[i] == b'0') {
                return None; // not an integer, or a leading zero (not JSON)
            }
            // The digits to the top bytes, leading zeros below them.
            return Some((eight_digits(values << (8 * (8 - len))), i + len));
        }
    }
    let digits = json[i..].iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 10 || (digits > 1 && json[i] == b'0') {
        return None;
    }
    let value = json[i..i + digits]
        .iter()
        .fold(0u64, |v, &b| v * 10 + u64::from(b - b'0'));
    Some((u32::try_from(value).ok()?, i + digits))
}

/// Eight decimal digit values, the most significant in the lowest byte, as
/// a number: pairs, then quadruples, then the whole in three multiplies.
fn eight_digits(values: u64) -> u32 {
    const LOW: u64 = 0x0000_00FF_0000_00FF;
    let pairs = values.wrapping_mul(10).wrapping_add(values >> 8);
    let quads = (pairs & LOW).wrapping_mul(100 + (1_000_000 << 32));
    let rest = ((pairs >> 16) & LOW).wrapping_mul(1 + (10_000 << 32));
    (quads.wrapping_add(rest) >> 32) as u32
}

/// A prompt: token ids, or text (needs a tokenizer); or a batch of
/// several (OpenAI's list of strings or of token-id lists), each a
/// `Tokens` or `Text`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Tokens(Vec<u32>),
    Text(String),
    Batch(Vec<Prompt>),
}

impl Prompt {
    /// The prompts: a batch's, or this one.
    pub fn into_prompts(self) -> Vec<Prompt> {
        match self {
            Prompt::Batch(prompts) => prompts,
            one => vec![one],
        }
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

struct PromptVisitor;

impl<'de> Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a prompt: a string, or a list of token ids (integers in 0..2^32)")
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(v.to_owned()))
    }

    fn visit_string<E: de::Error>(self, v: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(v))
    }

    /// The slow path of a token-id list (reached only when the scanner
    /// refused it, to say what is wrong), and OpenAI's batch forms: a list
    /// of one string or of one token-id list is that one prompt (as AIPerf
    /// sends it); a list of several is a batch, each prompt its own
    /// choices.
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        let mut tokens = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(1 << 20));
        let mut batch: Vec<Prompt> = Vec::new();
        while let Some(item) = seq.next_element::<Item>()? {
            match item {
                Item::Token(t) if batch.is_empty() => tokens.push(t),
                Item::Prompt(p) if tokens.is_empty() => batch.push(p),
                _ => {
                    return Err(de::Error::custom(
                        "a prompt list mixes token ids and prompts: send a list of token ids (one prompt) or a list of prompts (a batch)",
                    ))
                }
            }
        }
        Ok(match batch.len() {
            0 => Prompt::Tokens(tokens),
            1 => batch.pop().expect("one"),
            _ => Prompt::Batch(batch),
        })
    }
}

/// One element of a prompt list: a token id, or a whole prompt of a
/// batch (a string, a token-id list).
enum Item {
    Token(u32),
    Prompt(Prompt),
}

impl<'de> Deserialize<'de> for Item {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Item;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (an integer in 0..2^32), or one prompt of a batch")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Item, E> {
                TokenId::from_u64(v).map(|t| Item::Token(t.0))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Item, E> {
                if v < 0 {
                    return Err(E::custom(format!("token id {v} is negative")));
                }
                self.visit_u64(v as u64)
            }

            fn visit_str<E: de::Error>(self, v: &str) -> Result<Item, E> {
                Ok(Item::Prompt(Prompt::Text(v.to_owned())))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Item, A::Error> {
                let mut tokens = Vec::new();
                while let Some(token) = seq.next_element::<TokenId>()? {
                    tokens.push(token.0);
                }
                Ok(Item::Prompt(Prompt::Tokens(tokens)))
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// One element of a token-id prompt, with a clear error for the batched
/// forms OpenAI also accepts.
struct TokenId(u32);

impl TokenId {
    fn from_u64<E: de::Error>(v: u64) -> Result<Self, E> {
        u32::try_from(v)
            .map(TokenId)
            .map_err(|_| E::custom(format!("token id {v} does not fit in 32 bits")))
    }
}

impl<'de> Deserialize<'de> for TokenId {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = TokenId;

            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a token id (an integer in 0..2^32)")
            }

            fn visit_u64<E: de::Error>(self, v: u64) -> Result<TokenId, E> {
                u32::try_from(v)
                    .map(TokenId)
                    .map_err(|_| E::custom(format!("token id {v} does not fit in 32 bits")))
            }

            fn visit_i64<E: de::Error>(self, v: i64) -> Result<TokenId, E> {
                if v < 0 {
                    return Err(E::custom(format!("token id {v} is negative")));
                }
                self.visit_u64(v as u64)
            }

            fn visit_str<E: de::Error>(self, _: &str) -> Result<TokenId, E> {
                Err(E::custom(
                    "a batch's token-id prompt holds a string: each prompt of a batch is a string or a list of token ids",
                ))
            }

            fn visit_seq<A: SeqAccess<'de>>(self, _: A) -> Result<TokenId, A::Error> {
                Err(de::Error::custom(
                    "a batch's token-id prompt holds a list: prompts nest one level at most",
                ))
            }
        }
        deserializer.deserialize_any(V)
    }
}

/// The decision a response was served under, for people and clients.
#[derive(Debug, Clone, Serialize)]
pub struct SwitchyardInfo {
    /// The decision id (16 hex digits), also in `x-switchyard-decision`.
    pub decision: String,
    pub request_id: String,
    pub replica: String,
    /// `bypass` or `remote`.
    pub path: &'static str,
    pub decode: String,
    pub prefill: Option<String>,
    pub isl_tokens: u32,
    pub decode_overlap_tokens: u32,
    pub prefill_overlap_tokens: u32,
    pub policy: String,
    pub rule: String,
    pub reason: String,
    /// The decision of a first attempt that failed before any token, when
    /// this one is its retry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub retry_of: Option<String>,
}

impl SwitchyardInfo {
    pub fn new(decision: &RouteDecision, replica: &str) -> Self {
        Self {
            decision: decision.id.to_string(),
            request_id: decision.request_id.clone(),
            replica: replica.to_owned(),
            path: decision.path.as_str(),
            decode: decision.decode.to_string(),
            prefill: decision.prefill.as_ref().map(|p| p.to_string()),
            isl_tokens: decision.isl_tokens,
            decode_overlap_tokens: decision.decode_overlap_tokens,
            prefill_overlap_tokens: decision.prefill_overlap_tokens,
            policy: decision.policy.clone(),
            rule: decision.rule.clone(),
            reason: decision.reason.clone(),
            retry_of: None,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
    pub total_tokens: u32,
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens found cached: the engine's figure when it reported
    /// one, else the router's predicted overlap.
    pub cached_tokens: u32,
    /// `engine` or `router`: whose figure `cached_tokens` is (a Switchyard
    /// extension); `mixed` for a batch whose prompts' figures came from
    /// both.
    pub cached_tokens_source: &'static str,
}

impl Usage {
    /// A request's usage from its choices' (each with whether it is the
    /// first choice of its prompt): completion tokens summed over every
    /// choice, prompt and cached tokens over the prompts (each counted
    /// once, from its first choice, as OpenAI and vLLM count them).
    /// `cached_tokens_source` is `mixed` when the prompts' figures came
    /// from both.
    pub fn total(choices: impl IntoIterator<Item = (Usage, bool)>) -> Self {
        let mut sum = Usage {
            prompt_tokens: 0,
            completion_tokens: 0,
            total_tokens: 0,
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens: 0,
                cached_tokens_source: "",
            },
        };
        for (u, first_of_prompt) in choices {
            sum.completion_tokens = sum.completion_tokens.saturating_add(u.completion_tokens);
            if !first_of_prompt {
                continue;
            }
            sum.prompt_tokens = sum.prompt_tokens.saturating_add(u.prompt_tokens);
            let d = &mut sum.prompt_tokens_details;
            d.cached_tokens = d
                .cached_tokens
                .saturating_add(u.prompt_tokens_details.cached_tokens);
            let source = u.prompt_tokens_details.cached_tokens_source;
            d.cached_tokens_source = match d.cached_tokens_source {
                "" => source,
                s if s == source => s,
                _ => "mixed",
            };
        }
        sum.total_tokens = sum.prompt_tokens.saturating_add(sum.completion_tokens);
        if sum.prompt_tokens_details.cached_tokens_source.is_empty() {
            sum.prompt_tokens_details.cached_tokens_source = "router";
        }
        sum
    }

    /// `engine_cached`: what the engine that prefilled said it found
    /// cached, if it said; `router_overlap`: the decision's prediction.
    pub fn new(
        prompt_tokens: u32,
        completion_tokens: u32,
        engine_cached: Option<u32>,
        router_overlap: u32,
    ) -> Self {
        let (cached_tokens, cached_tokens_source) = match engine_cached {
            Some(n) => (n, "engine"),
            None => (router_overlap.min(prompt_tokens), "router"),
        };
        Self {
            prompt_tokens,
            completion_tokens,
            total_tokens: prompt_tokens.saturating_add(completion_tokens),
            prompt_tokens_details: PromptTokensDetails {
                cached_tokens,
                cached_tokens_source,
            },
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Choice<'a> {
    pub index: u32,
    /// Decoded text (empty without a tokenizer).
    pub text: &'a str,
    /// The generated token ids (a Switchyard extension).
    pub token_ids: &'a [u32],
    pub logprobs: Option<CompletionLogprobs>,
    pub finish_reason: Option<&'static str>,
}

/// A completion choice's `logprobs` (OpenAI's legacy shape, as vLLM
/// answers it): per token its text, its log-probability, the most likely
/// tokens there with theirs, and where its text starts in the choice's
/// text.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f64>,
    pub top_logprobs: Vec<TopLogprobs>,
    pub text_offset: Vec<u32>,
}

/// One position's most likely tokens: a JSON object of token text to
/// log-probability, most likely first (a text two ids decode to is kept
/// once, with the likelier).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TopLogprobs(pub Vec<(String, f64)>);

impl Serialize for TopLogprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut seen = std::collections::HashSet::new();
        let mut map = s.serialize_map(None)?;
        for (token, logprob) in &self.0 {
            if seen.insert(token.as_str()) {
                map.serialize_entry(token, logprob)?;
            }
        }
        map.end()
    }
}

/// A chat choice's `logprobs`: `content`, one entry a token.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
    /// Always `null` (no refusal tokens).
    pub refusal: Option<Vec<ChatTokenLogprob>>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f64,
    /// The token text's UTF-8 bytes.
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f64,
    pub bytes: Vec<u8>,
}

/// A completion's choice or a chat completion's.
#[derive(Debug, Serialize)]
#[serde(untagged)]
pub enum AnyChoice<'a> {
    Text(Choice<'a>),
    Chat(ChatChoice<'a>),
}

/// A chat completion's choice: the whole `message`, or a chunk's `delta`.
#[derive(Debug, Serialize)]
pub struct ChatChoice<'a> {
    pub index: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<ChatMessage<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delta: Option<ChatMessage<'a>>,
    /// The generated token ids (a Switchyard extension).
    pub token_ids: &'a [u32],
    pub logprobs: Option<ChatLogprobs>,
    pub finish_reason: Option<&'static str>,
}

#[derive(Debug, Serialize)]
pub struct ChatMessage<'a> {
    pub role: &'static str,
    pub content: &'a str,
}

/// A non-streamed response, or one SSE chunk of a streamed one.
#[derive(Debug, Serialize)]
pub struct Completion<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub model: &'a str,
    /// The choices (in a stream's chunk, one; none in its usage-only last
    /// chunk).
    pub choices: Vec<AnyChoice<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The decision of the first choice (index 0); a streamed chunk's is
    /// its choice's, on the choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switchyard: Option<&'a SwitchyardInfo>,
    /// With several choices, not streamed: every choice's decision, by
    /// index (each choice is its own routed request).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switchyard_choices: Option<Vec<&'a SwitchyardInfo>>,
}

/// `{"error": {...}}`, OpenAI's error shape.
#[derive(Debug, Serialize)]
pub struct ErrorBody<'a> {
    pub error: ErrorDetail<'a>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub switchyard: Option<&'a SwitchyardInfo>,
}

#[derive(Debug, Serialize)]
pub struct ErrorDetail<'a> {
    pub message: &'a str,
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// The request field at fault, when one is.
    pub param: Option<&'a str>,
    pub code: u16,
}

/// `GET /v1/models/{id}`, and each of `GET /v1/models`'s.
#[derive(Debug, Serialize)]
pub struct ModelCard<'a> {
    pub id: &'a str,
    pub object: &'static str,
    pub created: u64,
    pub owned_by: &'static str,
    pub root: &'a str,
    pub parent: Option<&'a str>,
    /// The context length requests are checked against (vLLM's field),
    /// when known.
    pub max_model_len: Option<u32>,
}

/// `GET /v1/models`.
#[derive(Debug, Serialize)]
pub struct ModelList<'a> {
    pub object: &'static str,
    pub data: [ModelCard<'a>; 1],
}

/// `POST /v1/route`: the decision's own JSON (`RouteDecision` reads it
/// back) plus the annotation.
#[derive(Debug, Serialize)]
pub struct RouteBody<'a> {
    #[serde(flatten)]
    pub decision: &'a RouteDecision,
    /// With `?explain=true`: what the decision looked at.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub explanation: Option<serde_json::Value>,
    pub switchyard: &'a SwitchyardInfo,
}

/// `GET /debug/ledger?decision=ID`.
#[derive(Debug, Deserialize)]
pub struct LedgerQuery {
    pub decision: Option<String>,
}

/// `GET /readyz`.
#[derive(Debug, Serialize)]
pub struct ReadyBody<'a> {
    pub ready: bool,
    pub status: &'a str,
    pub replica: &'a str,
}

/// `GET /debug/ledger`: one worker's view.
#[derive(Debug, Serialize)]
pub struct LedgerWorker {
    pub worker: String,
    /// `prefill`, `decode`, `both`, or `unregistered` (only referred to by
    /// in-flight decisions).
    pub role: &'static str,
    /// Its circuit breaker: `closed`, `open` (out of rotation) or
    /// `half_open` (one trial request may go).
    pub breaker: &'static str,
    pub charged_prefill_tokens: u64,
    /// Whole contexts of the requests decoding here (what selection
    /// spreads).
    pub charged_decode_blocks: u64,
    /// What those requests add to its cache once there (what the decode
    /// gate counts on top of the worker's report).
    pub charged_cache_blocks: u64,
    pub charged_requests: u32,
    pub effective_kv_blocks_used: Option<u64>,
    pub effective_queued_prefill_tokens: Option<u64>,
}

/// `GET /debug/ledger`.
#[derive(Debug, Serialize)]
pub struct LedgerBody {
    pub replica: String,
    pub in_flight: usize,
    pub applied_delta: u64,
    /// The index replica's digest (hex) and size: equal on replicas and
    /// the indexer at the same delta.
    pub index_digest: String,
    pub index_blocks: u64,
    pub workers: Vec<LedgerWorker>,
    /// With `?decision=ID`: whether the ledger holds it (in flight or
    /// recently finished).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub knows_decision: Option<bool>,
    /// The peer replicas alive (heartbeats), in id order.
    pub peers: Vec<LedgerPeer>,
}

/// `GET /debug/ledger`: a peer replica alive.
#[derive(Debug, Serialize)]
pub struct LedgerPeer {
    pub replica: String,
    /// Its decisions this ledger holds (in flight, no finish notice yet).
    pub held_decisions: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scanner reads exactly what serde reads, or leaves it to serde.
    #[test]
    fn the_scanner_agrees_with_serde() {
        let bodies = [
            r#"{"prompt":[]}"#,
            r#" { "prompt" : [ 1 , 2 ,
                3 ] , "max_tokens" : 4 } "#,
            r#"{"model":"m","prompt":[0,4294967295],"stream":true}"#,
            r#"{"stop":["]","}",","],"logit_bias":{"1":-100},"prompt":[7],"max_tokens":null}"#,
            r#"{"model":"a\"b\\","prompt":[5]}"#,
            r#"{"nested":{"prompt":[1]},"prompt":[2]}"#,
            r#"{"prompt":[1],"prompt":[2]}"#,
            r#"{"prompt":[1],"max_tokens":"x"}"#,
            r#"{"prompt":[1],}"#,
            r#"{"prompt":[1]"#,
            r#"{"prompt":[4294967296]}"#,
            r#"{"prompt":[01]}"#,
            r#"{"prompt":[1.0]}"#,
            r#"{"prompt":[-1]}"#,
            r#"{"prompt":"text"}"#,
            r#"{"prompt":[1]} x"#,
            r#"{"max_tokens":2}"#,
            r#"[1,2]"#,
        ];
        for body in bodies {
            let fast = CompletionRequest::parse(body.as_bytes());
            let slow = CompletionRequest::parse_whole(body.as_bytes());
            let fast = fast.map(|r| (r.prompt, r.fields));
            let slow = slow.map(|r| (r.prompt, r.fields));
            assert_eq!(fast, slow, "{body}");
        }
        let big: Vec<u32> = (0..10_000).map(|i| i * 429_497).collect();
        let body =
            serde_json::to_vec(&serde_json::json!({"prompt": big, "max_tokens": 3})).unwrap();
        assert!(scan_prompt(&body).is_some());
        assert_eq!(
            CompletionRequest::parse(&body).unwrap().prompt,
            Prompt::Tokens(big)
        );
    }

    proptest::proptest! {
        /// Token ids of every length and spacing, with a byte or two
        /// changed: whenever the scanner accepts an array, serde reads the
        /// same ids from it; whenever serde reads a valid one, so does the
        /// scanner.
        #[test]
        fn scanned_ids_are_serdes_ids(
            ids in proptest::collection::vec(
                proptest::prop_oneof![0u32..10, 0u32..200_000, proptest::num::u32::ANY], 0..40),
            spaces in proptest::collection::vec(0usize..3, 40),
            edits in proptest::collection::vec(
                (proptest::num::usize::ANY, proptest::sample::select(b"0957-.e+ ,]x".to_vec())), 0..3),
        ) {
            let mut text = String::from("[");
            for (k, id) in ids.iter().enumerate() {
                if k > 0 {
                    text.push(',');
                }
                text.push_str(&" ".repeat(spaces[k]));
                text.push_str(&id.to_string());
            }
            text.push(']');
            let mut bytes = text.into_bytes();
            for (at, byte) in edits {
                let at = at % (bytes.len() + 1);
                bytes.insert(at, byte);
            }
            let serde: Option<Vec<u32>> = serde_json::from_slice(&bytes).ok();
            let scanned = token_ids(&bytes, skip_ws(&bytes, 0))
                .filter(|&(_, end)| skip_ws(&bytes, end) == bytes.len())
                .map(|(ids, _)| ids);
            proptest::prop_assert_eq!(scanned, serde);
        }
    }

    #[test]
    fn a_token_array_glued_to_more_is_not_json() {
        // Found by `scripts/fuzz` (http_body): the scanner took the array,
        // and `0` in its place made `0.5` and `0E3` numbers.
        for body in [
            &br#"{"prompt":[0,4294967295].5,"max_tokens":1}"#[..],
            br#"{"prompt":[1,2]E-3}"#,
            br#"{"prompt":[1,2] x}"#,
        ] {
            assert!(
                CompletionRequest::parse(body).is_err(),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn prompts_parse_with_clear_errors() {
        let r = CompletionRequest::parse(br#"{"prompt":[1,2,3],"max_tokens":4}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!((r.fields.max_tokens, r.fields.stream), (Some(4), false));
        let r =
            CompletionRequest::parse(br#"{"prompt":"hi","stream":true,"temperature":0}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi".into()));
        // A batch of one prompt is that prompt.
        let r = CompletionRequest::parse(br#"{"prompt":["hi there"]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Text("hi there".into()));
        let r = CompletionRequest::parse(br#"{"prompt":[[4,5]]}"#).unwrap();
        assert_eq!(r.prompt, Prompt::Tokens(vec![4, 5]));
        // Several are a batch, in order.
        let r = CompletionRequest::parse(br#"{"prompt":["a","b"]}"#).unwrap();
        assert_eq!(
            r.prompt,
            Prompt::Batch(vec![Prompt::Text("a".into()), Prompt::Text("b".into())])
        );
        let r = CompletionRequest::parse(br#"{"prompt":[[1],[2,3],"c"]}"#).unwrap();
        assert_eq!(
            r.prompt.into_prompts(),
            vec![
                Prompt::Tokens(vec![1]),
                Prompt::Tokens(vec![2, 3]),
                Prompt::Text("c".into())
            ]
        );
        for (body, needle) in [
            (&br#"{"prompt":[1,-2]}"#[..], "negative"),
            (br#"{"prompt":[1,4294967296]}"#, "32 bits"),
            (br#"{"prompt":[[1],[[2]]]}"#, "nest one level"),
            (br#"{"prompt":[[1,"a"]]}"#, "holds a string"),
            (br#"{"prompt":[1,"a"]}"#, "mixes"),
            (br#"{"prompt":["a",1]}"#, "mixes"),
            (br#"{"prompt":1}"#, "a prompt"),
            (br#"{"prompt":[1.5]}"#, "floating point"),
            (br#"{"prompt":[1,,2]}"#, "expected value"),
            (br#"{"max_tokens":1}"#, "missing field `prompt`"),
            (br#"{"prompt":[1]"#, "EOF"),
            (b"", "empty"),
        ] {
            let e = CompletionRequest::parse(body).unwrap_err().message;
            assert!(e.contains(needle), "{}: {e}", String::from_utf8_lossy(body));
        }
    }
}
