//! The layers: a TOML file, the variables, the flags; deserialized into
//! the service's config.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::Serialize;
use toml::{Table, Value};

use crate::flags::{self, Flag};

/// Why the settings cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum SettingsError {
    #[error("reading the config file {path}: {error}")]
    ReadFile {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("parsing the config file {path}: {error}")]
    ParseFile {
        path: PathBuf,
        error: Box<toml::de::Error>,
    },
    #[error("{key} = {value:?}: {reason}")]
    Value {
        key: String,
        value: String,
        reason: String,
    },
    /// A key of the layered settings does not fit the config (unknown, or
    /// of the wrong type).
    #[error("{key}: {reason}")]
    Key { key: String, reason: String },
}

/// A setting spelled as an earlier release did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Deprecation {
    /// The old spelling.
    pub old: String,
    /// The spelling to use.
    pub new: String,
}

impl fmt::Display for Deprecation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} is deprecated and will be removed in the next release: use {}",
            self.old, self.new
        )
    }
}

/// What the command line and the environment said, and the config file
/// they name: the raw arguments, before they are layered and checked.
#[derive(Debug, Clone)]
pub struct Args {
    /// The `--config` file, if any.
    pub file: Option<PathBuf>,
    /// The values given by flags and variables, by config key.
    given: Table,
    /// Earlier spellings used on the command line or in the environment.
    deprecations: Vec<Deprecation>,
}

/// `command` with `--config` and every flag, their help showing the
/// defaults of `defaults` (the config's `Default`).
pub fn command(command: clap::Command, flags: &[Flag], defaults: &impl Serialize) -> clap::Command {
    flags::command(command, flags, &to_table(defaults))
}

impl Args {
    /// Reads the process's arguments (exits with clap's message on a bad
    /// flag, and prints `--help`).
    pub fn parse(command: clap::Command, flags: &[Flag], defaults: &impl Serialize) -> Args {
        let matches = self::command(command, flags, defaults).get_matches();
        Args::from_matches(&matches, flags).unwrap_or_else(|e| e.exit())
    }

    /// [`Args::parse`] over given arguments (the first is the program
    /// name), for tests.
    pub fn try_parse_from<I, T>(
        command: clap::Command,
        flags: &[Flag],
        defaults: &impl Serialize,
        args: I,
    ) -> Result<Args, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        let matches = self::command(command, flags, defaults).try_get_matches_from(args)?;
        Args::from_matches(&matches, flags)
    }

    /// No flags, no variables: only a file, or nothing (defaults).
    pub fn from_file(file: Option<PathBuf>) -> Args {
        Args {
            file,
            given: Table::new(),
            deprecations: Vec::new(),
        }
    }

    /// The arguments of `flags` in matches of a command that
    /// [`command`] made (what a clap `Args` impl over flags reads).
    pub fn from_matches(matches: &clap::ArgMatches, flags: &[Flag]) -> Result<Args, clap::Error> {
        let mut args = Args::from_file(matches.get_one::<PathBuf>(flags::CONFIG_ID).cloned());
        for flag in flags {
            for (id, legacy) in flag.ids() {
                let Some(raw) = given(matches, &id) else {
                    continue;
                };
                let value = flag.value(&raw, legacy).map_err(|reason| {
                    clap::Error::raw(
                        clap::error::ErrorKind::ValueValidation,
                        format!(
                            "--{}: {reason}\n",
                            legacy.map_or_else(|| flag.long_name(), |l| l.long.to_owned())
                        ),
                    )
                })?;
                if let Some(legacy) = legacy {
                    args.deprecations.push(Deprecation {
                        old: format!("--{}", legacy.long),
                        new: format!("--{} ({})", flag.long_name(), flag.path),
                    });
                }
                insert(&mut args.given, &flag.path, value);
            }
        }
        Ok(args)
    }

    /// Sets a key as a flag would (what tests and embedders use instead of
    /// a command line).
    pub fn set(&mut self, key: &str, value: impl Into<Value>) -> &mut Self {
        insert(&mut self.given, key, value.into());
        self
    }

    /// The file's settings with the variables' and the flags' over them,
    /// and every earlier spelling that was used.
    pub fn layered(&self, flags: &[Flag]) -> Result<(Table, Vec<Deprecation>), SettingsError> {
        let mut deprecations = self.deprecations.clone();
        let mut table = match &self.file {
            Some(path) => read_file(path)?,
            None => Table::new(),
        };
        remap_flat_keys(&mut table, flags, &mut deprecations);
        merge(&mut table, self.given.clone());
        Ok((table, deprecations))
    }

    /// [`Args::layered`], deserialized into the service's config.
    pub fn load<T: DeserializeOwned>(
        &self,
        flags: &[Flag],
    ) -> Result<(T, Vec<Deprecation>), SettingsError> {
        let (table, deprecations) = self.layered(flags)?;
        Ok((deserialize(table)?, deprecations))
    }
}

