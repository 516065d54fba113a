//! The cores are pure: no async runtime, no bus client, no clock. This
//! checks the sources, so that an `Instant::now()` slipped into a policy
//! fails the build's tests instead of waiting for a reviewer. (`scripts/test`
//! also builds the crates that hold cores without their services' features,
//! and checks that their dependency trees hold no `tokio`.)

use std::path::{Path, PathBuf};

/// Files and folders that hold only pure code.
const CORES: &[&str] = &[
    "router/src/core",
    "kv-indexer/src/index.rs",
    "kv-indexer/src/indexer.rs",
    "kv-indexer/src/replica.rs",
    "kv-indexer/src/live.rs",
    "engine-sim/src",
    "worker-agent/src/core",
    "protocol/src/decision_log.rs",
];

/// What a pure core must not name.
const FORBIDDEN: &[&str] = &["tokio", "async_nats", "Instant::now", "SystemTime"];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace root")
        .to_owned()
}

fn rust_files(path: &Path, out: &mut Vec<PathBuf>) {
    if path.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(path)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for entry in entries {
            rust_files(&entry, out);
        }
    } else if path.extension().is_some_and(|e| e == "rs") {
        out.push(path.to_owned());
    }
}

/// The code of a line: what comes before a `//` comment (a `//` inside a
/// string literal ends the line early, which only hides code: good enough
/// for names that never appear in strings of these files).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// Where `source` names a forbidden item, as `line: text`.
fn violations(source: &str) -> Vec<String> {
    source
        .lines()
        .enumerate()
        .filter(|(_, line)| {
            let code = code(line);
            FORBIDDEN.iter().any(|name| code.contains(name))
        })
        .map(|(i, line)| format!("{}: {}", i + 1, line.trim()))
        .collect()
}

#[test]
fn the_cores_name_no_runtime_bus_or_clock() {
    let root = root();
    let mut files = Vec::new();
    for core in CORES {
        let path = root.join(core);
        assert!(
            path.exists(),
            "{core} is listed as a core but does not exist"
        );
        rust_files(&path, &mut files);
    }
    assert!(files.len() > 10, "only {} files found", files.len());
    let mut found = Vec::new();
    for file in files {
        let source = std::fs::read_to_string(&file).unwrap();
        for v in violations(&source) {
            found.push(format!(
                "{}:{v}",
                file.strip_prefix(&root).unwrap().display()
            ));
        }
    }
    assert!(
        found.is_empty(),
        "pure cores name {FORBIDDEN:?}:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_sees_what_it_looks_for() {
    let source = "use std::time::Instant;\nlet t = Instant::now(); // a clock\n// tokio in a comment is fine\nlet rt = tokio::runtime::Runtime::new();\n";
    assert_eq!(
        violations(source),
        [
            "2: let t = Instant::now(); // a clock",
            "4: let rt = tokio::runtime::Runtime::new();"
        ]
    );
}
