//! Time to move KV between workers.
//!
//! One transfer alone: `t = setup + bytes / bytes_per_s` (engine-timing.md,
//! "KV transfer P -> D"; `bytes_per_s` is the effective rate `eta x link
//! bandwidth`), [`KvTransfer::duration_us`]. Concurrent transfers share
//! their workers' links: [`SharedLinks`], where each worker has one link of
//! that rate and a transfer between two workers moves at the rate its
//! busier end gives each of its transfers (`rate / transfers at that end`),
//! recomputed whenever a transfer starts or ends. Moving the bytes is the
//! driver's business; this only says when they arrive. Named link figures
//! are in [`crate::preset`].

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

/// One transfer in flight on [`SharedLinks`].
#[derive(Debug, Clone, Copy)]
struct Flow {
    id: u64,
    src: usize,
    dst: usize,
    /// Bytes still to move.
    remaining: f64,
    /// The bytes start moving then (after the setup).
    moving_from_us: u64,
}

/// Every worker's link, shared by the transfers in flight (P -> D KV
/// handoffs, D -> P prefix pulls): a pure model in virtual time. The
/// driver calls [`SharedLinks::start`] when a transfer begins and
/// [`SharedLinks::advance`] at [`SharedLinks::next_event_us`] (or any time
/// before), which returns the transfers done by then.
#[derive(Debug, Clone)]
pub struct SharedLinks {
    link: KvTransfer,
    flows: Vec<Flow>,
    /// Moving transfers per worker.
    active: Vec<u32>,
    now_us: u64,
}

impl SharedLinks {
    /// Links of `link`'s rate for `workers` workers, idle.
    pub fn new(link: KvTransfer, workers: usize) -> Self {
        Self {
            link,
            flows: Vec::new(),
            active: vec![0; workers],
            now_us: 0,
        }
    }

    /// Transfers in flight.
    pub fn in_flight(&self) -> usize {
        self.flows.len()
    }

    fn moving(&self, f: &Flow) -> bool {
        f.moving_from_us <= self.now_us
    }

    /// Bytes per microsecond the flow moves at now.
    fn rate(&self, f: &Flow) -> f64 {
        let share = self.active[f.src].max(self.active[f.dst]).max(1);
        self.link.bytes_per_s.max(0.0) / 1e6 / f64::from(share)
    }

    fn recount(&mut self) {
        self.active.iter_mut().for_each(|a| *a = 0);
        for i in 0..self.flows.len() {
            let f = self.flows[i];
            if self.moving(&f) {
                self.active[f.src] += 1;
                if f.dst != f.src {
                    self.active[f.dst] += 1;
                }
            }
        }
    }

    /// Starts transfer `id` of `bytes` from worker `src` to `dst` at
    /// `now_us` (no earlier than the last call); returns the transfers done
    /// by then, as [`SharedLinks::advance`] does.
    pub fn start(&mut self, now_us: u64, id: u64, src: usize, dst: usize, bytes: u64) -> Vec<u64> {
        let done = self.advance(now_us);
        self.flows.push(Flow {
            id,
            src,
            dst,
            remaining: bytes as f64,
            moving_from_us: now_us.saturating_add(self.link.setup_us),
        });
        self.recount();
        done
    }

    /// Moves every transfer on to `now_us` and returns, in start order,
    /// those whose bytes have all arrived.
    pub fn advance(&mut self, now_us: u64) -> Vec<u64> {
        // Rates change only when a transfer starts moving or ends: step
        // from one such moment to the next.
        let mut done = Vec::new();
        while self.now_us < now_us {
            let next = self
                .next_change_us()
                .unwrap_or(now_us)
                .min(now_us)
                .max(self.now_us + 1);
            let dt = (next - self.now_us) as f64;
            for i in 0..self.flows.len() {
                let f = self.flows[i];
                if self.moving(&f) {
                    let rate = self.rate(&f);
                    self.flows[i].remaining -= rate * dt;
                }
            }
            self.now_us = next;
            self.reap(&mut done);
        }
        self.reap(&mut done);
        done
    }

