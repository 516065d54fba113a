//! Structured reads from a fuzzer's bytes: every read succeeds (zeros once
//! the bytes run out), so a target never rejects an input for its length.

/// A cursor over the input.
#[derive(Debug, Clone)]
pub struct Input<'a> {
    rest: &'a [u8],
}

impl<'a> Input<'a> {
    pub fn new(data: &'a [u8]) -> Self {
        Self { rest: data }
    }

    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    pub fn byte(&mut self) -> u8 {
        match self.rest.split_first() {
            Some((&b, rest)) => {
                self.rest = rest;
                b
            }
            None => 0,
        }
    }

    pub fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.byte(), self.byte()])
    }

    pub fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        for x in &mut b {
            *x = self.byte();
        }
        u64::from_le_bytes(b)
    }

    /// Up to `n` bytes (fewer at the end).
    pub fn bytes(&mut self, n: usize) -> &'a [u8] {
        let (head, rest) = self.rest.split_at(n.min(self.rest.len()));
        self.rest = rest;
        head
    }

    /// A length-prefixed piece: a u16 length, then up to that many bytes.
    pub fn piece(&mut self) -> &'a [u8] {
        let n = usize::from(self.u16());
        self.bytes(n)
    }

    /// Everything left.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }
}

/// Appends a length-prefixed piece, the inverse of [`Input::piece`] (seeds
/// are built with it).
pub fn push_piece(out: &mut Vec<u8>, piece: &[u8]) {
    let n = u16::try_from(piece.len()).expect("a seed piece fits a u16 length");
    out.extend_from_slice(&n.to_le_bytes());
    out.extend_from_slice(piece);
}
