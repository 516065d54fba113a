//! Real `nats-server` and `etcd` processes behind RAII guards.
//!
//! Every server gets fresh loopback ports and its own temporary directory
//! (store or data dir plus a `server.log` that captures the server's stdout
//! and stderr). Dropping a guard stops the server gracefully (SIGTERM),
//! waits for it to exit, escalates to SIGKILL after [`STOP_TIMEOUT`], and
//! only then removes the directory; so the ports are free again once the
//! guard is gone, also when a test panics.
//!
//! A server never outlives the test process either, even when no `Drop`
//! runs (a guard kept in a `static`, `process::exit`, an abort, a SIGKILL
//! from a test runner): each server runs under a small `sh` supervisor,
//! in its own process group, whose stdin is a pipe held only by the test
//! process. When that pipe closes, for whatever reason, the supervisor
//! sends the server SIGTERM.
//!
//! Binaries are looked up on `PATH`, then in `/usr/sbin`, `/usr/local/sbin`,
//! `/usr/local/bin` and `/usr/bin`; `SWITCHYARD_NATS_SERVER` and
//! `SWITCHYARD_ETCD` override the lookup with an explicit path.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::fs::{self, File, OpenOptions};
use std::io::{self, BufRead, BufReader, Read, Seek, SeekFrom, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener, TcpStream};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use tempfile::TempDir;

/// How long a fresh (or restarted) `nats-server` may take to accept clients.
pub const NATS_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a fresh (or restarted) `etcd` may take to report itself healthy.
pub const ETCD_READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a server may take to exit after SIGTERM before it gets SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// Fresh ports tried when a server cannot bind the ports it was given
/// (another process took them between the probe and the server's bind).
const START_ATTEMPTS: usize = 5;
pub(crate) const POLL_INTERVAL: Duration = Duration::from_millis(10);
pub(crate) const LOG_FILE: &str = "server.log";
const NATS_PID_FILE: &str = "nats.pid";
const LOG_TAIL_BYTES: u64 = 4096;

/// The supervisor script: `$@` is the server's command line. It runs the
/// server in the background and waits for it; a watcher subshell blocks
/// reading the supervisor's stdin (kept on fd 3, since asynchronous lists
/// get /dev/null as stdin) and sends the server SIGTERM on EOF, which comes
/// when the test process closes its end of the pipe or dies. The
/// supervisor exits with the server's status.
const SUPERVISOR: &str = r#"exec 3<&0 </dev/null
"$@" 1>&2 3<&- &
server=$!
( read -r _ <&3; kill -TERM "$server" 2>/dev/null ) &
watcher=$!
exec 3<&-
wait "$server"
status=$?
kill "$watcher" 2>/dev/null
exit "$status"
"#;

/// A `nats-server` with JetStream (file store) on a free loopback port.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let mut nats = tests::NatsServer::start()?;
/// let url = nats.url(); // nats://127.0.0.1:PORT
/// nats.restart()?; // same port, same store: streams survive
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct NatsServer {
    port: u16,
    name: String,
    /// A server configuration file (`-c`): accounts, users, permissions,
    /// TLS. The command line's listen address, port, name and store win.
    config: Option<PathBuf>,
    server: Server,
}

impl NatsServer {
    /// Starts a server on a fresh port with an empty store and waits until
    /// it accepts clients (it has sent its `INFO` line).
    pub fn start() -> Result<Self> {
        Self::start_inner(None)
    }

    /// [`start`](Self::start) with a server configuration file (`-c`):
    /// its accounts, users, permissions and TLS apply; the listen address,
    /// port, server name and store are the guard's.
    pub fn start_with_config(config: &Path) -> Result<Self> {
        Self::start_inner(Some(config.to_owned()))
    }

