//! Shared by several test binaries; each uses a part of it.
#![allow(dead_code)]

//! A whole Switchyard deployment as processes on loopback: nats-server,
//! etcd, the kv-indexer, router replicas and worker agents, each with the
//! built-in simulated engine or in front of a `mock-vllm` engine (the
//! adapter a real vLLM gets: ZMQ KV events with engine-private hashes,
//! OpenAI HTTP, kv_transfer_params). Every process stops when the test
//! ends.

use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use futures::StreamExt;
use kv_indexer::{KvIndexer, OwnershipIndex};
use protocol::{KvEventBatch, Message};
use serde_json::{json, Value};
use tests::{free_port, EtcdCluster, EtcdServer, NatsCluster, NatsServer, Service};

mod backends;
mod load;
pub use backends::{Etcd, Nats};
#[allow(unused_imports)]
pub use load::{Load, LoadOutcome};

/// The engines' model and preset, and the block size: routers, agents and
/// engines agree on all three.
pub const MODEL: &str = "Llama-3.3-70B-Instruct-FP8";
pub const PRESET: &str = "llama70b_fp8_tp2_h100";
pub const BLOCK_SIZE: u32 = 16;
/// The LoRA adapter every mock-vllm engine serves beside the model.
pub const LORA: &str = "sql-adapter";
/// Every mock-vllm engine's context length (above the 400k tokens of the
/// longest prompt tested, which goes in fragments past NATS's 1 MiB).
pub const MAX_MODEL_LEN: u32 = 450_000;
const STARTUP: Duration = Duration::from_secs(30);

pub struct Node {
    pub service: Service,
    pub port: u16,
}

impl Node {
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// How a worker's engine publishes its KV events (mock-vllm).
#[derive(Debug, Clone, Copy)]
pub struct Wire {
    pub encoding: &'static str,
    pub hash_flavour: &'static str,
    pub replay_topic_frame: bool,
}

/// The engine behind a worker's agent.
#[derive(Debug, Clone, Copy)]
pub enum Engine {
    /// The agent's built-in simulated engine.
    Simulated,
    /// A `mock-vllm` process behind `worker-agent --engine vllm`.
    MockVllm(Wire),
    /// A `mock-vllm` acting as an SGLang decode-mode server (SGLang 0.5's
    /// events; no kv_transfer_params; a local prefill only with
    /// `do_local_prefill`) behind `worker-agent --engine sglang`, with
    /// `--sglang-do-local-prefill` when `do_local_prefill`.
    SglangDecode { do_local_prefill: bool },
}

/// One worker: its agent and, with mock-vllm, its engine process.
pub struct Worker {
    pub name: String,
    pub agent: Node,
    pub engine: Option<Node>,
    /// The engine id its prefills put in `kv_transfer_params` (mock-vllm).
    pub engine_id: String,
}

/// The bus with its permissions on (`bus::permissions`, the shipped
/// model): every service logs in as its role, the test's own clients as
/// an unrestricted test user.
pub struct Permissions {
    /// The server's configuration file, rewritten when a worker joins.
    config: std::path::PathBuf,
    agents: Vec<protocol::WorkerId>,
    /// JetStream's file store per server (`max_file_store`), when bounded.
    max_file_store: Option<&'static str>,
    _dir: tempfile::TempDir,
}

/// JetStream's file store per node of the secured HA cluster (the chaos
/// suite fills it; the indexer fits the streams' caps to it).
pub const HA_STORE_PER_NODE: &str = "96MB";

/// Every user's password in the tests.
pub const PASSWORD: &str = "e2e-password";
/// The unrestricted user of the test's own clients (not in the shipped
/// configuration).
pub const TEST_USER: &str = "e2e-test";

impl Permissions {
    fn new() -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let mut permissions = Self {
            config: dir.path().join("nats.conf"),
            agents: Vec::new(),
            max_file_store: None,
            _dir: dir,
        };
        permissions.write()?;
        Ok(permissions)
    }

    fn write(&mut self) -> Result<()> {
        let config = bus::permissions::nats_server_config(
            &self.agents,
            bus::permissions::Passwords::Literal(PASSWORD),
        );
        let test_user =
            format!("  users = [\n    {{ user: {TEST_USER:?}, password: {PASSWORD:?} }}\n");
        let mut config = config.replacen("  users = [\n", &test_user, 1);
        if let Some(size) = self.max_file_store {
            config.push_str(&format!("jetstream {{\n  max_file_store: {size}\n}}\n"));
        }
        std::fs::write(&self.config, config)?;
        Ok(())
    }
}

/// Whether clusters run with the bus's permissions on: always for
/// [`Cluster::start_secured`], for every cluster with
/// `SWITCHYARD_E2E_PERMISSIONS=1` (the whole e2e suite against the
/// permissioned server).
pub fn permissions_everywhere() -> bool {
    std::env::var("SWITCHYARD_E2E_PERMISSIONS").is_ok_and(|v| v == "1")
}