/// The value of a flag given on the command line or by its variable (not a
/// clap default: defaults come from the config's `Default`).
fn given(matches: &clap::ArgMatches, id: &str) -> Option<String> {
    use clap::parser::ValueSource;
    match matches.value_source(id) {
        Some(ValueSource::CommandLine | ValueSource::EnvVariable) => {
            let values: Vec<String> = matches.get_many::<String>(id)?.cloned().collect();
            Some(values.join(","))
        }
        _ => None,
    }
}

fn read_file(path: &Path) -> Result<Table, SettingsError> {
    let text = std::fs::read_to_string(path).map_err(|error| SettingsError::ReadFile {
        path: path.to_owned(),
        error,
    })?;
    text.parse::<Table>()
        .map_err(|error| SettingsError::ParseFile {
            path: path.to_owned(),
            error: Box::new(error),
        })
}

/// Top-level keys that are an earlier release's flat spelling of a flag
/// (`eff_isl_tokens`, `ledger_ttl_ms`, `policy = "isl"`) move to the flag's
/// key.
fn remap_flat_keys(table: &mut Table, flags: &[Flag], deprecations: &mut Vec<Deprecation>) {
    let roots: Vec<&str> = flags
        .iter()
        .map(|f| f.path.split('.').next().unwrap_or(&f.path))
        .collect();
    // A section is current; a plain value under a section's name (`policy
    // = "isl"`) or under no key of today is a candidate.
    let mut flat: Vec<String> = table
        .iter()
        .filter(|(k, v)| !(roots.contains(&k.as_str()) && v.is_table()))
        .map(|(k, _)| k.clone())
        .collect();
    // Those that become sections first, so that the others land in them.
    flat.sort_by_key(|k| !roots.contains(&k.as_str()));
    for key in flat {
        let Some((flag, legacy)) = flags
            .iter()
            .filter(|f| f.path != key)
            .find_map(|f| f.by_flat_key(&key))
        else {
            continue; // current, or unknown: the deserializer names it
        };
        let Some(old) = table.remove(&key) else {
            continue;
        };
        let value = match (legacy, &old) {
            (Some(legacy), Value::Integer(n)) => legacy.convert(&n.to_string()).map(Value::String),
            _ => Ok(old.clone()),
        };
        match value {
            Ok(value) => {
                deprecations.push(Deprecation {
                    old: format!("the file key {key}"),
                    new: flag.path.to_string(),
                });
                insert(table, &flag.path, value);
            }
            // Leave it where it was: the deserializer names the key.
            Err(_) => {
                table.insert(key, old);
            }
        }
    }
}

/// Sets `path` (`a.b.c`) in `table`, making the sections on the way.
fn insert(table: &mut Table, path: &str, value: Value) {
    let mut parts = path.split('.').peekable();
    let mut table = table;
    while let Some(part) = parts.next() {
        if parts.peek().is_none() {
            table.insert(part.to_owned(), value);
            return;
        }
        let entry = table
            .entry(part.to_owned())
            .or_insert_with(|| Value::Table(Table::new()));
        match entry.as_table_mut() {
            Some(section) => table = section,
            // A value where a section belongs: the deserializer names it.
            None => return,
        }
    }
}

/// `over` into `base`, key by key (sections merged, values replaced).
fn merge(base: &mut Table, over: Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(Value::Table(b)), Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

/// Deserializes the layered settings, naming the key that does not fit.
pub fn deserialize<T: DeserializeOwned>(table: Table) -> Result<T, SettingsError> {
    serde_path_to_error::deserialize(Value::Table(table)).map_err(|e| SettingsError::Key {
        key: e.path().to_string(),
        reason: e.into_inner().to_string(),
    })
}

/// A config as a table (for the defaults `--help` shows).
pub(crate) fn to_table(value: &impl Serialize) -> Table {
    match Value::try_from(value) {
        Ok(Value::Table(t)) => t,
        _ => Table::new(),
    }
}

/// The value at `path` in `table`.
pub(crate) fn lookup<'a>(table: &'a Table, path: &str) -> Option<&'a Value> {
    let mut parts = path.split('.');
    let mut value = table.get(parts.next()?)?;
    for part in parts {
        value = value.as_table()?.get(part)?;
    }
    Some(value)
}

#[cfg(test)]
mod tests;
