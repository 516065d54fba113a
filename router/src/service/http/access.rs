//! Who may call what: a middleware in front of every route.
//!
//! - With API keys configured (`[http] api_keys`), `POST /v1/completions`
//!   and `POST /v1/route` need `Authorization: Bearer KEY` (401 without).
//! - The debug endpoints (`/debug/...`) and explanations
//!   (`/v1/route?explain=true`, which tell which worker caches a prefix)
//!   need the admin token (`[http] admin_token`) when one is configured,
//!   else a client on loopback (403 otherwise): off the host by default.
//! - Health, readiness and metrics stay open.
//! - Routing annotations a client sends are stripped before any handler
//!   sees them: the `x-switchyard-*` headers and `x-bypass-remote-prefill`
//!   (the decision is the router's alone; the body's unknown fields, such
//!   as `kv_transfer_params`, are never read).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bus::Secret;
use serde::{Deserialize, Serialize};

use super::error::ApiError;

/// The HTTP access settings (`[http]`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Access {
    /// Bearer keys accepted on the completion and route endpoints; none:
    /// open.
    pub api_keys: Vec<Secret>,
    /// Bearer token of the debug endpoints and explanations (also accepted
    /// as an API key); none: loopback clients only.
    pub admin_token: Option<Secret>,
}

/// What a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Health, readiness, metrics, unknown paths.
    Open,
    /// Completions and decisions.
    Api,
    /// Debug endpoints and explanations.
    Admin,
}

fn class(path: &str, query: Option<&str>) -> Class {
    let explain = query.is_some_and(|q| {
        q.split('&')
            .any(|pair| matches!(pair.split_once('='), Some(("explain", v)) if v != "false"))
    });
    match path {
        "/v1/route" if explain => Class::Admin,
        "/v1/completions" | "/v1/route" => Class::Api,
        p if p.starts_with("/debug/") => Class::Admin,
        _ => Class::Open,
    }
}

