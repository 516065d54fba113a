//! The front door's work for a chat request whose conversation holds 60k
//! tokens, with the tokenization cache off and on (the prefix seen: the
//! previous turn went through this router). Per request: the JSON body
//! parsed, its messages rendered through the shipped ChatML template,
//! tokenized (whole, or the new part after a cached prefix), and hashed
//! into KV blocks (what `App::parse_chat` does), then routed by a
//! `RouterCore` whose index holds the conversation on one of 4 decode
//! workers (behind a mutex: the service's one event loop).
//!
//! Prints each variant's median and p90 of individually timed requests on
//! one thread, then requests/s with two threads sharing one cache and one
//! core (the machine's two cores), each sending its own conversation's next
//! turns.
//!
//!     cargo bench -p router --bench tokenize
//!
//! The tokenizer is the project's (`scripts/make-tokenizer`: a byte-level
//! BPE of 128k tokens, about 4.1 bytes a token on this text); a real
//! model's differs in speed, the cache's saving in kind does not.

use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use protocol::{
    BlockHasher, DecisionId, HashingContract, IndexChange, IndexDelta, LoadReport, Role, Tier,
    WorkerRecord,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::service::chat_template::{ChatTemplate, Message};
use router::service::text::Text;
use router::service::token_cache::Outcome;
use router::{IslBased, RouteOptions, RouteRequest, RouterConfig, RouterCore};

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

/// A core with 4 decode workers and a prefill worker; each conversation
/// held by one decode worker.
fn core(contract: &HashingContract, held: &[Vec<protocol::BlockHash>]) -> RouterCore {
    let mut core =
        RouterCore::new(RouterConfig::new(contract.clone()), IslBased::default()).expect("core");
    let names = [
        ("d0", Role::Decode),
        ("d1", Role::Decode),
        ("d2", Role::Decode),
        ("d3", Role::Decode),
        ("p0", Role::Prefill),
    ];
    for (name, role) in names {
        core.register(WorkerRecord {
            kv_capacity_blocks: 100_000,
            kv_bytes_per_token: 163_840,
            gpus: 2,
            max_model_len: 0,
            ..tests::fixtures::registration(name, role, contract.clone())
        })
        .expect("register");
        core.on_load(
            LoadReport {
                worker: name.parse().expect("worker"),
                running: 8,
                waiting: 0,
                queued_prefill_tokens: 0,
                active_decode_blocks: 5_000,
                kv_blocks_used: 20_000,
                kv_blocks_total: 100_000,
                at_ms: 0,
                recent_itl_us: 0,
            },
            0,
        );
    }
    let changes = held
        .iter()
        .enumerate()
        .map(|(i, blocks)| IndexChange::Stored {
            worker: names[i % 4].0.parse().expect("worker"),
            parent: None,
            blocks: blocks.clone(),
            tier: Tier::Device,
        })
        .collect();
    core.apply_delta(&IndexDelta {
        seq: 1,
        changes,
        source: None,
    })
    .expect("delta");
    core
}

/// The router's state a request is served against.
struct Door<'a> {
    text: &'a Text,
    template: &'a ChatTemplate,
    hasher: &'a BlockHasher,
    core: &'a Mutex<(RouterCore, ChaCha8Rng, u64)>,
}

/// One request through the front door and the decision: its overlap.
fn route(body: &[u8], door: &Door<'_>) -> (u32, Outcome) {
    let (hashes, outcome, isl) = prepare(body, door.text, door.template, door.hasher);
    let mut guard = door.core.lock().expect("core");
    let (core, rng, next) = &mut *guard;
    *next += 1;
    let id = DecisionId(*next);
    let request = RouteRequest {
        request_id: "bench",
        isl_tokens: isl,
        block_hashes: &hashes,
        expected_output_tokens: 64,
        session: None,
    };
    let routed = core
        .route(&request, RouteOptions::default(), id, *next, rng)
        .expect("routed");
    core.on_finished(id);
    (routed.decision.decode_overlap_tokens, outcome)
}

