//! A completion request's body as the router's front door reads it: the
//! fast scanner for token-id prompts, serde for the rest, every field
//! checked by name. Nothing may panic; a body read as token ids is valid
//! JSON whose `prompt` is exactly those ids (the scanner agrees with serde).

use router::service::http::openai::{CompletionRequest, Prompt};

pub fn run(data: &[u8]) {
    let Ok(request) = CompletionRequest::parse(data) else {
        return;
    };
    let Prompt::Tokens(tokens) = request.prompt else {
        return;
    };
    let value: serde_json::Value =
        serde_json::from_slice(data).expect("a body read as a request is valid JSON");
    let prompt = value.get("prompt").expect("the body has a prompt");
    if let Some(items) = prompt.as_array() {
        if items.iter().all(|v| v.is_u64()) {
            let serde: Vec<u64> = items.iter().filter_map(|v| v.as_u64()).collect();
            let ours: Vec<u64> = tokens.iter().map(|&t| u64::from(t)).collect();
            assert_eq!(ours, serde, "the scanner read other token ids than serde");
        }
    }
}

pub fn seeds() -> Vec<Vec<u8>> {
    [
        r#"{"model":"m","prompt":[1,2,3,40000],"max_tokens":16}"#,
        r#"{"model":"m","prompt":"Hello there","max_tokens":8,"stream":true,"stream_options":{"include_usage":true}}"#,
        r#"{"prompt":[0,4294967295],"model":"m","temperature":0.5,"top_p":0.9,"stop":["\n"],"seed":7}"#,
        r#"{"model":"m","prompt": [ 12 , 13 ],"max_tokens":1,"ignore_eos":true,"logit_bias":{"5":-100}}"#,
        r#"{"model":"m","prompt":[[1,2],[3]],"max_tokens":2}"#,
        r#"{"model":"m","prompt":[1,2],"prompt":[3],"max_tokens":2}"#,
    ]
    .iter()
    .map(|s| s.as_bytes().to_vec())
    .collect()
}
