//! A generation request larger than the NATS server's payload limit, sent
//! as numbered pieces of its encoding ([`RequestFragment`]s) to the same
//! subject with the same reply subject, and put back together by the
//! receiver ([`Reassembly`], pure: time is an argument). So prompts past
//! about 349k tokens (a packed prompt's 3 bytes a token against NATS's
//! default 1 MiB) reach the engine without raising `max_payload`.

use std::collections::HashMap;

use serde::{Deserialize, Serialize};

/// One piece of an encoded message (a `GenerateRequest`'s `encode()`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RequestFragment {
    /// Its place, from 0.
    pub index: u32,
    /// How many pieces the whole has.
    pub count: u32,
    /// The whole's length in bytes.
    pub total_bytes: u64,
    #[serde(with = "raw_bytes")]
    pub bytes: Vec<u8>,
}

/// Bytes as one msgpack byte string.
mod raw_bytes {
    use serde::de::{self, Deserializer, Visitor};
    use serde::Serializer;

    pub fn serialize<S: Serializer>(bytes: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(bytes)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Vec<u8>;

            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a byte string")
            }

            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<Vec<u8>, E> {
                Ok(v.to_vec())
            }
        }
        d.deserialize_bytes(V)
    }
}

/// Bytes a fragment's envelope adds to its piece (version, fields, byte
/// string header), rounded up generously.
pub const FRAGMENT_OVERHEAD: usize = 64;

/// The largest whole sent in fragments (a 16M-token prompt packed at 4
/// bytes a token is 64 MiB).
pub const MAX_FRAGMENTED_BYTES: u64 = 64 << 20;

/// `payload` in pieces of at most `piece` bytes (at least 1).
pub fn split(payload: &[u8], piece: usize) -> Vec<RequestFragment> {
    let piece = piece.max(1);
    let count = payload.len().div_ceil(piece).max(1) as u32;
    payload
        .chunks(piece)
        .enumerate()
        .map(|(index, bytes)| RequestFragment {
            index: index as u32,
            count,
            total_bytes: payload.len() as u64,
            bytes: bytes.to_vec(),
        })
        .collect()
}

/// Why a fragment was refused (its whole is dropped).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FragmentError {
    #[error("fragment {index} of {count}: not a place in the whole")]
    BadIndex { index: u32, count: u32 },
    #[error("a fragmented message of {0} bytes is larger than the most taken, {max} bytes", max = MAX_FRAGMENTED_BYTES)]
    TooLarge(u64),
    #[error("fragment {index} disagrees with the earlier ones on the whole's size or count")]
    Inconsistent { index: u32 },
    #[error("the fragments add up to {got} bytes, not the {want} announced")]
    WrongSize { got: u64, want: u64 },
    #[error("{pending} bytes of fragments are waiting already: no room for {more} more")]
    Full { pending: u64, more: u64 },
}

/// Fragments waiting for the rest of their whole, by key (the reply
/// subject they came with); bounded in bytes, each whole given `max_age_ms`
/// from its first fragment.
#[derive(Debug)]
pub struct Reassembly {
    pending: HashMap<String, Pending>,
    pending_bytes: u64,
    max_pending_bytes: u64,
    max_age_ms: u64,
}

#[derive(Debug)]
struct Pending {
    parts: Vec<Option<Vec<u8>>>,
    received: u32,
    total_bytes: u64,
    bytes: u64,
    started_ms: u64,
}

impl Reassembly {
    pub fn new(max_pending_bytes: u64, max_age_ms: u64) -> Self {
        Self {
            pending: HashMap::new(),
            pending_bytes: 0,
            max_pending_bytes,
            max_age_ms,
        }
    }

