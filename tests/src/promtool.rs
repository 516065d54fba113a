//! `promtool check metrics` on a service's `/metrics` text: Prometheus's own
//! parser and lints (Debian's `prometheus` package, which `scripts/test`
//! installs). Without promtool the check is skipped with a note, except
//! under CI (`CI` set), where that is an error.

use std::io::Write as _;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};

/// Checks `text` with promtool. `accepted` are lint messages the text may
/// draw (e.g. mock-vllm's `metric names should not contain ':'`: it exports
/// vLLM's own names); anything else promtool says is an error.
pub fn check_metrics(text: &str, accepted: &[&str]) -> Result<()> {
    let child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn();
    let mut child = match child {
        Ok(child) => child,
        Err(e) if std::env::var_os("CI").is_some() => {
            bail!("promtool could not run under CI (scripts/test installs it): {e}")
        }
        Err(_) => {
            eprintln!("NOTE: promtool is not installed: its check of /metrics is skipped");
            return Ok(());
        }
    };
    child
        .stdin
        .take()
        .context("promtool's stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let objections: Vec<&str> = said
        .lines()
        .filter(|l| !l.trim().is_empty() && !accepted.iter().any(|a| l.contains(a)))
        .collect();
    // Exit code 3: lint problems only (all of them accepted, if no
    // objection is left); anything else but success: the text is invalid.
    let linted_only = out.status.code() == Some(3);
    if !objections.is_empty() || !(out.status.success() || linted_only) {
        bail!(
            "promtool check metrics ({}): {}\n{text}",
            out.status,
            objections.join("; ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_text_and_lint_problems_are_errors_unless_accepted() {
        if Command::new("promtool").arg("--version").output().is_err() {
            eprintln!("NOTE: promtool is not installed: nothing to test");
            return;
        }
        let good = "# HELP a_total Things.\n# TYPE a_total counter\na_total 3\n";
        check_metrics(good, &[]).unwrap();
        let colon = "# HELP vllm:x_total Things.\n# TYPE vllm:x_total counter\nvllm:x_total 3\n";
        assert!(check_metrics(colon, &[]).is_err());
        check_metrics(colon, &["should not contain ':'"]).unwrap();
        let no_help = "# TYPE b_total counter\nb_total 1\n";
        assert!(check_metrics(no_help, &["should not contain ':'"]).is_err());
        assert!(check_metrics("not a metric line at all {\n", &[]).is_err());
    }
}
