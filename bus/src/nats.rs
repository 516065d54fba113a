use std::time::Duration;

use async_nats::jetstream::{self, consumer, object_store, stream};
use async_nats::{Client, ConnectOptions};
use futures::stream::BoxStream;
use futures::StreamExt;
use protocol::{subjects, DecodeError, IndexDelta, IndexSnapshot, KvEventBatch, LogEntry, Message};
use tokio::io::AsyncReadExt;

use crate::auth::{read, redact_url, split_user_info, AuthError, NatsAuth, NatsLogin, Secret};

/// How long [`Bus::connect`] keeps trying a server that is not up yet.
pub const CONNECT_PATIENCE: Duration = Duration::from_secs(30);

/// Retention of the streams. The default caps no stream's bytes: that is
/// what any service creates when a stream is missing (JetStream reserves a
/// capped stream's bytes in its store at creation, which fails on a small
/// disk). The kv-indexer then sets the deployment's caps
/// ([`Bus::apply_stream_limits`]).
#[derive(Debug, Clone)]
pub struct StreamLimits {
    /// KV events are kept this long (the indexer's snapshots and delta log
    /// make older ones unnecessary).
    pub kv_events_max_age: Duration,
    /// And the KV-event stream keeps at most this many bytes, dropping the
    /// oldest (`None`: no cap). Events dropped before the indexer read them
    /// show as gaps, which it mends by resyncing the workers.
    pub kv_events_max_bytes: Option<u64>,
    /// The decision log is kept this long (for replay and explain).
    pub decisions_max_age: Duration,
    /// And it keeps at most this many bytes, dropping the oldest (`None`:
    /// no cap). A dispatched 8k-token request's record is about 8 KB.
    pub decisions_max_bytes: Option<u64>,
    /// Republished messages within this window are dropped.
    pub duplicate_window: Duration,
    /// Copies JetStream keeps of every stream and of the snapshot store
    /// (1, or 3 on a 3-node cluster: a node can die without losing a
    /// message). Streams are created with it; the kv-indexer also sets it
    /// on streams that exist ([`Bus::apply_stream_limits`]).
    pub replicas: usize,
}

impl Default for StreamLimits {
    fn default() -> Self {
        Self {
            kv_events_max_age: Duration::from_secs(24 * 3600),
            kv_events_max_bytes: None,
            decisions_max_age: Duration::from_secs(24 * 3600),
            decisions_max_bytes: None,
            duplicate_window: Duration::from_secs(120),
            replicas: 1,
        }
    }
}

/// How long [`Bus::apply_stream_limits`] waits for a stream whose replicas
/// it changed to be served again.
const RESCALE_PATIENCE: Duration = Duration::from_secs(10);

/// JetStream keeps at most this many copies of a stream.
pub const MAX_REPLICAS: usize = 5;

/// How long a snapshot read may wait for its next bytes before it fails.
const SNAPSHOT_STALL: Duration = Duration::from_secs(3);

/// How long [`get_or_create_stream`] asks a JetStream that does not answer.
const STREAM_PATIENCE: Duration = Duration::from_secs(60);

