//! `sim tune` on a small cluster: one best per family, its split, router
//! settings and thresholds among those searched, the same for the same seed.

use engine_sim::{KvTransfer, Preset};
use router::{IslBased, Policy};
use sim::compare::{mean_attainment, run_point, Scenario, WorkloadSpec};
use sim::tune::{Progress, Tune};
use sim::workload::SyntheticConfig;
use sim::{Deployment, OutboxLimits, Search, SimConfig, Slo};

fn base() -> SimConfig {
    SimConfig {
        preset: Preset::llama8b_h100(),
        block_size: 16,
        deployment: Deployment::Aggregated { workers: 3 },
        link: KvTransfer::default(),
        index_delay_us: 5_000,
        kv_outbox: OutboxLimits::default(),
        load_interval_us: 100_000,
        expected_output_tokens: 128,
        slo: Slo {
            ttft_ms: 500.0,
            itl_ms: 30.0,
        },
        seed: 1,
        warmup_fraction: 0.2,
        fetch: router::FetchConfig::default(),
        kv_export: Default::default(),
        host_offload_gib: 0.0,
        reuse_ceiling: false,
        router_params: Vec::new(),
    }
}

#[test]
fn one_best_per_family_among_what_it_searched() {
    let base = base();
    let workload = WorkloadSpec::Synthetic(SyntheticConfig {
        duration_s: 8.0,
        prompt_tokens: (500, 3_000),
        output_tokens: (16, 64),
        ..SyntheticConfig::default()
    });
    let policies: Vec<Policy> = vec![IslBased::default().into()];
    let scenarios = [Scenario {
        config: base,
        workload,
    }];
    let tune = Tune {
        scenarios: &scenarios,
        workers: 3,
        policies: &policies,
        policy_params: &[],
        search: Search {
            start: 4.0,
            growth: 1.5,
            max_doublings: 8,
            tolerance: 0.2,
            ..Search::default()
        },
        threads: 2,
    };
    let progress = Progress::default();
    let best = tune.run(&progress, &|_| {}).unwrap();
    let families: Vec<&str> = best.iter().map(|b| b.family.as_str()).collect();
    assert_eq!(families, ["aggregated", "disaggregated", "isl"]);
    assert!(matches!(
        best[0].deployment,
        Deployment::Aggregated { workers: 3 }
    ));
    assert!(matches!(
        best[1].deployment,
        Deployment::Disaggregated { prefill: 1..=2, .. }
    ));
    let Deployment::Conditional {
        prefill, policy, ..
    } = &best[2].deployment
    else {
        panic!("{:?}", best[2].deployment)
    };
    assert!((1..=2).contains(prefill));
    // Its thresholds are the default's or on the registry's grid.
    for (name, value) in policy.params() {
        let spec = policy.spec().param(name).unwrap();
        let default = IslBased::default();
        let default: Policy = default.into();
        let d = default
            .params()
            .into_iter()
            .find(|p| p.0 == name)
            .unwrap()
            .1;
        assert!(value == d || spec.tune.contains(&value), "{name}={value}");
    }
    // Splits 1 and 2, then one setting per grid value at least.
    let grid: usize = policy.spec().params().map(|p| p.tune.len()).sum();
    assert!(best[2].tried >= 2 + grid.min(1), "{}", best[2].tried);
    // Every family's router settings are tuned, aggregated's over the
    // whole grid, and the scenarios it names carry them.
    let (credit, credits) = router::TUNED_PARAMS[0];
    assert_eq!(best[0].tried, credits.len());
    for b in &best {
        assert!(b.capacity.load() > 0.0, "{} {:?}", b.family, b.capacity);
        let [(name, value)] = b.router_params.as_slice() else {
            panic!("{} {:?}", b.family, b.router_params)
        };
        assert!(name == credit && credits.contains(value), "{name}={value}");
        let config = b.scenarios(&scenarios)[0].config.router_config().unwrap();
        assert_eq!(config.decode.overlap_credit, *value, "{}", b.family);
    }
    let again = tune.run(&Progress::default(), &|_| {}).unwrap();
    for (a, b) in best.iter().zip(&again) {
        assert_eq!(
            (&a.deployment, a.capacity, &a.router_params),
            (&b.deployment, b.capacity, &b.router_params)
        );
    }

    // A router setting fixed by the scenarios is not tuned.
    let mut fixed = scenarios.clone();
    fixed[0].config.router_params = vec![(credit.to_owned(), 3.0)];
    let tune = Tune {
        scenarios: &fixed,
        policies: &[],
        ..tune
    };
    let best = tune.run(&Progress::default(), &|_| {}).unwrap();
    assert_eq!(best[0].tried, 1);
    for b in &best {
        assert!(b.router_params.is_empty(), "{:?}", b.router_params);
        let config = b.scenarios(&fixed)[0].config.router_config().unwrap();
        assert_eq!(config.decode.overlap_credit, 3.0);
    }

    // A policy parameter fixed by `--param` is set and not tuned; the
    // others are.
    let tune = Tune {
        scenarios: &fixed,
        policies: &policies,
        policy_params: &[("eff_isl_tokens".to_owned(), 700.0)],
        ..tune
    };
    let stages = std::sync::Mutex::new(Vec::new());
    let best = tune
        .run(&Progress::default(), &|s| {
            stages.lock().unwrap().push(s.to_owned())
        })
        .unwrap();
    let stages = stages.into_inner().unwrap();
    assert!(
        stages.iter().any(|s| s == "isl: eff_isl_ratio"),
        "{stages:?}"
    );
    assert!(
        !stages.iter().any(|s| s.contains("eff_isl_tokens")),
        "{stages:?}"
    );
    let Deployment::Conditional { policy, .. } = &best[2].deployment else {
        panic!("{:?}", best[2].deployment)
    };
    let eff = policy
        .params()
        .into_iter()
        .find(|(n, _)| *n == "eff_isl_tokens");
    assert_eq!(eff, Some(("eff_isl_tokens", 700.0)));
}

/// With several seeds' scenarios a load is judged by the mean of their
/// attainments.
#[test]
fn scenarios_are_judged_by_their_mean_attainment() {
    let scenario = |seed| Scenario {
        config: SimConfig { seed, ..base() },
        workload: WorkloadSpec::Synthetic(SyntheticConfig {
            duration_s: 8.0,
            prompt_tokens: (500, 3_000),
            output_tokens: (16, 64),
            seed,
            ..SyntheticConfig::default()
        }),
    };
    let scenarios = [scenario(1), scenario(2)];
    let agg = Deployment::Aggregated { workers: 3 };
    let load = 150.0;
    let each: Vec<f64> = scenarios
        .iter()
        .map(|s| {
            run_point(&s.config, &agg, &s.workload, load)
                .unwrap()
                .summary
                .slo_attainment
        })
        .collect();
    assert_ne!(each[0], each[1], "the seeds differ at this load");
    let mean = mean_attainment(&scenarios, &agg, load).unwrap();
    assert_eq!(mean, (each[0] + each[1]) / 2.0);
}
