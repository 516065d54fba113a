//! The event log as a debugging tool, end to end: a multi-turn workload
//! through the real processes, the window exported with `replay export`,
//! then verified, explained and what-if'd from the file.

mod cluster;

use std::process::{Command, Output};

use anyhow::{ensure, Context, Result};
use cluster::{conversation, path, Cluster};
use serde_json::Value;

fn replay(args: &[&str]) -> Result<Output> {
    let output = Command::new(tests::binary("replay")?)
        .args(args)
        .output()
        .context("running replay")?;
    Ok(output)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn ok(output: Output, what: &str) -> Result<String> {
    ensure!(
        output.status.success(),
        "{what} failed ({}): {}{}",
        output.status,
        stdout(&output),
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(stdout(&output))
}

#[tokio::test(flavor = "multi_thread")]
async fn export_verify_explain_and_what_if() -> Result<()> {
    let cluster = Cluster::start(&["p0"], &["d0", "d1"], 1).await?;
    let result = async {
        let mut bypassed = None;
        for seed in 40..43 {
            let turns = conversation(&cluster, 0, seed, 3).await?;
            if path(&turns[2]) == "bypass" {
                bypassed = Some(format!("conv{seed}-turn2"));
            }
        }
        let bypassed = bypassed.context("a later turn bypassed")?;
        let dir = tempfile::tempdir()?;
        let file = dir.path().join("window.syx");
        let file_arg = file.to_str().context("a UTF-8 path")?;
        let nats = cluster.nats.url();

        let login = cluster.nats_login(bus::permissions::REPLAY_USER);
        let mut export_args = vec!["export", "--nats", &nats, "--out", file_arg];
        export_args.extend(login.iter().map(String::as_str));
        let export = ok(replay(&export_args)?, "export")?;
        ensure!(export.contains("9 decisions"), "{export}");

        // Every decision reproduced, the rebuilt index equal to the live one.
        let verify: Value = serde_json::from_str(&ok(
            replay(&["verify", "--file", file_arg, "--json"])?,
            "verify",
        )?)?;
        ensure!(
            verify["decisions"] == 9 && verify["reproduced"] == 9,
            "{verify}"
        );
        ensure!(
            verify["digest"]["live"] == verify["digest"]["rebuilt"],
            "{verify}"
        );

        // A window that starts mid-conversation: its first decision's
        // prompt begins with a turn logged before the window, which the
        // export carries; every decision still replays.
        let tail = dir.path().join("tail.syx");
        let tail_arg = tail.to_str().context("a UTF-8 path")?;
        let mut tail_args = vec!["export", "--nats", &nats, "--out", tail_arg, "--last", "4"];
        tail_args.extend(login.iter().map(String::as_str));
        let export = ok(replay(&tail_args)?, "export --last 4")?;
        ensure!(
            export.contains("4 decisions") && export.contains("1 earlier prompts"),
            "{export}"
        );
        let verify: Value = serde_json::from_str(&ok(
            replay(&["verify", "--file", tail_arg, "--json"])?,
            "verify the tail",
        )?)?;
        ensure!(
            verify["decisions"] == 4 && verify["reproduced"] == 4,
            "{verify}"
        );

        // Explaining a bypassed turn names the decode worker's overlap and
        // the threshold it was under.
        let text = ok(
            replay(&["explain", &bypassed, "--file", file_arg])?,
            "explain",
        )?;
        ensure!(
            text.contains("bypass") && text.contains("2048") && text.contains("holds"),
            "{text}"
        );
        let json: Value = serde_json::from_str(&ok(
            replay(&["explain", &bypassed, "--file", file_arg, "--json"])?,
            "explain --json",
        )?)?;
        let decode = json["explanation"]["decode"]
            .as_str()
            .context("decode worker")?
            .to_owned();
        let chosen = json["explanation"]["decode_candidates"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["worker"] == decode.as_str()))
            .context("the decode worker among the candidates")?;
        ensure!(
            chosen["picked"] == true && chosen["overlap_blocks"]["device"].as_u64() > Some(200),
            "{chosen}"
        );
        ensure!(json["reproduced"] == true, "{json}");

        // A lower ISL threshold sends the appends to prefill workers.
        let what_if: Value = serde_json::from_str(&ok(
            replay(&[
                "what-if",
                "--file",
                file_arg,
                "--param",
                "eff_isl_tokens=100",
                "--json",
            ])?,
            "what-if",
        )?)?;
        ensure!(what_if["bypass_to_remote"].as_u64() >= Some(6), "{what_if}");
        ensure!(what_if["remote_to_bypass"] == 0, "{what_if}");

        // A truncated or corrupt file: a clear error naming the offset.
        let bytes = std::fs::read(&file)?;
        let cut = dir.path().join("cut.syx");
        std::fs::write(&cut, &bytes[..bytes.len() / 2])?;
        let failed = replay(&["verify", "--file", cut.to_str().context("path")?])?;
        let error = String::from_utf8_lossy(&failed.stderr);
        ensure!(
            !failed.status.success() && error.contains("truncated at byte"),
            "{error}"
        );
        // Bytes that may still decode (inside a block hash, say) are caught
        // by the frame's checksum.
        let mut corrupt = bytes.clone();
        let at = bytes.len() / 3;
        corrupt[at..at + 8].copy_from_slice(b"\xff\xff\xff\xff\xff\xff\xff\xff");
        std::fs::write(&cut, &corrupt)?;
        let failed = replay(&["verify", "--file", cut.to_str().context("path")?])?;
        let error = String::from_utf8_lossy(&failed.stderr);
        ensure!(
            !failed.status.success() && error.contains("byte "),
            "status {}, stderr: {error}",
            failed.status
        );
        Ok(())
    }
    .await;
    result.with_context(|| cluster.logs())
}
