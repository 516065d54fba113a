//! Who may call what, on a router replica with API keys and an admin
//! token: completions and decisions need a key, debug endpoints and
//! explanations the admin token, health and metrics are open; a client's
//! routing annotations do not steer the decision (headers are stripped,
//! body fields refused by name).

mod service_support;

use anyhow::Result;
use bus::Secret;
use protocol::{Role, Stage};
use router::service::http::access::Access;
use service_support::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_and_the_admin_token_guard_the_endpoints() -> Result<()> {
    let cluster = Cluster::start().await?;
    let mut workers = Vec::new();
    for (name, role) in [("p0", Role::Prefill), ("d0", Role::Decode)] {
        workers.push(FakeWorker::start(&cluster, record(name, role), Behavior::Serve).await?);
    }
    let mut config = cluster.config("r1");
    config.http = Access {
        api_keys: vec![Secret::new("key-1"), Secret::new("key-2")],
        admin_token: Some(Secret::new("admin-token")),
    };
    let router = RouterHandle::ready(config).await?;
    let get = |path: &str, token: Option<&str>| {
        let mut request = router.http.get(router.url(path));
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    wait_for("the router to know both workers", || async {
        let ledger: serde_json::Value = get("/debug/ledger", Some("admin-token"))
            .await
            .ok()?
            .json()
            .await
            .ok()?;
        (ledger["workers"].as_array()?.len() == 2).then_some(())
    })
    .await?;

    let body = serde_json::json!({"model": MODEL, "prompt": tokens(5, 3000), "max_tokens": 2});
    let post = |path: &str, token: Option<&str>| {
        let mut request = router.http.post(router.url(path)).json(&body);
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        request.send()
    };
    // No key, a wrong key: 401 naming the problem. A key: served.
    let r = post("/v1/route", None).await?;
    assert_eq!(r.status(), 401);
    assert_eq!(r.headers()["www-authenticate"], "Bearer");
    let error: serde_json::Value = r.json().await?;
    assert!(error["error"]["message"]
        .as_str()
        .unwrap()
        .contains("API key is required"));
    assert_eq!(post("/v1/route", Some("key-3")).await?.status(), 401);
    assert_eq!(post("/v1/completions", None).await?.status(), 401);
    assert_eq!(post("/v1/route", Some("key-2")).await?.status(), 200);

    // Explanations and debug endpoints: the admin token, not a key, not
    // loopback alone.
    assert_eq!(
        post("/v1/route?explain=true", Some("key-1"))
            .await?
            .status(),
        403
    );
    let explained = post("/v1/route?explain=true", Some("admin-token")).await?;
    assert_eq!(explained.status(), 200);
    let explained: serde_json::Value = explained.json().await?;
    assert!(!explained["explanation"].is_null(), "{explained}");
    assert_eq!(get("/debug/ledger", None).await?.status(), 403);
    assert_eq!(get("/debug/ledger", Some("key-1")).await?.status(), 403);

    // Open: health, readiness, metrics (which count the refusals).
    for path in ["/healthz", "/readyz"] {
        assert_eq!(get(path, None).await?.status(), 200, "{path}");
    }
    let metrics = get("/metrics", None).await?.text().await?;
    assert!(metrics.contains("status=\"401\""), "{metrics}");

    // A client asking for a bypass in the body is refused, naming the
    // field, before anything is routed (no field is dropped silently).
    for field in ["kv_transfer_params", "switchyard"] {
        let mut body = serde_json::json!({
            "model": MODEL,
            "prompt": tokens(6, 3000),
            "max_tokens": 2,
        });
        body[field] = serde_json::json!({"do_remote_prefill": false, "path": "bypass"});
        let r = router
            .http
            .post(router.url("/v1/completions"))
            .bearer_auth("key-1")
            .json(&body)
            .send()
            .await?;
        assert_eq!(r.status(), 400, "{field}");
        let error: serde_json::Value = r.json().await?;
        assert_eq!(error["error"]["param"], field, "{error}");
    }

    // A client asking for a bypass by header gets the router's decision:
    // the headers are stripped, and a long cold prompt goes to remote
    // prefill.
    let r = router
        .http
        .post(router.url("/v1/completions"))
        .bearer_auth("key-1")
        .header("x-bypass-remote-prefill", "true")
        .header("x-switchyard-path", "bypass")
        .json(&serde_json::json!({
            "model": MODEL,
            "prompt": tokens(6, 3000),
            "max_tokens": 2,
        }))
        .send()
        .await?;
    assert_eq!(r.status(), 200);
    let body: serde_json::Value = r.json().await?;
    assert_eq!(body["switchyard"]["path"], "remote", "{body}");
    assert_eq!(workers[0].next_request().await?.stage, Stage::Prefill);
    router.stop().await
}
