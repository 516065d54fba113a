//! Credentials and TLS for NATS and etcd: one flag group, defined once
//! ([`auth_flags`]), that every service flattens into its own flags and
//! every tool into its command line ([`AuthArgs`]); its sections are
//! `[nats]` and `[etcd]` of the config file, its flags `--nats-*` and
//! `--etcd-*`, its variables `SWITCHYARD_NATS_*` and `SWITCHYARD_ETCD_*`.
//!
//! Secrets ([`Secret`]) never print: their `Debug` and `Serialize` say
//! `<redacted>`, and a URL's password is masked wherever a URL is logged
//! or put in an error ([`redact_url`]).

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use settings::{Flag, Kind};

/// A password or token: printed and serialized as `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

const REDACTED: &str = "<redacted>";

impl Secret {
    pub fn new(secret: impl Into<String>) -> Self {
        Self(secret.into())
    }

    /// The secret itself, for the client that sends it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(REDACTED)
    }
}

impl<'de> Deserialize<'de> for Secret {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer).map(Secret)
    }
}

/// How a client proves who it is to NATS, and its TLS (`[nats]`). At most
/// one of user/password, token, nkey seed file and creds file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NatsAuth {
    /// User name (with `password`).
    pub user: Option<String>,
    pub password: Option<Secret>,
    /// Authorization token.
    pub token: Option<Secret>,
    /// A file holding an nkey seed (`SU...`).
    pub nkey_file: Option<PathBuf>,
    /// A `.creds` file (user JWT and its nkey seed, decentralized auth).
    pub creds_file: Option<PathBuf>,
    /// PEM CA certificates that verify the server (implies TLS).
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate (with `tls_key`; implies TLS).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// Refuse a server that does not offer TLS (also implied by the
    /// other TLS settings and a `tls://` URL).
    pub tls_required: bool,
    /// Prefix of the client's reply subjects. Default: `_INBOX.USER` when
    /// a user is given (what the shipped permissions let each user read,
    /// [`crate::permissions`]), else `_INBOX`.
    pub inbox_prefix: Option<String>,
}

/// How a client proves who it is to etcd, and its TLS (`[etcd]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EtcdAuth {
    /// User name (with `password`).
    pub user: Option<String>,
    pub password: Option<Secret>,
    /// PEM CA certificates that verify the members (`https://` endpoints).
    pub tls_ca: Option<PathBuf>,
    /// PEM client certificate (with `tls_key`).
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    /// The name the members' certificate must carry, when it is not the
    /// endpoints' host.
    pub tls_domain: Option<String>,
}

/// Settings of a [`NatsAuth`] or [`EtcdAuth`] that do not go together.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AuthError {
    #[error("{service}: give at most one of {given} (they are different ways to log in)")]
    SeveralMethods {
        service: &'static str,
        given: String,
    },
    #[error("{service}: {given} needs {missing}")]
    Missing {
        service: &'static str,
        given: &'static str,
        missing: &'static str,
    },
    #[error("{service}: reading {path}: {message}")]
    Read {
        service: &'static str,
        path: PathBuf,
        message: String,
    },
    #[error("etcd: an https:// endpoint needs etcd.tls_ca (--etcd-tls-ca), the CA that signed the members' certificates")]
    HttpsWithoutCa,
}

/// How a NATS client logs in, once checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum NatsLogin {
    Anonymous,
    UserPassword(String, Secret),
    Token(Secret),
    NkeyFile(PathBuf),
    CredsFile(PathBuf),
}

impl NatsAuth {
    /// The one way of logging in these settings name, or why they are
    /// contradictory.
    pub(crate) fn login(&self) -> Result<NatsLogin, AuthError> {
        let service = "nats";
        let given: Vec<&str> = [
            (
                self.user.is_some() || self.password.is_some(),
                "user/password",
            ),
            (self.token.is_some(), "token"),
            (self.nkey_file.is_some(), "nkey_file"),
            (self.creds_file.is_some(), "creds_file"),
        ]
        .into_iter()
        .filter_map(|(set, name)| set.then_some(name))
        .collect();
        if given.len() > 1 {
            return Err(AuthError::SeveralMethods {
                service,
                given: given.join(", "),
            });
        }
        pair(
            service,
            &self.tls_cert,
            "tls_cert",
            &self.tls_key,
            "tls_key",
        )?;
        pair(service, &self.user, "user", &self.password, "password")?;
        Ok(
            if let (Some(user), Some(password)) = (&self.user, &self.password) {
                NatsLogin::UserPassword(user.clone(), password.clone())
            } else if let Some(token) = &self.token {
                NatsLogin::Token(token.clone())
            } else if let Some(path) = &self.nkey_file {
                NatsLogin::NkeyFile(path.clone())
            } else if let Some(path) = &self.creds_file {
                NatsLogin::CredsFile(path.clone())
            } else {
                NatsLogin::Anonymous
            },
        )
    }

