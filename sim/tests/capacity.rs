//! The capacity search on a cluster whose capacity is known by
//! construction: one aggregated worker, prompts of exactly one prefill step
//! (the engine's max batched tokens, nothing cached) answered with one
//! token, arriving evenly. Each request then costs one step of `t`; at a
//! period `T < t` the queue grows, request k's TTFT is `(k+1) t - k T`, and
//! with a TTFT target `S` the first `floor((S - t) / (t - T)) + 1` meet it.
//! 90% of N requests meet it iff `T >= t - (S - t) / (0.9 N - 1)`. The
//! TTFT p99 (nearest rank: of N = 100, request 98's) is `99 t - 98 T`,
//! within a bound `B` iff `T >= (99 t - B) / 98`.

use std::convert::Infallible;

use engine_sim::{KvTransfer, Preset};
use sim::capacity::{search, Capacity, Outcome, Search};
use sim::workload::{pseudo_tokens, Arrival, RequestSpec, Scripted};
use sim::{simulate, Deployment, OutboxLimits, SimConfig, Slo};

const N: u64 = 100;

fn config(ttft_ms: f64) -> SimConfig {
    SimConfig {
        preset: Preset::llama8b_h100(),
        block_size: 16,
        deployment: Deployment::Aggregated { workers: 1 },
        link: KvTransfer::default(),
        index_delay_us: 5_000,
        kv_outbox: OutboxLimits::default(),
        load_interval_us: 100_000,
        expected_output_tokens: 1,
        slo: Slo {
            ttft_ms,
            itl_ms: 60.0,
        },
        seed: 1,
        warmup_fraction: 0.0,
        fetch: router::FetchConfig::default(),
        kv_export: Default::default(),
        host_offload_gib: 0.0,
        reuse_ceiling: false,
        router_params: Vec::new(),
    }
}

/// `n` one-step requests, `rate` per second.
fn workload(n: u64, rate: f64) -> Scripted {
    let step_tokens = Preset::llama8b_h100().max_batched_tokens as usize;
    let arrivals = (0..n)
        .map(|k| {
            let mut prompt = Vec::new();
            pseudo_tokens(1_000 + k, step_tokens, &mut prompt);
            Arrival {
                at_us: (k as f64 * 1e6 / rate).round() as u64,
                request: RequestSpec {
                    id: k,
                    session: k,
                    turn: 0,
                    prompt: prompt.into(),
                    output: vec![7u32].into(),
                },
            }
        })
        .collect();
    Scripted::new(arrivals)
}

fn outcome(ttft_ms: f64, rate: f64) -> Outcome {
    let r = simulate(&config(ttft_ms), &mut workload(N, rate)).unwrap();
    assert_eq!(r.summary.measured, N as usize);
    Outcome {
        attainment: r.summary.slo_attainment,
        ttft_p99_ms: r.summary.ttft_ms.p99,
    }
}

/// The step time t: one request alone, its TTFT.
fn step_ms() -> f64 {
    let alone = simulate(&config(1e9), &mut workload(1, 1.0)).unwrap();
    let t_ms = alone.records[0].ttft_ms();
    assert!(t_ms > 100.0, "an 8k-token prefill takes {t_ms} ms");
    t_ms
}

/// `s` finds `capacity` (requests/s) with the TTFT target `slo_ms`, to
/// its tolerance (arrivals are rounded to microseconds: that much more).
fn assert_finds(s: &Search, slo_ms: f64, capacity: f64) {
    let (found, ran) = search(s, &[], |load| Ok::<_, Infallible>(outcome(slo_ms, load))).unwrap();
    let Capacity::Found { load, fails_at, .. } = found else {
        panic!("{found:?}")
    };
    assert!(
        load <= capacity * 1.001 && capacity <= fails_at * 1.001,
        "capacity {capacity:.4}/s by construction, search {found:?} after {ran:?}"
    );
    assert!(fails_at - load <= s.tolerance * fails_at);
}

#[test]
fn the_search_finds_the_capacity_known_by_construction() {
    let t_ms = step_ms();
    let slo_ms = 2.0 * t_ms;
    let period_ms = t_ms - (slo_ms - t_ms) / (0.9 * N as f64 - 1.0);
    let capacity = 1e3 / period_ms;
    let s = Search {
        start: 1.0,
        tolerance: 0.005,
        ..Search::default()
    };
    assert_finds(&s, slo_ms, capacity);
    // Below the bound it never searched past: reported as such.
    let s = Search {
        start: capacity / 16.0,
        max_doublings: 2,
        ..s
    };
    let (above, _) = search(&s, &[], |load| Ok::<_, Infallible>(outcome(slo_ms, load))).unwrap();
    assert_eq!(
        above,
        Capacity::AboveBound {
            bound: capacity / 4.0
        }
    );
}

#[test]
fn a_tail_bound_finds_the_capacity_known_by_construction() {
    let t_ms = step_ms();
    let slo_ms = 2.0 * t_ms;
    // The 90% alone would allow T down to about 0.989 t, where the p99 is
    // about 2.1 t: a bound of 1.5 t binds first.
    let bound_ms = 1.5 * t_ms;
    let capacity = 1e3 * 98.0 / (99.0 * t_ms - bound_ms);
    let unbounded = 1e3 / (t_ms - (slo_ms - t_ms) / (0.9 * N as f64 - 1.0));
    assert!(capacity < 0.995 * unbounded, "{capacity} {unbounded}");
    let s = Search {
        start: 1.0,
        tolerance: 0.005,
        ttft_p99_bound_ms: Some(bound_ms),
        ..Search::default()
    };
    assert_finds(&s, slo_ms, capacity);
}
