//! Data-driven tests: a folder of `*.txt` scenarios, each a sequence of
//! commands with their recorded outputs.
//!
//! A command is a line (plus the indented lines after it); its output
//! follows a `----` line and ends at a blank line. A command that prints
//! nothing has no `----`. Blank lines and `#` comments are kept. Run with
//! `UPDATE_EXPECT=1` to rewrite the recorded outputs after a deliberate
//! change (and review the diff).

use std::path::{Path, PathBuf};

/// Splits `key=value` options from plain words.
pub fn options<'a>(
    words: impl Iterator<Item = &'a str>,
) -> (Vec<(&'a str, &'a str)>, Vec<&'a str>) {
    let (opts, plain): (Vec<_>, Vec<_>) = words.partition(|w| w.contains('='));
    let opts = opts
        .into_iter()
        .map(|o| o.split_once('=').expect("partitioned on '='"))
        .collect();
    (opts, plain)
}

/// The value of option `key`.
pub fn option<'a>(opts: &[(&str, &'a str)], key: &str) -> Option<&'a str> {
    opts.iter().find(|(k, _)| *k == key).map(|(_, v)| *v)
}

/// The `*.txt` files of `dir`, in name order.
pub fn scenario_files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "txt"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no scenarios in {}", dir.display());
    files
}

/// Runs every scenario of `dir`: `start` makes a file's state from its
/// text, `run` runs one command (its lines, the indented ones trimmed) and
/// returns its output. Panics naming every command whose output differs
/// from the recorded one, or rewrites the files with `UPDATE_EXPECT=1`.
pub fn run_scenarios<S>(
    dir: &Path,
    mut start: impl FnMut(&str) -> S,
    mut run: impl FnMut(&mut S, &[&str]) -> String,
) {
    let update = std::env::var_os("UPDATE_EXPECT").is_some();
    let mut failures = Vec::new();
    for path in scenario_files(dir) {
        let text = std::fs::read_to_string(&path).expect("a readable scenario");
        let mut state = start(&text);
        let (rewritten, differences) = run_file(&text, |command| run(&mut state, command));
        if update {
            std::fs::write(&path, rewritten).expect("a writable scenario");
        } else {
            failures.extend(
                differences
                    .into_iter()
                    .map(|d| format!("{}: {d}", path.display())),
            );
        }
    }
    assert!(
        failures.is_empty(),
        "outputs differ from the recorded ones (UPDATE_EXPECT=1 rewrites them):\n{}",
        failures.join("\n")
    );
}

/// One file: the text with today's outputs, and the commands whose output
/// differs.
fn run_file(text: &str, mut run: impl FnMut(&[&str]) -> String) -> (String, Vec<String>) {
    let mut rewritten = String::new();
    let mut differences = Vec::new();
    let mut lines = text.lines().peekable();
    while let Some(line) = lines.next() {
        rewritten.push_str(line);
        rewritten.push('\n');
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let mut command = vec![line];
        while let Some(next) = lines.next_if(|l| l.starts_with(' ')) {
            rewritten.push_str(next);
            rewritten.push('\n');
            command.push(next.trim());
        }
        let mut recorded = String::new();
        if lines.next_if_eq(&"----").is_some() {
            while let Some(l) = lines.next_if(|l| !l.trim().is_empty()) {
                recorded.push_str(l);
                recorded.push('\n');
            }
        }
        let got = run(&command);
        if got != recorded {
            differences.push(format!("{line}\n--- recorded\n{recorded}--- now\n{got}"));
        }
        if !got.is_empty() {
            rewritten.push_str("----\n");
            rewritten.push_str(&got);
            // An output ends at a blank line.
            if lines.peek().is_some_and(|l| !l.trim().is_empty()) {
                rewritten.push('\n');
            }
        }
    }
    (rewritten, differences)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outputs_are_compared_and_rewritten() {
        let text =
            "# a comment\necho a\n----\na\n\necho b\n  more\n----\nwrong\n\nsilent\necho c\n";
        let (rewritten, differences) = run_file(text, |command| match command[0] {
            "silent" => String::new(),
            line => format!(
                "{}\n",
                command[1..].iter().fold(line[5..].to_owned(), |a, b| a + b)
            ),
        });
        assert_eq!(
            rewritten,
            "# a comment\necho a\n----\na\n\necho b\n  more\n----\nbmore\n\nsilent\necho c\n----\nc\n"
        );
        assert_eq!(differences.len(), 2, "{differences:?}");
        assert!(differences[0].starts_with("echo b\n--- recorded\nwrong\n--- now\nbmore\n"));
    }

    #[test]
    fn options_are_split_from_words() {
        let (opts, plain) = options("a x=1 b y=2".split_whitespace());
        assert_eq!(opts, [("x", "1"), ("y", "2")]);
        assert_eq!(plain, ["a", "b"]);
        assert_eq!(option(&opts, "y"), Some("2"));
        assert_eq!(option(&opts, "z"), None);
    }
}
