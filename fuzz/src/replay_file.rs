//! A replay export (`replay export`'s file), read back: raw bytes, and
//! files of checksummed frames around arbitrary payloads (so that the
//! fuzzer reaches the payloads' decoders past the checksums), then the
//! decisions resolved into records. Nothing may panic; an export that reads
//! writes back to the same bytes.

use replay::file::{raw_frame, Export, MAGIC};

use crate::input::{push_piece, Input};

/// The frame kinds the format knows, and one it does not.
const KINDS: [u8; 9] = [1, 2, 3, 4, 5, 6, 7, 0xff, 9];

fn read(bytes: &[u8]) {
    let Ok(export) = Export::from_bytes(bytes) else {
        return;
    };
    let _ = export.records();
    let written = export.to_bytes();
    let again = Export::from_bytes(&written).expect("a written export reads back");
    assert_eq!(
        again.to_bytes(),
        written,
        "an export changed on a round trip"
    );
}

pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    if input.byte() % 2 == 0 {
        read(input.rest());
        return;
    }
    let mut file = MAGIC.to_vec();
    let mut frames = 0u32;
    while !input.is_empty() {
        let kind = KINDS[usize::from(input.byte()) % KINDS.len()];
        if kind == 0xff {
            break;
        }
        raw_frame(&mut file, kind, input.piece());
        frames += 1;
    }
    raw_frame(&mut file, 0xff, &frames.to_le_bytes());
    read(&file);
}

pub fn seeds() -> Vec<Vec<u8>> {
    use protocol::Message;
    let delta = protocol::IndexDelta {
        seq: 1,
        changes: vec![protocol::IndexChange::WorkerCleared {
            worker: tests::fixtures::worker("d0"),
        }],
        source: None,
    };
    let mut raw = vec![0u8];
    raw.extend(Export::default().to_bytes());
    let mut framed = vec![1u8, 1];
    push_piece(&mut framed, &delta.encode());
    vec![raw, framed]
}
