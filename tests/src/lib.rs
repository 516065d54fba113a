//! Integration test support: real `nats-server` and `etcd` processes behind
//! RAII guards ([`servers`]) and their clusters (a JetStream cluster and
//! an etcd cluster, [`clusters`]), Switchyard's own binaries as child processes
//! ([`services`]), deterministic prompts ([`tokens`]), the protocol
//! fixtures and KV-stream tap the crates' tests share ([`fixtures`]), and
//! the runner of data-driven scenarios ([`datadriven`]), and a throwaway
//! certificate authority for TLS tests ([`tls`]), and the tokenizer the
//! project ships ([`tokenizer`]), and `promtool check metrics` on a
//! service's `/metrics` ([`promtool`]).

pub mod clusters;
pub mod datadriven;
pub mod fixtures;
pub mod promtool;
pub mod servers;
pub mod services;
pub mod tls;
pub mod tokenizer;

pub use clusters::{EtcdCluster, NatsCluster};
pub use servers::{free_port, EtcdServer, NatsServer};
pub use services::{binary, Service};
pub use tls::TestCa;

/// `n` deterministic pseudo-random token ids (xorshift from `seed`, in a
/// 150k vocabulary): the same seed gives the same prompt.
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 150_000) as u32
        })
        .collect()
}
