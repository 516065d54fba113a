//! Deterministic mutations of seeds, for the test that runs every target
//! without a fuzzer: bit flips, byte sets, truncations, duplicated and
//! deleted spans, splices of two seeds. Seeded, so a failure reproduces.

/// xorshift64*: small, seeded, good enough to pick mutations.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next_u64() % n as u64) as usize
        }
    }
}

/// One mutant of `seed` (with `other` for splices).
pub fn mutant(rng: &mut Rng, seed: &[u8], other: &[u8]) -> Vec<u8> {
    let mut out = seed.to_vec();
    for _ in 0..=rng.below(4) {
        let len = out.len();
        match rng.below(7) {
            0 if len > 0 => {
                let i = rng.below(len);
                out[i] ^= 1 << rng.below(8);
            }
            1 if len > 0 => {
                const INTERESTING: [u8; 8] = [0x00, 0x01, 0x7f, 0x80, 0xff, 0xc0, 0xdc, 0xdd];
                let i = rng.below(len);
                out[i] = INTERESTING[rng.below(INTERESTING.len())];
            }
            2 => out.truncate(rng.below(len + 1)),
            3 if len > 0 => {
                let from = rng.below(len);
                let to = from + rng.below(len - from + 1);
                let span = out[from..to].to_vec();
                let at = rng.below(len + 1);
                out.splice(at..at, span);
            }
            4 if len > 0 => {
                let from = rng.below(len);
                let to = from + rng.below((len - from).min(16) + 1);
                out.drain(from..to);
            }
            5 => {
                let cut = rng.below(len + 1);
                let from = rng.below(other.len() + 1);
                out.truncate(cut);
                out.extend_from_slice(&other[from..]);
            }
            _ => {
                let at = rng.below(len + 1);
                let b = rng.next_u64() as u8;
                out.insert(at, b);
            }
        }
    }
    out
}
