use std::io::Write;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::*;
use crate::flags::{Kind, Legacy};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Config {
    name: String,
    endpoints: Vec<String>,
    gate: Gate,
    #[serde(with = "crate::duration")]
    tick: Duration,
    #[serde(with = "crate::bytes")]
    cap: u64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Gate {
    enabled: bool,
    budget: f64,
    #[serde(with = "crate::duration_ms")]
    ttl_ms: u64,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            name: "x".into(),
            endpoints: vec!["http://a:1".into()],
            gate: Gate::default(),
            tick: Duration::from_secs(1),
            cap: 1 << 30,
        }
    }
}

impl Default for Gate {
    fn default() -> Self {
        Self {
            enabled: true,
            budget: 0.95,
            ttl_ms: 600_000,
        }
    }
}

fn flags() -> Vec<Flag> {
    vec![
        Flag::new("name", Kind::Text, "The name"),
        Flag::new("endpoints", Kind::List, "Endpoints"),
        Flag::new("gate.enabled", Kind::Switch, "Gate on"),
        Flag::new("gate.budget", Kind::Number, "Budget").legacy(Legacy::renamed("budget-fraction")),
        Flag::new("gate.ttl_ms", Kind::Duration, "TTL")
            .long("gate-ttl")
            .legacy(Legacy::millis("gate-ttl-ms")),
        Flag::new("tick", Kind::Duration, "Tick"),
        Flag::new("cap", Kind::Bytes, "Cap"),
    ]
}

fn command() -> clap::Command {
    clap::Command::new("svc").no_binary_name(false)
}

fn parse(args: &[&str]) -> Result<Args, clap::Error> {
    Args::try_parse_from(
        command(),
        &flags(),
        &Config::default(),
        std::iter::once("svc").chain(args.iter().copied()),
    )
}

fn file(text: &str) -> tempfile_path::TempFile {
    tempfile_path::TempFile::new(text)
}

/// A file in the temp dir, removed on drop (no tempfile crate needed here).
mod tempfile_path {
    use std::path::PathBuf;

    pub struct TempFile(pub PathBuf);

    impl TempFile {
        pub fn new(text: &str) -> Self {
            use std::sync::atomic::{AtomicU32, Ordering};
            static N: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "settings-test-{}-{}.toml",
                std::process::id(),
                N.fetch_add(1, Ordering::Relaxed)
            ));
            let mut f = std::fs::File::create(&path).unwrap();
            super::Write::write_all(&mut f, text.as_bytes()).unwrap();
            Self(path)
        }
    }

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

#[test]
fn defaults_come_from_default_and_show_in_help() {
    let (c, d): (Config, _) = parse(&[]).unwrap().load(&flags()).unwrap();
    assert_eq!(c, Config::default());
    assert!(d.is_empty());
    let mut cmd = flags::command(command(), &flags(), &to_table(&Config::default()));
    let help = cmd.render_long_help().to_string();
    for expected in [
        "--gate-budget <NUMBER>",
        "[default: 0.95]",
        "--gate-ttl <DURATION>",
        "[default: 10m]",
        "[default: 1GiB]",
        "[default: http://a:1]",
        "SWITCHYARD_GATE_BUDGET",
    ] {
        assert!(help.contains(expected), "{expected} not in\n{help}");
    }
    assert!(!help.contains("gate-ttl-ms"), "legacy flags are hidden");
}

#[test]
fn flags_beat_the_file_and_sections_fill_the_structs() {
    let f = file("name = \"from-file\"\ntick = \"250ms\"\n[gate]\nbudget = 0.5\nenabled = false\n");
    let args = parse(&[
        "--config",
        f.0.to_str().unwrap(),
        "--gate-budget",
        "0.75",
        "--endpoints",
        "http://b:2, http://c:3",
        "--cap",
        "64MiB",
    ])
    .unwrap();
    let (c, _): (Config, _) = args.load(&flags()).unwrap();
    assert_eq!(c.name, "from-file");
    assert_eq!(c.tick, Duration::from_millis(250));
    assert_eq!(c.gate.budget, 0.75, "the flag beats the file");
    assert!(!c.gate.enabled, "the file beats the default");
    assert_eq!(c.endpoints, ["http://b:2", "http://c:3"]);
    assert_eq!(c.cap, 64 << 20);
}

#[test]
fn earlier_spellings_work_and_are_reported() {
    let args = parse(&["--gate-ttl-ms", "1500", "--budget-fraction", "0.5"]).unwrap();
    let (c, d): (Config, _) = args.load(&flags()).unwrap();
    assert_eq!(c.gate.ttl_ms, 1500);
    assert_eq!(c.gate.budget, 0.5);
    let d: Vec<String> = d.iter().map(ToString::to_string).collect();
    assert_eq!(d.len(), 2, "{d:?}");
    assert!(
        d.iter()
            .any(|d| d.starts_with("--budget-fraction is deprecated")),
        "{d:?}"
    );

    let f = file("gate_ttl_ms = 2000\ngate_budget = 0.25\n");
    let (c, d): (Config, _) = Args::from_file(Some(f.0.clone())).load(&flags()).unwrap();
    assert_eq!((c.gate.ttl_ms, c.gate.budget), (2000, 0.25));
    let mut new: Vec<&str> = d.iter().map(|d| d.new.as_str()).collect();
    new.sort();
    assert_eq!(new, ["gate.budget", "gate.ttl_ms"]);
    assert!(
        d.iter().any(|d| d.old == "the file key gate_ttl_ms"),
        "{d:?}"
    );
}

#[test]
fn bad_values_and_keys_are_named() {
    let e = parse(&["--gate-budget", "lots"]).unwrap_err().to_string();
    assert!(
        e.contains("--gate-budget") && e.contains("not a number"),
        "{e}"
    );
    let e = parse(&["--tick", "5"]).unwrap_err().to_string();
    assert!(e.contains("not a duration"), "{e}");
    let e = parse(&["--gate-ttl", "1s", "--gate-ttl-ms", "5"]).unwrap_err();
    assert_eq!(e.kind(), clap::error::ErrorKind::ArgumentConflict);

    let f = file("[gate]\nbudjet = 0.5\n");
    let e = Args::from_file(Some(f.0.clone()))
        .load::<Config>(&flags())
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("gate.budjet: unknown field `budjet`")
            || e.starts_with("gate: unknown field `budjet`"),
        "{e}"
    );
    let f = file("[gate]\nbudget = \"high\"\n");
    let e = Args::from_file(Some(f.0.clone()))
        .load::<Config>(&flags())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("gate.budget: invalid type"), "{e}");
    let f = file("tick = \"soon\"\n");
    let e = Args::from_file(Some(f.0.clone()))
        .load::<Config>(&flags())
        .unwrap_err()
        .to_string();
    assert!(e.starts_with("tick: \"soon\" is not a duration"), "{e}");
    let e = Args::from_file(Some("/nonexistent/x.toml".into()))
        .load::<Config>(&flags())
        .unwrap_err();
    assert!(matches!(e, SettingsError::ReadFile { .. }), "{e}");
}

#[test]
fn embedders_set_keys_directly() {
    let mut args = Args::from_file(None);
    args.set("gate.budget", 0.5).set("name", "n");
    let (c, _): (Config, _) = args.load(&flags()).unwrap();
    assert_eq!((c.gate.budget, c.name.as_str()), (0.5, "n"));
}
