//! Time to move KV from a prefill worker to a decode worker.
//!
//! `t = setup + bytes / bytes_per_s` (engine-timing.md, "KV transfer P ->
//! D"; `bytes_per_s` is the effective rate `eta x link bandwidth`). Moving
//! the bytes is the driver's business; this only says how long it takes.
//! Named link figures are in [`crate::preset`].

/// A point-to-point KV transfer link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KvTransfer {
    /// Fixed cost of one transfer (handshake, descriptor exchange).
    pub setup_us: u64,
    /// Effective bytes per second.
    pub bytes_per_s: f64,
}

impl Default for KvTransfer {
    /// [`crate::preset::KV_TRANSFER_RDMA_4X200G`], the measured 87 GB/s.
    fn default() -> Self {
        crate::preset::KV_TRANSFER_RDMA_4X200G
    }
}

impl KvTransfer {
    /// Microseconds to move `bytes` (rounded up). A link with no usable
    /// bandwidth (zero, negative or NaN) never finishes: `u64::MAX`.
    pub fn duration_us(&self, bytes: u64) -> u64 {
        if bytes == 0 {
            return self.setup_us;
        }
        if self.bytes_per_s.is_nan() || self.bytes_per_s <= 0.0 {
            return u64::MAX;
        }
        // `as` saturates on overflow.
        let wire = (bytes as f64 * 1e6 / self.bytes_per_s).ceil() as u64;
        self.setup_us.saturating_add(wire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duration_is_setup_plus_bytes_over_rate() {
        let t = KvTransfer {
            setup_us: 100,
            bytes_per_s: 1e9,
        };
        assert_eq!(t.duration_us(0), 100);
        assert_eq!(t.duration_us(1_000_000), 1100);
        assert_eq!(t.duration_us(1), 101, "rounds up");
    }

    #[test]
    fn a_dead_link_never_finishes() {
        for rate in [0.0, -1.0, f64::NAN] {
            let t = KvTransfer {
                setup_us: 0,
                bytes_per_s: rate,
            };
            assert_eq!(t.duration_us(1), u64::MAX);
        }
    }
}
