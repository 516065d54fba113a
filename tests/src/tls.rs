//! A throwaway certificate authority for TLS tests: a CA, a server
//! certificate for `127.0.0.1`/`localhost` and a client certificate, made
//! with the `openssl` command in a temporary directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context as _, Result};
use tempfile::TempDir;

/// PEM files of a fresh CA and the two certificates it signed; removed on
/// drop.
#[derive(Debug)]
pub struct TestCa {
    dir: TempDir,
}

impl TestCa {
    /// A CA, `server.pem`/`server.key` (SAN `IP:127.0.0.1`, `DNS:localhost`)
    /// and `client.pem`/`client.key`, valid for a day.
    pub fn generate() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("switchyard-ca-")
            .tempdir()?;
        let ec = [
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
        ];
        openssl(
            dir.path(),
            &[
                &["req", "-x509"],
                &ec[..],
                &[
                    "-keyout",
                    "ca.key",
                    "-out",
                    "ca.pem",
                    "-days",
                    "1",
                    "-subj",
                    "/CN=switchyard-test-ca",
                ],
            ]
            .concat(),
        )?;
        for name in ["server", "client"] {
            let (key, csr, pem, ext) = (
                format!("{name}.key"),
                format!("{name}.csr"),
                format!("{name}.pem"),
                format!("{name}.ext"),
            );
            std::fs::write(
                dir.path().join(&ext),
                "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth,clientAuth\n",
            )?;
            let subject = format!("/CN={name}");
            openssl(
                dir.path(),
                &[
                    &["req"],
                    &ec[..],
                    &["-keyout", &key, "-out", &csr, "-subj", &subject],
                ]
                .concat(),
            )?;
            openssl(
                dir.path(),
                &[
                    "x509",
                    "-req",
                    "-in",
                    &csr,
                    "-CA",
                    "ca.pem",
                    "-CAkey",
                    "ca.key",
                    "-CAcreateserial",
                    "-out",
                    &pem,
                    "-days",
                    "1",
                    "-extfile",
                    &ext,
                ],
            )?;
        }
        Ok(Self { dir })
    }

    /// A file of the CA's directory: `ca.pem`, `server.pem`, `server.key`,
    /// `client.pem`, `client.key`.
    pub fn path(&self, file: &str) -> PathBuf {
        self.dir.path().join(file)
    }
}

fn openssl(dir: &Path, args: &[&str]) -> Result<()> {
    let output = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .context("running openssl (needed for the TLS tests)")?;
    if !output.status.success() {
        bail!(
            "openssl {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(())
}