    fn start_inner(config: Option<PathBuf>) -> Result<Self> {
        let program = find_program("nats-server", "SWITCHYARD_NATS_SERVER")?;
        let dir = server_dir("switchyard-nats-")?;
        let name = unique_name("nats");
        fs::create_dir(dir.path().join("store")).context("creating the JetStream store dir")?;
        let (port, process) = start_on_fresh_ports("nats-server", || {
            let port = free_port()?;
            Ok((
                port,
                spawn_nats(&program, port, &name, dir.path(), config.as_deref()),
            ))
        })?;
        Ok(Self {
            port,
            name,
            config,
            server: Server::new(process, dir),
        })
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// The client port; it stays the same across [`restart`](Self::restart).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The server name (`-n`), unique per guard; clients see it in
    /// `ServerInfo::server_name`.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The guard's temporary directory (store and log); removed on drop.
    pub fn dir(&self) -> &Path {
        self.server.dir.path()
    }

    /// The JetStream store directory (`-sd`).
    pub fn store_dir(&self) -> PathBuf {
        self.dir().join("store")
    }

    /// The server's stdout and stderr so far (across restarts).
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Whether the server process is running (it has not been stopped and
    /// has not exited on its own).
    pub fn is_running(&mut self) -> bool {
        self.server.is_running()
    }

    /// Stops the server gracefully (SIGTERM, then SIGKILL after
    /// [`STOP_TIMEOUT`]) and waits for it to exit; the port and store are
    /// kept for [`restart`](Self::restart). Does nothing if it is stopped.
    pub fn stop(&mut self) -> Result<()> {
        self.server.stop()
    }

    /// Makes the running server read its configuration file again
    /// (SIGHUP): users and permissions change without a restart.
    pub fn reload(&self) -> Result<()> {
        let pid = fs::read_to_string(self.dir().join(NATS_PID_FILE))
            .context("reading nats-server's pid file")?;
        let status = Command::new("kill")
            .args(["-HUP", pid.trim()])
            .status()
            .context("sending nats-server SIGHUP")?;
        if !status.success() {
            bail!("kill -HUP {} failed: {status}", pid.trim());
        }
        Ok(())
    }

    /// Stops the server (if running) and starts it again on the same port
    /// with the same store directory, waiting until it accepts clients.
    /// Clients reconnect to the same [`url`](Self::url).
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        let program = find_program("nats-server", "SWITCHYARD_NATS_SERVER")?;
        let process = respawn_on_same_ports(|| {
            spawn_nats(
                &program,
                self.port,
                &self.name,
                self.dir(),
                self.config.as_deref(),
            )
        })
        .with_context(|| format!("restarting nats-server on port {}", self.port))?;
        self.server.process = Some(process);
        Ok(())
    }
}

/// A single-member `etcd` on free loopback client and peer ports.
///
/// ```no_run
/// # fn main() -> anyhow::Result<()> {
/// let etcd = tests::EtcdServer::start()?;
/// let endpoint = etcd.endpoint(); // http://127.0.0.1:PORT
/// # Ok(()) }
/// ```
#[derive(Debug)]
pub struct EtcdServer {
    client_port: u16,
    peer_port: u16,
    name: String,
    /// A second, TLS client listener ([`EtcdServer::start_with_tls`]).
    tls: Option<EtcdTls>,
    server: Server,
}

/// An etcd member's TLS client listener: its port and PEM files.
#[derive(Debug, Clone)]
struct EtcdTls {
    port: u16,
    cert: PathBuf,
    key: PathBuf,
    ca: PathBuf,
}

impl EtcdServer {
    /// Starts a member with an empty data dir on fresh ports and waits until
    /// `GET /health` reports `"health":"true"`.
    ///
    /// Besides the usual single-member flags it runs with
    /// `--heartbeat-interval=10 --election-timeout=100`, which makes a fresh
    /// member healthy in ~0.1 s instead of ~0.6 s; leases keep their TTLs
    /// (the minimum TTL is 1.5 election timeouts, here 0.15 s).
    pub fn start() -> Result<Self> {
        let program = find_program("etcd", "SWITCHYARD_ETCD")?;
        let dir = server_dir("switchyard-etcd-")?;
        let name = unique_name("etcd");
        let ((client_port, peer_port), process) = start_on_fresh_ports("etcd", || {
            // A start that failed may have left a half-initialised member.
            let _ = fs::remove_dir_all(dir.path().join("data"));
            let ports = (free_port()?, free_port()?);
            Ok((ports, spawn_etcd(&program, ports, &name, dir.path(), None)))
        })?;
        Ok(Self {
            client_port,
            peer_port,
            name,
            tls: None,
            server: Server::new(process, dir),
        })
    }