/// The stream, created with `config` if missing. Services start in any
/// order: another one creating the stream between the look and the create
/// (JetStream: "stream name already in use with a different
/// configuration", or "subjects overlap with an existing stream") is no
/// error, the stream then exists, and is looked up again (a stream of
/// another name over the same subjects fails the second look too).
/// Retention is the kv-indexer's to set ([`Bus::apply_stream_limits`]),
/// not the creator's.
///
/// A JetStream that does not answer (a cluster still forming, or electing
/// a leader after a node's death) is asked again, after 0.25 s doubling to
/// 2 s, for up to [`STREAM_PATIENCE`]: services starting together with
/// a new cluster must not exit on its first slow answer.
async fn get_or_create_stream(
    js: &jetstream::Context,
    config: stream::Config,
) -> Result<stream::Stream, jetstream::context::CreateStreamError> {
    let started = tokio::time::Instant::now();
    let mut pause = Duration::from_millis(250);
    loop {
        let result = match js.get_or_create_stream(config.clone()).await {
            Err(e) if created_meanwhile(&e) => js.get_or_create_stream(config.clone()).await,
            other => other,
        };
        match result {
            Err(e) if unanswered(&e.to_string()) && started.elapsed() < STREAM_PATIENCE => {
                tracing::warn!(
                    stream = %config.name,
                    error = %e,
                    retry_in_ms = pause.as_millis() as u64,
                    "JetStream did not answer about the stream; asking again"
                );
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

/// Whether a create failed because another service created the stream
/// first (see [`get_or_create_stream`]).
fn created_meanwhile(e: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(err)
            if [
                jetstream::ErrorCode::STREAM_NAME_EXIST,
                jetstream::ErrorCode::STREAM_SUBJECT_OVERLAP,
            ]
            .contains(&err.error_code())
    )
}

/// How long one try of [`create_consumer_patiently`] waits for JetStream.
const CONSUMER_CREATE_WAIT: Duration = Duration::from_secs(2);
/// Tries of [`create_consumer_patiently`].
const CONSUMER_CREATE_TRIES: u32 = 10;

/// Creates a consumer (the future `create` makes), trying again when
/// JetStream does not answer within 2 s, 10 times. With a node of a
/// 3-node cluster dead, nats-server 2.9 places about half of the
/// ephemeral (ordered) consumers on the dead peer, and their creation never
/// answers: measured on 2.9.10, every stream leader elected, 7 of 12
/// creations timed out after 10 s; the next try is placed anew (so 10
/// tries all miss about once in a thousand opens). Errors
/// JetStream did answer are returned at once.
pub async fn create_consumer_patiently<T, E, F, Fut>(mut create: F) -> Result<T, String>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, E>>,
{
    let mut last = String::new();
    for attempt in 1..=CONSUMER_CREATE_TRIES {
        match tokio::time::timeout(CONSUMER_CREATE_WAIT, create()).await {
            Ok(Ok(consumer)) => return Ok(consumer),
            Ok(Err(e)) if !unanswered(&e.to_string()) => return Err(e.to_string()),
            Ok(Err(e)) => last = e.to_string(),
            Err(_) => last = format!("no answer within {CONSUMER_CREATE_WAIT:?}"),
        }
        tracing::debug!(attempt, error = %last, "creating a consumer went unanswered; trying again");
    }
    Err(format!(
        "creating a consumer timed out {CONSUMER_CREATE_TRIES} times ({last}); a NATS node may be down"
    ))
}

/// The `stream_replicas` setting every service takes (the kv-indexer sets
/// it on the streams; the others create missing streams with it).
pub fn stream_replicas_flag() -> settings::Flag {
    settings::Flag::new(
        "stream_replicas",
        settings::Kind::Number,
        "Copies JetStream keeps of each stream and of the snapshot store: 1, or 3 on a 3-node NATS cluster (a node may die without losing a message); the kv-indexer sets it on existing streams, other services create missing streams with it",
    )
}

/// Checks a `stream_replicas` setting: 1 to [`MAX_REPLICAS`], else what
/// is expected.
pub fn check_replicas(replicas: usize) -> Result<usize, &'static str> {
    if (1..=MAX_REPLICAS).contains(&replicas) {
        Ok(replicas)
    } else {
        Err("JetStream keeps 1 to 5 copies of a stream")
    }
}

impl StreamLimits {
    /// The default limits with `replicas` copies: what services other
    /// than the kv-indexer create missing streams with.
    pub fn with_replicas(replicas: usize) -> Self {
        Self {
            replicas,
            ..Self::default()
        }
    }
}

/// What went wrong talking to NATS.
#[derive(Debug, thiserror::Error)]
pub enum BusError {
    #[error("connecting to NATS at {url}: {message}")]
    Connect { url: String, message: String },
    #[error("JetStream stream {stream}: {message}")]
    Stream {
        stream: &'static str,
        message: String,
    },
    #[error("publishing to {subject}: {message}")]
    Publish { subject: String, message: String },
    #[error("subscribing to {subject}: {message}")]
    Subscribe { subject: String, message: String },
    #[error(
        "delta {seq} refused: the delta stream does not end at {} (is another indexer running?)",
        seq - 1
    )]
    Fenced { seq: u64 },
    #[error("delta stream: message {stream_seq} holds delta {delta_seq}")]
    DeltaOutOfPlace { stream_seq: u64, delta_seq: u64 },
    #[error("snapshot store {bucket}: {message}")]
    Snapshot {
        bucket: &'static str,
        message: String,
    },
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

impl BusError {
    /// Whether JetStream refused for want of room in its store (or the
    /// account's): a full disk, or caps larger than the store can reserve.
    /// The cure is space, not a retry as such.
    pub fn is_store_full(&self) -> bool {
        match self {
            BusError::Stream { message, .. }
            | BusError::Publish { message, .. }
            | BusError::Snapshot { message, .. } => store_full(message),
            _ => false,
        }
    }

    /// Whether JetStream did not take a write: refused for want of room
    /// ([`BusError::is_store_full`]), or not confirmed at all (a timeout,
    /// no stream leader, no responders: a clustered JetStream whose store
    /// is full stops confirming rather than refusing). The write is held
    /// and retried; the service says it is not accepted meanwhile.
    pub fn is_unaccepted(&self) -> bool {
        self.is_store_full()
            || match self {
                BusError::Publish { message, .. } => {
                    unanswered(message) || message.to_ascii_lowercase().contains("no stream found")
                }
                _ => false,
            }
    }

    /// Whether a request about a stream (its info, its last message) or
    /// the snapshot store went unanswered: a timeout or no responders, as
    /// while a stream's leader is being elected. Asking again may succeed.
    pub fn is_unanswered(&self) -> bool {
        matches!(
            self,
            BusError::Stream { message, .. } | BusError::Snapshot { message, .. }
                if unanswered(message)
        )
    }
}

/// How long a question about a stream's state (its last sequence, a
/// consumer's info) waits for JetStream. A question sent while the
/// stream's leader is being elected is never answered and used to wait out
/// the client's whole request timeout: after a NATS node's kill -9 the
/// kv-indexer's resend, and a standby's recovery, learnt of the new leader
/// up to 10 s after its election. Asked again after this bound, they learn
/// of it within it.
pub const STREAM_ASK_WAIT: Duration = Duration::from_secs(2);

/// `ask`'s answer, or an unanswered [`BusError::Stream`] about `stream`
/// after `wait` ([`STREAM_ASK_WAIT`]).
async fn within<T>(
    wait: Duration,
    stream: &'static str,
    ask: impl std::future::Future<Output = Result<T, BusError>>,
) -> Result<T, BusError> {
    tokio::time::timeout(wait, ask).await.unwrap_or_else(|_| {
        Err(stream_error(stream)(format!(
            "timed out: no answer within {wait:?} (is its leader being elected?)"
        )))
    })
}

/// JetStream gave no answer: a timeout, or no responders.
fn unanswered(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    m.contains("timed out")
        || m.contains("no responders")
        // 10008: the server's JetStream is between leaders (its meta
        // leader stepped down, as a full store makes it do).
        || m.contains("temporarily unavailable")
        || m.contains("error code 10008")
}

/// JetStream's answers for a store without room: insufficient resources
/// (10047), storage or memory resources exceeded (10023, 10028), and the
/// account's storage limit (10120: "maximum bytes exceeded" is a stream's
/// own cap, which discards the oldest instead).
pub fn store_full(message: &str) -> bool {
    let m = message.to_ascii_lowercase();
    ["10047", "10023", "10028", "10120"].iter().any(|code| {
        m.contains(&format!("code {code}"))
            || m.contains(&format!("code: {code}"))
            || m.contains(&format!("err_code={code}"))
    }) || m.contains("insufficient resources")
        || m.contains("insufficient storage")
        || m.contains("insufficient memory")
        || m.contains("resources exceeded")
}

/// The smallest cap [`Bus::fit_stream_limits`] lowers a stream's to.
pub const MIN_FITTED_BYTES: u64 = 1 << 20;

/// The streams' configurations, each with its name.
fn stream_configs(limits: &StreamLimits) -> [(&'static str, stream::Config); 3] {
    let stream = |name: &'static str, subject: &str, max_age, max_bytes| {
        let config = stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            max_age,
            max_bytes,
            duplicate_window: limits.duplicate_window,
            storage: stream::StorageType::File,
            num_replicas: limits.replicas.max(1),
            ..Default::default()
        };
        (name, config)
    };
    [
        stream(
            subjects::KV_EVENTS_STREAM,
            subjects::KV_EVENTS_ALL,
            limits.kv_events_max_age,
            byte_limit(limits.kv_events_max_bytes),
        ),
        // The indexer trims the deltas its snapshots cover.
        stream(
            subjects::INDEX_DELTAS_STREAM,
            subjects::INDEX_DELTAS,
            Duration::ZERO,
            UNLIMITED,
        ),
        stream(
            subjects::DECISIONS_STREAM,
            subjects::DECISIONS_ALL,
            limits.decisions_max_age,
            byte_limit(limits.decisions_max_bytes),
        ),
    ]
}

