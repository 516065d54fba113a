//! A response's parts from its choices' streams, as plain functions (no
//! IO): a choice's usage, the request's total, a choice's text with its
//! echoed prompt, and the engine's per-token log-probabilities in
//! OpenAI's completion and chat shapes. `completions.rs` drives them.

use protocol::TokenLogprob;

use super::openai::{
    ChatLogprobs, ChatTokenLogprob, ChatTopLogprob, CompletionLogprobs, SwitchyardInfo,
    TopLogprobs, Usage,
};

/// What a choice counts towards its request's usage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChoiceUsage {
    pub prompt_tokens: u32,
    /// Whether it is its prompt's first choice (the one whose prompt
    /// tokens count).
    pub first_of_prompt: bool,
    /// The router's predicted overlap on the worker that prefilled.
    pub router_overlap: u32,
}

impl ChoiceUsage {
    pub fn new(prompt_tokens: u32, first_of_prompt: bool, info: &SwitchyardInfo) -> Self {
        let router_overlap = if info.path == "remote" {
            info.prefill_overlap_tokens
        } else {
            info.decode_overlap_tokens
        };
        Self {
            prompt_tokens,
            first_of_prompt,
            router_overlap,
        }
    }

    /// The choice's own usage, with the engine's cached figure when it
    /// said one.
    pub fn usage(&self, output_tokens: u32, engine_cached: Option<u32>) -> Usage {
        Usage::new(
            self.prompt_tokens,
            output_tokens,
            engine_cached,
            self.router_overlap,
        )
    }
}

/// The request's usage from its choices' ([`Usage::total`]).
pub fn total_usage<'a>(choices: impl IntoIterator<Item = (&'a ChoiceUsage, Usage)>) -> Usage {
    Usage::total(choices.into_iter().map(|(c, u)| (u, c.first_of_prompt)))
}

/// How a token is named in `logprobs`: its text (the tokenizer's), else
/// `token_id:ID` (vLLM's `return_tokens_as_token_ids` form).
pub type Namer<'a> = &'a dyn Fn(u32) -> String;

/// `token_id:ID`, a token's name without a tokenizer.
pub fn id_name(id: u32) -> String {
    format!("token_id:{id}")
}

/// The engine's `f32` as the `f64` of its shortest decimal (`-0.1`, not
/// `-0.10000000149011612`, in the JSON).
pub fn wide(x: f32) -> f64 {
    x.to_string().parse().unwrap_or(f64::from(x))
}

/// A completion choice's `logprobs` for `tokens` (and theirs, one a
/// token), the first token's text at character `offset` of the choice's
/// text; `offset` moves past them.
pub fn completion_logprobs(
    tokens: &[u32],
    logprobs: &[TokenLogprob],
    name: Namer<'_>,
    offset: &mut u32,
) -> CompletionLogprobs {
    let mut out = CompletionLogprobs::default();
    for (&token, lp) in tokens.iter().zip(logprobs) {
        let text = name(token);
        out.text_offset.push(*offset);
        *offset = offset.saturating_add(text.chars().count() as u32);
        out.tokens.push(text);
        out.token_logprobs.push(wide(lp.logprob));
        out.top_logprobs.push(TopLogprobs(
            lp.top.iter().map(|&(id, l)| (name(id), wide(l))).collect(),
        ));
    }
    out
}

/// A chat choice's `logprobs` for `tokens` (and theirs).
pub fn chat_logprobs(tokens: &[u32], logprobs: &[TokenLogprob], name: Namer<'_>) -> ChatLogprobs {
    let content = tokens
        .iter()
        .zip(logprobs)
        .map(|(&token, lp)| {
            let text = name(token);
            ChatTokenLogprob {
                bytes: text.as_bytes().to_vec(),
                token: text,
                logprob: wide(lp.logprob),
                top_logprobs: lp
                    .top
                    .iter()
                    .map(|&(id, logprob)| {
                        let token = name(id);
                        ChatTopLogprob {
                            bytes: token.as_bytes().to_vec(),
                            token,
                            logprob: wide(logprob),
                        }
                    })
                    .collect(),
            }
        })
        .collect();
    ChatLogprobs {
        content,
        refusal: None,
    }
}