    /// [`start`](Self::start), plus a TLS client listener
    /// ([`tls_endpoint`](Self::tls_endpoint)) with `ca`'s server
    /// certificate that requires a client certificate `ca` signed. The
    /// plain listener stays (the guard checks health on it).
    pub fn start_with_tls(ca: &crate::TestCa) -> Result<Self> {
        let program = find_program("etcd", "SWITCHYARD_ETCD")?;
        let dir = server_dir("switchyard-etcd-")?;
        let name = unique_name("etcd");
        let mut tls = EtcdTls {
            port: 0,
            cert: ca.path("server.pem"),
            key: ca.path("server.key"),
            ca: ca.path("ca.pem"),
        };
        let ((client_port, peer_port, tls_port), process) = start_on_fresh_ports("etcd", || {
            let _ = fs::remove_dir_all(dir.path().join("data"));
            let ports = (free_port()?, free_port()?, free_port()?);
            tls.port = ports.2;
            let spawned = spawn_etcd(&program, (ports.0, ports.1), &name, dir.path(), Some(&tls));
            Ok((ports, spawned))
        })?;
        tls.port = tls_port;
        Ok(Self {
            client_port,
            peer_port,
            name,
            tls: Some(tls),
            server: Server::new(process, dir),
        })
    }

    /// `https://127.0.0.1:PORT` of the TLS listener, if it has one.
    pub fn tls_endpoint(&self) -> Option<String> {
        self.tls
            .as_ref()
            .map(|tls| format!("https://127.0.0.1:{}", tls.port))
    }

    /// `http://127.0.0.1:CLIENT_PORT`, for `etcd_client::Client::connect`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }

    /// The client port; it stays the same across [`restart`](Self::restart).
    pub fn client_port(&self) -> u16 {
        self.client_port
    }

    /// The peer port; it stays the same across [`restart`](Self::restart).
    pub fn peer_port(&self) -> u16 {
        self.peer_port
    }

    /// The member name (`--name`), unique per guard.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The guard's temporary directory (data dir and log); removed on drop.
    pub fn dir(&self) -> &Path {
        self.server.dir.path()
    }

    /// The data directory (`--data-dir`).
    pub fn data_dir(&self) -> PathBuf {
        self.dir().join("data")
    }

    /// The server's stdout and stderr so far (across restarts).
    pub fn log(&self) -> String {
        self.server.log()
    }

    /// Whether the server process is running.
    pub fn is_running(&mut self) -> bool {
        self.server.is_running()
    }

    /// Stops the member gracefully and waits for it to exit (its ports are
    /// free afterwards); the ports and data are kept for
    /// [`restart`](Self::restart). Does nothing if it is stopped.
    pub fn stop(&mut self) -> Result<()> {
        self.server.stop()
    }

    /// Stops the member (if running) and starts it again on the same ports
    /// with the same data dir (keys survive; leases are extended by the
    /// restart), waiting until it is healthy.
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        let program = find_program("etcd", "SWITCHYARD_ETCD")?;
        let ports = (self.client_port, self.peer_port);
        let process = respawn_on_same_ports(|| {
            spawn_etcd(&program, ports, &self.name, self.dir(), self.tls.as_ref())
        })
        .with_context(|| format!("restarting etcd on port {}", self.client_port))?;
        self.server.process = Some(process);
        Ok(())
    }
}

/// What both guards hold: the supervised server (while it runs) and its
/// temporary directory, removed only after the server has stopped.
#[derive(Debug)]
struct Server {
    process: Option<Supervised>,
    dir: TempDir,
}

