//! The routers' API key (`--api-key`, `SWITCHYARD_API_KEY`): sent as
//! `Authorization: Bearer KEY` on every request when given.

/// A client builder that sends the key, if any.
pub fn client(api_key: Option<&str>) -> anyhow::Result<reqwest::ClientBuilder> {
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = api_key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}"))
            .map_err(|_| anyhow::anyhow!("the API key is not a valid header value"))?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    Ok(reqwest::Client::builder().default_headers(headers))
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// What a request from a client with (or without) a key carries.
    async fn request_head(api_key: Option<&str>) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut socket, _) = listener.accept().await.unwrap();
            let mut buf = vec![0; 4096];
            let n = socket.read(&mut buf).await.unwrap();
            socket
                .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")
                .await
                .unwrap();
            String::from_utf8_lossy(&buf[..n]).to_lowercase()
        });
        let client = super::client(api_key).unwrap().build().unwrap();
        client.get(format!("http://{addr}/")).send().await.unwrap();
        server.await.unwrap()
    }

    #[tokio::test]
    async fn the_key_is_sent_as_a_bearer_token() {
        assert!(request_head(Some("k1"))
            .await
            .contains("authorization: bearer k1"));
        assert!(!request_head(None).await.contains("authorization"));
    }
}
