//! The `sim` binary's command line, run as a user runs it.

use std::collections::BTreeMap;
use std::process::Command;

fn sim(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .output()?;
    anyhow::ensure!(
        output.status.success(),
        "sim {args:?} failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// The table's data rows (after its two header lines).
fn rows(table: &str) -> Vec<&str> {
    table
        .lines()
        .skip(2)
        .filter(|l| l.starts_with("c/d") || l.starts_with("agg") || l.starts_with("disagg"))
        .collect()
}

/// A short `sim run` of the ISL policy.
const SHORT_ISL_RUN: [&str; 7] = [
    "run",
    "--deployment",
    "isl",
    "--load",
    "1.0",
    "--duration-s",
    "20",
];

/// `--seeds N` prints a row per seed in seed order, each the row `--seed S`
/// prints alone, and the spread of attainment over them.
#[test]
fn run_with_seeds_prints_each_seed_and_the_spread() -> anyhow::Result<()> {
    let common = SHORT_ISL_RUN;
    let both = sim(&[
        &common[..],
        &["--seeds", "2", "--seed", "3", "--threads", "2"],
    ]
    .concat())?;
    let seeded = rows(&both);
    assert_eq!(seeded.len(), 2, "{both}");
    for (i, seed) in ["3", "4"].into_iter().enumerate() {
        let alone = sim(&[&common[..], &["--seed", seed]].concat())?;
        assert_eq!(rows(&alone), [seeded[i]], "seed {seed}:\n{alone}\n{both}");
    }
    let spread = both
        .lines()
        .find(|l| l.starts_with("rows in seed order 3..=4; SLO attainment: mean "))
        .unwrap_or_else(|| panic!("no spread line:\n{both}"));
    let each: Vec<f64> = spread
        .rsplit("each: ")
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()?;
    assert_eq!(each.len(), 2, "{spread}");
    Ok(())
}

/// `sim run` of the SLA policy says what its calibration learnt: factors
/// off 1 once the run fed it observations; other policies learn nothing.
#[test]
fn run_of_the_sla_policy_prints_what_it_learnt() -> anyhow::Result<()> {
    let run = |policy| {
        sim(&[
            "run",
            "--deployment",
            policy,
            "--load",
            "1.0",
            "--duration-s",
            "20",
        ])
    };
    let out = run("sla_dynamic")?;
    let line = out
        .lines()
        .find(|l| {
            l.starts_with("sla_dynamic calibration at the end (observed / predicted): TTFT x")
        })
        .unwrap_or_else(|| panic!("no calibration line:\n{out}"));
    let factors: Vec<f64> = line
        .split(" x")
        .skip(1)
        .map(|f| f.split([',', ';', ' ']).next().unwrap_or_default().parse())
        .collect::<Result<_, _>>()?;
    assert_eq!(factors.len(), 3, "{line}");
    assert!(factors.iter().any(|&f| f != 1.0), "nothing learnt: {line}");
    assert!(!run("isl")?.contains("calibration"));
    Ok(())
}

/// The numbers after `label` in `line`, in order (`%` and `ms` dropped).
fn numbers_after(line: &str, label: &str) -> Vec<f64> {
    line.split(label)
        .skip(1)
        .filter_map(|rest| {
            let word = rest.split_whitespace().next()?;
            word.trim_end_matches([',', ';', '%']).parse().ok()
        })
        .collect()
}

/// `sim run` says what no router could beat: the turn-2+ TTFT floor below
/// the run's p90, and the reuse ceiling with the cluster's memory at most
/// the one with unbounded memory.
#[test]
fn run_prints_the_floor_and_the_reuse_ceiling() -> anyhow::Result<()> {
    let out = sim(&SHORT_ISL_RUN)?;
    let line = |start: &str| {
        out.lines()
            .find(|l| l.starts_with(start))
            .unwrap_or_else(|| panic!("no line starting {start:?}:\n{out}"))
    };
    let floor = line("turn-2+ TTFT p90 ");
    let (p90, floor_p90) = (numbers_after(floor, "p90 "), numbers_after(floor, "floor "));
    let (p90, floor_p90) = (p90[0], floor_p90[0]);
    let held = numbers_after(floor, "held: ");
    assert!(0.0 < floor_p90 && floor_p90 <= p90, "{floor}");
    assert!(held[0] > 50.0 && held[0] < 100.0, "{floor}");
    let ceiling = line("prompt blocks any cache could serve");
    let unbounded = numbers_after(ceiling, "requests): ");
    let pooled = numbers_after(ceiling, "at most ");
    assert!(0.0 < pooled[0] && pooled[0] <= unbounded[0], "{ceiling}");
    Ok(())
}

/// `sim <args>`'s error: it must fail.
fn sim_error(args: &[&str]) -> anyhow::Result<String> {
    let output = Command::new(env!("CARGO_BIN_EXE_sim"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()?;
    anyhow::ensure!(!output.status.success(), "sim {args:?} succeeded");
    Ok(String::from_utf8(output.stderr)?)
}

/// `sim tune --policies <policies>`'s error.
fn tune_error(policies: &str) -> anyhow::Result<String> {
    sim_error(&["tune", "--policies", policies])
}

/// `tune --param` names a parameter none of the tuned policies has, and
/// an out-of-range value, before anything runs.
#[test]
fn tune_refuses_a_param_no_tuned_policy_has() -> anyhow::Result<()> {
    let stderr = sim_error(&[
        "tune",
        "--policies",
        "isl",
        "--param",
        "spare_decodes_up_to=2",
    ])?;
    assert!(
        stderr.contains("--param spare_decodes_up_to: none of the tuned policies (isl) has it"),
        "{stderr}"
    );
    let stderr = sim_error(&[
        "tune",
        "--policies",
        "sla_dynamic",
        "--param",
        "spare_decodes_up_to=-1",
    ])?;
    assert!(stderr.contains("spare_decodes_up_to = -1"), "{stderr}");
    Ok(())
}

/// `--router-param` takes the router's settings by the names its decision
/// records list, and names what is wrong before anything runs.
#[test]
fn run_takes_router_settings_by_their_names() -> anyhow::Result<()> {
    fn with(param: &str) -> Vec<&str> {
        [&SHORT_ISL_RUN[..], &["--router-param", param]].concat()
    }
    let out = sim(&with("prefill.miss_weight=0"))?;
    assert_eq!(rows(&out).len(), 1, "{out}");
    let stderr = sim_error(&with("prefill.miss_weigth=0"))?;
    assert!(
        stderr.contains("the router has no setting \"prefill.miss_weigth\""),
        "{stderr}"
    );
    let stderr = sim_error(&with("prefill.miss_weight=-1"))?;
    assert!(
        stderr.contains("prefill.miss_weight = -1 is out of range"),
        "{stderr}"
    );
    let stderr = sim_error(&with("fetch.enabled=0"))?;
    assert!(stderr.contains("--prefix-fetch"), "{stderr}");
    Ok(())
}

/// `tune --policies` names what it does not know, and the known ones.
#[test]
fn tune_refuses_an_unknown_policy_by_name() -> anyhow::Result<()> {
    let stderr = tune_error("isl,nope")?;
    assert!(
        stderr.contains("no C/D policy named \"nope\"; known: isl, load, isl_or_load, sla_dynamic"),
        "{stderr}"
    );
    // A fixed deployment's policy is no C/D policy either.
    let stderr = tune_error("disagg")?;
    assert!(
        stderr.contains("no C/D policy named \"disagg\""),
        "{stderr}"
    );
    Ok(())
}

/// A misses line's groups (paths or rules), each with its five figures:
/// "<name> <misses> of <requests> (TTFT only <n>, ITL only <n>, both <n>)".
fn misses_by(line: &str) -> Vec<(String, [u64; 5])> {
    let (_, groups) = line.split_once(": ").unwrap_or_else(|| panic!("{line}"));
    groups
        .split("; ")
        .map(|group| {
            let words: Vec<&str> = group.split_whitespace().collect();
            let name_len = words
                .iter()
                .position(|w| w.parse::<u64>().is_ok())
                .unwrap_or_else(|| panic!("{group}"));
            let numbers: Vec<u64> = group
                .split([' ', '(', ')', ','])
                .filter_map(|w| w.parse().ok())
                .collect();
            let figures = numbers[..].try_into().unwrap_or_else(|_| panic!("{group}"));
            (words[..name_len].join(" "), figures)
        })
        .collect()
}

/// A "SLO misses by path" line's figures, per path in the printed order.
fn misses_by_path(line: &str) -> Vec<[u64; 5]> {
    misses_by(line).into_iter().map(|(_, f)| f).collect()
}

/// The line starting with `prefix`.
fn line_starting<'a>(out: &'a str, prefix: &str) -> &'a str {
    out.lines()
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line {prefix:?}:\n{out}"))
}

/// Each figure summed over the groups.
fn sum_figures(groups: &[[u64; 5]]) -> [u64; 5] {
    let mut sum = [0; 5];
    for g in groups {
        for (s, f) in sum.iter_mut().zip(g) {
            *s += f;
        }
    }
    sum
}

/// `sim run` says where the SLO misses are: every measured request on one
/// path, and the misses there adding up to what the attainment leaves; and
/// the same requests by the rule that chose their path.
#[test]
fn run_prints_the_misses_by_path_and_by_rule() -> anyhow::Result<()> {
    // Targets tight enough that some requests miss each.
    let out = sim(&[
        &SHORT_ISL_RUN[..],
        &["--ttft-slo-ms", "250", "--itl-slo-ms", "20"],
    ]
    .concat())?;
    let measured = out
        .lines()
        .find_map(|l| l.strip_prefix("measured "))
        .and_then(|rest| rest.split_whitespace().next())
        .unwrap_or_else(|| panic!("no measured line:\n{out}"))
        .parse::<u64>()?;
    let attainment: f64 = rows(&out)[0]
        .split('|')
        .nth(4)
        .and_then(|cell| cell.split_whitespace().next())
        .unwrap_or_else(|| panic!("no SLO% cell:\n{out}"))
        .parse()?;
    let line = line_starting(&out, "SLO misses by path: ");
    let [misses, requests, ttft_only, itl_only, both] = sum_figures(&misses_by_path(line));
    assert_eq!(requests, measured, "{line}");
    assert_eq!(misses, ttft_only + itl_only + both, "{line}");
    assert!(
        ttft_only + both > 0 && itl_only + both > 0,
        "each target was meant to be missed: {line}"
    );
    let missed_share = 100.0 * misses as f64 / measured as f64;
    assert!(
        (missed_share - (100.0 - attainment)).abs() < 0.06,
        "{missed_share} against {attainment}% within the SLO:\n{out}"
    );
    // By rule: the same requests and misses, under the ISL rule's names
    // (and the gate's), the one that missed most first.
    let line = line_starting(&out, "SLO misses by rule: ");
    let rules = misses_by(line);
    let figures: Vec<[u64; 5]> = rules.iter().map(|(_, f)| *f).collect();
    assert_eq!(
        sum_figures(&figures),
        [misses, requests, ttft_only, itl_only, both],
        "{line}"
    );
    assert!(
        rules
            .iter()
            .all(|(name, _)| name.starts_with("isl.") || name.starts_with("gate.")),
        "{line}"
    );
    assert!(
        rules.iter().any(|(name, _)| name == "isl.short_append"),
        "{line}"
    );
    assert!(figures.windows(2).all(|w| w[0][0] >= w[1][0]), "{line}");
    Ok(())
}

/// `sim run --seeds N` sums the misses over the seeds: each path's and
/// each rule's figures are the sums of what each seed prints alone.
#[test]
fn run_with_seeds_sums_the_misses() -> anyhow::Result<()> {
    let tight = ["--ttft-slo-ms", "250", "--itl-slo-ms", "20"];
    let both = sim(&[&SHORT_ISL_RUN[..], &tight, &["--seeds", "2", "--seed", "3"]].concat())?;
    let alone: Vec<String> = ["3", "4"]
        .iter()
        .map(|seed| sim(&[&SHORT_ISL_RUN[..], &tight, &["--seed", seed]].concat()))
        .collect::<anyhow::Result<_>>()?;
    for by in ["path", "rule"] {
        let printed = misses_by(line_starting(
            &both,
            &format!("SLO misses by {by}, all seeds: "),
        ));
        if by == "rule" {
            assert!(
                printed.windows(2).all(|w| w[0].1[0] >= w[1].1[0]),
                "the rule that missed most first:\n{both}"
            );
        }
        let summed: BTreeMap<String, [u64; 5]> = printed.iter().cloned().collect();
        assert_eq!(summed.len(), printed.len(), "each {by} once:\n{both}");
        let mut expected: BTreeMap<String, [u64; 5]> = BTreeMap::new();
        for out in &alone {
            let groups = misses_by(line_starting(out, &format!("SLO misses by {by}: ")));
            if by == "path" {
                assert_eq!(groups.len(), 3, "every path taken in this run:\n{out}");
            }
            for (name, figures) in groups {
                let sum = expected.entry(name).or_default();
                *sum = sum_figures(&[*sum, figures]);
            }
        }
        assert_eq!(summed, expected, "{both}");
    }
    Ok(())
}

/// A cluster small enough to tune in seconds: 3 workers of the 8B preset
/// and 6 s of single-turn requests.
const SMALL_CLUSTER: [&str; 8] = [
    "--workload",
    "synthetic",
    "--duration-s",
    "6",
    "--workers",
    "3",
    "--preset",
    "llama8b_h100",
];

/// The last JSON line `sim` printed.
fn last_json(out: &str) -> anyhow::Result<serde_json::Value> {
    let line = out
        .lines()
        .rfind(|l| l.starts_with('{'))
        .ok_or_else(|| anyhow::anyhow!("no JSON line:\n{out}"))?;
    Ok(serde_json::from_str(line)?)
}

/// The TTFT p99 in `sim run`'s first row.
fn run_p99(run: &str) -> anyhow::Result<f64> {
    let row = rows(run)
        .first()
        .copied()
        .ok_or_else(|| anyhow::anyhow!("no row:\n{run}"))?;
    let p99 = row
        .split('|')
        .nth(1)
        .and_then(|c| c.split_whitespace().nth(2))
        .ok_or_else(|| anyhow::anyhow!("no TTFT p99 in {row}"))?;
    Ok(p99.parse()?)
}

/// `sim compare --loads 2` on the small cluster with `args`: what it
/// printed, and its `capacity.json`.
fn compare_small(args: &[&str]) -> anyhow::Result<(String, serde_json::Value)> {
    let dir = std::env::temp_dir().join(format!(
        "sim-compare-{}-{}",
        std::process::id(),
        args.join("_")
    ));
    let out_dir = dir
        .to_str()
        .ok_or_else(|| anyhow::anyhow!("not UTF-8: {dir:?}"))?;
    let out = sim(&[
        &["compare", "--loads", "2", "--out", out_dir][..],
        args,
        &SMALL_CLUSTER,
    ]
    .concat())?;
    let json = serde_json::from_str(&std::fs::read_to_string(dir.join("capacity.json"))?)?;
    std::fs::remove_dir_all(&dir)?;
    Ok((out, json))
}

/// `sim tune` prints each family's TTFT p99 at its capacity, seed by seed:
/// each the p99 `sim run` prints for that family at that load and seed.
#[test]
fn tune_shows_each_familys_tail_at_its_capacity() -> anyhow::Result<()> {
    let out = sim(&[
        &["tune", "--policies", "isl", "--seeds", "2"][..],
        &SMALL_CLUSTER,
    ]
    .concat())?;
    assert!(out.contains("TTFT p99 there"), "{out}");
    // Single-turn requests: no turn-2+ comparison (it used to say 0.00x).
    assert!(
        out.contains("no request of this workload is a conversation's later turn"),
        "{out}"
    );
    let json = last_json(&out)?;
    assert!(json["later_turn_ttft_p90"].is_null(), "{json}");
    let agg = &json["families"][0];
    assert_eq!(agg["family"], "aggregated");
    let tails: Vec<f64> = agg["ttft_p99_ms_at_capacity"]
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("no tail: {agg}"))?
        .iter()
        .filter_map(|v| v.as_f64())
        .collect();
    assert_eq!(tails.len(), 2, "{agg}");
    for family in json["families"].as_array().into_iter().flatten() {
        assert_eq!(
            family["ttft_p99_ms_at_capacity"].as_array().map(Vec::len),
            Some(2)
        );
    }
    let capacity = agg["capacity"].as_f64().unwrap_or_default().to_string();
    let credit = agg["router_params"]["decode.overlap_credit"]
        .as_f64()
        .unwrap_or_default();
    for (seed, tail) in ["1", "2"].into_iter().zip(&tails) {
        let run = sim(&[
            &[
                "run",
                "--deployment",
                "aggregated",
                "--load",
                &capacity,
                "--seed",
                seed,
                "--router-param",
                &format!("decode.overlap_credit={credit}"),
            ][..],
            &SMALL_CLUSTER,
        ]
        .concat())?;
        let p99 = run_p99(&run)?;
        assert!(
            (p99 - tail).abs() <= 0.5,
            "seed {seed}: {tail} in the tune, {p99} in sim run"
        );
    }
    Ok(())
}

/// `sim tune --ttft-p99-bound-ms`: a load passes only with its TTFT p99
/// within the bound too. No run's p99 is within 1 ms, so no load passes
/// and no ratio is claimed; with a bound no run reaches, the capacities
/// are those without one.
#[test]
fn tune_bounds_the_tail_when_asked() -> anyhow::Result<()> {
    let small = [&["tune", "--policies", "isl"][..], &SMALL_CLUSTER].concat();
    let capacities = |json: &serde_json::Value| -> Vec<f64> {
        json["families"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|f| f["capacity"].as_f64().unwrap_or(f64::NAN))
            .collect()
    };

    let out = sim(&[&small[..], &["--ttft-p99-bound-ms", "1"]].concat())?;
    assert!(out.contains("and a TTFT p99 <= 1 ms"), "{out}");
    assert!(out.contains("no ratio"), "{out}");
    let json = last_json(&out)?;
    assert_eq!(json["ttft_p99_bound_ms"], 1.0, "{json}");
    assert!(json["cd_over_baseline"].is_null(), "{json}");
    assert_eq!(capacities(&json), vec![0.0; 3], "{json}");

    let free = last_json(&sim(&small)?)?;
    assert!(free["ttft_p99_bound_ms"].is_null(), "{free}");
    assert!(capacities(&free).iter().all(|&c| c > 0.0), "{free}");
    let loose = last_json(&sim(
        &[&small[..], &["--ttft-p99-bound-ms", "1e9"]].concat()
    )?)?;
    assert_eq!(capacities(&loose), capacities(&free), "{loose}\n{free}");

    let stderr = sim_error(&[&small[..], &["--ttft-p99-bound-ms", "0"]].concat())?;
    assert!(
        stderr.contains("--ttft-p99-bound-ms must be a finite number > 0, not 0"),
        "{stderr}"
    );
    Ok(())
}

/// `sim compare --ttft-p99-bound-ms`: the capacity's definition names the
/// bound, and `capacity.json` records what passed: with no run's p99
/// within 1 ms, no deployment passes at any load.
#[test]
fn compare_bounds_the_tail_when_asked() -> anyhow::Result<()> {
    let (out, json) = compare_small(&["--ttft-p99-bound-ms", "1"])?;
    assert!(
        out.contains("within the SLO and a TTFT p99 <= 1 ms"),
        "{out}"
    );
    let rows = json
        .as_array()
        .ok_or_else(|| anyhow::anyhow!("not an array of deployments: {json}"))?;
    assert!(rows.len() >= 3, "{json}");
    for row in rows {
        assert_eq!(row["ttft_p99_bound_ms"], 1.0, "{row}");
        assert_eq!(row["capacity"], 0.0, "{row}");
        assert!(row["below"].is_number(), "{row}");
        assert!(row["ttft_p99_ms_at_capacity"].is_null(), "{row}");
    }
    Ok(())
}

/// `sim compare` prints each deployment's TTFT p99 at its capacity, and
/// `capacity.json` records it: the p99 `sim run` prints for that
/// deployment at that load.
#[test]
fn compare_shows_each_deployments_tail_at_its_capacity() -> anyhow::Result<()> {
    let (out, json) = compare_small(&[])?;
    assert!(out.contains("TTFT p99 there"), "{out}");
    let agg = &json[0];
    assert_eq!(agg["deployment"], "agg 3", "{json}");
    let tail = agg["ttft_p99_ms_at_capacity"]
        .as_f64()
        .ok_or_else(|| anyhow::anyhow!("no tail: {agg}"))?;
    let capacity = agg["capacity"].as_f64().unwrap_or_default().to_string();
    let run = sim(&[
        &["run", "--deployment", "aggregated", "--load", &capacity][..],
        &SMALL_CLUSTER,
    ]
    .concat())?;
    let p99 = run_p99(&run)?;
    assert!(
        (p99 - tail).abs() <= 0.5,
        "{tail} in compare, {p99} in sim run"
    );
    Ok(())
}