impl Server {
    fn new(process: Supervised, dir: TempDir) -> Self {
        Self {
            process: Some(process),
            dir,
        }
    }

    fn log(&self) -> String {
        fs::read_to_string(self.dir.path().join(LOG_FILE)).unwrap_or_default()
    }

    fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(Supervised::is_running)
    }

    fn stop(&mut self) -> Result<()> {
        match self.process.take() {
            Some(mut process) => process.stop(),
            None => Ok(()),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // Errors cannot be reported from Drop; `stop` escalates to SIGKILL.
        // The directory goes after this, with the fields.
        let _ = self.stop();
    }
}

/// Why a server did not come up.
#[derive(Debug)]
pub(crate) enum StartError {
    /// It could not bind its ports: try again (on other ports).
    PortTaken(anyhow::Error),
    Failed(anyhow::Error),
}

/// Starts a server on fresh ports (chosen by `attempt`, which also spawns
/// it), again on other ports when it could not bind them.
pub(crate) fn start_on_fresh_ports<P, S>(
    what: &str,
    mut attempt: impl FnMut() -> Result<(P, Result<S, StartError>)>,
) -> Result<(P, S)> {
    let mut last_error = None;
    for _ in 0..START_ATTEMPTS {
        match attempt()? {
            (ports, Ok(process)) => return Ok((ports, process)),
            (_, Err(StartError::PortTaken(err))) => last_error = Some(err),
            (_, Err(StartError::Failed(err))) => return Err(err),
        }
    }
    let err = last_error.unwrap_or_else(|| anyhow!("no attempt made"));
    Err(err.context(format!("{what}: ports taken in {START_ATTEMPTS} attempts")))
}

/// After a stop, the ports are normally free at once; something else may
/// still grab one in between, so retry briefly before giving up.
pub(crate) fn respawn_on_same_ports(
    mut spawn: impl FnMut() -> Result<Supervised, StartError>,
) -> Result<Supervised> {
    let mut attempt = 1;
    loop {
        match spawn() {
            Ok(process) => return Ok(process),
            Err(StartError::PortTaken(_)) if attempt < START_ATTEMPTS => {
                thread::sleep(Duration::from_millis(100 * attempt as u64));
                attempt += 1;
            }
            Err(StartError::PortTaken(err) | StartError::Failed(err)) => return Err(err),
        }
    }
}

