//! An engine's KV event stream as the agent's adapter reads it: ZMQ frames
//! (live `[topic, seq, payload]`, replay replies), msgpack batches in every
//! shape vLLM and SGLang publish, into the `RankCore` that decodes,
//! translates to canonical hashes and sequences them. Nothing may panic;
//! and once no replay is in progress, the blocks the core published (its
//! actions, applied in order) are the block set it reports for a resync.

use std::collections::BTreeSet;

use bytes::Bytes;
use mock_vllm::wire::{encode_batch, Encoding, EngineEvent, Flavour};
use protocol::{BlockHash, BlockHasher, HashSalt, KvEvent, Tier};
use worker_agent::vllm::sequence::{Action, RankCore};
use worker_agent::vllm::translate::Translator;
use worker_agent::vllm::wire::{parse_live, parse_replay, ReplayFrame};

use crate::input::{push_piece, Input};

const BLOCK_SIZE: u32 = 4;

/// The (block, tier) pairs a stream of canonical events leaves.
#[derive(Debug, Default)]
struct Published(BTreeSet<(BlockHash, u8)>);

impl Published {
    fn apply(&mut self, events: &[KvEvent]) {
        for e in events {
            match e {
                KvEvent::Stored { blocks, tier, .. } => {
                    self.0.extend(blocks.iter().map(|b| (*b, *tier as u8)));
                }
                KvEvent::Removed { blocks, tier } => {
                    for b in blocks {
                        self.0.remove(&(*b, *tier as u8));
                    }
                }
                KvEvent::Cleared => self.0.clear(),
            }
        }
    }

    fn take(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Events(events) => self.apply(&events),
                Action::NewEpoch { set, .. } => {
                    self.0.clear();
                    self.apply(&set);
                }
                Action::Replay { .. } | Action::Fatal(_) => {}
            }
        }
    }
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let flags = input.byte();
    let hasher = BlockHasher::new(BLOCK_SIZE, HashSalt::new("m", None, None)).expect("block size");
    let mut core = RankCore::new(
        Translator::new("m", hasher),
        0,
        flags & 1 == 1,
        usize::from(flags >> 4) + 1,
    );
    let mut published = Published::default();
    published.take(core.start());
    let mut next_seq = 0u64;
    let mut fatal = false;
    while !input.is_empty() {
        let op = input.byte();
        let actions = match op % 8 {
            // A live message as three frames, seq and all from the input.
            0 => {
                let frames = [input.piece(), input.piece(), input.piece()];
                match parse_live(&frames) {
                    Ok((_, seq, payload)) => core.on_live(seq, Bytes::copy_from_slice(payload)),
                    Err(_) => Vec::new(),
                }
            }
            // A live batch with the next seq: the common case.
            1..=3 => {
                let seq = next_seq;
                next_seq += 1;
                core.on_live(seq, Bytes::copy_from_slice(input.piece()))
            }
            // A replay reply as frames.
            4 => {
                let n = usize::from(input.byte() % 4) + 1;
                let frames: Vec<&[u8]> = (0..n).map(|_| input.piece()).collect();
                match parse_replay(&frames) {
                    Ok(ReplayFrame::Batch { seq, payload }) => {
                        core.on_replay(seq, Bytes::copy_from_slice(payload))
                    }
                    Ok(ReplayFrame::End) => core.on_replay_end(),
                    Err(_) => Vec::new(),
                }
            }
            5 => {
                let seq = u64::from(input.byte());
                core.on_replay(seq, Bytes::copy_from_slice(input.piece()))
            }
            6 => match input.byte() % 3 {
                0 => core.on_replay_end(),
                1 => core.on_replay_failed(),
                _ => {
                    core.on_reconnected();
                    Vec::new()
                }
            },
            // The engine restarted: its seqs start again.
            _ => {
                next_seq = u64::from(input.byte());
                Vec::new()
            }
        };
        fatal |= actions.iter().any(|a| matches!(a, Action::Fatal(_)));
        published.take(actions);
    }
    if fatal || core.replaying_from().is_some() {
        return;
    }
    let mut reported = Published::default();
    reported.apply(&core.block_set());
    assert_eq!(
        published.0, reported.0,
        "the blocks published differ from the block set a resync would send"
    );
}

fn stored(hashes: std::ops::Range<u64>, parent: Option<u64>, tier: Tier) -> EngineEvent {
    let n = hashes.end - hashes.start;
    EngineEvent::Stored {
        hashes: hashes.collect(),
        parent,
        tokens: (0..n as u32 * BLOCK_SIZE).collect(),
        block_size: BLOCK_SIZE,
        tier,
    }
}

pub fn seeds() -> Vec<Vec<u8>> {
    let batches = [
        vec![stored(100..104, None, Tier::Device)],
        vec![
            stored(104..106, Some(103), Tier::Device),
            EngineEvent::Removed {
                hashes: vec![105],
                tier: Tier::Device,
            },
        ],
        vec![stored(100..102, None, Tier::Host)],
        vec![EngineEvent::AllCleared],
    ];
    let mut seeds = Vec::new();
    for encoding in [Encoding::Array, Encoding::Map] {
        for flavour in [Flavour::Vllm, Flavour::Sglang] {
            let mut live = vec![0u8];
            let mut framed = vec![1u8];
            for (seq, events) in batches.iter().enumerate() {
                let payload = encode_batch(1.5, events, 0, encoding, flavour);
                live.push(1);
                push_piece(&mut live, &payload);
                framed.push(0);
                push_piece(&mut framed, b"kv-events");
                push_piece(&mut framed, &(seq as u64).to_be_bytes());
                push_piece(&mut framed, &payload);
            }
            seeds.push(live);
            seeds.push(framed);
        }
    }
    seeds
}
