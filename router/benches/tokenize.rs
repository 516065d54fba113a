//! The front door's work for a chat request whose conversation holds 60k
//! tokens, with the tokenization cache off and on (the prefix seen: the
//! previous turn went through this router). Per request: the JSON body
//! parsed, its messages rendered through the shipped ChatML template,
//! tokenized (whole, or the new part after a cached prefix), and hashed
//! into KV blocks — what `App::parse_chat` does before asking for a
//! decision (the decision itself: `benches/decide.rs`).
//!
//! Prints each variant's median and p90 of individually timed requests on
//! one thread, then requests/s with two threads sharing one cache (the
//! machine's two cores), each sending its own conversation's next turns.
//!
//!     cargo bench -p router --bench tokenize
//!
//! The tokenizer is the project's (`scripts/make-tokenizer`: a byte-level
//! BPE of 128k tokens, about 4.1 bytes a token on this text); a real
//! model's differs in speed, the cache's saving in kind does not.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use protocol::{BlockHasher, HashingContract};
use router::service::chat_template::{ChatTemplate, Message};
use router::service::text::Text;
use router::service::token_cache::Outcome;

const HISTORY_TOKENS: usize = 60_000;
const SAMPLES: usize = 40;
const THROUGHPUT_FOR: Duration = Duration::from_secs(4);

/// An agent's conversation: a system prompt, then tool calls and results
/// (varied words, code-like lines) until it holds about 60k tokens.
fn history(text: &Text, template: &ChatTemplate, seed: u64) -> Vec<Message> {
    let words = [
        "read",
        "the",
        "file",
        "src/main.rs",
        "and",
        "fix",
        "failing",
        "test",
        "cargo",
        "build",
        "error[E0502]:",
        "cannot",
        "borrow",
        "as",
        "mutable",
        "let",
        "mut",
        "x",
        "=",
        "vec![1,",
        "2];",
        "fn",
        "main()",
        "{",
        "}",
        "// comment",
        "patched",
        "ran",
        "it",
        "passes",
        "now.",
    ];
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut sentence = |n: usize| {
        let mut s = String::new();
        for i in 0..n {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            if i > 0 {
                s.push(if state % 11 == 0 { '\n' } else { ' ' });
            }
            s.push_str(words[(state >> 8) as usize % words.len()]);
        }
        s
    };
    let mut messages = vec![Message {
        role: "system".into(),
        content: format!("You are a coding agent (session {seed}). {}", sentence(300)),
    }];
    loop {
        messages.push(Message {
            role: "user".into(),
            content: sentence(400),
        });
        messages.push(Message {
            role: "assistant".into(),
            content: sentence(200),
        });
        let rendered = template.render(&messages).expect("render");
        if text.encode_rendered(&rendered).expect("encode").ids.len() >= HISTORY_TOKENS {
            return messages;
        }
    }
}

/// A request's body: the history and turn `n`'s new message.
fn body(history: &[Message], n: usize) -> Vec<u8> {
    let mut messages: Vec<serde_json::Value> = history
        .iter()
        .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
        .collect();
    messages.push(serde_json::json!({"role": "user", "content": format!("Turn {n}: now run the tests again and report.")}));
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages, "max_tokens": 64}))
        .expect("JSON")
}

/// The front door's work on one body: the block hashes' count.
fn serve(
    body: &[u8],
    text: &Text,
    template: &ChatTemplate,
    hasher: &BlockHasher,
) -> (usize, Outcome) {
    let value: serde_json::Value = serde_json::from_slice(body).expect("JSON");
    let messages: Vec<Message> = value["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .map(|m| Message {
            role: m["role"].as_str().expect("role").to_owned(),
            content: m["content"].as_str().expect("content").to_owned(),
        })
        .collect();
    let rendered = template.render(&messages).expect("render");
    let encoded = text.encode_rendered(&rendered).expect("encode");
    (hasher.hash_prompt(&encoded.ids).len(), encoded.outcome)
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not
    // want the run.
    if !std::env::args().any(|a| a == "--bench") {
        return;
    }
    let path = tests::tokenizer::shipped();
    let template = Arc::new(
        ChatTemplate::from_tokenizer_config(&path.with_file_name("tokenizer_config.json"))
            .expect("config")
            .expect("template"),
    );
    let contract = HashingContract::for_model("m", 16);
    let hasher = BlockHasher::new(16, contract.salt).expect("hasher");
    let probe = Text::load(&path, 0).expect("tokenizer");
    let histories: Vec<Vec<Message>> = (0..2).map(|s| history(&probe, &template, s)).collect();
    let bodies: Vec<Vec<Vec<u8>>> = histories
        .iter()
        .map(|h| (0..SAMPLES + 1).map(|n| body(h, n)).collect())
        .collect();
    println!(
        "chat request: {} KB of JSON, {} tokens, {} blocks",
        bodies[0][0].len() / 1000,
        {
            let r = template.render(&histories[0]).expect("render");
            probe.encode_rendered(&r).expect("encode").ids.len()
        },
        serve(&bodies[0][0], &probe, &template, &hasher).0
    );

    for (name, cache_bytes) in [("cache off", 0u64), ("cache on, prefix seen", 256 << 20)] {
        let text = Text::load(&path, cache_bytes).expect("tokenizer");
        assert_eq!(text.cached(), cache_bytes > 0);
        // Turn 0 goes through first: the prefix is seen.
        serve(&bodies[0][0], &text, &template, &hasher);
        let mut times: Vec<Duration> = (1..=SAMPLES)
            .map(|n| {
                let start = Instant::now();
                let (_, outcome) = black_box(serve(&bodies[0][n], &text, &template, &hasher));
                if cache_bytes > 0 {
                    assert_eq!(outcome, Outcome::Prefix);
                }
                start.elapsed()
            })
            .collect();
        times.sort();
        // Two threads, one cache, each its own conversation.
        for b in &bodies {
            serve(&b[0], &text, &template, &hasher);
        }
        let started = Instant::now();
        let served: usize = std::thread::scope(|s| {
            let workers: Vec<_> = bodies
                .iter()
                .map(|b| {
                    let (text, template, hasher) = (&text, &template, &hasher);
                    s.spawn(move || {
                        let mut n = 0;
                        while started.elapsed() < THROUGHPUT_FOR {
                            black_box(serve(&b[1 + n % SAMPLES], text, template, hasher));
                            n += 1;
                        }
                        n
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().expect("thread")).sum()
        });
        let rate = served as f64 / started.elapsed().as_secs_f64();
        println!(
            "{name:>22}: median {:>8.2?}, p90 {:>8.2?} a request (1 thread); {rate:>7.0} requests/s on 2 threads",
            percentile(&times, 0.5),
            percentile(&times, 0.9),
        );
    }
}
