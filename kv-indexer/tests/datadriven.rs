//! Data-driven tests of the indexer core: event sequences in
//! `tests/data/*.txt`, each command followed by `----` and its expected
//! output. Run with `UPDATE_EXPECT=1` to rewrite the expectations after a
//! deliberate change (and review the diff).
//!
//! Commands:
//! - `batch WORKER epoch=E seq=S`, then indented events: `stored [parent=B]
//!   [tier=T] B...`, `removed [tier=T] B...`, `cleared`;
//! - `remove-worker WORKER`; `match B...`; `stats`; `snapshot-restore`.
//!
//! Blocks are short names. A name gets its chained hash where it first
//! appears (after its parent in that line), as an engine would compute it,
//! and keeps it afterwards; so names stand for blocks at one place of one
//! chain.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::path::Path;

use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{BlockHash, BlockHasher, KvEvent, KvEventBatch, Tier, WorkerId};

/// Block names and their hashes.
#[derive(Default)]
struct Names(HashMap<String, BlockHash>);

impl Names {
    /// The hashes of a chain of names following `parent`.
    fn chain(&mut self, parent: Option<BlockHash>, names: &[&str]) -> Vec<BlockHash> {
        let mut prev = parent;
        names
            .iter()
            .map(|name| {
                let hash = *self.0.entry((*name).to_owned()).or_insert_with(|| {
                    BlockHasher::chain(prev, xxhash_rust::xxh3::xxh3_64(name.as_bytes()))
                });
                prev = Some(hash);
                hash
            })
            .collect()
    }

    fn one(&mut self, name: &str) -> BlockHash {
        self.chain(None, &[name])[0]
    }
}

fn tier(name: &str) -> Tier {
    match name {
        "device" => Tier::Device,
        "host" => Tier::Host,
        "disk" => Tier::Disk,
        other => panic!("unknown tier {other}"),
    }
}

/// Splits `key=value` options from plain words.
fn options<'a>(words: impl Iterator<Item = &'a str>) -> (Vec<(&'a str, &'a str)>, Vec<&'a str>) {
    let (opts, plain): (Vec<_>, Vec<_>) = words.partition(|w| w.contains('='));
    (
        opts.into_iter()
            .map(|o| o.split_once('=').unwrap())
            .collect(),
        plain,
    )
}

fn option<'a>(opts: &[(&str, &'a str)], key: &str) -> Option<&'a str> {
    opts.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
}

fn event(names: &mut Names, line: &str) -> KvEvent {
    let mut words = line.split_whitespace();
    let kind = words.next().expect("an event");
    let (opts, plain) = options(words);
    let parent = option(&opts, "parent").map(|p| names.one(p));
    let blocks = names.chain(parent, &plain);
    let tier = option(&opts, "tier").map_or(Tier::Device, tier);
    match kind {
        "stored" => KvEvent::Stored {
            parent,
            blocks,
            tier,
        },
        "removed" => KvEvent::Removed { blocks, tier },
        "cleared" => KvEvent::Cleared,
        other => panic!("unknown event {other}"),
    }
}

fn run(indexer: &mut KvIndexer, names: &mut Names, command: &[&str]) -> String {
    let mut words = command[0].split_whitespace();
    let mut out = String::new();
    match words.next().unwrap() {
        "batch" => {
            let worker: WorkerId = words.next().unwrap().parse().unwrap();
            let (opts, _) = options(words);
            let batch = KvEventBatch {
                worker,
                epoch: option(&opts, "epoch").unwrap().parse().unwrap(),
                seq: option(&opts, "seq").unwrap().parse().unwrap(),
                events: command[1..].iter().map(|l| event(names, l)).collect(),
            };
            let outcome = indexer.apply(batch);
            writeln!(out, "{:?}", outcome.status).unwrap();
            match outcome.delta {
                Some(d) => {
                    writeln!(out, "delta {} with {} changes", d.seq, d.changes.len()).unwrap()
                }
                None => writeln!(out, "no delta").unwrap(),
            }
        }
        "remove-worker" => {
            let worker: WorkerId = words.next().unwrap().parse().unwrap();
            match indexer.remove_worker(&worker) {
                Some(d) => writeln!(out, "delta {}", d.seq).unwrap(),
                None => writeln!(out, "unknown worker").unwrap(),
            }
        }
        "match" => {
            let query = names.chain(None, &words.collect::<Vec<_>>());
            let index = indexer.index();
            let matches = index.find_matches(&query);
            if matches.is_empty() {
                writeln!(out, "no match").unwrap();
            }
            let mut lines: Vec<String> = matches
                .iter()
                .map(|(slot, d)| {
                    format!(
                        "{} device={} host={} disk={}",
                        index.worker(slot).unwrap(),
                        d.device,
                        d.host,
                        d.disk
                    )
                })
                .collect();
            lines.sort();
            for l in lines {
                writeln!(out, "{l}").unwrap();
            }
        }
        "stats" => {
            let s = indexer.index().stats();
            writeln!(
                out,
                "blocks={} pairs={} runs={} evicted={}",
                s.blocks, s.pairs, s.runs, s.evicted_blocks
            )
            .unwrap();
            let mut workers: Vec<_> = indexer
                .index()
                .workers()
                .map(|(w, n)| format!("{w}={n}"))
                .collect();
            workers.sort();
            writeln!(out, "workers {}", workers.join(" ")).unwrap();
        }
        "snapshot-restore" => {
            let snapshot = indexer.snapshot();
            let before = indexer.index().digest();
            *indexer = KvIndexer::restore(OwnershipIndex::new(), snapshot).unwrap();
            let same = indexer.index().digest() == before;
            writeln!(
                out,
                "restored at delta {}, digest equal: {same}",
                indexer.delta_seq()
            )
            .unwrap();
        }
        other => panic!("unknown command {other}"),
    }
    out
}

fn check_file(path: &Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let cap = text
        .lines()
        .find_map(|l| l.strip_prefix("# max_blocks="))
        .map(|v| v.trim().parse().unwrap());
    let mut indexer =
        KvIndexer::new(cap.map_or_else(OwnershipIndex::new, OwnershipIndex::with_max_blocks));
    let mut names = Names::default();
    let mut rewritten = String::new();
    let mut failures = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim().is_empty() || line.starts_with('#') {
            rewritten.push_str(line);
            rewritten.push('\n');
            continue;
        }
        let mut command = vec![line];
        while let Some(next) = lines.next_if(|l| l.starts_with(' ')) {
            command.push(next.trim());
        }
        for l in &command {
            if !l.starts_with(' ') && *l != line {
                rewritten.push_str("  ");
            }
            rewritten.push_str(l);
            rewritten.push('\n');
        }
        assert_eq!(
            lines.next(),
            Some("----"),
            "{}: `----` after {line:?}",
            path.display()
        );
        let mut expected = String::new();
        while let Some(l) = lines.next_if(|l| !l.trim().is_empty()) {
            expected.push_str(l);
            expected.push('\n');
        }
        let got = run(&mut indexer, &mut names, &command);
        if got != expected {
            failures.push(format!("{line}\n--- expected\n{expected}--- got\n{got}"));
        }
        rewritten.push_str("----\n");
        rewritten.push_str(&got);
    }
    if std::env::var_os("UPDATE_EXPECT").is_some() {
        std::fs::write(path, rewritten).unwrap();
    } else if !failures.is_empty() {
        panic!("{}:\n{}", path.display(), failures.join("\n"));
    }
}

#[test]
fn data_driven() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    let mut files: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    files.sort();
    assert!(!files.is_empty());
    for file in files {
        check_file(&file);
    }
}
