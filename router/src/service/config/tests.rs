use std::io::Write;

use super::*;
use crate::core::{IslBased, IslOrLoad, SlaDynamic};

fn parse(args: &[&str]) -> Result<Loaded, ConfigError> {
    let args = Args::try_parse_from(
        command(),
        &flags(),
        &Config::default(),
        std::iter::once("router").chain(args.iter().copied()),
    )
    .map_err(|e| ConfigError::Invalid {
        key: "args",
        value: e.to_string(),
        expected: "valid flags",
    })?;
    Config::from_args(&args)
}

fn file(text: &str) -> tempfile::NamedTempFile {
    let mut f = tempfile::NamedTempFile::new().unwrap();
    f.write_all(text.as_bytes()).unwrap();
    f
}

#[test]
fn defaults_resolve() {
    let c = Config::new("nats://n:1", &["http://e:2".into()], "m").unwrap();
    assert_eq!(c.router().contract, HashingContract::for_model("m", 16));
    assert_eq!(c.policy, Policy::default());
    assert_eq!(c.policy.name(), "isl_or_load");
    assert!(valid_token(&c.replica_id), "{}", c.replica_id);
    assert_eq!(c.timeouts, Timeouts::default());
    assert_eq!(c.max_body(), 32 << 20);
    let r = c.router();
    assert_eq!(r.decode.tier_weights, TierWeights::default());
    assert_eq!(r.ledger, LedgerConfig::default());
}

#[test]
fn the_model_is_required() {
    let e = parse(&[]).unwrap_err();
    assert!(e.to_string().contains("SWITCHYARD_MODEL"), "{e}");
}

