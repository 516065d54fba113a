//! Every fuzz target over its seeds and deterministic mutations of them:
//! the targets build, their oracles hold on what they were written for,
//! and a panic found by `scripts/fuzz` stays fixed once its input is added
//! as a seed. (The coverage-guided runs are `scripts/fuzz`'s, not CI's.)

use fuzz_targets::mutate::{mutant, Rng};
use fuzz_targets::TARGETS;

const MUTANTS_PER_TARGET: usize = 3_000;

#[test]
fn every_target_has_seeds_and_holds_on_them() {
    for t in TARGETS {
        let seeds = (t.seeds)();
        assert!(!seeds.is_empty(), "{} has no seeds", t.name);
        for seed in &seeds {
            (t.run)(seed);
        }
    }
}

#[test]
fn every_target_holds_on_mutants_of_its_seeds() {
    for (n, t) in TARGETS.iter().enumerate() {
        let seeds = (t.seeds)();
        let mut rng = Rng::new(0x5eed + n as u64);
        for _ in 0..MUTANTS_PER_TARGET {
            let seed = &seeds[rng.below(seeds.len())];
            let other = &seeds[rng.below(seeds.len())];
            let input = mutant(&mut rng, seed, other);
            let result = std::panic::catch_unwind(|| (t.run)(&input));
            assert!(
                result.is_ok(),
                "{} panicked on {:?}",
                t.name,
                String::from_utf8_lossy(&input)
            );
        }
    }
}

#[test]
fn the_request_seeds_are_requests() {
    // A seed every decoder refuses gives the fuzzer nothing to start from.
    for seed in fuzz_targets::http_body::seeds().iter().take(4) {
        if let Err(e) = router::service::http::openai::CompletionRequest::parse(seed) {
            panic!(
                "seed {} does not parse: {e:?}",
                String::from_utf8_lossy(seed)
            );
        }
    }
}

/// Inputs `scripts/fuzz` found crashing, kept in `fuzz/regressions/TARGET/`
/// once fixed: each runs again here.
#[test]
fn found_crashes_stay_fixed() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions");
    let mut ran = 0;
    for t in TARGETS {
        let Ok(entries) = std::fs::read_dir(dir.join(t.name)) else {
            continue;
        };
        for entry in entries {
            let path = entry.expect("a readable entry").path();
            let input = std::fs::read(&path).expect("a readable regression");
            (t.run)(&input);
            ran += 1;
        }
    }
    assert!(ran > 0, "no regression inputs under {}", dir.display());
}