/// Spawns `nats-server` and waits until it has sent its `INFO` line.
fn spawn_nats(
    program: &Path,
    port: u16,
    name: &str,
    dir: &Path,
    config: Option<&Path>,
) -> Result<Supervised, StartError> {
    let mut args: Vec<OsString> = config
        .map(|c| vec!["-c".into(), c.into()])
        .unwrap_or_default();
    args.extend::<[OsString; 11]>([
        "-P".into(),
        dir.join(NATS_PID_FILE).into(),
        "-a".into(),
        "127.0.0.1".into(),
        "-p".into(),
        port.to_string().into(),
        "-n".into(),
        name.into(),
        "-js".into(),
        "-sd".into(),
        dir.join("store").into(),
    ]);
    let mut process =
        Supervised::spawn(program, &args, &dir.join(LOG_FILE)).map_err(StartError::Failed)?;
    let deadline = Instant::now() + NATS_READY_TIMEOUT;
    let want = format!("\"server_name\":\"{name}\"");
    loop {
        process.check_alive("nats-server")?;
        // Another server could answer on a port ours failed to bind; the
        // name in its INFO line tells them apart.
        if read_info_line(port).is_ok_and(|info| info.contains(&want)) {
            return Ok(process);
        }
        if Instant::now() >= deadline {
            return Err(process.timed_out("nats-server", NATS_READY_TIMEOUT));
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Spawns a single-member `etcd` and waits until it is healthy.
fn spawn_etcd(
    program: &Path,
    (client_port, peer_port): (u16, u16),
    name: &str,
    dir: &Path,
    tls: Option<&EtcdTls>,
) -> Result<Supervised, StartError> {
    let client_url = format!("http://127.0.0.1:{client_port}");
    let peer_url = format!("http://127.0.0.1:{peer_port}");
    let listen = match tls {
        Some(tls) => format!("{client_url},https://127.0.0.1:{}", tls.port),
        None => client_url.clone(),
    };
    let mut args: Vec<OsString> = vec![
        "--name".into(),
        name.into(),
        "--data-dir".into(),
        dir.join("data").into(),
        "--logger=zap".into(),
        "--log-level=warn".into(),
        "--listen-client-urls".into(),
        listen.into(),
        "--advertise-client-urls".into(),
        client_url.into(),
        "--listen-peer-urls".into(),
        peer_url.clone().into(),
        "--initial-advertise-peer-urls".into(),
        peer_url.clone().into(),
        "--initial-cluster".into(),
        format!("{name}={peer_url}").into(),
        "--heartbeat-interval=10".into(),
        "--election-timeout=100".into(),
    ];
    if let Some(tls) = tls {
        args.extend([
            "--cert-file".into(),
            tls.cert.clone().into(),
            "--key-file".into(),
            tls.key.clone().into(),
            "--trusted-ca-file".into(),
            tls.ca.clone().into(),
            "--client-cert-auth".into(),
        ]);
    }
    let mut process =
        Supervised::spawn(program, &args, &dir.join(LOG_FILE)).map_err(StartError::Failed)?;
    let deadline = Instant::now() + ETCD_READY_TIMEOUT;
    let member = format!("\"name\":\"{name}\"");
    loop {
        process.check_alive("etcd")?;
        let healthy = http_request(client_port, "GET", "/health", "")
            .is_ok_and(|body| body.contains("\"health\":\"true\""));
        // Another etcd could answer on a port ours failed to bind; the
        // member list names the member that answered.
        if healthy
            && http_request(client_port, "POST", "/v3/cluster/member/list", "{}")
                .is_ok_and(|body| body.contains(&member))
        {
            return Ok(process);
        }
        if Instant::now() >= deadline {
            return Err(process.timed_out("etcd", ETCD_READY_TIMEOUT));
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// A server process under the `sh` supervisor (see [`SUPERVISOR`]).
#[derive(Debug)]
pub(crate) struct Supervised {
    child: Child,
    /// The write end of the supervisor's stdin; closing it stops the server.
    lifeline: Option<ChildStdin>,
    log: PathBuf,
    /// Where this run's output starts in the (appended-to) log.
    log_start: u64,
}

impl Supervised {
    pub(crate) fn spawn(program: &Path, args: &[OsString], log: &Path) -> Result<Self> {
        let mut log_file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let log_start = log_file.seek(SeekFrom::End(0))?;
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(SUPERVISOR)
            .arg("switchyard-supervisor")
            .arg(program)
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log_file))
            // A service that exits with an error prints the error, not a
            // backtrace of where it was made: the log's tail, which a
            // failing test shows, is the message itself. (Panics keep
            // RUST_BACKTRACE's setting.)
            .env("RUST_LIB_BACKTRACE", "0")
            // Its own process group: a Ctrl-C meant for the test runner
            // does not race the supervisor, and SIGKILL can take the group.
            .process_group(0)
            .spawn()
            .with_context(|| format!("spawning {}", program.display()))?;
        let lifeline = child.stdin.take();
        Ok(Self {
            child,
            lifeline,
            log: log.to_owned(),
            log_start,
        })
    }

    pub(crate) fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGKILL to the whole process group (a crash: no shutdown code runs),
    /// then wait.
    pub(crate) fn kill(&mut self) -> Result<()> {
        let group = format!("-{}", self.child.id());
        let _ = Command::new("kill")
            .args(["-KILL", "--", &group])
            .stderr(Stdio::null())
            .status();
        let _ = self.child.kill();
        self.child.wait()?;
        drop(self.lifeline.take());
        Ok(())
    }

    /// An error if the server has exited; [`StartError::PortTaken`] if it
    /// exited because it could not bind a port.
    pub(crate) fn check_alive(&mut self, what: &str) -> Result<(), StartError> {
        let status = match self.child.try_wait() {
            Ok(None) => return Ok(()),
            Ok(Some(status)) => status,
            Err(err) => return Err(StartError::Failed(anyhow!(err).context("waiting for it"))),
        };
        let log = self.log_tail();
        let err = anyhow!("{what} exited during startup ({status}); its output:\n{log}");
        if log.contains("address already in use") {
            Err(StartError::PortTaken(err))
        } else {
            Err(StartError::Failed(err))
        }
    }

    pub(crate) fn timed_out(mut self, what: &str, timeout: Duration) -> StartError {
        let _ = self.stop();
        StartError::Failed(anyhow!(
            "{what} was not ready within {timeout:?}; its output:\n{}",
            self.log_tail()
        ))
    }

    /// SIGTERM (by closing the lifeline), without waiting for the exit.
    pub(crate) fn terminate(&mut self) {
        drop(self.lifeline.take());
    }

    /// SIGTERM (by closing the lifeline), wait, SIGKILL the process group
    /// after [`STOP_TIMEOUT`], wait.
    pub(crate) fn stop(&mut self) -> Result<()> {
        drop(self.lifeline.take());
        match wait_timeout(&mut self.child, STOP_TIMEOUT)? {
            Some(_) => Ok(()),
            None => {
                let group = format!("-{}", self.child.id());
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &group])
                    .stderr(Stdio::null())
                    .status();
                let _ = self.child.kill();
                self.child.wait()?;
                bail!(
                    "server did not exit within {STOP_TIMEOUT:?} of SIGTERM and was killed; \
                     its output:\n{}",
                    self.log_tail()
                )
            }
        }
    }

    /// The last few KiB this run wrote to the log.
    pub(crate) fn log_tail(&self) -> String {
        let read = || -> io::Result<String> {
            let mut file = File::open(&self.log)?;
            let end = file.seek(SeekFrom::End(0))?;
            let start = self.log_start.max(end.saturating_sub(LOG_TAIL_BYTES));
            file.seek(SeekFrom::Start(start))?;
            let mut bytes = Vec::new();
            file.read_to_end(&mut bytes)?;
            let mut text = String::from_utf8_lossy(&bytes).into_owned();
            if start > self.log_start {
                text.insert_str(0, "[...]\n");
            }
            Ok(text)
        };
        read().unwrap_or_else(|err| format!("(cannot read {}: {err})", self.log.display()))
    }
}

impl Drop for Supervised {
    fn drop(&mut self) {
        if self.lifeline.is_some() {
            let _ = self.stop();
        } else if matches!(self.child.try_wait(), Ok(None)) {
            // Terminated, not exited yet: give it the stop's time.
            if !matches!(wait_timeout(&mut self.child, STOP_TIMEOUT), Ok(Some(_))) {
                let _ = self.kill();
            }
        }
    }
}

fn wait_timeout(child: &mut Child, timeout: Duration) -> io::Result<Option<ExitStatus>> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
        thread::sleep(POLL_INTERVAL);
    }
}

