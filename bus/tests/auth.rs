//! Credentials and TLS against real servers: every way of logging in to
//! nats-server works, a wrong or missing credential is refused at once
//! and never printed; etcd with its authentication on.

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Result;
use bus::{Bus, EtcdAuth, NatsAuth, Registry, Secret};
use tests::{EtcdServer, NatsServer, TestCa};

/// A nats-server with `config` (written to a temporary file).
fn nats_with(config: &str, dir: &Path) -> Result<NatsServer> {
    let path = dir.join("nats.conf");
    std::fs::write(&path, config)?;
    NatsServer::start_with_config(&path)
}

/// Connecting with `auth` fails, quickly (a refusal is not retried), and
/// the error names no secret.
async fn refused(url: &str, auth: &NatsAuth, secrets: &[&str]) -> Result<String> {
    let started = Instant::now();
    let error = match Bus::connect_with(url, "auth-test", auth).await {
        Ok(_) => anyhow::bail!("connected with {auth:?}"),
        Err(e) => e.to_string(),
    };
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "a refusal is not retried: {error}"
    );
    for secret in secrets {
        assert!(!error.contains(secret), "{error}");
    }
    Ok(error)
}

async fn publishes(bus: &Bus) -> Result<()> {
    bus.client().publish("sy.auth.test", "x".into()).await?;
    bus.client().flush().await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_user_password_and_token() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let server = nats_with(
        "authorization { users = [ { user: app, password: hunter2 } ] }",
        dir.path(),
    )?;
    let good = NatsAuth {
        user: Some("app".into()),
        password: Some(Secret::new("hunter2")),
        ..NatsAuth::default()
    };
    publishes(&Bus::connect_with(&server.url(), "auth-test", &good).await?).await?;
    // In the URL, too; its errors show it masked.
    let in_url = server.url().replace("nats://", "nats://app:hunter2@");
    publishes(&Bus::connect_with(&in_url, "auth-test", &NatsAuth::default()).await?).await?;
    let wrong_url = server.url().replace("nats://", "nats://app:wrong-pass@");
    let error = refused(&wrong_url, &NatsAuth::default(), &["wrong-pass"]).await?;
    assert!(error.contains("app:<redacted>@"), "{error}");

    let wrong = NatsAuth {
        password: Some(Secret::new("not-it")),
        ..good.clone()
    };
    refused(&server.url(), &wrong, &["not-it", "hunter2"]).await?;
    refused(&server.url(), &NatsAuth::default(), &[]).await?;

    let token_server = nats_with(
        "authorization { token: s3cret-token }",
        &dir.path().join(".."),
    )?;
    let token = NatsAuth {
        token: Some(Secret::new("s3cret-token")),
        ..NatsAuth::default()
    };
    publishes(&Bus::connect_with(&token_server.url(), "auth-test", &token).await?).await?;
    refused(&token_server.url(), &good, &["hunter2"]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_nkey_and_creds_files() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let user = nkeys::KeyPair::new_user();
    let server = nats_with(
        &format!(
            "authorization {{ users = [ {{ nkey: {} }} ] }}",
            user.public_key()
        ),
        dir.path(),
    )?;
    let seed_file = dir.path().join("agent.nk");
    std::fs::write(&seed_file, format!("{}\n", user.seed()?))?;
    let nkey = NatsAuth {
        nkey_file: Some(seed_file),
        ..NatsAuth::default()
    };
    publishes(&Bus::connect_with(&server.url(), "auth-test", &nkey).await?).await?;

    let other = nkeys::KeyPair::new_user();
    let other_file = dir.path().join("other.nk");
    std::fs::write(&other_file, other.seed()?)?;
    let seed = other.seed()?;
    refused(
        &server.url(),
        &NatsAuth {
            nkey_file: Some(other_file),
            ..NatsAuth::default()
        },
        &[&seed],
    )
    .await?;

    // Decentralized auth: an operator, an account it signed, a user the
    // account signed, the user's .creds file.
    let operator = nkeys::KeyPair::new_operator();
    let account = nkeys::KeyPair::new_account();
    let operator_jwt = jwt(
        &operator,
        &operator,
        "operator",
        r#"{"type":"operator","version":2}"#,
    )?;
    let account_jwt = jwt(
        &operator,
        &account,
        "account",
        r#"{"limits":{"subs":-1,"data":-1,"payload":-1,"imports":-1,"exports":-1,"wildcards":true,"conn":-1,"leaf":-1},"default_permissions":{"pub":{},"sub":{}},"type":"account","version":2}"#,
    )?;
    let system = nkeys::KeyPair::new_account();
    let system_jwt = jwt(
        &operator,
        &system,
        "system",
        r#"{"limits":{"subs":-1,"data":-1,"payload":-1,"imports":-1,"exports":-1,"wildcards":true,"conn":-1,"leaf":-1},"type":"account","version":2}"#,
    )?;
    let user = nkeys::KeyPair::new_user();
    let user_jwt = jwt(
        &account,
        &user,
        "user",
        r#"{"pub":{},"sub":{},"subs":-1,"data":-1,"payload":-1,"type":"user","version":2}"#,
    )?;
    let jwt_server = nats_with(
        &format!(
            "operator: {operator_jwt}\nsystem_account: {system}\nresolver: MEMORY\nresolver_preload: {{ {account}: {account_jwt}, {system}: {system_jwt} }}\n",
            account = account.public_key(),
            system = system.public_key(),
        ),
        &dir.path().join(".."),
    )?;
    let creds = dir.path().join("user.creds");
    std::fs::write(
        &creds,
        format!(
            "-----BEGIN NATS USER JWT-----\n{user_jwt}\n------END NATS USER JWT------\n\n-----BEGIN USER NKEY SEED-----\n{}\n------END USER NKEY SEED------\n",
            user.seed()?
        ),
    )?;
    let with_creds = NatsAuth {
        creds_file: Some(creds),
        ..NatsAuth::default()
    };
    publishes(&Bus::connect_with(&jwt_server.url(), "auth-test", &with_creds).await?).await?;
    refused(&jwt_server.url(), &NatsAuth::default(), &[]).await?;
    Ok(())
}

/// A NATS JWT of `subject` signed by `issuer`.
fn jwt(
    issuer: &nkeys::KeyPair,
    subject: &nkeys::KeyPair,
    name: &str,
    nats: &str,
) -> Result<String> {
    use base64::Engine as _;
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let claims = format!(
        r#"{{"jti":"{name}-{}","iat":1700000000,"iss":"{}","name":"{name}","sub":"{}","nats":{nats}}}"#,
        subject.public_key(),
        issuer.public_key(),
        subject.public_key()
    );
    let body = format!("{header}.{}", b64.encode(claims));
    let signature = issuer.sign(body.as_bytes())?;
    Ok(format!("{body}.{}", b64.encode(signature)))
}

#[tokio::test(flavor = "multi_thread")]
async fn nats_tls_with_a_client_certificate() -> Result<()> {
    let ca = TestCa::generate()?;
    let dir = tempfile::tempdir()?;
    let server = nats_with(
        &format!(
            "tls {{ cert_file: {:?}, key_file: {:?}, ca_file: {:?}, verify: true }}",
            ca.path("server.pem"),
            ca.path("server.key"),
            ca.path("ca.pem")
        ),
        dir.path(),
    )?;
    let tls = NatsAuth {
        tls_ca: Some(ca.path("ca.pem")),
        tls_cert: Some(ca.path("client.pem")),
        tls_key: Some(ca.path("client.key")),
        ..NatsAuth::default()
    };
    publishes(&Bus::connect_with(&server.url(), "auth-test", &tls).await?).await?;
    // The server verifies clients: no certificate, no connection.
    let no_cert = NatsAuth {
        tls_ca: Some(ca.path("ca.pem")),
        ..NatsAuth::default()
    };
    refused(&server.url(), &no_cert, &[]).await?;
    // A server the CA did not sign is refused by the client.
    let other = TestCa::generate()?;
    let wrong_ca = NatsAuth {
        tls_ca: Some(other.path("ca.pem")),
        ..tls
    };
    refused(&server.url(), &wrong_ca, &[]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_with_authentication_on() -> Result<()> {
    let server = EtcdServer::start()?;
    let endpoints = [server.endpoint()];
    {
        let mut admin = etcd_client::Client::connect(&endpoints, None).await?;
        admin.user_add("root", "r00t-pass", None).await?;
        admin.user_grant_role("root", "root").await?;
        admin.auth_enable().await?;
    }
    let root = EtcdAuth {
        user: Some("root".into()),
        password: Some(Secret::new("r00t-pass")),
        ..EtcdAuth::default()
    };
    let registry = Registry::connect_with(&endpoints, &root).await?;
    registry.workers().await?;

    let anonymous = Registry::connect(&endpoints).await?;
    let error = anonymous
        .workers()
        .await
        .expect_err("auth is on")
        .to_string();
    assert!(
        error.contains("user name is empty") || error.contains("permission"),
        "{error}"
    );
    let wrong = EtcdAuth {
        password: Some(Secret::new("not-it")),
        ..root
    };
    let error = match Registry::connect_with(&endpoints, &wrong).await {
        Ok(registry) => registry
            .workers()
            .await
            .expect_err("wrong password")
            .to_string(),
        Err(e) => e.to_string(),
    };
    assert!(!error.contains("not-it"), "{error}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn etcd_over_tls_with_a_client_certificate() -> Result<()> {
    let ca = TestCa::generate()?;
    let server = EtcdServer::start_with_tls(&ca)?;
    let endpoints = [server.tls_endpoint().expect("a TLS listener")];
    let tls = EtcdAuth {
        tls_ca: Some(ca.path("ca.pem")),
        tls_cert: Some(ca.path("client.pem")),
        tls_key: Some(ca.path("client.key")),
        ..EtcdAuth::default()
    };
    let registry = Registry::connect_with(&endpoints, &tls).await?;
    registry.workers().await?;

    // https without a CA: a clear error before any connection.
    let error = Registry::connect(&endpoints)
        .await
        .expect_err("no CA")
        .to_string();
    assert!(error.contains("tls_ca"), "{error}");
    // No client certificate: the member refuses.
    let no_cert = EtcdAuth {
        tls_ca: Some(ca.path("ca.pem")),
        ..EtcdAuth::default()
    };
    let refused = tokio::time::timeout(Duration::from_secs(10), async {
        Registry::connect_with(&endpoints, &no_cert)
            .await?
            .workers()
            .await?;
        anyhow::Ok(())
    })
    .await;
    assert!(
        !matches!(refused, Ok(Ok(()))),
        "served without a client certificate"
    );
    Ok(())
}
