//! The tokenizer the project ships (`deploy/tokenizer/`: `tokenizer.json`
//! and a `tokenizer_config.json` with a ChatML chat template), made by
//! `scripts/make-tokenizer` when absent. The test suite uses the same files
//! as `scripts/dev` and the client runs.

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The directory of the shipped tokenizer, made on first use (the script
/// writes each file aside and renames it, so concurrent tests are safe).
pub fn shipped_dir() -> PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("the workspace")
            .to_path_buf();
        let dir = root.join("deploy/tokenizer");
        if !dir.join("tokenizer.json").exists() || !dir.join("tokenizer_config.json").exists() {
            let status = Command::new("python3")
                .arg(root.join("scripts/make-tokenizer"))
                .arg(&dir)
                .status()
                .expect("running python3 scripts/make-tokenizer (python3 is needed to make the shipped tokenizer)");
            assert!(status.success(), "scripts/make-tokenizer failed: {status}");
        }
        dir
    })
    .clone()
}

/// The shipped `tokenizer.json`.
pub fn shipped() -> PathBuf {
    shipped_dir().join("tokenizer.json")
}
