//! Steps per second of one engine under a realistic closed-loop load.
//!
//! Each benchmark keeps `concurrency` requests in flight (a finished request
//! is replaced at once, as in the benchmark behind the 70B ITL figures) and
//! drains the KV events after every step, as a driver would. One iteration
//! is one step; criterion reports steps/s as elements/s.

use std::hint::black_box;
use std::sync::Arc;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use engine_sim::{Engine, EngineRequest, Mode, Preset, StepOutput};
use protocol::{Role, WorkerId};

struct ClosedLoop {
    engine: Engine,
    now: u64,
    /// Distinct prompts, reused round-robin (later rounds hit the cache
    /// when their blocks survived).
    prompts: Vec<Arc<[u32]>>,
    outputs: Arc<[u32]>,
    next_id: u64,
}

impl ClosedLoop {
    fn new(
        preset: Preset,
        block_size: u32,
        concurrency: u64,
        prompt_len: u32,
        output_len: u32,
    ) -> Self {
        let cfg = preset.engine_config(block_size);
        let worker = WorkerId::new("bench", 0).expect("valid worker id");
        let engine = Engine::new(worker, Role::Both, cfg).expect("preset config is valid");
        let mut state = 42u64;
        let mut token = move || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            (state >> 33) as u32
        };
        let prompts = (0..512)
            .map(|_| (0..prompt_len).map(|_| token()).collect())
            .collect();
        let outputs = (0..output_len).map(|_| token()).collect();
        let mut l = Self {
            engine,
            now: 0,
            prompts,
            outputs,
            next_id: 0,
        };
        for _ in 0..concurrency {
            l.submit();
        }
        // Reach steady state: spread the requests over their lifetime.
        for _ in 0..(2 * output_len) {
            l.step();
        }
        l
    }

    fn submit(&mut self) {
        let id = self.next_id;
        self.next_id += 1;
        let prompt = self.prompts[id as usize % self.prompts.len()].clone();
        // Staggered output lengths keep arrivals spread out.
        let out = 1 + (id as usize * 7919) % self.outputs.len();
        self.engine
            .submit(EngineRequest {
                id,
                prompt,
                output_tokens: Arc::from(&self.outputs[..out]),
                mode: Mode::LocalPrefill,
                pull_tokens: 0,
            })
            .expect("request fits");
    }

    fn step(&mut self) -> usize {
        let Some(step) = self.engine.step(self.now) else {
            return 0;
        };
        self.now = step.end_us();
        let n = step.outputs.len();
        for out in &step.outputs {
            if matches!(out, StepOutput::Finished { .. }) {
                self.submit();
            }
        }
        black_box(self.engine.take_kv_events());
        n
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine_step");
    group.throughput(Throughput::Elements(1));
    let cases = [
        // The 70B ITL benchmark's shape at concurrency 50.
        (
            "70b_c50_5k_in_500_out_bs16",
            Preset::llama70b_fp8_tp2_h100(),
            16,
            50,
            5000,
            500,
        ),
        // A full decode batch of short prompts.
        (
            "8b_c256_1k_in_200_out_bs16",
            Preset::llama8b_h100(),
            16,
            256,
            1000,
            200,
        ),
        // The 12k-request trace's shape: long prompts, 512-token blocks.
        (
            "70b_c32_12k_in_300_out_bs512",
            Preset::llama70b_fp8_tp2_h100(),
            512,
            32,
            12_000,
            300,
        ),
    ];
    for (name, preset, block_size, concurrency, prompt_len, output_len) in cases {
        let mut l = ClosedLoop::new(preset, block_size, concurrency, prompt_len, output_len);
        group.bench_function(name, |b| b.iter(|| black_box(l.step())));
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