    /// The prefix of the client's reply subjects.
    pub fn inbox_prefix(&self) -> String {
        match (&self.inbox_prefix, &self.user) {
            (Some(prefix), _) => prefix.clone(),
            (None, Some(user)) => crate::permissions::inbox_prefix(user),
            (None, None) => "_INBOX".to_owned(),
        }
    }

    /// Whether the connection must be TLS.
    pub(crate) fn wants_tls(&self) -> bool {
        self.tls_required
            || self.tls_ca.is_some()
            || self.tls_cert.is_some()
            || self.tls_key.is_some()
    }
}

impl EtcdAuth {
    /// Checks that the settings go together (a password with its user, a
    /// key with its certificate, a CA for `https://` endpoints).
    pub fn check(&self, endpoints: &[String]) -> Result<(), AuthError> {
        let service = "etcd";
        pair(service, &self.user, "user", &self.password, "password")?;
        pair(
            service,
            &self.tls_cert,
            "tls_cert",
            &self.tls_key,
            "tls_key",
        )?;
        if self.tls_ca.is_none() && endpoints.iter().any(|e| e.starts_with("https://")) {
            return Err(AuthError::HttpsWithoutCa);
        }
        Ok(())
    }
}

fn pair<A, B>(
    service: &'static str,
    a: &Option<A>,
    a_name: &'static str,
    b: &Option<B>,
    b_name: &'static str,
) -> Result<(), AuthError> {
    match (a.is_some(), b.is_some()) {
        (true, false) => Err(AuthError::Missing {
            service,
            given: a_name,
            missing: b_name,
        }),
        (false, true) => Err(AuthError::Missing {
            service,
            given: b_name,
            missing: a_name,
        }),
        _ => Ok(()),
    }
}

pub(crate) fn read(service: &'static str, path: &PathBuf) -> Result<Vec<u8>, AuthError> {
    std::fs::read(path).map_err(|e| AuthError::Read {
        service,
        path: path.clone(),
        message: e.to_string(),
    })
}

/// `url` with the password (or a lone token) of its user info masked:
/// `nats://app:<redacted>@host:4222`. What logs and errors show of a URL.
pub fn redact_url(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return url.to_owned();
    };
    let user = match rest[..at].split_once(':') {
        Some((user, _password)) => format!("{user}:{REDACTED}"),
        None => REDACTED.to_owned(),
    };
    format!("{scheme}://{user}@{}", &rest[at + 1..])
}

/// The user info of a URL, split off: (the URL without it, user,
/// password). A URL without user info comes back as it was.
pub(crate) fn split_user_info(url: &str) -> (String, Option<String>, Option<Secret>) {
    let Some((scheme, rest)) = url.split_once("://") else {
        return (url.to_owned(), None, None);
    };
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return (url.to_owned(), None, None);
    };
    let (user, password) = match rest[..at].split_once(':') {
        Some((user, password)) => (user.to_owned(), Some(Secret::new(password))),
        None => (rest[..at].to_owned(), None),
    };
    (
        format!("{scheme}://{}", &rest[at + 1..]),
        Some(user),
        password,
    )
}

/// The credential and TLS flags of every service and tool: `nats.*` and
/// `etcd.*` (`--nats-user`, `SWITCHYARD_NATS_USER`, `[nats] user`).
pub fn auth_flags() -> Vec<Flag> {
    vec![
        Flag::new(
            "nats.user",
            Kind::Text,
            "NATS user name (with --nats-password)",
        ),
        Flag::new(
            "nats.password",
            Kind::Text,
            "NATS password (prefer the variable or the file: flags show in ps)",
        ),
        Flag::new("nats.token", Kind::Text, "NATS authorization token"),
        Flag::new(
            "nats.nkey_file",
            Kind::Text,
            "File holding the NATS nkey seed (SU...)",
        ),
        Flag::new(
            "nats.creds_file",
            Kind::Text,
            "NATS .creds file (user JWT and seed, decentralized auth)",
        ),
        Flag::new(
            "nats.tls_ca",
            Kind::Text,
            "PEM CA that verifies the NATS server (implies TLS)",
        ),
        Flag::new(
            "nats.tls_cert",
            Kind::Text,
            "PEM client certificate for NATS (with --nats-tls-key)",
        ),
        Flag::new(
            "nats.tls_key",
            Kind::Text,
            "PEM key of the NATS client certificate",
        ),
        Flag::new(
            "nats.tls_required",
            Kind::Switch,
            "Refuse a NATS server without TLS",
        ),
        Flag::new(
            "etcd.user",
            Kind::Text,
            "etcd user name (with --etcd-password)",
        ),
        Flag::new(
            "etcd.password",
            Kind::Text,
            "etcd password (prefer the variable or the file: flags show in ps)",
        ),
        Flag::new(
            "etcd.tls_ca",
            Kind::Text,
            "PEM CA that verifies the etcd members (https:// endpoints)",
        ),
        Flag::new(
            "etcd.tls_cert",
            Kind::Text,
            "PEM client certificate for etcd (with --etcd-tls-key)",
        ),
        Flag::new(
            "etcd.tls_key",
            Kind::Text,
            "PEM key of the etcd client certificate",
        ),
        Flag::new(
            "etcd.tls_domain",
            Kind::Text,
            "Name the etcd members' certificate carries, when not the endpoints' host",
        ),
    ]
}