    /// Wholes waiting for more fragments.
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }

    /// Takes a fragment that came with `key`: the whole once its last
    /// fragment is in, else `None`. A bad fragment drops its whole. Wholes
    /// older than `max_age_ms` are dropped first (their sender gave up).
    pub fn push(
        &mut self,
        key: &str,
        f: RequestFragment,
        now_ms: u64,
    ) -> Result<Option<Vec<u8>>, FragmentError> {
        self.expire(now_ms);
        let result = self.push_inner(key, f, now_ms);
        if result.is_err() {
            self.drop_key(key);
        }
        result
    }

    fn push_inner(
        &mut self,
        key: &str,
        f: RequestFragment,
        now_ms: u64,
    ) -> Result<Option<Vec<u8>>, FragmentError> {
        if f.count == 0 || f.index >= f.count || f.count as u64 > f.total_bytes.max(1) {
            return Err(FragmentError::BadIndex {
                index: f.index,
                count: f.count,
            });
        }
        if f.total_bytes > MAX_FRAGMENTED_BYTES {
            return Err(FragmentError::TooLarge(f.total_bytes));
        }
        let more = f.bytes.len() as u64;
        if self.pending_bytes + more > self.max_pending_bytes {
            return Err(FragmentError::Full {
                pending: self.pending_bytes,
                more,
            });
        }
        let p = self
            .pending
            .entry(key.to_owned())
            .or_insert_with(|| Pending {
                parts: vec![None; f.count as usize],
                received: 0,
                total_bytes: f.total_bytes,
                bytes: 0,
                started_ms: now_ms,
            });
        if p.parts.len() != f.count as usize || p.total_bytes != f.total_bytes {
            return Err(FragmentError::Inconsistent { index: f.index });
        }
        let slot = &mut p.parts[f.index as usize];
        if slot.is_some() {
            // A duplicate: the first copy stands.
            return Ok(None);
        }
        p.bytes += more;
        p.received += 1;
        self.pending_bytes += more;
        *slot = Some(f.bytes);
        if p.bytes > p.total_bytes {
            return Err(FragmentError::WrongSize {
                got: p.bytes,
                want: p.total_bytes,
            });
        }
        if p.received < f.count {
            return Ok(None);
        }
        let p = self.pending.remove(key).expect("present");
        self.pending_bytes -= p.bytes;
        if p.bytes != p.total_bytes {
            return Err(FragmentError::WrongSize {
                got: p.bytes,
                want: p.total_bytes,
            });
        }
        Ok(Some(p.parts.into_iter().flatten().flatten().collect()))
    }

    fn drop_key(&mut self, key: &str) {
        if let Some(p) = self.pending.remove(key) {
            self.pending_bytes -= p.bytes;
        }
    }

    /// Drops wholes whose first fragment is older than `max_age_ms`;
    /// returns how many.
    pub fn expire(&mut self, now_ms: u64) -> usize {
        let max_age = self.max_age_ms;
        let before = self.pending.len();
        let mut freed = 0;
        self.pending.retain(|_, p| {
            let keep = now_ms.saturating_sub(p.started_ms) <= max_age;
            if !keep {
                freed += p.bytes;
            }
            keep
        });
        self.pending_bytes -= freed;
        before - self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn whole(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    #[test]
    fn pieces_in_any_order_make_the_whole() {
        let payload = whole(10_000);
        let mut parts = split(&payload, 999);
        assert_eq!(parts.len(), 11);
        assert!(parts.iter().all(|p| p.bytes.len() <= 999));
        parts.reverse();
        let mut r = Reassembly::new(1 << 20, 1_000);
        let last = parts.pop().unwrap();
        for p in parts {
            assert_eq!(r.push("inbox.1", p, 0), Ok(None));
        }
        // A duplicate changes nothing.
        let dup = split(&payload, 999).remove(3);
        assert_eq!(r.push("inbox.1", dup, 0), Ok(None));
        assert_eq!(r.push("inbox.1", last, 0), Ok(Some(payload)));
        assert_eq!((r.waiting(), r.pending_bytes), (0, 0));
        // One piece is a whole too.
        assert_eq!(
            r.push("inbox.2", split(&[7, 8], 10).remove(0), 0),
            Ok(Some(vec![7, 8]))
        );
    }

    #[test]
    fn interleaved_wholes_stay_apart() {
        let (a, b) = (whole(300), vec![9u8; 250]);
        let (pa, pb) = (split(&a, 100), split(&b, 100));
        let mut r = Reassembly::new(1 << 20, 1_000);
        let mut got = Vec::new();
        for (x, y) in pa.into_iter().zip(pb) {
            got.extend(r.push("a", x, 0).unwrap());
            got.extend(r.push("b", y, 0).unwrap());
        }
        assert_eq!(got, vec![a, b]);
    }

    #[test]
    fn bad_fragments_drop_their_whole() {
        let mut r = Reassembly::new(1 << 20, 1_000);
        let parts = split(&whole(300), 100);
        r.push("k", parts[0].clone(), 0).unwrap();
        let mut other = parts[1].clone();
        other.count = 4;
        assert_eq!(
            r.push("k", other, 0),
            Err(FragmentError::Inconsistent { index: 1 })
        );
        assert_eq!((r.waiting(), r.pending_bytes), (0, 0));
        let mut bad = parts[2].clone();
        bad.index = 3;
        assert!(matches!(
            r.push("k", bad, 0),
            Err(FragmentError::BadIndex { .. })
        ));
        let mut huge = parts[0].clone();
        huge.total_bytes = MAX_FRAGMENTED_BYTES + 1;
        assert!(matches!(
            r.push("k", huge, 0),
            Err(FragmentError::TooLarge(_))
        ));
        // More bytes than announced.
        let mut long = split(&whole(300), 150);
        long[1].bytes.push(0);
        r.push("k", long[0].clone(), 0).unwrap();
        assert!(matches!(
            r.push("k", long[1].clone(), 0),
            Err(FragmentError::WrongSize { .. })
        ));
        assert_eq!((r.waiting(), r.pending_bytes), (0, 0));
    }

    #[test]
    fn bounded_in_bytes_and_age() {
        let mut r = Reassembly::new(250, 1_000);
        let parts = split(&whole(600), 100);
        r.push("a", parts[0].clone(), 0).unwrap();
        r.push("a", parts[1].clone(), 0).unwrap();
        assert!(matches!(
            r.push("b", parts[2].clone(), 10),
            Err(FragmentError::Full { pending: 200, .. })
        ));
        // Past its age the first whole is dropped, and there is room.
        assert_eq!(r.push("b", parts[2].clone(), 1_001), Ok(None));
        assert_eq!((r.waiting(), r.pending_bytes), (1, 100));
        assert_eq!(r.expire(5_000), 1);
        assert_eq!(r.pending_bytes, 0);
    }
}
