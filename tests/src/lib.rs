//! Integration test support: real `nats-server` and `etcd` processes behind
//! RAII guards ([`servers`]), and Switchyard's own binaries as child
//! processes ([`services`]).

pub mod servers;
pub mod services;

pub use servers::{free_port, EtcdServer, NatsServer};
pub use services::{binary, Service};
