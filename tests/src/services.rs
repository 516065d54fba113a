//! Switchyard's own binaries (`kv-indexer`, `router`, `worker-agent`) as
//! child processes, for end-to-end tests across processes. The same
//! supervisor as the servers' (see [`crate::servers`]) guarantees that no
//! child outlives the test.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _, Result};
use tempfile::TempDir;

use crate::servers::{http_request, Supervised};

/// The path of a workspace binary built beside the running test (in
/// `target/<profile>/`). `scripts/test` builds every binary first.
pub fn binary(name: &str) -> Result<PathBuf> {
    let exe = std::env::current_exe().context("locating the test executable")?;
    // target/<profile>/deps/<test>-<hash>
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .ok_or_else(|| anyhow!("unexpected test executable path {}", exe.display()))?;
    let path = profile_dir.join(name);
    if !path.is_file() {
        bail!(
            "{} is not built; run `cargo build --workspace --bins` first (scripts/test does)",
            path.display()
        );
    }
    Ok(path)
}

/// One of our services running as a child process; stopped (SIGTERM, then
/// SIGKILL) when dropped.
#[derive(Debug)]
pub struct Service {
    name: String,
    program: PathBuf,
    args: Vec<OsString>,
    process: Option<Supervised>,
    dir: TempDir,
}

impl Service {
    /// Starts `bin` with `args`; its output goes to a log file.
    pub fn start(bin: &str, name: &str, args: &[String]) -> Result<Self> {
        let program = binary(bin)?;
        let dir = tempfile::Builder::new()
            .prefix(&format!("switchyard-{name}-"))
            .tempdir()
            .context("creating a temporary directory")?;
        let args: Vec<OsString> = args.iter().map(OsString::from).collect();
        let process = Supervised::spawn(&program, &args, &dir.path().join("service.log"))?;
        Ok(Self {
            name: name.to_owned(),
            program,
            args,
            process: Some(process),
            dir,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The service's output so far (the tail).
    pub fn log(&self) -> String {
        self.process
            .as_ref()
            .map(|p| p.log_tail())
            .unwrap_or_else(|| {
                std::fs::read_to_string(self.dir.path().join("service.log")).unwrap_or_default()
            })
    }

    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(|p| p.is_running())
    }

    /// Graceful stop (SIGTERM).
    pub fn stop(&mut self) -> Result<()> {
        match self.process.take() {
            Some(mut p) => p.stop(),
            None => Ok(()),
        }
    }

    /// SIGTERM without waiting: the service drains and exits on its own
    /// (see [`Service::is_running`]).
    pub fn terminate(&mut self) {
        if let Some(p) = self.process.as_mut() {
            p.terminate();
        }
    }

    /// A crash: SIGKILL, no shutdown code runs.
    pub fn kill(&mut self) -> Result<()> {
        match self.process.take() {
            Some(mut p) => p.kill(),
            None => Ok(()),
        }
    }

    /// Starts it again with the same arguments (after `stop` or `kill`).
    pub fn restart(&mut self) -> Result<()> {
        self.stop()?;
        self.process = Some(Supervised::spawn(
            &self.program,
            &self.args,
            &self.dir.path().join("service.log"),
        )?);
        Ok(())
    }

    /// Waits until `GET http://127.0.0.1:{port}{path}` answers 200; the
    /// error carries the service's log.
    pub fn wait_http_ok(&mut self, port: u16, path: &str, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let answer = match http_request(port, "GET", path, "") {
                Ok(_) => return Ok(()),
                Err(e) => e,
            };
            if !self.is_running() {
                bail!("{} exited; its output:\n{}", self.name, self.log());
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not answer 200 on {path} within {timeout:?} (its last answer: {answer}); its output:\n{}",
                    self.name,
                    self.log()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}
