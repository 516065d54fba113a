//! Data-driven tests of the indexer core: event sequences in
//! `tests/data/*.txt`, each command followed by `----` and its expected
//! output (see `tests::datadriven`; `UPDATE_EXPECT=1` rewrites them).
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
use tests::datadriven::{option, options, run_scenarios};

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

fn event(names: &mut Names, line: &str) -> KvEvent {
    let mut words = line.split_whitespace();
    let kind = words.next().expect("an event");
    let (opts, plain) = options(words);
    let parent = option(&opts, "parent").map(|p| names.one(p));
    let blocks = names.chain(parent, &plain);
    let tier = option(&opts, "tier").map_or(Tier::Device, |t| t.parse().unwrap());
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

#[test]
fn data_driven() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data");
    run_scenarios(
        &dir,
        |text| {
            let cap = text
                .lines()
                .find_map(|l| l.strip_prefix("# max_blocks="))
                .map(|v| v.trim().parse().unwrap());
            let index = cap.map_or_else(OwnershipIndex::new, OwnershipIndex::with_max_blocks);
            (KvIndexer::new(index), Names::default())
        },
        |(indexer, names), command| run(indexer, names, command),
    );
}