/// JetStream's "no limit" for a stream's bytes.
const UNLIMITED: i64 = -1;

fn byte_limit(bytes: Option<u64>) -> i64 {
    bytes.map_or(UNLIMITED, |b| i64::try_from(b).unwrap_or(i64::MAX))
}

/// A stream's retention limits and replicas, "none" spelled one way (the
/// server answers -1 where a configuration may say 0, and 0 replicas for 1).
fn retention(config: &stream::Config) -> (Duration, i64, usize) {
    let bytes = if config.max_bytes > 0 {
        config.max_bytes
    } else {
        UNLIMITED
    };
    (config.max_age, bytes, config.num_replicas.max(1))
}

/// The server addresses of `urls`, comma separated (`nats://a:4222,
/// nats://b:4222`: the client picks one and fails over to the others), and
/// the login their user info names: every URL must name the same (the
/// same user info or none, all `tls://` or none).
fn split_urls(urls: &str, auth: &NatsAuth) -> Result<(Vec<String>, NatsAuth), String> {
    let mut addresses = Vec::new();
    let mut login: Option<NatsAuth> = None;
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let (address, with_info) = with_url_user_info(url, auth).map_err(|e| e.to_string())?;
        match &login {
            Some(seen) if *seen != with_info => {
                return Err(format!(
                    "{} logs in differently from the URLs before it (user info or tls://)",
                    redact_url(url)
                ))
            }
            Some(_) => {}
            None => login = Some(with_info),
        }
        addresses.push(address);
    }
    match login {
        Some(login) => Ok((addresses, login)),
        None => Err("no NATS URL given".into()),
    }
}

/// `auth` with the URL's user info as its login, and the URL without it.
fn with_url_user_info(url: &str, auth: &NatsAuth) -> Result<(String, NatsAuth), AuthError> {
    let (address, user, password) = split_user_info(url);
    let mut auth = auth.clone();
    match (user, password) {
        (Some(user), Some(password)) => {
            auth.user = Some(user);
            auth.password = Some(password);
        }
        (Some(token), None) => auth.token = Some(Secret::new(token)),
        _ => {}
    }
    auth.login()?;
    if address.starts_with("tls://") {
        auth.tls_required = true;
    }
    Ok((address, auth))
}

/// The client's options for `auth` (reads the nkey seed or creds file).
async fn connect_options(auth: &NatsAuth, name: &str) -> Result<ConnectOptions, AuthError> {
    let mut options = ConnectOptions::new()
        .name(name)
        .custom_inbox_prefix(auth.inbox_prefix());
    options = match auth.login()? {
        NatsLogin::Anonymous => options,
        NatsLogin::UserPassword(user, password) => {
            options.user_and_password(user, password.expose().to_owned())
        }
        NatsLogin::Token(token) => options.token(token.expose().to_owned()),
        NatsLogin::NkeyFile(path) => {
            let seed = read("nats", &path)?;
            let seed = String::from_utf8_lossy(&seed).trim().to_owned();
            options.nkey(seed)
        }
        NatsLogin::CredsFile(path) => {
            options
                .credentials_file(&path)
                .await
                .map_err(|e| AuthError::Read {
                    service: "nats",
                    path: path.clone(),
                    message: e.to_string(),
                })?
        }
    };
    if let Some(ca) = &auth.tls_ca {
        read("nats", ca)?;
        options = options.add_root_certificates(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&auth.tls_cert, &auth.tls_key) {
        read("nats", cert)?;
        read("nats", key)?;
        options = options.add_client_certificate(cert.clone(), key.clone());
    }
    if auth.wants_tls() {
        options = options.require_tls(true);
    }
    Ok(options)
}

/// Whether the server refused the client (bad credentials or TLS): not
/// worth retrying.
fn refused(error: &async_nats::ConnectError) -> bool {
    use async_nats::ConnectErrorKind as Kind;
    match error.kind() {
        Kind::AuthorizationViolation | Kind::Authentication | Kind::Tls => true,
        // A TLS alert from the server arrives as an IO error.
        Kind::Io => {
            let text = error.to_string();
            text.contains("alert") || text.contains("certificate")
        }
        _ => false,
    }
}

fn stream_error(stream: &'static str) -> impl Fn(String) -> BusError {
    move |message| BusError::Stream { stream, message }
}

/// Whether `error` (or an error it wraps) says the stream does not exist.
fn stream_not_found(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(error);
    while let Some(error) = next {
        if error.to_string().contains("stream not found") {
            return true;
        }
        next = error.source();
    }
    false
}

fn snapshot_error(message: impl ToString) -> BusError {
    BusError::Snapshot {
        bucket: subjects::SNAPSHOT_BUCKET,
        message: message.to_string(),
    }
}

/// Sends deltas in order without waiting for each confirmation (see
/// [`Bus::delta_publisher`]). Deltas must reach the server in sequence,
/// so send them one after the other (await [`DeltaPublisher::send`]) and
/// await only the confirmations concurrently: concurrent
/// [`Bus::publish_delta`] futures would not keep the order.
#[derive(Debug, Clone)]
pub struct DeltaPublisher {
    js: jetstream::Context,
    client: Client,
}

impl DeltaPublisher {
    /// Announces the delta on the live subject, then queues it for the
    /// stream on the connection (in order); the returned [`DeltaSent`]
    /// resolves when the stream confirms it.
    pub async fn send(&self, delta: &IndexDelta) -> Result<DeltaSent, BusError> {
        let payload = bytes::Bytes::from(delta.encode());
        self.announce_encoded(delta.seq, payload.clone()).await;
        send_delta(&self.js, delta.seq, payload).await
    }

    /// Queues the delta for the stream only (it was announced already:
    /// a delta sent again).
    pub async fn store(&self, delta: &IndexDelta) -> Result<DeltaSent, BusError> {
        send_delta(&self.js, delta.seq, delta.encode().into()).await
    }

    /// Announces the delta on the live subject only
    /// ([`subjects::INDEX_DELTAS_LIVE`]): again, for routers that missed
    /// it while the stream does not confirm it.
    pub async fn announce(&self, delta: &IndexDelta) {
        self.announce_encoded(delta.seq, delta.encode().into())
            .await;
    }

    /// Announces each of `deltas` again, in order ([`Self::announce`]).
    pub async fn announce_all<'a>(&self, deltas: impl IntoIterator<Item = &'a IndexDelta>) {
        for delta in deltas {
            self.announce(delta).await;
        }
    }

    /// Best effort: the stream is the record, and a router that missed an
    /// announcement reads the delta there.
    async fn announce_encoded(&self, seq: u64, payload: bytes::Bytes) {
        if let Err(e) = self
            .client
            .publish(subjects::INDEX_DELTAS_LIVE, payload)
            .await
        {
            tracing::debug!(seq, error = %e, "announcing a delta failed (the stream still gets it)");
        }
    }
}

