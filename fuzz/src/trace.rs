//! A Mooncake-format trace, as `sim --trace`, `kv-indexer-bench` and
//! `bench-peers` read it. Nothing may panic.

pub fn run(data: &[u8]) {
    if let Ok(text) = std::str::from_utf8(data) {
        let _ = protocol::trace::parse_mooncake(text);
    }
}

/// A synthetic line of each shape, and the first lines of the shared trace
/// when it is beside the project (it is never copied into the repository).
pub fn seeds() -> Vec<Vec<u8>> {
    let mut seeds = vec![
        br#"{"timestamp": 0, "input_length": 1024, "output_length": 16, "hash_ids": [0, 1]}"#.to_vec(),
        concat!(
            r#"{"timestamp": 5, "input_length": 600, "output_length": 4, "hash_ids": [0, 1, 2], "session_id": "s"}"#,
            "\n",
            r#"{"timestamp": 9, "input_length": 10, "output_length": 1, "hash_ids": []}"#,
            "\n"
        )
        .as_bytes()
        .to_vec(),
    ];
    let shared = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/traces/mooncake_conversation_trace.jsonl"
    );
    if let Ok(text) = std::fs::read_to_string(shared) {
        let head: Vec<&str> = text.lines().take(3).collect();
        seeds.push(head.join("\n").into_bytes());
    }
    seeds
}
