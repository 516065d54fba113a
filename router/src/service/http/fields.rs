//! A completion request's fields other than its prompt, each one read by
//! name, its type and range checked: the sampling and stopping parameters
//! into [`protocol::Sampling`] for the engine, the rest for the router. A
//! field this router does not know, or knows but cannot honour (`best_of`,
//! `suffix`), is an error naming it — never dropped with a 200. `n` and
//! `echo` are the router's own (each choice is its own request; the
//! prompt is echoed from what the client sent).

use protocol::{Sampling, SessionId};
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::Deserialize;
use serde_json::Value;

/// Why a request is refused: the message, and the field at fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldError {
    pub param: Option<String>,
    pub message: String,
}

impl FieldError {
    pub fn body(message: impl Into<String>) -> Self {
        Self {
            param: None,
            message: message.into(),
        }
    }

    pub fn field(name: &str, message: impl std::fmt::Display) -> Self {
        Self {
            param: Some(name.to_owned()),
            message: format!("{name}: {message}"),
        }
    }
}

impl std::fmt::Display for FieldError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

/// A JSON object's members in order; a key given twice is an error (as
/// serde's derived structs say it).
#[derive(Debug, Default)]
pub struct Members(pub Vec<(String, Value)>);

impl<'de> Deserialize<'de> for Members {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Members;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON object (a completion request)")
            }

            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Members, A::Error> {
                let mut out: Vec<(String, Value)> = Vec::new();
                while let Some(key) = map.next_key::<String>()? {
                    if out.iter().any(|(k, _)| *k == key) {
                        return Err(de::Error::custom(format!("duplicate field `{key}`")));
                    }
                    let value = map.next_value()?;
                    out.push((key, value));
                }
                Ok(Members(out))
            }
        }
        deserializer.deserialize_map(V)
    }
}

/// The fields read, but the prompt.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fields {
    pub model: Option<String>,
    pub max_tokens: Option<u32>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    pub sampling: Sampling,
    /// `agent_context.session_id` (Dynamo's): the conversation's session.
    pub session: Option<SessionId>,
    /// `n`: choices per prompt (`None`: one).
    pub n: Option<u32>,
    /// `echo`: each choice's text starts with its prompt.
    pub echo: bool,
}

/// Most choices one request may ask for (`n` times the prompts of a
/// batch): each is its own routed request.
pub const MAX_CHOICES: u32 = 128;

impl Fields {
    /// Choices per prompt.
    pub fn choices(&self) -> u32 {
        self.n.unwrap_or(1)
    }
}

/// The fields a completion request may have besides the sampling ones
/// (`Sampling::ENGINE_FIELDS` and `lora`), the prompt included.
pub const REQUEST_FIELDS: [&str; 11] = [
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "user",
    "n",
    "best_of",
    "echo",
    "suffix",
    "agent_context",
];

/// The LoRA adapter's field (a Switchyard extension: vLLM names it in
/// `model`, which this router keeps for the base model).
pub const LORA: &str = "lora";

impl Fields {
    /// Reads every member (the prompt excluded); the first bad one is the
    /// error. `null` is "not set" for every field.
    pub fn read(members: Vec<(String, Value)>) -> Result<Self, FieldError> {
        let mut f = Fields::default();
        for (key, value) in members {
            if value.is_null() {
                continue;
            }
            f.read_one(&key, value)?;
        }
        if f.sampling.min_tokens > 0 {
            if let Some(max) = f.max_tokens {
                if f.sampling.min_tokens > max {
                    return Err(FieldError::field(
                        "min_tokens",
                        format!("{} is more than max_tokens ({max})", f.sampling.min_tokens),
                    ));
                }
            }
        }
        Ok(f)
    }