/// Request headers a client may not set: they would read as the router's
/// own annotations.
fn is_routing_annotation(name: &str) -> bool {
    name.starts_with("x-switchyard-") || name == "x-bypass-remote-prefill"
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// Compares without stopping at the first difference.
fn same(a: &str, b: &str) -> bool {
    a.len() == b.len()
        && a.bytes()
            .zip(b.bytes())
            .fold(0u8, |acc, (x, y)| acc | (x ^ y))
            == 0
}

impl Access {
    fn admits(
        &self,
        class: Class,
        token: Option<&str>,
        peer: Option<SocketAddr>,
    ) -> Result<(), (StatusCode, &'static str)> {
        let is_admin = |t: &str| {
            self.admin_token
                .as_ref()
                .is_some_and(|a| same(a.expose(), t))
        };
        match class {
            Class::Open => Ok(()),
            Class::Api if self.api_keys.is_empty() => Ok(()),
            Class::Api => match token {
                Some(t) if self.api_keys.iter().any(|k| same(k.expose(), t)) || is_admin(t) => Ok(()),
                Some(_) => Err((StatusCode::UNAUTHORIZED, "the API key is not valid")),
                None => Err((
                    StatusCode::UNAUTHORIZED,
                    "an API key is required: send Authorization: Bearer KEY",
                )),
            },
            Class::Admin => match (&self.admin_token, token) {
                (Some(_), Some(t)) if is_admin(t) => Ok(()),
                (Some(_), _) => Err((
                    StatusCode::FORBIDDEN,
                    "debug endpoints and explanations need the admin token (Authorization: Bearer TOKEN)",
                )),
                (None, _) if peer.is_some_and(|p| p.ip().is_loopback()) => Ok(()),
                (None, _) => Err((
                    StatusCode::FORBIDDEN,
                    "debug endpoints and explanations are served to loopback clients only (set [http] admin_token to allow others)",
                )),
            },
        }
    }
}

/// The middleware: strips routing annotations, then admits or refuses.
pub async fn guard(
    State(access): State<Arc<Access>>,
    mut request: Request,
    next: Next,
) -> Response {
    let annotations: Vec<_> = request
        .headers()
        .keys()
        .filter(|name| is_routing_annotation(name.as_str()))
        .cloned()
        .collect();
    for name in annotations {
        request.headers_mut().remove(name);
    }
    let class = class(request.uri().path(), request.uri().query());
    let peer = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(addr)| *addr);
    match access.admits(class, bearer(request.headers()), peer) {
        Ok(()) => next.run(request).await,
        Err((status, message)) => {
            let mut response = ApiError::new(status, "-", message).into_response();
            if status == StatusCode::UNAUTHORIZED {
                response
                    .headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            response
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(keys: &[&str], admin: Option<&str>) -> Access {
        Access {
            api_keys: keys.iter().map(|k| Secret::new(*k)).collect(),
            admin_token: admin.map(Secret::new),
        }
    }

    const LOOPBACK: Option<SocketAddr> = Some(SocketAddr::new(
        std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
        1,
    ));
    const REMOTE: Option<SocketAddr> = Some(SocketAddr::new(
        std::net::IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 7)),
        1,
    ));

    #[test]
    fn routes_are_classified() {
        assert_eq!(class("/v1/completions", None), Class::Api);
        assert_eq!(class("/v1/route", Some("explain=false")), Class::Api);
        assert_eq!(class("/v1/route", Some("x=1&explain=true")), Class::Admin);
        assert_eq!(class("/debug/ledger", None), Class::Admin);
        assert_eq!(class("/metrics", None), Class::Open);
        assert_eq!(class("/readyz", None), Class::Open);
    }

    #[test]
    fn api_keys_and_the_admin_token() {
        let open = access(&[], None);
        assert!(open.admits(Class::Api, None, REMOTE).is_ok());
        assert!(open.admits(Class::Admin, None, LOOPBACK).is_ok());
        assert_eq!(
            open.admits(Class::Admin, None, REMOTE).unwrap_err().0,
            StatusCode::FORBIDDEN
        );
        assert_eq!(
            open.admits(Class::Admin, None, None).unwrap_err().0,
            StatusCode::FORBIDDEN
        );

        let keyed = access(&["k1", "k2"], Some("adm"));
        assert!(keyed.admits(Class::Api, Some("k2"), REMOTE).is_ok());
        assert!(keyed.admits(Class::Api, Some("adm"), REMOTE).is_ok());
        assert_eq!(
            keyed.admits(Class::Api, Some("k3"), REMOTE).unwrap_err().0,
            StatusCode::UNAUTHORIZED
        );
        assert_eq!(
            keyed.admits(Class::Api, None, LOOPBACK).unwrap_err().0,
            StatusCode::UNAUTHORIZED
        );
        // With a token, loopback is not enough, and an API key is not it.
        assert_eq!(
            keyed
                .admits(Class::Admin, Some("k1"), LOOPBACK)
                .unwrap_err()
                .0,
            StatusCode::FORBIDDEN
        );
        assert!(keyed.admits(Class::Admin, Some("adm"), REMOTE).is_ok());
        assert!(keyed.admits(Class::Open, None, REMOTE).is_ok());
    }

    /// Through the middleware to a handler that reports the headers it
    /// got: the annotations are gone, the rest is there.
    #[tokio::test]
    async fn annotations_never_reach_a_handler() {
        use axum::routing::post;
        async fn echo(headers: HeaderMap) -> String {
            let mut names: Vec<&str> = headers.keys().map(|k| k.as_str()).collect();
            names.sort_unstable();
            names.join(",")
        }
        let app = axum::Router::new()
            .route("/v1/completions", post(echo))
            .route_layer(axum::middleware::from_fn_with_state(
                Arc::new(Access::default()),
                guard,
            ));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            axum::serve(
                listener,
                app.into_make_service_with_connect_info::<SocketAddr>(),
            )
            .await
        });
        let seen = reqwest::Client::new()
            .post(format!("http://{addr}/v1/completions"))
            .header("x-bypass-remote-prefill", "true")
            .header("x-switchyard-decision", "0123456789abcdef")
            .header("x-request-id", "r1")
            .body("{}")
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        server.abort();
        assert!(seen.contains("x-request-id"), "{seen}");
        assert!(
            !seen.contains("x-bypass") && !seen.contains("x-switchyard"),
            "{seen}"
        );
    }

    #[test]
    fn annotations_are_recognised() {
        assert!(is_routing_annotation("x-bypass-remote-prefill"));
        assert!(is_routing_annotation("x-switchyard-decision"));
        assert!(!is_routing_annotation("x-request-id"));
        assert!(!is_routing_annotation("authorization"));
    }
}
