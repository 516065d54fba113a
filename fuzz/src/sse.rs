//! An engine's server-sent events, as the agent's vLLM adapter reads its
//! streamed completions: split into events, each parsed as a chunk.
//! Nothing may panic; where the bytes parse, how the network cut them does
//! not change the events (fed whole, or in the pieces the input names).

use worker_agent::vllm::openai::{parse_event, SseParser};

use crate::input::Input;

fn events(pieces: &[&[u8]]) -> Option<Vec<String>> {
    let mut parser = SseParser::new();
    let mut out = Vec::new();
    for piece in pieces {
        out.extend(parser.feed(piece).ok()?);
    }
    out.extend(parser.finish());
    Some(out)
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let cuts = usize::from(input.byte() % 8);
    let sizes: Vec<usize> = (0..cuts).map(|_| usize::from(input.byte())).collect();
    let text = input.rest();
    let mut pieces = Vec::new();
    let mut rest = text;
    for size in sizes {
        let (head, tail) = rest.split_at(size.min(rest.len()));
        pieces.push(head);
        rest = tail;
    }
    pieces.push(rest);
    let whole = events(&[text]);
    let split = events(&pieces);
    if let (Some(whole), Some(split)) = (&whole, &split) {
        assert_eq!(whole, split, "the cuts changed the events");
    }
    for data in whole.into_iter().flatten() {
        let _ = parse_event(&data);
    }
}

pub fn seeds() -> Vec<Vec<u8>> {
    let stream = concat!(
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"a\",\"token_ids\":[5],\"finish_reason\":null}]}\n\n",
        ": keep-alive\n\n",
        "data: {\"id\":\"c\",\"choices\":[{\"index\":0,\"text\":\"b\",\"token_ids\":[6],\"finish_reason\":\"length\"}],",
        "\"usage\":{\"prompt_tokens\":4,\"completion_tokens\":2,\"prompt_tokens_details\":{\"cached_tokens\":2}}}\r\n\r\n",
        "data: [DONE]\n\n",
    );
    let mut cut = vec![3u8, 10, 70, 5];
    cut.extend_from_slice(stream.as_bytes());
    let mut whole = vec![0u8];
    whole.extend_from_slice(stream.as_bytes());
    vec![whole, cut]
}