    fn read_one(&mut self, key: &str, value: Value) -> Result<(), FieldError> {
        match key {
            "model" => self.model = Some(typed(key, value)?),
            "max_tokens" => self.max_tokens = Some(typed(key, value)?),
            "stream" => self.stream = typed(key, value)?,
            "stream_options" => {
                let o: StreamOptions = typed(key, value)?;
                self.include_usage = o.include_usage.unwrap_or(false);
            }
            // Metadata for abuse monitoring at OpenAI; nothing to do here.
            "user" => {
                let _: String = typed(key, value)?;
            }
            "n" => {
                let n: u32 = typed(key, value)?;
                if !(1..=MAX_CHOICES).contains(&n) {
                    return Err(FieldError::field(
                        key,
                        format!("{n}: must be in [1, {MAX_CHOICES}]"),
                    ));
                }
                self.n = Some(n);
            }
            "best_of" => {
                let n: u32 = typed(key, value)?;
                if n != 1 {
                    return Err(FieldError::field(
                        key,
                        format!("{n}: ranking several generations is not supported (vLLM's V1 engine has no best_of either): send best_of 1, or n choices and rank them yourself"),
                    ));
                }
            }
            "echo" => self.echo = typed(key, value)?,
            "suffix" => {
                if !typed::<String>(key, value)?.is_empty() {
                    return Err(FieldError::field(key, "suffixes are not supported"));
                }
            }
            "temperature" => self.sampling.temperature = Some(ranged(key, value, 0.0, f64::MAX)?),
            "top_p" => {
                let p = ranged(key, value, 0.0, 1.0)?;
                if p == 0.0 {
                    return Err(FieldError::field(key, "must be in (0, 1]"));
                }
                self.sampling.top_p = Some(p);
            }
            "top_k" => {
                let k: i32 = typed(key, value)?;
                if k < -1 {
                    return Err(FieldError::field(
                        key,
                        format!("{k}: must be -1 (no top-k) or at least 0"),
                    ));
                }
                self.sampling.top_k = Some(k);
            }
            "min_p" => self.sampling.min_p = Some(ranged(key, value, 0.0, 1.0)?),
            "seed" => self.sampling.seed = Some(typed(key, value)?),
            "stop" => {
                self.sampling.stop = match typed::<StopField>(key, value)? {
                    StopField::One(stop) => vec![stop],
                    StopField::Many(stops) => stops,
                };
                if self.sampling.stop.iter().any(String::is_empty) {
                    return Err(FieldError::field(key, "a stop string is empty"));
                }
            }
            "stop_token_ids" => self.sampling.stop_token_ids = typed(key, value)?,
            "ignore_eos" => self.sampling.ignore_eos = typed(key, value)?,
            "min_tokens" => self.sampling.min_tokens = typed(key, value)?,
            "presence_penalty" => {
                self.sampling.presence_penalty = Some(ranged(key, value, -2.0, 2.0)?)
            }
            "frequency_penalty" => {
                self.sampling.frequency_penalty = Some(ranged(key, value, -2.0, 2.0)?)
            }
            "repetition_penalty" => {
                let p = ranged(key, value, 0.0, f64::MAX)?;
                if p == 0.0 {
                    return Err(FieldError::field(key, "must be more than 0"));
                }
                self.sampling.repetition_penalty = Some(p);
            }
            "logprobs" => {
                let n: u32 = typed(key, value)?;
                if n > MAX_LOGPROBS {
                    return Err(FieldError::field(
                        key,
                        format!("{n}: at most {MAX_LOGPROBS}"),
                    ));
                }
                self.sampling.logprobs = Some(n);
            }
            "logit_bias" => {
                let bias: std::collections::BTreeMap<String, f64> = typed(key, value)?;
                let mut out = Vec::with_capacity(bias.len());
                for (token, b) in bias {
                    let id = token.parse::<u32>().map_err(|_| {
                        FieldError::field(key, format!("{token:?} is not a token id"))
                    })?;
                    if !(-100.0..=100.0).contains(&b) {
                        return Err(FieldError::field(
                            key,
                            format!("token {id}'s bias {b} is outside [-100, 100]"),
                        ));
                    }
                    out.push((id, b));
                }
                out.sort_by_key(|&(id, _)| id);
                self.sampling.logit_bias = out;
            }
            "response_format" => {
                let kind = value.get("type").and_then(Value::as_str);
                if !value.is_object() || kind.is_none() {
                    return Err(FieldError::field(
                        key,
                        "must be an object with a \"type\" (text, json_object, json_schema)",
                    ));
                }
                self.sampling.response_format = Some(value.to_string());
            }
            // Dynamo's agent context: the session whose turns stay on one
            // decode worker.
            "agent_context" => {
                let context: AgentContext = typed(key, value)?;
                self.session = context
                    .session_id
                    .map(|s| SessionId::new(&s))
                    .transpose()
                    .map_err(|e| FieldError::field("agent_context.session_id", e))?;
            }
            "cache_salt" => self.sampling.cache_salt = Some(non_empty(key, value)?),
            LORA => self.sampling.lora = Some(non_empty(key, value)?),
            "prompt" => {}
            other => {
                return Err(FieldError::field(
                    other,
                    format!(
                        "unknown field (a completion request has: {}, {}, {LORA})",
                        REQUEST_FIELDS.join(", "),
                        Sampling::ENGINE_FIELDS.join(", ")
                    ),
                ))
            }
        }
        Ok(())
    }
}

