//! The agent's core (`src/core/`) does no IO and reads no clock: none of
//! its files names the async runtime, NATS or the system clocks.

use std::path::Path;

#[test]
fn the_core_names_no_runtime_no_nats_and_no_clock() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src/core");
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).expect("src/core is there") {
        let path = entry.expect("a directory entry").path();
        let text = std::fs::read_to_string(&path).expect("a readable file");
        files += 1;
        for name in ["tokio", "async_nats", "Instant", "SystemTime"] {
            assert!(
                !text.contains(name),
                "{} names {name}: the core must stay sans-IO",
                path.display()
            );
        }
    }
    assert!(files >= 4, "only {files} files in {}", dir.display());
}