/// [`auth_flags`] for a tool's clap command line: `#[command(flatten)]
/// auth: bus::AuthArgs` adds the flags, their variables and `--config`
/// (of which only the `[nats]` and `[etcd]` sections are read, so a
/// service's file serves).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AuthArgs {
    pub nats: NatsAuth,
    pub etcd: EtcdAuth,
}

impl clap::FromArgMatches for AuthArgs {
    fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
        let flags = auth_flags();
        let invalid = |e: &dyn fmt::Display| {
            clap::Error::raw(clap::error::ErrorKind::ValueValidation, format!("{e}\n"))
        };
        let args = settings::Args::from_matches(matches, &flags)?;
        let (mut table, _deprecations) = args.layered(&flags).map_err(|e| invalid(&e))?;
        let mut sections = toml::Table::new();
        for key in ["nats", "etcd"] {
            if let Some(section) = table.remove(key) {
                sections.insert(key.to_owned(), section);
            }
        }
        settings::deserialize(sections).map_err(|e| invalid(&e))
    }

    fn update_from_arg_matches(&mut self, matches: &clap::ArgMatches) -> Result<(), clap::Error> {
        *self = Self::from_arg_matches(matches)?;
        Ok(())
    }
}

impl clap::Args for AuthArgs {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        settings::command(cmd, &auth_flags(), &AuthArgs::default())
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_password_is_masked() {
        assert_eq!(
            redact_url("nats://app:hunter2@127.0.0.1:4222"),
            "nats://app:<redacted>@127.0.0.1:4222"
        );
        assert_eq!(
            redact_url("nats://s3cret@host:4222/x"),
            "nats://<redacted>@host:4222/x"
        );
        assert_eq!(redact_url("nats://host:4222"), "nats://host:4222");
        assert_eq!(
            split_user_info("tls://a:b@h:1"),
            (
                "tls://h:1".to_owned(),
                Some("a".to_owned()),
                Some(Secret::new("b"))
            )
        );
    }

    #[test]
    fn secrets_never_print() {
        let auth = NatsAuth {
            user: Some("app".into()),
            password: Some(Secret::new("hunter2")),
            ..NatsAuth::default()
        };
        assert!(!format!("{auth:?}").contains("hunter2"));
        let table = toml::Value::try_from(&auth).unwrap().to_string();
        assert!(!table.contains("hunter2"), "{table}");
    }

    #[test]
    fn contradictory_logins_are_refused() {
        let both = NatsAuth {
            token: Some(Secret::new("t")),
            nkey_file: Some("seed".into()),
            ..NatsAuth::default()
        };
        assert_eq!(
            both.login(),
            Err(AuthError::SeveralMethods {
                service: "nats",
                given: "token, nkey_file".into()
            })
        );
        let lone_user = NatsAuth {
            user: Some("app".into()),
            ..NatsAuth::default()
        };
        assert!(matches!(
            lone_user.login(),
            Err(AuthError::Missing {
                missing: "password",
                ..
            })
        ));
        let https = EtcdAuth::default().check(&["https://etcd:2379".into()]);
        assert_eq!(https, Err(AuthError::HttpsWithoutCa));
    }

    #[test]
    fn the_tools_read_the_flags_variables_and_file() {
        use clap::{Args as _, FromArgMatches as _};
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("auth.toml");
        std::fs::write(&file, "model = \"ignored\"\n[nats]\ntoken = \"from-file\"\n[etcd]\nuser = \"u\"\npassword = \"p\"\n").unwrap();
        let cmd = AuthArgs::augment_args(clap::Command::new("tool"));
        let matches = cmd
            .try_get_matches_from([
                "tool",
                "--config",
                file.to_str().unwrap(),
                "--nats-tls-ca",
                "ca.pem",
            ])
            .unwrap();
        let auth = AuthArgs::from_arg_matches(&matches).unwrap();
        assert_eq!(auth.nats.token, Some(Secret::new("from-file")));
        assert_eq!(auth.nats.tls_ca, Some("ca.pem".into()));
        assert_eq!(auth.etcd.user.as_deref(), Some("u"));
    }
}