/// The front door's work on one body: the block hashes.
fn prepare(
    body: &[u8],
    text: &Text,
    template: &ChatTemplate,
    hasher: &BlockHasher,
) -> (Vec<protocol::BlockHash>, Outcome, u32) {
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
    let isl = encoded.ids.len() as u32;
    (hasher.hash_prompt(&encoded.ids), encoded.outcome, isl)
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
    let template =
        ChatTemplate::from_tokenizer_config(&path.with_file_name("tokenizer_config.json"))
            .expect("config")
            .expect("template");
    let contract = HashingContract::for_model("m", 16);
    let hasher = BlockHasher::new(16, contract.salt).expect("hasher");
    let probe = Text::load(&path, 0).expect("tokenizer");
    let histories: Vec<Vec<Message>> = (0..2).map(|s| history(&probe, &template, s)).collect();
    let bodies: Vec<Vec<Vec<u8>>> = histories
        .iter()
        .map(|h| (0..SAMPLES + 1).map(|n| body(h, n)).collect())
        .collect();
    let held: Vec<Vec<protocol::BlockHash>> = histories
        .iter()
        .map(|h| {
            let r = template.render(h).expect("render");
            hasher.hash_prompt(&probe.encode_rendered(&r).expect("encode").ids)
        })
        .collect();
    let (first, _, isl) = prepare(&bodies[0][0], &probe, &template, &hasher);
    println!(
        "chat request: {} KB of JSON, {isl} tokens, {} blocks",
        bodies[0][0].len() / 1000,
        first.len(),
    );

    for (name, cache_bytes) in [("cache off", 0u64), ("cache on, prefix seen", 256 << 20)] {
        let text = Text::load(&path, cache_bytes).expect("tokenizer");
        assert_eq!(text.cached(), cache_bytes > 0);
        let core = Mutex::new((core(&contract, &held), ChaCha8Rng::seed_from_u64(1), 0));
        let door = Door {
            text: &text,
            template: &template,
            hasher: &hasher,
            core: &core,
        };
        // Turn 0 goes through first: the prefix is seen.
        route(&bodies[0][0], &door);
        let mut times: Vec<Duration> = (1..=SAMPLES)
            .map(|n| {
                let start = Instant::now();
                let (overlap, outcome) = black_box(route(&bodies[0][n], &door));
                let took = start.elapsed();
                assert!(
                    overlap as usize >= held[0].len() * 16 - 16,
                    "overlap {overlap}"
                );
                if cache_bytes > 0 {
                    assert_eq!(outcome, Outcome::Prefix);
                }
                took
            })
            .collect();
        times.sort();
        // Two threads, one cache and one core, each its own conversation.
        for b in &bodies {
            route(&b[0], &door);
        }
        let started = Instant::now();
        let served: Vec<(usize, usize)> = std::thread::scope(|s| {
            let workers: Vec<_> = bodies
                .iter()
                .map(|b| {
                    let door = &door;
                    s.spawn(move || {
                        let (mut n, mut missed) = (0, 0);
                        while started.elapsed() < THROUGHPUT_FOR {
                            let (_, outcome) = black_box(route(&b[1 + n % SAMPLES], door));
                            missed += usize::from(outcome == Outcome::Miss);
                            n += 1;
                        }
                        (n, missed)
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().expect("thread"))
                .collect()
        });
        let rate =
            served.iter().map(|s| s.0).sum::<usize>() as f64 / started.elapsed().as_secs_f64();
        let missed: usize = served.iter().map(|s| s.1).sum();
        println!(
            "{name:>22}: median {:>8.2?}, p90 {:>8.2?} a request (1 thread); {rate:>7.0} requests/s on 2 threads ({missed} cache misses)",
            percentile(&times, 0.5),
            percentile(&times, 0.9),
        );
    }
}
