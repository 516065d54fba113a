//! Clustered servers on loopback: a JetStream cluster of `nats-server`s
//! ([`NatsCluster`], routes on free ports) and an `etcd` cluster
//! ([`EtcdCluster`]), each node supervised like the single servers of
//! [`crate::servers`] (so none outlives the test). A node can be killed
//! (SIGKILL, a crash) and restarted on the same ports with the same store
//! or data dir, while the others serve.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::thread;
use std::time::Instant;

use anyhow::{anyhow, Context as _, Result};
use tempfile::TempDir;

use crate::servers::{
    find_program, free_port, http_request, read_info_line, respawn_on_same_ports, server_dir,
    start_on_fresh_ports, unique_name, StartError, Supervised, ETCD_READY_TIMEOUT, LOG_FILE,
    NATS_READY_TIMEOUT, POLL_INTERVAL,
};

/// One node's ports and name.
#[derive(Debug, Clone)]
struct NatsNode {
    name: String,
    port: u16,
    cluster_port: u16,
    monitor_port: u16,
}

/// `n` nats-servers with JetStream forming one cluster (`-cluster`,
/// `-routes` to every node), each with its own store, log and monitoring
/// port. Streams created with 3 replicas survive one node's death.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let mut nats = tests::NatsCluster::start(3)?;
/// let urls = nats.urls(); // nats://127.0.0.1:A,nats://127.0.0.1:B,...
/// nats.kill(0)?; // kill -9
/// nats.restart(0)?; // same ports, same store
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct NatsCluster {
    cluster_name: String,
    nodes: Vec<NatsNode>,
    config: Option<PathBuf>,
    /// Dropped (stopped) before the directory.
    processes: Vec<Option<Supervised>>,
    dir: TempDir,
}

impl NatsCluster {
    /// Starts `n` nodes on fresh ports and waits until every node accepts
    /// clients and the cluster has elected its JetStream meta leader.
    pub fn start(n: usize) -> Result<Self> {
        Self::start_inner(n, None)
    }

    /// [`start`](Self::start) with a server configuration file (`-c`) on
    /// every node (accounts, users, permissions).
    pub fn start_with_config(n: usize, config: &Path) -> Result<Self> {
        Self::start_inner(n, Some(config.to_owned()))
    }