/// Dropped in field order: workers, routers and the indexer first, NATS
/// and etcd last (services stop quickly while their servers are up).
pub struct Cluster {
    pub workers: Vec<Worker>,
    pub routers: Vec<Node>,
    /// The indexer that leads (after a failover: the one that took over).
    pub indexer: Node,
    /// A standby indexer ([`Cluster::start_ha`]).
    pub standby: Option<Node>,
    pub http: reqwest::Client,
    pub etcd: Etcd,
    pub nats: Nats,
    pub permissions: Option<Permissions>,
    /// Flags every router and every agent gets besides the harness's own
    /// ([`Cluster::start_with_flags`]).
    pub extra: ExtraFlags,
}

/// Flags added to every router's, agent's and mock-vllm engine's command
/// line.
#[derive(Debug, Clone, Default)]
pub struct ExtraFlags {
    pub router: Vec<String>,
    pub agent: Vec<String>,
    pub engine: Vec<String>,
}

impl Cluster {
    /// `prefill` and `decode` name workers with simulated engines;
    /// `routers` replicas.
    pub async fn start(prefill: &[&str], decode: &[&str], routers: usize) -> Result<Self> {
        let workers: Vec<(&str, &str, Engine)> = prefill
            .iter()
            .map(|n| (*n, "prefill", Engine::Simulated))
            .chain(decode.iter().map(|n| (*n, "decode", Engine::Simulated)))
            .collect();
        Self::start_with(&workers, routers).await
    }

    /// Workers as (name, role, engine); `routers` replicas.
    pub async fn start_with(workers: &[(&str, &str, Engine)], routers: usize) -> Result<Self> {
        Self::start_with_permissions(
            workers,
            routers,
            permissions_everywhere(),
            ExtraFlags::default(),
            false,
        )
        .await
    }

    /// [`Cluster::start_with`], every router and agent given `extra`'s
    /// flags too.
    pub async fn start_with_flags(
        workers: &[(&str, &str, Engine)],
        routers: usize,
        extra: ExtraFlags,
    ) -> Result<Self> {
        Self::start_with_permissions(workers, routers, permissions_everywhere(), extra, false).await
    }

    /// High availability: a 3-node JetStream cluster (streams with 3
    /// replicas), a 3-member etcd cluster, and a standby indexer beside
    /// the leader; every service is given every node's address.
    pub async fn start_ha(prefill: &[&str], decode: &[&str], routers: usize) -> Result<Self> {
        let workers: Vec<(&str, &str, Engine)> = prefill
            .iter()
            .map(|n| (*n, "prefill", Engine::Simulated))
            .chain(decode.iter().map(|n| (*n, "decode", Engine::Simulated)))
            .collect();
        Self::start_with_permissions(
            &workers,
            routers,
            permissions_everywhere(),
            ExtraFlags::default(),
            true,
        )
        .await
    }

    /// [`Cluster::start_ha`] with the bus's permissions on.
    pub async fn start_ha_secured(
        prefill: &[&str],
        decode: &[&str],
        routers: usize,
    ) -> Result<Self> {
        let workers: Vec<(&str, &str, Engine)> = prefill
            .iter()
            .map(|n| (*n, "prefill", Engine::Simulated))
            .chain(decode.iter().map(|n| (*n, "decode", Engine::Simulated)))
            .collect();
        Self::start_with_permissions(&workers, routers, true, ExtraFlags::default(), true).await
    }

    /// [`Cluster::start`] with the bus's permissions on.
    pub async fn start_secured(prefill: &[&str], decode: &[&str], routers: usize) -> Result<Self> {
        let workers: Vec<(&str, &str, Engine)> = prefill
            .iter()
            .map(|n| (*n, "prefill", Engine::Simulated))
            .chain(decode.iter().map(|n| (*n, "decode", Engine::Simulated)))
            .collect();
        Self::start_with_permissions(&workers, routers, true, ExtraFlags::default(), false).await
    }

    async fn start_with_permissions(
        workers: &[(&str, &str, Engine)],
        routers: usize,
        secured: bool,
        extra: ExtraFlags,
        ha: bool,
    ) -> Result<Self> {
        let mut permissions = secured.then(Permissions::new).transpose()?;
        if let Some(permissions) = &mut permissions {
            // A bounded store, so that the chaos suite can fill it.
            permissions.max_file_store = ha.then_some(HA_STORE_PER_NODE);
            for (name, _, _) in workers {
                permissions.agents.push(name.parse()?);
            }
            permissions.write()?;
        }
        let (nats, etcd) = if ha {
            let nats = match &permissions {
                Some(p) => NatsCluster::start_with_config(3, &p.config)?,
                None => NatsCluster::start(3)?,
            };
            (Nats::Cluster(nats), Etcd::Cluster(EtcdCluster::start(3)?))
        } else {
            let nats = match &permissions {
                Some(p) => NatsServer::start_with_config(&p.config)?,
                None => NatsServer::start()?,
            };
            (Nats::Single(nats), Etcd::Single(EtcdServer::start()?))
        };
        let indexer = Self::spawn_indexer(&nats, &etcd, permissions.is_some(), "kv-indexer")?;
        let standby = if ha {
            // The first is the leader once it is ready.
            let port = indexer.port;
            wait_http(port, "/readyz").await?;
            Some(Self::spawn_indexer(
                &nats,
                &etcd,
                permissions.is_some(),
                "kv-indexer-standby",
            )?)
        } else {
            None
        };
        let mut cluster = Self {
            nats,
            etcd,
            indexer,
            standby,
            routers: Vec::new(),
            workers: Vec::new(),
            http: reqwest::Client::new(),
            permissions,
            extra,
        };
        for (name, role, engine) in workers {
            cluster.start_worker(name, role, *engine)?;
        }
        for i in 0..routers {
            cluster.start_router(&format!("r{i}"))?;
        }
        // A start that fails shows every service's log, not only the one
        // that was waited for.
        if let Err(e) = cluster.wait_ready().await {
            return Err(e.context(cluster.logs()));
        }
        Ok(cluster)
    }