/// vLLM's default `max_logprobs`.
pub const MAX_LOGPROBS: u32 = 20;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct AgentContext {
    session_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct StreamOptions {
    include_usage: Option<bool>,
    #[allow(dead_code)]
    continuous_usage_stats: Option<bool>,
}

#[derive(Deserialize)]
#[serde(untagged, expecting = "a string or a list of strings")]
enum StopField {
    One(String),
    Many(Vec<String>),
}

fn typed<T: de::DeserializeOwned>(key: &str, value: Value) -> Result<T, FieldError> {
    serde_json::from_value(value).map_err(|e| FieldError::field(key, e))
}

fn ranged(key: &str, value: Value, min: f64, max: f64) -> Result<f64, FieldError> {
    let v: f64 = typed(key, value)?;
    if !(min..=max).contains(&v) {
        let range = if max == f64::MAX {
            format!("at least {min}")
        } else {
            format!("in [{min}, {max}]")
        };
        return Err(FieldError::field(key, format!("{v}: must be {range}")));
    }
    Ok(v)
}

fn non_empty(key: &str, value: Value) -> Result<String, FieldError> {
    let s: String = typed(key, value)?;
    if s.is_empty() {
        return Err(FieldError::field(key, "must not be empty"));
    }
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn read(v: Value) -> Result<Fields, FieldError> {
        let Value::Object(o) = v else { panic!() };
        Fields::read(o.into_iter().collect())
    }

    #[test]
    fn every_sampling_field_is_read() {
        let f = read(json!({
            "model": "m", "max_tokens": 9, "stream": true,
            "stream_options": {"include_usage": true}, "user": "u", "n": 3, "echo": true,
            "logprobs": 2,
            "temperature": 0, "top_p": 0.5, "top_k": -1, "min_p": 0.1, "seed": 42,
            "stop": "\n", "stop_token_ids": [2, 3], "ignore_eos": true, "min_tokens": 4,
            "presence_penalty": 1.5, "frequency_penalty": -1, "repetition_penalty": 1.2,
            "logit_bias": {"7": -100, "3": 1.5},
            "response_format": {"type": "json_object"}, "cache_salt": "s", "lora": "a",
            "suffix": null,
        }))
        .unwrap();
        assert_eq!(
            (f.model.as_deref(), f.max_tokens, f.stream, f.include_usage),
            (Some("m"), Some(9), true, true)
        );
        assert_eq!((f.choices(), f.echo), (3, true));
        let s = f.sampling;
        assert_eq!(s.logprobs, Some(2));
        assert_eq!(s.temperature, Some(0.0));
        assert_eq!(s.stop, vec!["\n".to_owned()]);
        assert_eq!(s.logit_bias, vec![(3, 1.5), (7, -100.0)]);
        assert_eq!(
            s.response_format.as_deref(),
            Some(r#"{"type":"json_object"}"#)
        );
        assert_eq!(s.fields_set().len(), 17, "{:?}", s.fields_set());
    }

    #[test]
    fn bad_fields_are_named() {
        for (body, param, needle) in [
            (
                json!({"temperature": "hot"}),
                "temperature",
                "invalid type: string",
            ),
            (json!({"temperature": -1}), "temperature", "at least 0"),
            (json!({"top_p": 0}), "top_p", "(0, 1]"),
            (json!({"top_k": -2}), "top_k", "-1"),
            (json!({"seed": 1.5}), "seed", "invalid type"),
            (
                json!({"stop": [1]}),
                "stop",
                "a string or a list of strings",
            ),
            (
                json!({"stop_token_ids": [-1]}),
                "stop_token_ids",
                "invalid value",
            ),
            (json!({"ignore_eos": "yes"}), "ignore_eos", "invalid type"),
            (
                json!({"min_tokens": 5, "max_tokens": 4}),
                "min_tokens",
                "more than max_tokens",
            ),
            (
                json!({"presence_penalty": 3}),
                "presence_penalty",
                "[-2, 2]",
            ),
            (json!({"logprobs": 21}), "logprobs", "at most 20"),
            (json!({"logprobs": true}), "logprobs", "invalid type"),
            (
                json!({"logit_bias": {"x": 1}}),
                "logit_bias",
                "not a token id",
            ),
            (
                json!({"logit_bias": {"1": 101}}),
                "logit_bias",
                "[-100, 100]",
            ),
            (
                json!({"response_format": "json"}),
                "response_format",
                "object",
            ),
            (json!({"cache_salt": ""}), "cache_salt", "empty"),
            (json!({"n": 0}), "n", "[1, 128]"),
            (json!({"n": 129}), "n", "[1, 128]"),
            (json!({"best_of": 2}), "best_of", "not supported"),
            (json!({"echo": "yes"}), "echo", "invalid type"),
            (
                json!({"stream_options": {"x": 1}}),
                "stream_options",
                "unknown field",
            ),
            (json!({"max_tokens": "x"}), "max_tokens", "invalid type"),
            (json!({"temprature": 0}), "temprature", "unknown field"),
        ] {
            let e = read(body.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {e}");
            assert!(e.message.starts_with(param), "{body}: {e}");
            assert!(e.message.contains(needle), "{body}: {e}");
        }
    }
}