/// Where test ports are drawn from: below Linux's ephemeral range
/// (32768–60999), so that no outgoing connection's source port (and there
/// are many: every service's NATS and etcd clients) takes a port between
/// the draw and the server's bind.
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// How long a claim on a port (below) holds against other test processes;
/// after that the port is drawn again (a run ends well within it).
const PORT_CLAIM_TTL: Duration = Duration::from_secs(30 * 60);

/// A loopback port that was free a moment ago and that no test process has
/// been handed in the last [`PORT_CLAIM_TTL`]: drawn at random from
/// [`TEST_PORTS`] and claimed by creating a file named after it
/// (`create_new` is atomic across processes), so concurrent test binaries
/// never race for the same port.
pub fn free_port() -> Result<u16> {
    static HANDED_OUT: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    static DRAWS: AtomicU64 = AtomicU64::new(0);
    let mut handed_out = HANDED_OUT.lock().unwrap_or_else(PoisonError::into_inner);
    let claims = std::env::temp_dir().join("switchyard-test-ports");
    fs::create_dir_all(&claims).with_context(|| format!("creating {}", claims.display()))?;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let mut x = u64::from(std::process::id()) << 32
        ^ u64::from(nanos)
        ^ DRAWS
            .fetch_add(1, Ordering::Relaxed)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let span = u64::from(TEST_PORTS.end - TEST_PORTS.start);
    for _ in 0..2_000 {
        // splitmix64 step: a different draw every time round.
        x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        let port = TEST_PORTS.start + ((z ^ (z >> 31)) % span) as u16;
        if handed_out.contains(&port) || !claim_port(&claims.join(port.to_string()))? {
            continue;
        }
        if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
            handed_out.push(port);
            return Ok(port);
        }
    }
    bail!("no unused loopback port found in {TEST_PORTS:?}")
}