    fn start_inner(n: usize, config: Option<PathBuf>) -> Result<Self> {
        let program = find_program("nats-server", "SWITCHYARD_NATS_SERVER")?;
        let dir = server_dir("switchyard-nats-cluster-")?;
        let cluster_name = unique_name("natsc");
        let (nodes, processes) = start_on_fresh_ports("nats cluster", || {
            let nodes = (0..n)
                .map(|i| {
                    Ok(NatsNode {
                        name: format!("{cluster_name}-n{i}"),
                        port: free_port()?,
                        cluster_port: free_port()?,
                        monitor_port: free_port()?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let mut processes = Vec::new();
            for (i, _) in nodes.iter().enumerate() {
                let node_dir = dir.path().join(format!("n{i}"));
                fs::create_dir_all(node_dir.join("store"))?;
                match spawn_nats_node(
                    &program,
                    &cluster_name,
                    &nodes,
                    i,
                    &node_dir,
                    config.as_deref(),
                ) {
                    Ok(process) => processes.push(Some(process)),
                    Err(e) => return Ok((nodes, Err(e))),
                }
            }
            for i in 0..nodes.len() {
                let process = processes[i].as_mut().expect("just started");
                if let Err(e) = wait_nats_node(process, &nodes[i], true) {
                    return Ok((nodes, Err(e)));
                }
            }
            Ok((nodes, Ok(processes)))
        })?;
        Ok(Self {
            cluster_name,
            nodes,
            config,
            processes,
            dir,
        })
    }

    /// Every node's client URL, comma separated: what services are given.
    pub fn urls(&self) -> String {
        (0..self.nodes.len())
            .map(|i| self.url(i))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// Node `i`'s client URL.
    pub fn url(&self, i: usize) -> String {
        format!("nats://127.0.0.1:{}", self.nodes[i].port)
    }

    /// Node `i`'s server name (unique per node).
    pub fn name(&self, i: usize) -> &str {
        &self.nodes[i].name
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Node `i`'s output so far (across restarts).
    pub fn log(&self, i: usize) -> String {
        fs::read_to_string(self.node_dir(i).join(LOG_FILE)).unwrap_or_default()
    }

    fn node_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("n{i}"))
    }

    /// Makes every running node read its configuration file again
    /// (SIGHUP): users and permissions change without a restart.
    pub fn reload(&self) -> Result<()> {
        for i in 0..self.nodes.len() {
            if self.processes[i].is_none() {
                continue;
            }
            let pid = fs::read_to_string(self.node_dir(i).join("nats.pid"))
                .with_context(|| format!("reading nats node {i}'s pid file"))?;
            let status = std::process::Command::new("kill")
                .args(["-HUP", pid.trim()])
                .status()
                .context("sending nats-server SIGHUP")?;
            anyhow::ensure!(
                status.success(),
                "kill -HUP {} failed: {status}",
                pid.trim()
            );
        }
        Ok(())
    }

    /// Kills node `i` (SIGKILL: no shutdown code runs); its ports and store
    /// are kept for [`restart`](Self::restart).
    pub fn kill(&mut self, i: usize) -> Result<()> {
        match self.processes[i].take() {
            Some(mut process) => process.kill(),
            None => Ok(()),
        }
    }

    /// Starts node `i` again (after [`kill`](Self::kill), or stops it
    /// first) on its ports with its store, and waits until it accepts
    /// clients and JetStream reports it healthy.
    pub fn restart(&mut self, i: usize) -> Result<()> {
        self.restart_waiting(i, true)
    }

    /// [`restart`](Self::restart), waiting only until the node accepts
    /// clients: its JetStream may still be catching up
    /// ([`jetstream_healthy`](Self::jetstream_healthy) says when it is).
    pub fn restart_accepting(&mut self, i: usize) -> Result<()> {
        self.restart_waiting(i, false)
    }

    /// Whether node `i`'s JetStream reports itself healthy now (its
    /// `/healthz`: caught up with its streams' and consumers' leaders).
    pub fn jetstream_healthy(&self, i: usize) -> bool {
        http_request(self.nodes[i].monitor_port, "GET", "/healthz", "")
            .is_ok_and(|body| body.contains("ok"))
    }

    fn restart_waiting(&mut self, i: usize, jetstream: bool) -> Result<()> {
        if let Some(mut process) = self.processes[i].take() {
            process.stop()?;
        }
        let program = find_program("nats-server", "SWITCHYARD_NATS_SERVER")?;
        let node_dir = self.node_dir(i);
        let process = respawn_on_same_ports(|| {
            let mut process = spawn_nats_node(
                &program,
                &self.cluster_name,
                &self.nodes,
                i,
                &node_dir,
                self.config.as_deref(),
            )?;
            wait_nats_node(&mut process, &self.nodes[i], jetstream)?;
            Ok(process)
        })
        .with_context(|| format!("restarting nats node {i}"))?;
        self.processes[i] = Some(process);
        Ok(())
    }
}

fn spawn_nats_node(
    program: &Path,
    cluster_name: &str,
    nodes: &[NatsNode],
    i: usize,
    dir: &Path,
    config: Option<&Path>,
) -> Result<Supervised, StartError> {
    let node = &nodes[i];
    let routes = nodes
        .iter()
        .enumerate()
        .filter(|(j, _)| *j != i)
        .map(|(_, n)| format!("nats://127.0.0.1:{}", n.cluster_port))
        .collect::<Vec<_>>()
        .join(",");
    let mut args: Vec<OsString> = config
        .map(|c| vec!["-c".into(), c.into()])
        .unwrap_or_default();
    args.extend::<Vec<OsString>>(vec![
        "-P".into(),
        dir.join("nats.pid").into(),
        "-a".into(),
        "127.0.0.1".into(),
        "-p".into(),
        node.port.to_string().into(),
        "-m".into(),
        node.monitor_port.to_string().into(),
        "-n".into(),
        node.name.clone().into(),
        "-js".into(),
        "-sd".into(),
        dir.join("store").into(),
        "--cluster_name".into(),
        cluster_name.into(),
        "-cluster".into(),
        format!("nats://127.0.0.1:{}", node.cluster_port).into(),
        "-routes".into(),
        routes.into(),
    ]);
    Supervised::spawn(program, &args, &dir.join(LOG_FILE)).map_err(StartError::Failed)
}

/// Waits until the node accepts clients as itself and (with `jetstream`)
/// its JetStream knows the meta leader and reports healthy.
fn wait_nats_node(
    process: &mut Supervised,
    node: &NatsNode,
    jetstream: bool,
) -> Result<(), StartError> {
    let deadline = Instant::now() + NATS_READY_TIMEOUT;
    let want = format!("\"server_name\":\"{}\"", node.name);
    loop {
        process.check_alive("nats-server")?;
        let up = read_info_line(node.port).is_ok_and(|info| info.contains(&want));
        let ready = up
            && (!jetstream
                || (http_request(node.monitor_port, "GET", "/jsz", "")
                    .is_ok_and(|body| body.contains("\"leader\":"))
                    && http_request(node.monitor_port, "GET", "/healthz", "")
                        .is_ok_and(|body| body.contains("ok"))));
        if ready {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StartError::Failed(anyhow!(
                "nats node {} was not ready within {NATS_READY_TIMEOUT:?}; its output:\n{}",
                node.name,
                process.log_tail()
            )));
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// One member's name and ports.
#[derive(Debug, Clone)]
struct EtcdMember {
    name: String,
    client_port: u16,
    peer_port: u16,
}

/// `n` etcd members forming one cluster, each with its own data dir and
/// log. With `--heartbeat-interval=50 --election-timeout=500` a leader
/// is re-elected within about half a second of the leader's death, and
/// the minimum lease TTL is 0.75 s (so a 1 s lease stays 1 s).
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let mut etcd = tests::EtcdCluster::start(3)?;
/// let endpoints = etcd.endpoints(); // every member's client URL
/// etcd.kill(1)?;
/// etcd.restart(1)?;
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EtcdCluster {
    token: String,
    members: Vec<EtcdMember>,
    processes: Vec<Option<Supervised>>,
    dir: TempDir,
}

impl EtcdCluster {
    /// Starts `n` members on fresh ports and waits until every member
    /// reports itself healthy (the cluster has a leader).
    pub fn start(n: usize) -> Result<Self> {
        let program = find_program("etcd", "SWITCHYARD_ETCD")?;
        let dir = server_dir("switchyard-etcd-cluster-")?;
        let token = unique_name("etcdc");
        let (members, processes) = start_on_fresh_ports("etcd cluster", || {
            let members = (0..n)
                .map(|i| {
                    Ok(EtcdMember {
                        name: format!("{token}-m{i}"),
                        client_port: free_port()?,
                        peer_port: free_port()?,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            let mut processes = Vec::new();
            for i in 0..members.len() {
                let member_dir = dir.path().join(format!("m{i}"));
                let _ = fs::remove_dir_all(member_dir.join("data"));
                fs::create_dir_all(&member_dir)?;
                match spawn_etcd_member(&program, &token, &members, i, &member_dir) {
                    Ok(process) => processes.push(Some(process)),
                    Err(e) => return Ok((members, Err(e))),
                }
            }
            for i in 0..members.len() {
                let process = processes[i].as_mut().expect("just started");
                if let Err(e) = wait_etcd_member(process, &members[i]) {
                    return Ok((members, Err(e)));
                }
            }
            Ok((members, Ok(processes)))
        })?;
        Ok(Self {
            token,
            members,
            processes,
            dir,
        })
    }

    /// Every member's client URL: what services are given.
    pub fn endpoints(&self) -> Vec<String> {
        (0..self.members.len()).map(|i| self.endpoint(i)).collect()
    }

    /// Member `i`'s client URL.
    pub fn endpoint(&self, i: usize) -> String {
        format!("http://127.0.0.1:{}", self.members[i].client_port)
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Member `i`'s output so far.
    pub fn log(&self, i: usize) -> String {
        fs::read_to_string(self.member_dir(i).join(LOG_FILE)).unwrap_or_default()
    }

    fn member_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("m{i}"))
    }

    /// Kills member `i` (SIGKILL); its ports and data are kept.
    pub fn kill(&mut self, i: usize) -> Result<()> {
        match self.processes[i].take() {
            Some(mut process) => process.kill(),
            None => Ok(()),
        }
    }

    /// Starts member `i` again on its ports with its data, and waits until
    /// it is healthy (it rejoined the cluster).
    pub fn restart(&mut self, i: usize) -> Result<()> {
        if let Some(mut process) = self.processes[i].take() {
            process.stop()?;
        }
        let program = find_program("etcd", "SWITCHYARD_ETCD")?;
        let member_dir = self.member_dir(i);
        let process = respawn_on_same_ports(|| {
            let mut process =
                spawn_etcd_member(&program, &self.token, &self.members, i, &member_dir)?;
            wait_etcd_member(&mut process, &self.members[i])?;
            Ok(process)
        })
        .with_context(|| format!("restarting etcd member {i}"))?;
        self.processes[i] = Some(process);
        Ok(())
    }
}

fn spawn_etcd_member(
    program: &Path,
    token: &str,
    members: &[EtcdMember],
    i: usize,
    dir: &Path,
) -> Result<Supervised, StartError> {
    let member = &members[i];
    let client_url = format!("http://127.0.0.1:{}", member.client_port);
    let peer_url = format!("http://127.0.0.1:{}", member.peer_port);
    let initial_cluster = members
        .iter()
        .map(|m| format!("{}=http://127.0.0.1:{}", m.name, m.peer_port))
        .collect::<Vec<_>>()
        .join(",");
    let args: Vec<OsString> = vec![
        "--name".into(),
        member.name.clone().into(),
        "--data-dir".into(),
        dir.join("data").into(),
        "--logger=zap".into(),
        "--log-level=warn".into(),
        "--listen-client-urls".into(),
        client_url.clone().into(),
        "--advertise-client-urls".into(),
        client_url.into(),
        "--listen-peer-urls".into(),
        peer_url.clone().into(),
        "--initial-advertise-peer-urls".into(),
        peer_url.into(),
        "--initial-cluster".into(),
        initial_cluster.into(),
        "--initial-cluster-token".into(),
        token.into(),
        "--initial-cluster-state".into(),
        "new".into(),
        "--heartbeat-interval=50".into(),
        "--election-timeout=500".into(),
    ];
    Supervised::spawn(program, &args, &dir.join(LOG_FILE)).map_err(StartError::Failed)
}

fn wait_etcd_member(process: &mut Supervised, member: &EtcdMember) -> Result<(), StartError> {
    let deadline = Instant::now() + ETCD_READY_TIMEOUT;
    let name = format!("\"name\":\"{}\"", member.name);
    loop {
        process.check_alive("etcd")?;
        let healthy = http_request(member.client_port, "GET", "/health", "")
            .is_ok_and(|body| body.contains("\"health\":\"true\""));
        if healthy
            && http_request(member.client_port, "POST", "/v3/cluster/member/list", "{}")
                .is_ok_and(|body| body.contains(&name))
        {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StartError::Failed(anyhow!(
                "etcd member {} was not healthy within {ETCD_READY_TIMEOUT:?}; its output:\n{}",
                member.name,
                process.log_tail()
            )));
        }
        thread::sleep(POLL_INTERVAL);
    }
}
