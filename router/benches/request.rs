//! Parsing a `/v1/completions` or `/v1/route` body: 8k token ids as JSON
//! (ids of a 128k vocabulary, as the load generator sends them; about
//! 56 KB). The router does this on every request, before hashing.

use std::hint::black_box;

use criterion::{Criterion, Throughput};
use router::service::http::openai::CompletionRequest;

fn body(tokens: usize) -> Vec<u8> {
    let mut prompt = Vec::with_capacity(tokens);
    protocol::trace::extend_block_tokens(7, tokens, &mut prompt);
    serde_json::to_vec(&serde_json::json!({
        "model": "switchyard",
        "prompt": prompt,
        "max_tokens": 128,
    }))
    .expect("JSON")
}

fn main() {
    let body = body(8_192);
    let mut c = Criterion::default().configure_from_args();
    let mut group = c.benchmark_group("request");
    group.throughput(Throughput::Bytes(body.len() as u64));
    group.bench_function("parse/8k_token_ids", |b| {
        b.iter(|| CompletionRequest::parse(black_box(&body)).expect("valid"))
    });
    group.finish();
    c.final_summary();
}