    /// `--nats-url`, and with the permissions on the login of `user`.
    fn nats_args(nats: &Nats, secured: bool, user: &str) -> Vec<String> {
        let mut args = vec![format!("--nats-url={}", nats.url())];
        if secured {
            args.extend([
                format!("--nats-user={user}"),
                format!("--nats-password={PASSWORD}"),
            ]);
        }
        args
    }

    /// The flags that log a service or tool in as `user` (none with the
    /// permissions off).
    pub fn nats_login(&self, user: &str) -> Vec<String> {
        Self::nats_args(&self.nats, self.permissions.is_some(), user).split_off(1)
    }

    /// Waits until the server (reloading its configuration) lets `user`
    /// log in. `start_worker` is not async: the check runs on a thread of
    /// its own with its own runtime.
    fn wait_for_user(&self, user: &str) -> Result<()> {
        let (url, user) = (self.nats.urls()[0].clone(), user.to_owned());
        let check = std::thread::spawn(move || -> Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                let attempt = runtime.block_on(
                    async_nats::ConnectOptions::new()
                        .user_and_password(user.clone(), PASSWORD.into())
                        .connect(url.as_str()),
                );
                match attempt {
                    Ok(_) => return Ok(()),
                    Err(e) if Instant::now() >= deadline => {
                        bail!("{user} cannot log in after the reload: {e}")
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(20)),
                }
            }
        });
        check
            .join()
            .map_err(|_| anyhow!("the login check panicked"))?
    }

    /// A client of the test's own (unrestricted).
    pub async fn nats_client(&self) -> Result<async_nats::Client> {
        let options = match self.permissions {
            Some(_) => async_nats::ConnectOptions::new()
                .user_and_password(TEST_USER.into(), PASSWORD.into()),
            None => async_nats::ConnectOptions::new(),
        };
        Ok(options.connect(self.nats.urls()).await?)
    }

    fn spawn_indexer(nats: &Nats, etcd: &Etcd, secured: bool, name: &str) -> Result<Node> {
        let port = free_port()?;
        let mut args = Self::nats_args(nats, secured, bus::permissions::INDEXER_USER);
        args.extend([
            format!("--stream-replicas={}", nats.replicas()),
            "--leader-ttl=1s".into(),
            format!("--etcd-endpoints={}", etcd.endpoint()),
            format!("--http-addr=127.0.0.1:{port}"),
            "--snapshot-interval=1s".into(),
            "--worker-grace=3s".into(),
        ]);
        let mut service = Service::start("kv-indexer", name, &args)?;
        service.wait_http_ok(port, "/healthz", STARTUP)?;
        Ok(Node { service, port })
    }

    pub fn start_worker(&mut self, name: &str, role: &str, engine: Engine) -> Result<()> {
        let engine_id = format!("engine-{name}");
        let worker: protocol::WorkerId = name.parse()?;
        if let Some(permissions) = &mut self.permissions {
            if !permissions.agents.contains(&worker) {
                permissions.agents.push(worker.clone());
                permissions.write()?;
                self.nats.reload()?;
                self.wait_for_user(&bus::permissions::agent_user(&worker))?;
            }
        }
        let mut agent_args = Self::nats_args(
            &self.nats,
            self.permissions.is_some(),
            &bus::permissions::agent_user(&worker),
        );
        agent_args.extend([
            format!("--stream-replicas={}", self.nats.replicas()),
            format!("--etcd-endpoints={}", self.etcd.endpoint()),
            format!("--worker-name={name}"),
            format!("--role={role}"),
            format!("--model={MODEL}"),
            format!("--preset={PRESET}"),
            format!("--block-size={BLOCK_SIZE}"),
            "--lease-ttl=2s".into(),
            // Bounded teardown of a test that leaves streams open.
            "--drain-timeout=5s".into(),
        ]);
        let engine_node = match engine {
            Engine::Simulated => {
                agent_args.push("--speedup=20".into());
                None
            }
            Engine::MockVllm(_) | Engine::SglangDecode { .. } => {
                let (wire, engine_flag, mut mock_extra, mut agent_extra) = match engine {
                    Engine::MockVllm(wire) => (wire, "vllm", vec![], vec![]),
                    Engine::SglangDecode { do_local_prefill } => (
                        Wire {
                            encoding: "tagged",
                            hash_flavour: "sglang",
                            replay_topic_frame: true,
                        },
                        "sglang",
                        vec!["--sglang-decode=true".to_owned()],
                        if do_local_prefill {
                            vec!["--sglang-do-local-prefill=true".to_owned()]
                        } else {
                            vec![]
                        },
                    ),
                    Engine::Simulated => unreachable!(),
                };
                let (http, events, replay) = (free_port()?, free_port()?, free_port()?);
                let mut service = Service::start(
                    "mock-vllm",
                    &format!("{name}-engine"),
                    &[
                        format!("--port={http}"),
                        "--host=127.0.0.1".into(),
                        format!("--model={MODEL}"),
                        format!("--preset={PRESET}"),
                        format!("--role={role}"),
                        format!("--block-size={BLOCK_SIZE}"),
                        format!("--kv-events-endpoint=tcp://*:{events}"),
                        format!("--kv-replay-endpoint=tcp://*:{replay}"),
                        format!("--encoding={}", wire.encoding),
                        format!("--hash-flavour={}", wire.hash_flavour),
                        format!("--replay-topic-frame={}", wire.replay_topic_frame),
                        format!("--engine-id={engine_id}"),
                        format!("--lora-modules={LORA}"),
                        format!("--max-model-len={MAX_MODEL_LEN}"),
                        "--speedup=20".into(),
                    ]
                    .into_iter()
                    .chain(mock_extra.drain(..))
                    .chain(self.extra.engine.iter().cloned())
                    .collect::<Vec<_>>(),
                )?;
                service.wait_http_ok(http, "/health", STARTUP)?;
                agent_args.append(&mut agent_extra);
                agent_args.extend([
                    format!("--engine={engine_flag}"),
                    format!("--engine-url=http://127.0.0.1:{http}"),
                    format!("--kv-events-endpoint=tcp://127.0.0.1:{events}"),
                    format!("--kv-replay-endpoint=tcp://127.0.0.1:{replay}"),
                    "--engine-timeout=20s".into(),
                ]);
                Some(Node {
                    service,
                    port: http,
                })
            }
        };
        let port = free_port()?;
        agent_args.push(format!("--http-addr=127.0.0.1:{port}"));
        agent_args.extend(self.extra.agent.iter().cloned());
        let mut service = Service::start("worker-agent", name, &agent_args)?;
        service.wait_http_ok(port, "/healthz", STARTUP)?;
        self.workers.push(Worker {
            name: name.to_owned(),
            agent: Node { service, port },
            engine: engine_node,
            engine_id,
        });
        Ok(())
    }

    pub fn worker(&self, name: &str) -> Result<&Worker> {
        self.workers
            .iter()
            .find(|w| w.name == name)
            .with_context(|| format!("no worker {name}"))
    }

    /// A mock-vllm engine's `/switchyard/debug`: what it was sent.
    pub async fn engine_debug(&self, name: &str) -> Result<Value> {
        let engine = self
            .worker(name)?
            .engine
            .as_ref()
            .with_context(|| format!("{name} has no mock-vllm engine"))?;
        self.get_json(format!("{}/switchyard/debug", engine.url()))
            .await
    }

    pub fn start_router(&mut self, replica: &str) -> Result<usize> {
        self.start_router_with::<&str>(replica, &[])
    }

    /// A router replica with `extra` flags (`--tokenizer=...`, a policy:
    /// `isl` unless one is given).
    pub fn start_router_with<S: AsRef<str>>(
        &mut self,
        replica: &str,
        extra: &[S],
    ) -> Result<usize> {
        let port = free_port()?;
        let mut args = Self::nats_args(
            &self.nats,
            self.permissions.is_some(),
            bus::permissions::ROUTER_USER,
        );
        args.extend([
            format!("--stream-replicas={}", self.nats.replicas()),
            format!("--etcd-endpoints={}", self.etcd.endpoint()),
            format!("--http-addr=127.0.0.1:{port}"),
            format!("--replica-id={replica}"),
            format!("--model={MODEL}"),
            format!("--block-size={BLOCK_SIZE}"),
        ]);
        if !extra.iter().any(|a| a.as_ref().starts_with("--policy")) {
            args.push("--policy=isl".into());
        }
        args.extend(self.extra.router.iter().cloned());
        args.extend(extra.iter().map(|a| a.as_ref().to_owned()));
        let service = Service::start("router", replica, &args)?;
        self.routers.push(Node { service, port });
        Ok(self.routers.len() - 1)
    }

    /// Every router ready and knowing every agent.
    pub async fn wait_ready(&mut self) -> Result<()> {
        for i in 0..self.routers.len() {
            let port = self.routers[i].port;
            self.routers[i]
                .service
                .wait_http_ok(port, "/readyz", STARTUP)?;
        }
        self.wait_routers_know_workers().await
    }

    /// Every router knowing every agent (after a start or a restart).
    pub async fn wait_routers_know_workers(&self) -> Result<()> {
        let agents = self.workers.len();
        for i in 0..self.routers.len() {
            self.eventually(
                &format!("router {i} to know {agents} workers"),
                || async move {
                    let state = self.router_state(i).await?;
                    Ok(state["workers"].as_array().map_or(0, Vec::len) == agents)
                },
            )
            .await?;
        }
        Ok(())
    }

    /// Polls `check` until it holds, for up to 30 s; the error names what
    /// was awaited.
    pub async fn eventually<F, Fut>(&self, what: &str, mut check: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool>>,
    {
        self.eventually_some(what, || {
            let check = check();
            async move { Ok(check.await?.then_some(())) }
        })
        .await
    }

    /// Polls `check` until it gives a value, for up to 30 s.
    pub async fn eventually_some<T, F, Fut>(&self, what: &str, mut check: F) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<Option<T>>>,
    {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut last = None;
        loop {
            match check().await {
                Ok(Some(value)) => return Ok(value),
                Ok(None) => {}
                Err(e) => last = Some(e),
            }
            if Instant::now() > deadline {
                bail!("timed out waiting for {what} (last error: {last:?})");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn get_json(&self, url: String) -> Result<Value> {
        let response = self
            .http
            .get(&url)
            .send()
            .await
            .with_context(|| format!("GET {url}"))?;
        let status = response.status();
        let body: Value = response
            .json()
            .await
            .with_context(|| format!("GET {url}: body"))?;
        if !status.is_success() {
            bail!("GET {url}: HTTP {status}: {body}");
        }
        Ok(body)
    }

    /// A router's `/debug/ledger`: workers, ledger, applied delta, digest.
    pub async fn router_state(&self, router: usize) -> Result<Value> {
        self.get_json(format!("{}/debug/ledger", self.routers[router].url()))
            .await
    }

    /// The leading indexer's `/status`: the indexer's, or the standby's
    /// once it leads (the indexer stopped by itself).
    pub async fn indexer_status(&self) -> Result<Value> {
        let status = self
            .get_json(format!("{}/status", self.indexer.url()))
            .await;
        match (&status, &self.standby) {
            (Ok(s), _) if s["role"] == "leader" || s.get("role").is_none() => status,
            (_, Some(standby)) => {
                let other = self.get_json(format!("{}/status", standby.url())).await?;
                if other["role"] == "leader" {
                    Ok(other)
                } else {
                    status
                }
            }
            (_, None) => status,
        }
    }

    /// Restarts every service that stopped by itself (what a supervisor
    /// does) and, if the standby indexer leads now, makes it `indexer`.
    /// Returns the names of those restarted, each with its last words.
    pub async fn heal(&mut self) -> Result<Vec<String>> {
        let mut restarted = Vec::new();
        let nodes = std::iter::once(&mut self.indexer)
            .chain(self.standby.as_mut())
            .chain(self.routers.iter_mut())
            .chain(self.workers.iter_mut().map(|w| &mut w.agent));
        for node in nodes {
            if !node.service.is_running() {
                let why = last_words(&node.service.log());
                restarted.push(format!("{} ({why})", node.service.name()));
                node.service.restart()?;
                let port = node.port;
                node.service.wait_http_ok(port, "/healthz", STARTUP)?;
            }
        }
        if let Some(standby) = &self.standby {
            let status = self.get_json(format!("{}/status", standby.url())).await?;
            if status["role"] == "leader" {
                let standby = self.standby.as_mut().expect("checked");
                std::mem::swap(&mut self.indexer, standby);
            }
        }
        Ok(restarted)
    }

    /// Starts a long streamed completion that bypasses to `decode` (a short
    /// prompt; 20,000 tokens would take ~18 s), leaves after three chunks,
    /// and checks that the worker dropped the request: its load reports
    /// show nothing running within 5 s, and its agent counted the cancel.
    pub async fn leave_mid_stream(&self, decode: &str) -> Result<()> {
        let nats = self.nats_client().await?;
        let id: protocol::WorkerId = decode.parse()?;
        let mut reports = nats.subscribe(protocol::subjects::load(&id)).await?;
        let response = self
            .http
            .post(format!("{}/v1/completions", self.routers[0].url()))
            .json(&json!({
                "model": MODEL,
                "prompt": tokens(90, 64),
                "max_tokens": 20_000,
                "stream": true,
            }))
            .send()
            .await?;
        ensure!(response.status().is_success(), "{}", response.status());
        let mut body = response.bytes_stream();
        for _ in 0..3 {
            body.next().await.context("the stream ended")??;
        }
        // Reports until the worker shows the request running, then until
        // it shows nothing running.
        until_running(&mut reports, true)
            .await
            .with_context(|| format!("{decode} never ran the request"))?;
        drop(body);
        until_running(&mut reports, false)
            .await
            .with_context(|| format!("{decode} kept generating for a client that left"))?;
        let metrics = self
            .http
            .get(format!("{}/metrics", self.worker(decode)?.agent.url()))
            .send()
            .await?
            .text()
            .await?;
        ensure!(
            metrics.contains(r#"worker_agent_cancels_total{outcome="cancelled"} 1"#),
            "{metrics}"
        );
        Ok(())
    }

    /// A non-streamed completion; the response JSON (with `switchyard`).
    /// A completion with `body` (the model added) and extra headers.
    pub async fn complete_with(
        &self,
        router: usize,
        request_id: &str,
        mut body: Value,
        headers: &[(&str, &str)],
    ) -> Result<Value> {
        body["model"] = json!(MODEL);
        let mut request = self
            .http
            .post(format!("{}/v1/completions", self.routers[router].url()))
            .header("x-request-id", request_id);
        for (k, v) in headers {
            request = request.header(*k, *v);
        }
        let response = request.json(&body).send().await?;
        let status = response.status();
        let body: Value = response.json().await?;
        if !status.is_success() {
            bail!("completion {request_id}: HTTP {status}: {body}");
        }
        Ok(body)
    }

    pub async fn complete(
        &self,
        router: usize,
        request_id: &str,
        prompt: &[u32],
        max_tokens: u32,
    ) -> Result<Value> {
        let response = self
            .http
            .post(format!("{}/v1/completions", self.routers[router].url()))
            .header("x-request-id", request_id)
            .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}))
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await?;
        if !status.is_success() {
            bail!("completion {request_id}: HTTP {status}: {body}");
        }
        Ok(body)
    }

    /// `/v1/route` (no dispatch): the decision's `switchyard` object.
    pub async fn route(&self, router: usize, prompt: &[u32]) -> Result<Value> {
        let response = self
            .http
            .post(format!("{}/v1/route", self.routers[router].url()))
            .json(&json!({"model": MODEL, "prompt": prompt, "max_tokens": 16}))
            .send()
            .await?;
        let status = response.status();
        let body: Value = response.json().await?;
        if !status.is_success() {
            bail!("route: HTTP {status}: {body}");
        }
        Ok(body["switchyard"].clone())
    }

    /// Waits until every router has applied the indexer's last delta (the
    /// last it made, which it announces at once, whether or not the
    /// stream holds it yet), and returns the common digest; fails if they
    /// differ.
    pub async fn converged_digest(&self) -> Result<String> {
        self.eventually_some(
            "routers to reach the indexer's delta and digest",
            || async {
                let status = self.indexer_status().await?;
                self.routers_at(&status).await
            },
        )
        .await
    }

    /// Waits until the index has every agent's KV batches (the leading
    /// indexer's cursor of each worker at or past the last batch its agent
    /// formed, read first, from its `/metrics`) and the routers have
    /// reached the indexer's delta and digest ([`Self::converged_digest`]'s
    /// check): the index follows the engines again, not only the indexer.
    pub async fn converged_with_agents(&self) -> Result<String> {
        self.eventually_some(
            "the indexer to hold every agent's last KV batch and the routers to reach it",
            || async {
                let formed = self.agents_last_batch().await?;
                let status = self.indexer_status().await?;
                for (worker, epoch, seq) in &formed {
                    let cursor = &status["worker_cursors"][worker.as_str()];
                    if cursor["epoch"].as_u64() != Some(*epoch)
                        || cursor["last_seq"].as_u64() < Some(*seq)
                    {
                        return Ok(None);
                    }
                }
                self.routers_at(&status).await
            },
        )
        .await
    }

    /// The indexer's digest when every router holds the index at the
    /// indexer's delta (`status`, its `/status`).
    async fn routers_at(&self, status: &Value) -> Result<Option<String>> {
        let seq = status["delta_seq"].as_u64().unwrap_or(0);
        let expected = status["digest"].as_str().unwrap_or_default().to_owned();
        for i in 0..self.routers.len() {
            let state = self.router_state(i).await?;
            if state["applied_delta"].as_u64() != Some(seq)
                || state["index_digest"].as_str() != Some(&expected)
            {
                return Ok(None);
            }
        }
        Ok(Some(expected))
    }

    /// Every agent's last KV batch formed: (worker, epoch, seq), from its
    /// `worker_agent_kv_epoch` and `worker_agent_kv_batch_seq`.
    async fn agents_last_batch(&self) -> Result<Vec<(String, u64, u64)>> {
        let mut formed = Vec::new();
        for worker in &self.workers {
            let url = format!("{}/metrics", worker.agent.url());
            let text = self
                .http
                .get(&url)
                .send()
                .await
                .with_context(|| format!("GET {url}"))?
                .text()
                .await?;
            let gauge = |name: &str| {
                text.lines()
                    .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
                    .and_then(|v| v.trim().parse::<f64>().ok())
                    .map(|v| v as u64)
            };
            let epoch = gauge("worker_agent_kv_epoch")
                .with_context(|| format!("{}: no worker_agent_kv_epoch", worker.name))?;
            formed.push((
                worker.name.clone(),
                epoch,
                gauge("worker_agent_kv_batch_seq").unwrap_or(0),
            ));
        }
        Ok(formed)
    }

    /// Whether the routers' converged index comes to equal one built from
    /// the KV-event log, within 15 s: agents may still be publishing (an
    /// eviction, a late batch) when a fault's load ends, and the indexer
    /// applies what the log holds a moment after it is there. A read that
    /// fails (a stream without a leader for a moment, after a fault) is
    /// tried again within the same 15 s; the last error is returned when
    /// none succeeded by then.
    pub async fn index_matches_log(&self) -> Result<bool> {
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            let compared = async {
                anyhow::Ok(self.converged_digest().await? == self.digest_from_event_log().await?)
            }
            .await;
            match compared {
                Ok(true) => return Ok(true),
                Ok(false) if Instant::now() > deadline => {
                    self.print_divergence().await;
                    return Ok(false);
                }
                Err(e) if Instant::now() > deadline => return Err(e),
                Ok(false) | Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// Where the indexer and a rebuild from the KV log differ, per worker,
    /// on stderr: what a digest mismatch needs to be explained.
    async fn print_divergence(&self) {
        let report = async {
            let status = self.indexer_status().await?;
            let rebuild = self.rebuild_from_event_log().await?;
            let held: std::collections::BTreeMap<String, u64> = rebuild
                .indexer
                .index()
                .workers()
                .map(|(w, blocks)| (w.to_string(), blocks))
                .collect();
            let cursors: Vec<String> = rebuild
                .indexer
                .cursors()
                .map(|c| {
                    format!(
                        "{} epoch {} seq {}{}",
                        c.worker,
                        c.epoch,
                        c.last_seq,
                        if c.resync_pending { " (awaiting resync)" } else { "" }
                    )
                })
                .collect();
            anyhow::Ok(format!(
                "the indexer: digest {} at delta {}, KV stream seq {}, blocks per worker {}, frozen {}\n\
                 the KV log ({} messages) rebuilt: digest {:016x}, blocks per worker {held:?}, cursors {cursors:?}, \
                 removed as unregistered {:?}",
                status["digest"],
                status["delta_seq"],
                status["kv_stream_seq"],
                status["worker_blocks"],
                status["frozen_workers"],
                rebuild.last_seq,
                rebuild.indexer.index().digest(),
                rebuild.removed
            ))
        }
        .await;
        match report {
            Ok(text) => eprintln!("index differs from the KV log:\n{text}"),
            Err(e) => eprintln!("index differs from the KV log (no details: {e:#})"),
        }
    }

    /// The digest of an index built here, independently, from every batch
    /// on the KV-event stream: what the indexer must hold.
    pub async fn digest_from_event_log(&self) -> Result<String> {
        let rebuild = self.rebuild_from_event_log().await?;
        Ok(format!("{:016x}", rebuild.indexer.index().digest()))
    }

    /// An index built here, independently, from every batch on the
    /// KV-event stream, without the workers no longer registered.
    async fn rebuild_from_event_log(&self) -> Result<LogRebuild> {
        let client = self.nats_client().await?;
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(protocol::subjects::KV_EVENTS_STREAM).await?;
        let last = stream.clone().info().await?.state.last_sequence;
        let consumer = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig::default())
            .await?;
        let mut messages = consumer.messages().await?;
        let mut indexer = KvIndexer::new(OwnershipIndex::new());
        let mut seen = 0;
        while seen < last {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .context("reading the KV event log")?
                .ok_or_else(|| anyhow!("the KV event log ended early"))??;
            seen = message.info().map_err(|e| anyhow!("{e}"))?.stream_sequence;
            if let Ok(batch) = KvEventBatch::decode(&message.payload) {
                indexer.apply(batch);
            }
        }
        // Workers whose leases expired left the indexer's index too.
        let registry = bus::Registry::connect(&self.etcd.endpoints()).await?;
        let (registered, _) = registry.workers().await?;
        let alive: Vec<_> = registered
            .into_iter()
            .filter_map(|c| match c {
                bus::WorkerChange::Up(r) => Some(r.id),
                _ => None,
            })
            .collect();
        let gone: Vec<_> = indexer
            .index()
            .workers()
            .map(|(w, _)| w.clone())
            .filter(|w| !alive.contains(w))
            .collect();
        for worker in &gone {
            indexer.remove_worker(worker);
        }
        Ok(LogRebuild {
            indexer,
            last_seq: last,
            removed: gone,
        })
    }

    /// Every router's base URL.
    pub fn router_urls(&self) -> Vec<String> {
        self.routers.iter().map(Node::url).collect()
    }

    /// Kills the leading indexer (SIGKILL) with a standby running, waits
    /// until the standby leads (its `/readyz` answers 200), and restarts
    /// the killed one, which becomes the standby. Returns the seconds from
    /// the kill to the standby's readiness.
    pub async fn fail_over_indexer(&mut self) -> Result<f64> {
        let mut standby = self.standby.take().context("no standby indexer")?;
        self.indexer.service.kill()?;
        let killed = Instant::now();
        let deadline = killed + Duration::from_secs(30);
        let url = format!("{}/readyz", standby.url());
        loop {
            let ready = self
                .http
                .get(&url)
                .timeout(Duration::from_millis(500))
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ready {
                break;
            }
            if !standby.service.is_running() {
                bail!(
                    "the standby indexer exited; its output:\n{}",
                    standby.service.log()
                );
            }
            if Instant::now() > deadline {
                bail!(
                    "the standby indexer did not take over within 30 s; its output:\n{}",
                    standby.service.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let took = killed.elapsed().as_secs_f64();
        std::mem::swap(&mut self.indexer, &mut standby);
        standby.service.restart()?;
        let port = standby.port;
        standby.service.wait_http_ok(port, "/healthz", STARTUP)?;
        self.standby = Some(standby);
        Ok(took)
    }

    /// Every process's output, for a failing test's message.
    pub fn logs(&self) -> String {
        let mut out = format!("--- kv-indexer\n{}\n", self.indexer.service.log());
        if let Some(standby) = &self.standby {
            out.push_str(&format!(
                "--- standby kv-indexer\n{}\n",
                standby.service.log()
            ));
        }
        let workers = self
            .workers
            .iter()
            .flat_map(|w| std::iter::once(&w.agent).chain(w.engine.as_ref()));
        for node in self.routers.iter().chain(workers) {
            out.push_str(&format!(
                "--- {}\n{}\n",
                node.service.name(),
                node.service.log()
            ));
        }
        out
    }
}

/// Waits (30 s at most) until `GET 127.0.0.1:port path` answers 200.
pub async fn wait_http(port: u16, path: &str) -> Result<()> {
    let url = format!("http://127.0.0.1:{port}{path}");
    let client = reqwest::Client::new();
    let deadline = Instant::now() + STARTUP;
    loop {
        if client
            .get(&url)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{url} did not answer 200 within {STARTUP:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A prompt of `n` deterministic tokens from `seed`.
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut out = Vec::with_capacity(n);
    protocol::trace::extend_block_tokens(seed, n, &mut out);
    out
}

/// The generated token ids of a completion.
pub fn output(response: &Value) -> Vec<u32> {
    response["choices"][0]["token_ids"]
        .as_array()
        .map(|ids| {
            ids.iter()
                .filter_map(Value::as_u64)
                .map(|t| t as u32)
                .collect()
        })
        .unwrap_or_default()
}

/// Turn 0 of a conversation: long and cold, so it goes remote (ISL rule,
/// 2048 tokens); later turns append a few hundred tokens to the previous
/// prompt and answer, so they bypass to the decode worker holding them.
pub const COLD_PROMPT: usize = 4_000;
pub const APPEND: usize = 300;
pub const ANSWER: u32 = 40;

pub fn path(response: &Value) -> &str {
    response["switchyard"]["path"].as_str().unwrap_or("?")
}

pub fn decode(response: &Value) -> &str {
    response["switchyard"]["decode"].as_str().unwrap_or("?")
}

/// Sends turns 0..turns of conversation `seed` to `router`; returns each
/// turn's response.
pub async fn conversation(
    cluster: &Cluster,
    router: usize,
    seed: u64,
    turns: usize,
) -> Result<Vec<Value>> {
    let mut prompt = tokens(seed, COLD_PROMPT);
    let mut previous_prompt = 0;
    let mut responses = Vec::new();
    for turn in 0..turns {
        if turn > 0 {
            // The router must see the previous turn's blocks on its decode
            // worker (at least its whole prompt) before this turn can be
            // routed to it.
            let held = previous_prompt as u64 / 16 * 16;
            cluster
                .eventually("the previous turn's blocks to reach the router", || {
                    let prompt = &prompt;
                    async move {
                        let d = cluster.route(router, prompt).await?;
                        Ok(d["decode_overlap_tokens"].as_u64().unwrap_or(0) >= held)
                    }
                })
                .await?;
        }
        let response = cluster
            .complete(router, &format!("conv{seed}-turn{turn}"), &prompt, ANSWER)
            .await?;
        previous_prompt = prompt.len();
        prompt.extend(output(&response));
        prompt.extend(tokens(seed * 1000 + turn as u64, APPEND));
        responses.push(response);
    }
    Ok(responses)
}

/// Waits (5 s at most) for a load report whose `running > 0` is `running`.
async fn until_running(reports: &mut async_nats::Subscriber, running: bool) -> Result<()> {
    tokio::time::timeout(Duration::from_secs(5), async {
        while let Some(message) = reports.next().await {
            let report = protocol::LoadReport::decode(&message.payload)?;
            if (report.running > 0) == running {
                return Ok(());
            }
        }
        bail!("load reports ended")
    })
    .await?
}

/// An index rebuilt from the raw KV log ([`Cluster::index_matches_log`]).
struct LogRebuild {
    indexer: KvIndexer,
    /// The log's last stream sequence read.
    last_seq: u64,
    /// Workers dropped for not being registered any more.
    removed: Vec<protocol::WorkerId>,
}

/// A stopped service's last words: its error report with its causes, else
/// its last error line (else its last line), without colours.
fn last_words(log: &str) -> String {
    let plain = |line: &str| {
        let mut out = String::new();
        let mut chars = line.chars();
        while let Some(c) = chars.next() {
            if c == '\u{1b}' {
                // An ANSI escape: up to its final letter.
                for c in chars.by_ref() {
                    if c.is_ascii_alphabetic() {
                        break;
                    }
                }
            } else {
                out.push(c);
            }
        }
        out
    };
    let lines: Vec<String> = log
        .lines()
        .map(plain)
        .filter(|l| !l.trim().is_empty())
        .collect();
    // anyhow's report: "Error: …", then "Caused by:" and the causes.
    if let Some(at) = lines.iter().rposition(|l| l.starts_with("Error")) {
        let report: Vec<&str> = lines[at..]
            .iter()
            .map(|l| l.trim())
            .filter(|l| *l != "Caused by:")
            .collect();
        return report.join(" / ").chars().take(600).collect();
    }
    let line = lines
        .iter()
        .rev()
        .find(|l| l.contains("ERROR"))
        .or(lines.last())
        .map_or("no output", String::as_str);
    line.chars().take(300).collect()
}