/// A delta on its way to the stream.
#[derive(Debug)]
pub struct DeltaSent {
    seq: u64,
    ack: jetstream::context::PublishAckFuture,
}

impl DeltaSent {
    pub fn seq(&self) -> u64 {
        self.seq
    }

    /// Waits for the stream's confirmation; [`BusError::Fenced`] when the
    /// stream did not end at the delta before.
    pub async fn confirmed(self) -> Result<(), BusError> {
        let seq = self.seq;
        self.ack.await.map_err(|e| delta_error(seq, &e))?;
        Ok(())
    }
}

/// Sends a delta expecting the stream to end at the one before it, with a
/// message id naming its content (so republishing the same delta is a
/// no-op).
async fn send_delta(
    js: &jetstream::Context,
    seq: u64,
    payload: bytes::Bytes,
) -> Result<DeltaSent, BusError> {
    let id = format!("delta.{seq}.{:016x}", xxhash_rust::xxh3::xxh3_64(&payload));
    let message = jetstream::message::PublishMessage::build()
        .payload(payload)
        .message_id(id)
        .expected_last_sequence(seq - 1);
    let ack = js
        .send_publish(subjects::INDEX_DELTAS, message)
        .await
        .map_err(|e| delta_error(seq, &e))?;
    Ok(DeltaSent { seq, ack })
}

fn delta_error(seq: u64, error: &dyn std::fmt::Display) -> BusError {
    let text = error.to_string();
    if text.contains("wrong last sequence") {
        BusError::Fenced { seq }
    } else {
        BusError::Publish {
            subject: subjects::INDEX_DELTAS.into(),
            message: text,
        }
    }
}

/// A connection to NATS with JetStream.
#[derive(Debug, Clone)]
pub struct Bus {
    client: Client,
    js: jetstream::Context,
    /// Connections made so far (the first and every reconnection).
    connections: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
}

impl Bus {
    /// Connects without credentials ([`Bus::connect_with`]).
    pub async fn connect(url: &str, name: &str) -> Result<Self, BusError> {
        Self::connect_with(url, name, &NatsAuth::default()).await
    }