    fn reap(&mut self, done: &mut Vec<u64>) {
        let now = self.now_us;
        let before = self.flows.len();
        self.flows.retain(|f| {
            let finished = f.moving_from_us <= now && f.remaining <= 0.5;
            if finished {
                done.push(f.id);
            }
            !finished
        });
        if self.flows.len() != before || self.flows.iter().any(|f| f.moving_from_us == now) {
            self.recount();
        }
    }

    /// The next moment a transfer starts moving or finishes at the current
    /// rates.
    fn next_change_us(&self) -> Option<u64> {
        self.flows
            .iter()
            .map(|f| {
                if !self.moving(f) {
                    f.moving_from_us
                } else {
                    let rate = self.rate(f);
                    if rate <= 0.0 {
                        u64::MAX
                    } else {
                        // `as` saturates.
                        self.now_us
                            .saturating_add((f.remaining.max(0.0) / rate).ceil() as u64)
                    }
                }
            })
            .min()
    }

    /// When [`SharedLinks::advance`] should next be called (a transfer
    /// finishes or starts moving), `None` when idle.
    pub fn next_event_us(&self) -> Option<u64> {
        self.next_change_us().map(|t| t.max(self.now_us))
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

    fn links() -> SharedLinks {
        let link = KvTransfer {
            setup_us: 0,
            bytes_per_s: 1e9, // 1000 bytes per us
        };
        SharedLinks::new(link, 4)
    }

    fn run(links: &mut SharedLinks) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        while let Some(t) = links.next_event_us() {
            for id in links.advance(t) {
                out.push((id, t));
            }
        }
        out
    }

    /// Alone, a transfer takes `bytes / rate`; two into the same worker
    /// share its link (each twice as long); two between disjoint pairs do
    /// not slow each other.
    #[test]
    fn concurrent_transfers_share_a_worker_link() {
        let mut l = links();
        assert!(l.start(0, 1, 0, 1, 1_000_000).is_empty());
        assert_eq!(run(&mut l), [(1, 1_000)]);

        let mut l = links();
        let _ = l.start(0, 1, 0, 2, 1_000_000);
        let _ = l.start(0, 2, 1, 2, 1_000_000);
        assert_eq!(run(&mut l), [(1, 2_000), (2, 2_000)]);

        let mut l = links();
        let _ = l.start(0, 1, 0, 1, 1_000_000);
        let _ = l.start(0, 2, 2, 3, 1_000_000);
        assert_eq!(run(&mut l), [(1, 1_000), (2, 1_000)]);
    }

    /// A transfer that starts halfway through another shares the link only
    /// while both move: the first ends at 1.5 ms (half alone, then half at
    /// half rate: 0.5 + 1.0), the second at 2 ms.
    #[test]
    fn a_late_transfer_shares_only_the_overlap() {
        let mut l = links();
        let _ = l.start(0, 1, 0, 1, 1_000_000);
        assert!(l.advance(500).is_empty());
        let _ = l.start(500, 2, 2, 1, 1_000_000);
        assert_eq!(run(&mut l), [(1, 1_500), (2, 2_000)]);
    }

    /// The setup delays the bytes; a dead link never finishes.
    #[test]
    fn setup_delays_and_a_dead_link_never_finishes() {
        let mut l = SharedLinks::new(
            KvTransfer {
                setup_us: 100,
                bytes_per_s: 1e9,
            },
            2,
        );
        let _ = l.start(0, 7, 0, 1, 1_000);
        assert_eq!(run(&mut l), [(7, 101)]);
        let mut dead = SharedLinks::new(
            KvTransfer {
                setup_us: 0,
                bytes_per_s: 0.0,
            },
            2,
        );
        let _ = dead.start(0, 1, 0, 1, 1);
        assert_eq!(dead.next_event_us(), Some(u64::MAX));
    }
}
