//! Integration test support: real `nats-server` and `etcd` processes behind
//! RAII guards (see [`servers`]).

pub mod servers;

pub use servers::{EtcdServer, NatsServer};