    /// Connects with `auth`'s credentials and TLS, naming the connection
    /// (it shows in the server's monitor). `url` may list several servers
    /// of a cluster, comma separated: the client connects to one and fails
    /// over to the others (and to the servers the cluster announces). User
    /// info in the URL
    /// (`nats://user:password@host`, `nats://token@host`) logs in as the
    /// settings' user/password or token would. A server that is not up
    /// yet (services starting together) is retried for up to
    /// [`CONNECT_PATIENCE`]; refused credentials are not. Once connected,
    /// the client reconnects by itself. Logs and errors show the URL with
    /// its password masked.
    pub async fn connect_with(url: &str, name: &str, auth: &NatsAuth) -> Result<Self, BusError> {
        let shown = redact_url(url);
        let connect_error = |message: String| BusError::Connect {
            url: shown.clone(),
            message,
        };
        let (addresses, auth) = split_urls(url, auth).map_err(connect_error)?;
        let deadline = tokio::time::Instant::now() + CONNECT_PATIENCE;
        let mut pause = Duration::from_millis(100);
        let connections = std::sync::Arc::new(tokio::sync::watch::Sender::new(0u64));
        loop {
            let counted = connections.clone();
            let options = connect_options(&auth, name)
                .await
                .map_err(|e| connect_error(e.to_string()))?
                .event_callback(move |event| {
                    let counted = counted.clone();
                    async move {
                        if let async_nats::Event::Connected = event {
                            counted.send_modify(|n| *n += 1);
                        }
                        tracing::info!("event: {event}");
                    }
                });
            match options.connect(addresses.as_slice()).await {
                Ok(client) => {
                    let js = jetstream::new(client.clone());
                    return Ok(Self {
                        client,
                        js,
                        connections,
                    });
                }
                Err(e) if !refused(&e) && tokio::time::Instant::now() + pause < deadline => {
                    tracing::warn!(url = %shown, error = %e, "NATS not reachable yet; retrying");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(connect_error(e.to_string())),
            }
        }
    }

    pub fn from_client(client: Client) -> Self {
        let js = jetstream::new(client.clone());
        Self {
            client,
            js,
            connections: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
        }
    }

    /// Changes with every reconnection (to another NATS server, or the same
    /// one back): what core NATS delivered meanwhile is lost. A bus made
    /// [`Bus::from_client`] does not count them.
    pub fn reconnections(&self) -> tokio::sync::watch::Receiver<u64> {
        self.connections.subscribe()
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn jetstream(&self) -> &jetstream::Context {
        &self.js
    }

    /// Creates the KV-event, delta and decision streams if they do not exist
    /// (whoever starts first creates them; the configuration is defined here
    /// only). Only features of nats-server 2.9 are used.
    pub async fn ensure_streams(&self, limits: &StreamLimits) -> Result<(), BusError> {
        for (name, config) in stream_configs(limits) {
            get_or_create_stream(&self.js, config)
                .await
                .map_err(|e| stream_error(name)(e.to_string()))?;
        }
        Ok(())
    }

    /// Creates the KV-event stream if it does not exist, with `limits`'
    /// replicas: all an agent needs (the bus's permissions let agents
    /// create no other stream).
    pub async fn ensure_kv_stream(&self, limits: &StreamLimits) -> Result<(), BusError> {
        let (name, config) = stream_configs(limits)
            .into_iter()
            .find(|(name, _)| *name == subjects::KV_EVENTS_STREAM)
            .expect("the KV-event stream is configured");
        get_or_create_stream(&self.js, config)
            .await
            .map_err(|e| stream_error(name)(e.to_string()))?;
        Ok(())
    }

    /// Like [`Bus::ensure_streams`], and sets the retention of streams that
    /// exist with other limits: the kv-indexer does this at start, so that
    /// its flags are the deployment's word on retention (other services
    /// only create what is missing). Returns the streams it changed.
    pub async fn apply_stream_limits(
        &self,
        limits: &StreamLimits,
    ) -> Result<Vec<&'static str>, BusError> {
        let mut changed = Vec::new();
        for (name, wanted) in stream_configs(limits) {
            let error = stream_error(name);
            let mut stream = get_or_create_stream(&self.js, wanted.clone())
                .await
                .map_err(|e| error(e.to_string()))?;
            let mut config = stream
                .info()
                .await
                .map_err(|e| error(e.to_string()))?
                .config
                .clone();
            if retention(&config) == retention(&wanted) {
                continue;
            }
            let rescaled = config.num_replicas.max(1) != wanted.num_replicas;
            config.max_age = wanted.max_age;
            config.max_bytes = wanted.max_bytes;
            config.num_replicas = wanted.num_replicas;
            self.js
                .update_stream(config)
                .await
                .map_err(|e| error(e.to_string()))?;
            if rescaled {
                self.wait_replicated(name, wanted.num_replicas).await?;
            }
            changed.push(name);
        }
        // The snapshot store is a stream too: its replicas follow.
        self.snapshot_store_with(Some(limits.replicas)).await?;
        let name = subjects::SNAPSHOT_STREAM;
        let error = stream_error(name);
        let mut stream = self.stream(name).await?;
        let mut config = stream
            .info()
            .await
            .map_err(|e| error(e.to_string()))?
            .config
            .clone();
        // Reads of the latest snapshot go to the stream's leader: with
        // direct gets any replica answers, and one catching up after a
        // restart answers with an older snapshot or none (whose deltas may
        // be trimmed already).
        let rescale = config.num_replicas.max(1) != limits.replicas.max(1);
        if rescale || config.allow_direct {
            config.allow_direct = false;
            config.num_replicas = limits.replicas.max(1);
            self.js
                .update_stream(config)
                .await
                .map_err(|e| error(e.to_string()))?;
            if rescale {
                self.wait_replicated(name, limits.replicas.max(1)).await?;
                changed.push(name);
            }
        }
        Ok(changed)
    }

    /// [`Bus::apply_stream_limits`], lowering the byte caps until JetStream
    /// has room to reserve them: each refusal for want of room halves both
    /// caps (down to [`MIN_FITTED_BYTES`]). Returns the limits set (the
    /// ones asked for unless lowered) and the streams changed; a refusal
    /// for another reason, or at the smallest caps, is the error.
    pub async fn fit_stream_limits(
        &self,
        limits: &StreamLimits,
    ) -> Result<(StreamLimits, Vec<&'static str>), BusError> {
        let mut limits = limits.clone();
        let mut changed: Vec<&'static str> = Vec::new();
        loop {
            match self.apply_stream_limits(&limits).await {
                Ok(now) => {
                    for name in now {
                        if !changed.contains(&name) {
                            changed.push(name);
                        }
                    }
                    return Ok((limits, changed));
                }
                Err(e) if e.is_store_full() => {
                    let halve = |cap: Option<u64>| {
                        cap.filter(|&c| c > MIN_FITTED_BYTES)
                            .map(|c| (c / 2).max(MIN_FITTED_BYTES))
                    };
                    let (kv, decisions) = (
                        halve(limits.kv_events_max_bytes),
                        halve(limits.decisions_max_bytes),
                    );
                    if kv.is_none() && decisions.is_none() {
                        return Err(e);
                    }
                    limits.kv_events_max_bytes = kv.or(limits.kv_events_max_bytes);
                    limits.decisions_max_bytes = decisions.or(limits.decisions_max_bytes);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Waits (up to [`RESCALE_PATIENCE`]) until a stream whose replicas
    /// changed has a leader and `replicas - 1` current followers: until
    /// then the cluster answers its publishes with "no stream found".
    async fn wait_replicated(&self, name: &'static str, replicas: usize) -> Result<(), BusError> {
        let deadline = tokio::time::Instant::now() + RESCALE_PATIENCE;
        loop {
            let mut stream = self.stream(name).await?;
            let info = stream
                .info()
                .await
                .map_err(|e| stream_error(name)(e.to_string()))?;
            let ready = match &info.cluster {
                Some(cluster) => {
                    cluster.leader.is_some()
                        && cluster.replicas.iter().filter(|p| p.current).count() + 1 >= replicas
                }
                None => replicas <= 1,
            };
            if ready {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    stream = name,
                    replicas,
                    "the stream's replicas did not catch up in time; continuing"
                );
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn stream(&self, name: &'static str) -> Result<stream::Stream, BusError> {
        self.js
            .get_stream(name)
            .await
            .map_err(|e| stream_error(name)(e.to_string()))
    }

    /// Publishes a worker's KV batch and waits for the stream's ack. The
    /// message id makes a republished batch a no-op; returns whether it
    /// was one.
    pub async fn publish_kv_batch(&self, batch: &KvEventBatch) -> Result<bool, BusError> {
        let subject = subjects::kv_events(&batch.worker);
        let message = jetstream::message::PublishMessage::build()
            .payload(batch.encode().into())
            .message_id(subjects::kv_batch_msg_id(
                &batch.worker,
                batch.epoch,
                batch.seq,
            ));
        let ack = self
            .js
            .send_publish(subject.clone(), message)
            .await
            .map_err(|e| BusError::Publish {
                subject: subject.clone(),
                message: e.to_string(),
            })?
            .await
            .map_err(|e| BusError::Publish {
                subject,
                message: e.to_string(),
            })?;
        Ok(ack.duplicate)
    }

    /// Announces a KV batch on its worker's live subject
    /// ([`subjects::kv_events_live`]), fire and forget: the stream (see
    /// [`Self::publish_kv_batch`]) is the record.
    pub async fn announce_kv_batch(&self, batch: &KvEventBatch) -> Result<(), BusError> {
        let subject = subjects::kv_events_live(&batch.worker);
        self.client
            .publish(subject.clone(), batch.encode().into())
            .await
            .map_err(|e| BusError::Publish {
                subject,
                message: e.to_string(),
            })
    }

    /// Publishes the next delta and waits for the stream's confirmation.
    /// The stream must end at `delta.seq - 1`: otherwise another indexer
    /// is writing, or this one is behind, and the delta is refused
    /// ([`BusError::Fenced`]). Publishing the very same delta again is a
    /// no-op (its message id names its content). To the stream only: not
    /// announced on the live subject (the indexer's [`DeltaPublisher`]
    /// does both).
    pub async fn publish_delta(&self, delta: &IndexDelta) -> Result<(), BusError> {
        send_delta(&self.js, delta.seq, delta.encode().into())
            .await?
            .confirmed()
            .await
    }

    /// A publisher that sends deltas in order and lets their confirmations
    /// be awaited concurrently, for throughput: up to `max_in_flight`
    /// unconfirmed deltas, each confirmed within `timeout`.
    pub fn delta_publisher(&self, max_in_flight: usize, timeout: Duration) -> DeltaPublisher {
        let js = jetstream::context::ContextBuilder::new()
            .timeout(timeout)
            .max_ack_inflight(max_in_flight.max(1))
            .build(self.client.clone());
        DeltaPublisher {
            js,
            client: self.client.clone(),
        }
    }

    /// The deltas announced on the live subject from now on
    /// ([`subjects::INDEX_DELTAS_LIVE`]), as they come: ahead of the
    /// stream, maybe with gaps (core NATS drops what a reconnect misses)
    /// and repeats (announced again while the stream does not confirm
    /// them).
    pub async fn live_deltas(
        &self,
    ) -> Result<BoxStream<'static, Result<IndexDelta, BusError>>, BusError> {
        let subscriber = self
            .client
            .subscribe(subjects::INDEX_DELTAS_LIVE)
            .await
            .map_err(|e| BusError::Subscribe {
                subject: subjects::INDEX_DELTAS_LIVE.into(),
                message: e.to_string(),
            })?;
        Ok(subscriber
            .map(|message| Ok(IndexDelta::decode(&message.payload)?))
            .boxed())
    }

    /// The last delta in the stream (0 when none), or an unanswered error
    /// ([`BusError::is_unanswered`]) after [`STREAM_ASK_WAIT`].
    pub async fn last_delta_seq(&self) -> Result<u64, BusError> {
        let name = subjects::INDEX_DELTAS_STREAM;
        within(STREAM_ASK_WAIT, name, async {
            let mut stream = self.stream(name).await?;
            let info = stream
                .info()
                .await
                .map_err(|e| stream_error(name)(e.to_string()))?;
            Ok(info.state.last_sequence)
        })
        .await
    }

    /// The delta stored at `seq`, as stored (its encoding), or an
    /// unanswered error after [`STREAM_ASK_WAIT`].
    pub async fn stored_delta(&self, seq: u64) -> Result<bytes::Bytes, BusError> {
        let name = subjects::INDEX_DELTAS_STREAM;
        within(STREAM_ASK_WAIT, name, async {
            let stream = self.stream(name).await?;
            let message = stream
                .get_raw_message(seq)
                .await
                .map_err(|e| stream_error(name)(format!("reading delta {seq}: {e}")))?;
            Ok(message.payload)
        })
        .await
    }

    /// Whether a client is pulling from the durable consumer `name` of the
    /// KV-event stream (the indexer: it always has a pull request
    /// waiting while it runs); `false` when there is no such consumer.
    pub async fn kv_consumer_pulling(&self, name: &str) -> Result<bool, BusError> {
        let error = stream_error(subjects::KV_EVENTS_STREAM);
        within(STREAM_ASK_WAIT, subjects::KV_EVENTS_STREAM, async {
            let stream = self.stream(subjects::KV_EVENTS_STREAM).await?;
            match stream.consumer_info(name).await {
                Ok(info) => Ok(info.num_waiting > 0),
                Err(e) if e.to_string().contains("consumer not found") => Ok(false),
                Err(e) => Err(error(e.to_string())),
            }
        })
        .await
    }

    /// Deltas from `start` on, in order, then new ones as they come. An
    /// ordered consumer: the server redelivers nothing, and the client
    /// restarts it where it stopped after a reconnect.
    pub async fn deltas_from(
        &self,
        start: u64,
    ) -> Result<BoxStream<'static, Result<IndexDelta, BusError>>, BusError> {
        let stream = self.stream(subjects::INDEX_DELTAS_STREAM).await?;
        let consumer = create_consumer_patiently(|| {
            stream.create_consumer(consumer::push::OrderedConfig {
                deliver_subject: self.client.new_inbox(),
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: start.max(1),
                },
                ..Default::default()
            })
        })
        .await
        .map_err(stream_error(subjects::INDEX_DELTAS_STREAM))?;
        let messages = consumer
            .messages()
            .await
            .map_err(|e| stream_error(subjects::INDEX_DELTAS_STREAM)(e.to_string()))?;
        Ok(messages
            .map(|message| {
                let message = message
                    .map_err(|e| stream_error(subjects::INDEX_DELTAS_STREAM)(e.to_string()))?;
                let delta = IndexDelta::decode(&message.payload)?;
                let stream_seq = message
                    .info()
                    .map(|i| i.stream_sequence)
                    .unwrap_or(delta.seq);
                if stream_seq != delta.seq {
                    return Err(BusError::DeltaOutOfPlace {
                        stream_seq,
                        delta_seq: delta.seq,
                    });
                }
                Ok(delta)
            })
            .boxed())
    }

    /// Drops deltas up to and including `seq` (a snapshot covers them).
    pub async fn trim_deltas(&self, seq: u64) -> Result<u64, BusError> {
        let stream = self.stream(subjects::INDEX_DELTAS_STREAM).await?;
        let purged = stream
            .purge()
            .sequence(seq + 1)
            .await
            .map_err(|e| stream_error(subjects::INDEX_DELTAS_STREAM)(e.to_string()))?;
        Ok(purged.purged)
    }

    /// Sends an entry of `replica`'s decision log; the returned future
    /// is JetStream's acknowledgement. Entries sent one after the other on
    /// this connection are stored in that order, so a writer can keep many
    /// unacknowledged without reordering them.
    pub async fn send_log_entry(
        &self,
        replica: &str,
        entry: &LogEntry,
    ) -> Result<impl std::future::Future<Output = Result<(), BusError>> + Send + 'static, BusError>
    {
        let subject = subjects::decisions(replica);
        let publish_error = {
            let subject = subject.clone();
            move |e: &dyn std::fmt::Display| BusError::Publish {
                subject: subject.clone(),
                message: e.to_string(),
            }
        };
        let mut message =
            jetstream::message::PublishMessage::build().payload(entry.encode().into());
        if let Some(d) = entry.decision() {
            message = message.message_id(subjects::decision_msg_id(&d.decision.id));
        }
        let ack = self
            .js
            .send_publish(subject.clone(), message)
            .await
            .map_err(|e| publish_error(&e))?;
        Ok(async move {
            ack.await.map_err(|e| publish_error(&e))?;
            Ok(())
        })
    }

    /// The snapshot store, created if missing with as many replicas as the
    /// delta stream has (a store of one replica, made while the indexer
    /// could not set the limits, died with its node in a drill).
    async fn snapshot_store(&self) -> Result<object_store::ObjectStore, BusError> {
        self.snapshot_store_with(None).await
    }

    /// The snapshot store, created with `replicas` (`None`: the delta
    /// stream's) if missing.
    async fn snapshot_store_with(
        &self,
        replicas: Option<usize>,
    ) -> Result<object_store::ObjectStore, BusError> {
        match self.js.get_object_store(subjects::SNAPSHOT_BUCKET).await {
            Ok(store) => Ok(store),
            // A cluster electing the stream's leader answers slowly or not
            // at all: that is no reason to create the store.
            Err(e) if !stream_not_found(&e) => Err(snapshot_error(e)),
            Err(_) => {
                let replicas = match replicas {
                    Some(r) => r,
                    None => {
                        let mut deltas = self.stream(subjects::INDEX_DELTAS_STREAM).await?;
                        let info = deltas.info().await.map_err(|e| {
                            stream_error(subjects::INDEX_DELTAS_STREAM)(e.to_string())
                        })?;
                        info.config.num_replicas
                    }
                };
                let created = self
                    .js
                    .create_object_store(object_store::Config {
                        bucket: subjects::SNAPSHOT_BUCKET.into(),
                        storage: stream::StorageType::File,
                        num_replicas: replicas.max(1),
                        ..Default::default()
                    })
                    .await;
                match created {
                    Ok(store) => Ok(store),
                    // Another service created it between the look and the
                    // create (JetStream: "stream name already in use with a
                    // different configuration"): it exists now.
                    Err(e) => self
                        .js
                        .get_object_store(subjects::SNAPSHOT_BUCKET)
                        .await
                        .map_err(|_| snapshot_error(e)),
                }
            }
        }
    }

    /// Stores a snapshot as the latest one.
    pub async fn put_snapshot(&self, snapshot: &IndexSnapshot) -> Result<(), BusError> {
        let store = self.snapshot_store().await?;
        let bytes = snapshot.encode();
        store
            .put(subjects::SNAPSHOT_LATEST, &mut bytes.as_slice())
            .await
            .map_err(snapshot_error)?;
        Ok(())
    }

    /// The latest snapshot, if one was ever stored. Reading never creates
    /// the store (routers may not: the bus's permissions keep that to the
    /// indexer); a store not there yet holds no snapshot.
    ///
    /// The object's read goes through an ordered consumer, which nats-server
    /// 2.9 may place on a dead node (see [`create_consumer_patiently`]): a
    /// read that does not answer within [`SNAPSHOT_STALL`] is started again,
    /// [`CONSUMER_CREATE_TRIES`] times.
    pub async fn latest_snapshot(&self) -> Result<Option<IndexSnapshot>, BusError> {
        let mut attempt = 1;
        loop {
            match self.read_latest_snapshot().await {
                Err(e) if e.is_unanswered() && attempt < CONSUMER_CREATE_TRIES => {
                    tracing::debug!(attempt, error = %e, "reading the latest snapshot went unanswered; trying again");
                    attempt += 1;
                }
                result => return result,
            }
        }
    }

    async fn read_latest_snapshot(&self) -> Result<Option<IndexSnapshot>, BusError> {
        let store = match self.js.get_object_store(subjects::SNAPSHOT_BUCKET).await {
            Ok(store) => store,
            Err(e) if stream_not_found(&e) => return Ok(None),
            Err(e) => return Err(snapshot_error(e)),
        };
        let got = tokio::time::timeout(SNAPSHOT_STALL, store.get(subjects::SNAPSHOT_LATEST))
            .await
            .map_err(|_| {
                snapshot_error(format!(
                    "opening {} timed out after {SNAPSHOT_STALL:?}",
                    subjects::SNAPSHOT_LATEST
                ))
            })?;
        let mut object = match got {
            Ok(object) => object,
            Err(e) if e.kind() == object_store::GetErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(snapshot_error(e)),
        };
        // Read with a bound on each wait: the object's consumer can die
        // with a NATS node, and a plain read would then wait for ever.
        let mut bytes = Vec::new();
        let mut chunk = vec![0u8; 256 * 1024];
        loop {
            let n = tokio::time::timeout(SNAPSHOT_STALL, object.read(&mut chunk))
                .await
                .map_err(|_| {
                    snapshot_error(format!(
                        "reading {} timed out: nothing for {SNAPSHOT_STALL:?} after {} bytes",
                        subjects::SNAPSHOT_LATEST,
                        bytes.len()
                    ))
                })?
                .map_err(snapshot_error)?;
            if n == 0 {
                break;
            }
            bytes.extend_from_slice(&chunk[..n]);
        }
        Ok(Some(IndexSnapshot::decode(&bytes)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unconfirmed_and_refused_writes_are_unaccepted_a_fence_is_not() {
        let publish = |message: &str| BusError::Publish {
            subject: "s".into(),
            message: message.into(),
        };
        for message in [
            "publish failed: insufficient resources (code 503, error code 10023)",
            "no stream found for given subject",
            "timed out: didn't receive ack in time",
            "no responders",
        ] {
            assert!(publish(message).is_unaccepted(), "{message}");
        }
        assert!(!publish("maximum payload exceeded").is_unaccepted());
        assert!(!BusError::Fenced { seq: 3 }.is_unaccepted());
        assert!(!publish("no stream found for given subject").is_store_full());
    }

    #[test]
    fn unanswered_stream_and_snapshot_requests_may_be_asked_again() {
        let stream = |message: &str| BusError::Stream {
            stream: "SY_INDEX_DELTAS",
            message: message.into(),
        };
        assert!(stream("request error: timed out: request timed out").is_unanswered());
        assert!(stream("jetstream error: no responders").is_unanswered());
        assert!(stream(
            "reading delta 6032: JetStream error: JetStream system temporarily unavailable \
             (code 503, error code 10008)"
        )
        .is_unanswered());
        assert!(!stream("stream not found (code 404, error code 10059)").is_unanswered());
        // The snapshot store's own bounded waits say so too.
        assert!(snapshot_error(format!(
            "opening {} timed out after {SNAPSHOT_STALL:?}",
            subjects::SNAPSHOT_LATEST
        ))
        .is_unanswered());
        assert!(snapshot_error("timed out").is_unanswered());
        assert!(!snapshot_error("checksum mismatch").is_unanswered());
        assert!(!BusError::Fenced { seq: 3 }.is_unanswered());
    }

    #[tokio::test]
    async fn a_question_about_a_stream_unanswered_in_time_may_be_asked_again() {
        let wait = Duration::from_millis(10);
        let never = std::future::pending::<Result<u64, BusError>>();
        let e = within(wait, "SY_INDEX_DELTAS", never).await.unwrap_err();
        assert!(e.is_unanswered(), "{e}");
        assert!(e.to_string().contains("SY_INDEX_DELTAS"), "{e}");
        let answered = within(wait, "SY_INDEX_DELTAS", async { Ok(7) }).await;
        assert_eq!(answered.unwrap(), 7);
    }

    #[test]
    fn several_urls_one_login() {
        let none = NatsAuth::default();
        let (addresses, auth) = split_urls("nats://a:4222, nats://b:4222,", &none).unwrap();
        assert_eq!(addresses, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(auth, none);
        // The same user info on every URL is the login.
        let (addresses, auth) = split_urls("nats://u:p@a:4222,nats://u:p@b:4222", &none).unwrap();
        assert_eq!(addresses, ["nats://a:4222", "nats://b:4222"]);
        assert_eq!(auth.user.as_deref(), Some("u"));
        // Different logins, or TLS on some only, are refused.
        let e = split_urls("nats://u:p@a:4222,nats://b:4222", &none).unwrap_err();
        assert!(e.contains("nats://b:4222 logs in differently"), "{e}");
        assert!(split_urls("tls://a:4222,nats://b:4222", &none).is_err());
        assert!(
            !split_urls("nats://u:secret@a:1,nats://v:secret@b:1", &none)
                .unwrap_err()
                .contains("secret")
        );
        assert_eq!(split_urls(" , ", &none).unwrap_err(), "no NATS URL given");
    }

    #[test]
    fn replicas_are_one_to_five() {
        assert_eq!(check_replicas(3), Ok(3));
        assert!(check_replicas(0).is_err());
        assert!(check_replicas(MAX_REPLICAS + 1).is_err());
        let config = &stream_configs(&StreamLimits::with_replicas(3))[0].1;
        assert_eq!(retention(config).2, 3);
    }
}