/// A choice's text: its echoed prompt (when asked), then what it
/// generated.
pub fn echoed(echo: Option<&str>, generated: &str) -> String {
    match echo {
        Some(prompt) => format!("{prompt}{generated}"),
        None => generated.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use protocol::Path;

    fn info(path: Path, decode_overlap: u32, prefill_overlap: u32) -> SwitchyardInfo {
        SwitchyardInfo {
            decision: "0".into(),
            request_id: "r".into(),
            replica: "r0".into(),
            path: path.as_str(),
            decode: "d0".into(),
            prefill: None,
            isl_tokens: 0,
            decode_overlap_tokens: decode_overlap,
            prefill_overlap_tokens: prefill_overlap,
            policy: "p".into(),
            rule: "x".into(),
            reason: "y".into(),
            retry_of: None,
        }
    }

    /// Two prompts, two choices each: completion tokens over all four,
    /// prompt and cached tokens once per prompt; the cached figure's
    /// source says when the prompts' came from both.
    #[test]
    fn usage_sums_over_choices_and_counts_each_prompt_once() {
        let a0 = ChoiceUsage::new(100, true, &info(Path::Bypass, 64, 0));
        let a1 = ChoiceUsage::new(100, false, &info(Path::Bypass, 96, 0));
        let b0 = ChoiceUsage::new(40, true, &info(Path::Remote, 0, 16));
        let b1 = ChoiceUsage::new(40, false, &info(Path::Remote, 0, 32));
        let parts = [
            (&a0, a0.usage(5, Some(80))),
            (&a1, a1.usage(7, Some(100))),
            (&b0, b0.usage(3, None)),
            (&b1, b1.usage(4, None)),
        ];
        let u = total_usage(parts);
        assert_eq!(
            (u.prompt_tokens, u.completion_tokens, u.total_tokens),
            (140, 19, 159)
        );
        // The engine's 80 for prompt a, the router's 16 (prefill overlap)
        // for prompt b.
        assert_eq!(u.prompt_tokens_details.cached_tokens, 96);
        assert_eq!(u.prompt_tokens_details.cached_tokens_source, "mixed");
        let one = total_usage([(&a0, a0.usage(5, Some(80)))]);
        assert_eq!(
            (
                one.prompt_tokens,
                one.completion_tokens,
                one.prompt_tokens_details.cached_tokens,
                one.prompt_tokens_details.cached_tokens_source
            ),
            (100, 5, 80, "engine")
        );
        let router = total_usage([(&b0, b0.usage(3, None))]);
        assert_eq!(router.prompt_tokens_details.cached_tokens_source, "router");
    }

    fn lp(logprob: f32, top: &[(u32, f32)]) -> TokenLogprob {
        TokenLogprob {
            logprob,
            top: top.to_vec(),
        }
    }

    /// Tokens named by the namer, offsets continuing from the echo's
    /// length, and the JSON OpenAI's clients parse.
    #[test]
    fn completion_logprobs_shape() {
        let name = |id: u32| format!("<{id}>");
        let mut offset = 6;
        let l = completion_logprobs(
            &[7, 42],
            &[lp(-0.5, &[(7, -0.5), (8, -1.0)]), lp(-2.0, &[(9, -1.0)])],
            &name,
            &mut offset,
        );
        assert_eq!(offset, 6 + 3 + 4);
        assert_eq!(
            serde_json::to_value(&l).unwrap(),
            serde_json::json!({
                "tokens": ["<7>", "<42>"],
                "token_logprobs": [-0.5, -2.0],
                "top_logprobs": [{"<7>": -0.5, "<8>": -1.0}, {"<9>": -1.0}],
                "text_offset": [6, 9],
            })
        );
        // Two ids of one text: kept once, the likelier (listed first).
        let same = |_: u32| "a".to_owned();
        let l = completion_logprobs(&[1], &[lp(-0.1, &[(1, -0.1), (2, -0.2)])], &same, &mut 0);
        assert_eq!(
            serde_json::to_value(&l.top_logprobs).unwrap(),
            serde_json::json!([{"a": -0.1}])
        );
        assert_eq!(id_name(5), "token_id:5");
    }

    #[test]
    fn chat_logprobs_shape() {
        let name = |id: u32| {
            if id == 1 {
                "é".to_owned()
            } else {
                id_name(id)
            }
        };
        let l = chat_logprobs(&[1], &[lp(-0.25, &[(1, -0.25), (3, -4.0)])], &name);
        assert_eq!(
            serde_json::to_value(&l).unwrap(),
            serde_json::json!({
                "content": [{
                    "token": "é", "logprob": -0.25, "bytes": [195, 169],
                    "top_logprobs": [
                        {"token": "é", "logprob": -0.25, "bytes": [195, 169]},
                        {"token": "token_id:3", "logprob": -4.0, "bytes": [116, 111, 107, 101, 110, 95, 105, 100, 58, 51]},
                    ],
                }],
                "refusal": null,
            })
        );
    }

    #[test]
    fn logprobs_print_short() {
        assert_eq!(wide(-0.1), -0.1);
        assert_eq!(wide(f32::NEG_INFINITY), f64::NEG_INFINITY);
        assert_eq!(serde_json::to_string(&wide(-1.1)).unwrap(), "-1.1");
    }

    #[test]
    fn echo_comes_first() {
        assert_eq!(echoed(Some("Say: "), "hi"), "Say: hi");
        assert_eq!(echoed(None, "hi"), "hi");
    }
}
