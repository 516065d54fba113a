//! The servers under a test deployment: one nats-server and one etcd, or
//! (high availability) a 3-node JetStream cluster and a 3-member etcd
//! cluster. The deployment reads addresses and logs through these enums.

use anyhow::Result;
use tests::{EtcdCluster, EtcdServer, NatsCluster, NatsServer};

/// The NATS side.
pub enum Nats {
    Single(NatsServer),
    Cluster(NatsCluster),
}

impl Nats {
    /// What services' `--nats-url` is given: the server's URL, or every
    /// node's, comma separated.
    pub fn url(&self) -> String {
        match self {
            Nats::Single(server) => server.url(),
            Nats::Cluster(cluster) => cluster.urls(),
        }
    }

    /// The URLs one by one (for the test's own clients).
    pub fn urls(&self) -> Vec<String> {
        self.url().split(',').map(str::to_owned).collect()
    }

    /// The streams' replicas the deployment asks for (3 on a cluster).
    pub fn replicas(&self) -> usize {
        match self {
            Nats::Single(_) => 1,
            Nats::Cluster(cluster) => cluster.len().min(3),
        }
    }

    /// Every server's output so far.
    pub fn log(&self) -> String {
        match self {
            Nats::Single(server) => server.log(),
            Nats::Cluster(cluster) => (0..cluster.len())
                .map(|i| format!("--- nats node {i}\n{}", cluster.log(i)))
                .collect(),
        }
    }

    /// Makes the servers read their configuration file again.
    pub fn reload(&self) -> Result<()> {
        match self {
            Nats::Single(server) => server.reload(),
            Nats::Cluster(cluster) => cluster.reload(),
        }
    }

    /// The cluster, for faults on one node.
    pub fn cluster(&mut self) -> Option<&mut NatsCluster> {
        match self {
            Nats::Single(_) => None,
            Nats::Cluster(cluster) => Some(cluster),
        }
    }

    /// The single server, for faults on it.
    pub fn single(&mut self) -> Option<&mut NatsServer> {
        match self {
            Nats::Single(server) => Some(server),
            Nats::Cluster(_) => None,
        }
    }
}

/// The etcd side.
pub enum Etcd {
    Single(EtcdServer),
    Cluster(EtcdCluster),
}

impl Etcd {
    pub fn endpoints(&self) -> Vec<String> {
        match self {
            Etcd::Single(server) => vec![server.endpoint()],
            Etcd::Cluster(cluster) => cluster.endpoints(),
        }
    }

    /// What services' `--etcd-endpoints` is given.
    pub fn endpoint(&self) -> String {
        self.endpoints().join(",")
    }

    /// The cluster, for faults on one member.
    pub fn cluster(&mut self) -> Option<&mut EtcdCluster> {
        match self {
            Etcd::Single(_) => None,
            Etcd::Cluster(cluster) => Some(cluster),
        }
    }

    /// The single server, for faults on it.
    pub fn single(&mut self) -> Option<&mut EtcdServer> {
        match self {
            Etcd::Single(server) => Some(server),
            Etcd::Cluster(_) => None,
        }
    }
}