#[test]
fn bad_values_are_named() {
    for (args, key) in [
        (&["--block-size", "0"][..], "block_size"),
        (&["--replica-id", "a.b"], "replica_id"),
        (&["--policy", "isl", "--eff-isl-ratio", "-1"], "policy"),
        (&["--gate-budget-fraction", "0"], "gate.budget_fraction"),
        (&["--first-chunk-timeout", "0s"], "timeouts.first_chunk"),
        (&["--decode-temperature", "-1"], "decode.temperature"),
        (&["--policy", "fastest"], "policy"),
        (&["--policy", "load", "--eff-isl-tokens", "10"], "policy"),
        (&["--max-body-bytes", "1"], "max_body_bytes"),
    ] {
        let mut all = vec!["--model", "m"];
        all.extend_from_slice(args);
        let e = parse(&all).unwrap_err().to_string();
        assert!(e.starts_with(key), "{args:?}: {e}");
    }
    let e = parse(&["--model", "m", "--policy", "fastest"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("unknown policy \"fastest\" (known: always_disagg"),
        "{e}"
    );
    let e = parse(&["--model", "m", "--policy", "load", "--eff-isl-tokens", "10"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("policy load has no parameter \"eff_isl_tokens\""),
        "{e}"
    );
}

#[test]
fn policies_by_name_and_earlier_spellings() {
    for (name, expected, deprecated) in [
        ("always_disagg", "always_disagg", false),
        ("always-disagg", "always_disagg", true),
        ("never_disagg", "never_disagg", false),
        ("aggregated", "never_disagg", true),
        ("isl", "isl", false),
        ("load", "load", false),
        ("isl_or_load", "isl_or_load", false),
        ("ISL-or-load", "isl_or_load", true),
        ("sla", "sla_dynamic", true),
    ] {
        let loaded = parse(&["--model", "m", "--policy", name]).unwrap();
        assert_eq!(loaded.config.policy.name(), expected, "{name}");
        assert_eq!(
            !loaded.deprecations.is_empty(),
            deprecated,
            "{name}: {:?}",
            loaded.deprecations
        );
    }
}

#[test]
fn flags_beat_the_file_and_sections_are_the_cores_structs() {
    let f = file(
        "model = \"from-file\"\nblock_size = 32\n[policy]\nname = \"isl\"\neff_isl_tokens = 512\n[decode]\noverlap_credit = 2.0\n[ledger]\nttl = \"5m\"\n[timeouts]\nroute = \"500ms\"\n",
    );
    let path = f.path().to_str().unwrap();
    let loaded = parse(&["--config", path, "--block-size", "64"]).unwrap();
    let c = loaded.config;
    assert!(loaded.deprecations.is_empty(), "{:?}", loaded.deprecations);
    assert_eq!(c.model, "from-file");
    assert_eq!(
        c.router().contract.block_size,
        64,
        "the flag beats the file"
    );
    assert_eq!(
        c.policy,
        Policy::Isl(IslBased {
            eff_isl_tokens: 512,
            ..IslBased::default()
        })
    );
    assert_eq!(c.decode.overlap_credit, 2.0);
    assert_eq!(c.ledger.ttl_ms, 300_000);
    assert_eq!(c.timeouts.route, Duration::from_millis(500));

    let f = file("modle = \"x\"\n");
    let e = parse(&["--config", f.path().to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("modle"), "{e}");
    let f = file("[gate]\nbudget = 0.5\n");
    let e = parse(&["--model", "m", "--config", f.path().to_str().unwrap()])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("gate") && e.contains("budget"), "{e}");
}

/// A file of the previous release (flat keys, `_ms` integers) still loads,
/// and says what to write instead.
#[test]
fn the_previous_releases_spellings_still_load() {
    let f = file(
        "model = \"m\"\npolicy = \"isl-or-load\"\neff_isl_tokens = 1024\ndecode_overlap_credit = 0.5\nledger_ttl_ms = 1000\nhost_tier_weight = 0.1\ngate_enabled = false\n",
    );
    let loaded = parse(&[
        "--config",
        f.path().to_str().unwrap(),
        "--route-timeout-ms",
        "250",
    ])
    .unwrap();
    let c = &loaded.config;
    assert_eq!(
        c.policy,
        Policy::IslOrLoad(IslOrLoad {
            isl: IslBased {
                eff_isl_tokens: 1024,
                ..IslBased::default()
            },
            ..IslOrLoad::default()
        })
    );
    assert_eq!(c.decode.overlap_credit, 0.5);
    assert_eq!(c.ledger.ttl_ms, 1000);
    assert_eq!(c.router().prefill.tier_weights.host, 0.1);
    assert!(!c.gate.enabled);
    assert_eq!(c.timeouts.route, Duration::from_millis(250));
    let said: Vec<String> = loaded
        .deprecations
        .iter()
        .map(ToString::to_string)
        .collect();
    for expected in [
        "--route-timeout-ms is deprecated",
        "the file key ledger_ttl_ms is deprecated",
        "the policy name \"isl-or-load\" is deprecated",
    ] {
        assert!(
            said.iter().any(|s| s.starts_with(expected)),
            "{expected}: {said:?}"
        );
    }
}

#[test]
fn flags_parse_and_help_shows_the_registry_and_the_defaults() {
    let c = parse(&[
        "--model",
        "m",
        "--etcd-endpoints",
        "http://a:1,http://b:2",
        "--policy",
        "sla_dynamic",
        "--ttft-target-ms",
        "500",
        "--ledger-ttl",
        "2m",
    ])
    .unwrap()
    .config;
    assert_eq!(c.etcd_endpoints, vec!["http://a:1", "http://b:2"]);
    assert_eq!(
        c.policy,
        Policy::SlaDynamic(SlaDynamic {
            ttft_target_ms: 500.0,
            ..SlaDynamic::default()
        })
    );
    assert_eq!(c.ledger.ttl_ms, 120_000);

    let mut command = settings_command();
    let help = command.render_long_help().to_string();
    for expected in [
        "--eff-isl-tokens <NUMBER>",
        "2048 for isl, 2048 for isl_or_load",
        "--ttft-target-ms <NUMBER>",
        "2000 for sla_dynamic",
        "sla_dynamic (predict TTFT",
        "[default: isl_or_load]",
        "--ledger-ttl <DURATION>",
        "[default: 10m]",
        "--max-body-bytes <SIZE>",
        "[default: 32MiB]",
        "SWITCHYARD_ROUTER_HTTP_ADDR",
    ] {
        assert!(help.contains(expected), "{expected} not in\n{help}");
    }
    assert!(!help.contains("ledger-ttl-ms"), "old flags are hidden");
}

fn settings_command() -> clap::Command {
    settings::command(command(), &flags(), &Config::default())
}

#[test]
fn the_tokenization_cache_is_sized_in_bytes() {
    let c = parse(&["--model", "m"]).unwrap().config;
    assert_eq!(c.tokenizer_cache, 256 << 20);
    let c = parse(&["--model", "m", "--tokenizer-cache", "64MiB"])
        .unwrap()
        .config;
    assert_eq!(c.tokenizer_cache, 64 << 20);
    let c = parse(&["--model", "m", "--tokenizer-cache", "0"])
        .unwrap()
        .config;
    assert_eq!(c.tokenizer_cache, 0);
}

#[test]
fn a_cluster_of_servers_and_replicated_streams() {
    let c = parse(&[
        "--model",
        "m",
        "--nats-url",
        "nats://a:4222,nats://b:4222",
        "--stream-replicas",
        "3",
    ])
    .unwrap()
    .config;
    assert_eq!(c.nats_url, "nats://a:4222,nats://b:4222");
    assert_eq!(c.stream_replicas, 3);
    let e = parse(&["--model", "m", "--stream-replicas", "9"])
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("stream_replicas = 9"), "{e}");
}
