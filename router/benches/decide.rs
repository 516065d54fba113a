//! One full routing decision for an 8k-token prompt (block size 16) over 64
//! decode workers and 8 prefill workers with a populated index: hashing,
//! matching, selection, policy, gate, ledger charge, and the decision with
//! its reason string.
//!
//! Prints the median and tail of individually timed decisions, then runs
//! the criterion benchmark.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::Criterion;
use protocol::{
    BlockHash, DecisionId, HashingContract, IndexChange, IndexDelta, IndexSnapshot, LoadReport,
    LogEntry, LogReader, LogWriter, Message, Role, RouteDecision, Tier, WorkerId, WorkerRecord,
};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use router::{
    decision_seed, IslBased, Overrides, Replayer, RouteError, RouteOptions, RouteRequest,
    RouterConfig, RouterCore,
};
use tests::tokens;

const DECODE: usize = 64;
const PREFILL: usize = 8;
const BLOCK: u32 = 16;

fn record(name: String, role: Role, contract: &HashingContract) -> WorkerRecord {
    WorkerRecord {
        kv_capacity_blocks: 100_000,
        kv_bytes_per_token: 163_840,
        gpus: 2,
        max_model_len: 0,
        ..tests::fixtures::registration(&name, role, contract.clone())
    }
}

/// The core and the benched prompt: every worker holds a shared 2k-token
/// system prompt; each decode worker holds 40 conversations of 2k-8k tokens
/// behind it (so the index holds about 2 600 chains, 500k blocks); the
/// benched conversation (7.5k tokens) is on d7 and its first half on d8 and
/// on p1, and the prompt appends 700 new tokens: a bypass on d7.
fn setup() -> (RouterCore, Vec<u32>) {
    let contract = HashingContract::for_model("bench", BLOCK);
    let mut core =
        RouterCore::new(RouterConfig::new(contract.clone()), IslBased::default()).unwrap();
    let mut names = Vec::new();
    for i in 0..DECODE {
        names.push((format!("d{i}"), Role::Decode));
    }
    for i in 0..PREFILL {
        names.push((format!("p{i}"), Role::Prefill));
    }
    for (name, role) in &names {
        core.register(record(name.clone(), *role, &contract))
            .unwrap();
    }
    let hasher = *core.hasher();
    let system = tokens(1, 2_048);
    let mut changes = Vec::new();
    let mut seed = 10;
    for (w, (name, _)) in names.iter().enumerate() {
        let worker: WorkerId = name.parse().unwrap();
        let conversations = if w < DECODE { 40 } else { 5 };
        for _ in 0..conversations {
            seed += 1;
            let mut t = system.clone();
            t.extend(tokens(seed, 2_000 + (seed as usize * 97) % 6_000));
            changes.push(IndexChange::Stored {
                worker: worker.clone(),
                parent: None,
                blocks: hasher.hash_prompt(&t),
                tier: if seed % 5 == 0 {
                    Tier::Host
                } else {
                    Tier::Device
                },
            });
        }
    }
    let mut conversation = system.clone();
    conversation.extend(tokens(7, 7_500 - 2_048));
    let held = hasher.hash_prompt(&conversation);
    for (name, n) in [
        ("d7", held.len()),
        ("d8", held.len() / 2),
        ("p1", held.len() / 2),
    ] {
        changes.push(IndexChange::Stored {
            worker: name.parse().unwrap(),
            parent: None,
            blocks: held[..n].to_vec(),
            tier: Tier::Device,
        });
    }
    core.apply_delta(&IndexDelta {
        seq: 1,
        changes,
        source: None,
    })
    .unwrap();
    for (i, (name, _)) in names.iter().enumerate() {
        // d7 (which holds the conversation) among the least loaded, so that
        // the decision is a bypass there and goes through the gate.
        let d7 = name == "d7";
        let active = if d7 {
            5_000
        } else {
            5_000 + (i as u64 * 7_919) % 40_000
        };
        let queued = if d7 { 0 } else { (i as u64 * 1_013) % 9_000 };
        core.on_load(
            LoadReport {
                worker: name.parse().unwrap(),
                running: 32,
                waiting: 0,
                queued_prefill_tokens: queued,
                active_decode_blocks: active,
                kv_blocks_used: active + 10_000,
                kv_blocks_total: 100_000,
                at_ms: 0,
                recent_itl_us: 0,
            },
            0,
        );
    }
    conversation.extend(tokens(8, 8_192 - conversation.len()));
    assert_eq!(conversation.len(), 8_192);
    (core, conversation)
}

/// Routes `n` decisions, timing each; every decision is finished right away
/// (untimed) so that the ledger stays small and the state steady.
/// A full decision as the service makes it: the prompt hashed (into a
/// reused buffer), then routed.
fn decide(
    core: &mut RouterCore,
    prompt: &[u32],
    hashes: &mut Vec<BlockHash>,
    id: DecisionId,
    now_ms: u64,
    rng: &mut ChaCha8Rng,
) -> Result<RouteDecision, RouteError> {
    hashes.clear();
    core.hasher().extend(None, prompt, hashes);
    let request = RouteRequest {
        request_id: "bench",
        isl_tokens: prompt.len() as u32,
        block_hashes: hashes,
        expected_output_tokens: 300,
        session: None,
    };
    Ok(core
        .route(&request, RouteOptions::default(), id, now_ms, rng)?
        .decision)
}