/// Claims a port through its claim file: a new one, or one older than
/// [`PORT_CLAIM_TTL`] (its run is over), renewed.
fn claim_port(file: &Path) -> Result<bool> {
    match OpenOptions::new().write(true).create_new(true).open(file) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let age = fs::metadata(file)
                .and_then(|m| m.modified())
                .map(|t| t.elapsed().unwrap_or_default());
            match age {
                Ok(age) if age > PORT_CLAIM_TTL => {
                    fs::write(file, b"").with_context(|| format!("renewing {}", file.display()))?;
                    Ok(true)
                }
                _ => Ok(false),
            }
        }
        Err(e) => Err(e).with_context(|| format!("claiming {}", file.display())),
    }
}

pub(crate) fn unique_name(kind: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    format!("switchyard-{kind}-{}-{n}", std::process::id())
}

pub(crate) fn server_dir(prefix: &str) -> Result<TempDir> {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .context("creating a temporary directory")
}

/// `override_var` if set, else the first executable `name` on `PATH` or in
/// the sbin/bin directories Debian packages install servers into.
pub(crate) fn find_program(name: &str, override_var: &str) -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(override_var) {
        return Ok(PathBuf::from(path));
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let fallback = ["/usr/sbin", "/usr/local/sbin", "/usr/local/bin", "/usr/bin"];
    std::env::split_paths(&path)
        .chain(fallback.iter().map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            anyhow!(
                "`{name}` not found on PATH nor in {}; install it (scripts/test does) \
                 or set {override_var}",
                fallback.join(", ")
            )
        })
}

fn loopback(port: u16) -> SocketAddr {
    SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port))
}

/// Connects to a NATS port and returns the first line the server sends.
pub(crate) fn read_info_line(port: u16) -> io::Result<String> {
    let stream = TcpStream::connect_timeout(&loopback(port), Duration::from_millis(200))?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut line = String::new();
    BufReader::new(stream).read_line(&mut line)?;
    if line.starts_with("INFO ") {
        Ok(line)
    } else {
        Err(io::Error::other(format!("unexpected greeting {line:?}")))
    }
}

/// A minimal HTTP/1.0 exchange on a loopback port; returns the body of a
/// 200 response.
pub(crate) fn http_request(port: u16, method: &str, path: &str, body: &str) -> io::Result<String> {
    let mut stream = TcpStream::connect_timeout(&loopback(port), Duration::from_millis(200))?;
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    stream.set_write_timeout(Some(Duration::from_secs(1)))?;
    let mut request = String::new();
    let _ = write!(
        request,
        "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes())?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or_else(|| io::Error::other("malformed HTTP response"))?;
    if head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200") {
        Ok(body.to_owned())
    } else {
        let status = head.lines().next().unwrap_or(head);
        Err(io::Error::other(format!("{status}: {}", body.trim())))
    }
}