fn timed(
    core: &mut RouterCore,
    prompt: &[u32],
    rng: &mut ChaCha8Rng,
    next: &mut u64,
    n: u64,
) -> Vec<Duration> {
    let mut out = Vec::with_capacity(n as usize);
    let mut hashes = Vec::new();
    for _ in 0..n {
        *next += 1;
        let id = DecisionId(*next);
        let start = Instant::now();
        let decision = decide(core, black_box(prompt), &mut hashes, id, *next, rng);
        out.push(start.elapsed());
        black_box(&decision);
        core.on_finished(id);
        if *next % 4_096 == 0 {
            core.expire(*next + 120_000);
        }
    }
    out
}

fn main() {
    let (mut core, prompt) = setup();
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let mut next = 0;
    let first = decide(
        &mut core,
        &prompt,
        &mut Vec::new(),
        DecisionId(u64::MAX),
        0,
        &mut rng,
    )
    .unwrap();
    core.on_finished(first.id);
    println!(
        "decision: {} on {} (rule {}): {}",
        first.path, first.decode, first.rule, first.reason
    );

    timed(&mut core, &prompt, &mut rng, &mut next, 2_000); // warm up
    let mut samples = timed(&mut core, &prompt, &mut rng, &mut next, 20_000);
    samples.sort_unstable();
    let q = |p: f64| samples[((samples.len() - 1) as f64 * p) as usize].as_secs_f64() * 1e6;
    println!(
        "full decision, 8k tokens, {DECODE} decode + {PREFILL} prefill workers: p50 {:.2} us, p90 {:.2} us, p99 {:.2} us",
        q(0.5),
        q(0.9),
        q(0.99)
    );

    let hasher = *core.hasher();
    let mut hashes = Vec::new();
    let start = Instant::now();
    for _ in 0..20_000 {
        hashes.clear();
        hasher.extend(None, black_box(&prompt), &mut hashes);
        black_box(&hashes);
    }
    println!(
        "of which hashing alone: {:.2} us",
        start.elapsed().as_secs_f64() * 1e6 / 20_000.0
    );
    let start = Instant::now();
    for _ in 0..20_000 {
        black_box(core.replica().index().find_matches(black_box(&hashes)));
    }
    println!(
        "of which matching alone: {:.2} us",
        start.elapsed().as_secs_f64() * 1e6 / 20_000.0
    );

    // The decision-log entries of this decision, and how fast it replays.
    // The conversation's previous turn (its first 7 500 tokens) was
    // decided and logged before it: this is a turn 2+ entry.
    let explain = RouteOptions {
        avoid: &[],
        explain: true,
    };
    let record_of = |core: &mut RouterCore, request_id: &str, tokens: &[u32], id: u64| {
        let hashes = core.hasher().hash_prompt(tokens);
        let request = RouteRequest {
            request_id,
            isl_tokens: tokens.len() as u32,
            block_hashes: &hashes,
            expected_output_tokens: 300,
            session: None,
        };
        let seed = decision_seed(0, &request);
        let routed = core
            .route(
                &request,
                explain,
                DecisionId(id),
                0,
                &mut ChaCha8Rng::seed_from_u64(seed),
            )
            .unwrap();
        let (decision, explanation) = (routed.decision, routed.explanation.unwrap());
        core.on_finished(decision.id);
        core.record(&decision, &explanation, &request, seed, &[])
    };
    let previous = record_of(&mut core, "bench-turn-1", &prompt[..7_500], u64::MAX - 2);
    let record = record_of(&mut core, "bench-turn-2", &prompt, u64::MAX - 1);
    let size = |entries: &[LogEntry]| entries.iter().map(|e| e.encode().len()).sum::<usize>();
    let alone = LogWriter::default().write(&record, 0);
    let mut writer = LogWriter::default();
    let first = writer.write(&previous, 0);
    let entries = writer.write(&record, 1);
    let logged = entries.last().and_then(LogEntry::decision).unwrap();
    println!(
        "decision-log entry of this turn 2+: {} bytes ({} candidates, {} new of {} block hashes); logged alone: {} bytes and its context {} bytes once",
        size(&entries),
        record.inputs.candidates.len(),
        logged.prompt.blocks.0.len(),
        record.inputs.block_hashes.len(),
        size(&alone[1..]),
        size(&alone[..1]),
    );
    let mut reader = LogReader::new();
    for entry in &first {
        reader.read(entry).unwrap();
    }
    let (workers, runs) = core.replica().index().export();
    let mut replayer = Replayer::new();
    replayer
        .restore(IndexSnapshot {
            delta_seq: core.replica().applied(),
            workers,
            cursors: Vec::new(),
            runs,
            digest: core.replica().index().digest(),
        })
        .unwrap();
    let replays = 2_000;
    let start = Instant::now();
    for _ in 0..replays {
        let replayed = replayer.replay(&record, &Overrides::default()).unwrap();
        assert_eq!(
            router::difference(&record.decision, &replayed.decision),
            None
        );
    }
    println!(
        "replay: {:.0} decisions re-decided per second",
        replays as f64 / start.elapsed().as_secs_f64()
    );
    let start = Instant::now();
    for _ in 0..replays {
        assert_eq!(black_box(reader.decision(logged).unwrap()), record);
    }
    println!(
        "reading the entry back into its record: {:.1} us",
        start.elapsed().as_secs_f64() * 1e6 / f64::from(replays)
    );

    let mut c = Criterion::default().configure_from_args();
    c.bench_function("decide/8k_tokens_64_decode_8_prefill", |b| {
        b.iter_custom(|iters| {
            timed(&mut core, &prompt, &mut rng, &mut next, iters)
                .iter()
                .sum()
        })
    });
    c.final_summary();
}
