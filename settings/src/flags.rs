//! A service's flags, described once: each names the config key it sets.

use std::borrow::Cow;
use std::path::PathBuf;

use clap::{Arg, ArgAction, Command};
use toml::{Table, Value};

use crate::units::{parse_bytes, parse_duration};

/// The id of the `--config FILE` flag every service has.
pub(crate) const CONFIG_ID: &str = "config";

/// What a flag's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Text (names, addresses, URLs, paths).
    Text,
    /// A number.
    Number,
    /// `true` or `false`.
    Switch,
    /// Comma-separated texts (a list in the file).
    List,
    /// `500ms`, `30s`, `10m` ([`crate::units::parse_duration`]).
    Duration,
    /// `512MiB`, `1GiB` ([`crate::units::parse_bytes`]).
    Bytes,
}

impl Kind {
    fn value_name(self) -> &'static str {
        match self {
            Kind::Text => "TEXT",
            Kind::Number => "NUMBER",
            Kind::Switch => "BOOL",
            Kind::List => "LIST",
            Kind::Duration => "DURATION",
            Kind::Bytes => "SIZE",
        }
    }
}

/// What an old flag's number meant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// The same value as the new flag takes.
    Same,
    /// Whole milliseconds (the new flag takes a duration).
    Millis,
    /// Whole seconds (the new flag takes a duration).
    Seconds,
}

/// An earlier release's name of a flag: still accepted (hidden from
/// `--help`), with a deprecation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Legacy {
    /// The old long flag, without `--` (its variable is derived the same
    /// way as a flag's).
    pub long: &'static str,
    unit: Unit,
}

impl Legacy {
    /// Renamed, same values.
    pub const fn renamed(long: &'static str) -> Self {
        Self {
            long,
            unit: Unit::Same,
        }
    }

    /// An old `_ms` flag: whole milliseconds.
    pub const fn millis(long: &'static str) -> Self {
        Self {
            long,
            unit: Unit::Millis,
        }
    }

    /// An old `_s` flag: whole seconds.
    pub const fn seconds(long: &'static str) -> Self {
        Self {
            long,
            unit: Unit::Seconds,
        }
    }

    /// The old value as the new flag's text.
    pub(crate) fn convert(&self, raw: &str) -> Result<String, String> {
        let whole = |unit: &str| {
            raw.trim()
                .parse::<u64>()
                .map(|n| format!("{n}{unit}"))
                .map_err(|_| format!("{raw:?} is not a whole number"))
        };
        match self.unit {
            Unit::Same => Ok(raw.to_owned()),
            Unit::Millis => whole("ms"),
            Unit::Seconds => whole("s"),
        }
    }
}

/// One flag: the config key it sets, with its help.
#[derive(Debug, Clone)]
pub struct Flag {
    /// The config key, `section.field` (`decode.overlap_credit`).
    pub path: Cow<'static, str>,
    /// What it does (`--help` adds the default).
    pub help: Cow<'static, str>,
    /// What its value is.
    pub kind: Kind,
    long: Option<Cow<'static, str>>,
    env: Option<Cow<'static, str>>,
    legacy: Vec<Legacy>,
}

impl Flag {
    /// A flag for `path`: `--a-b-c` for `a.b_c`, variable `SWITCHYARD_A_B_C`.
    pub fn new(path: &'static str, kind: Kind, help: &'static str) -> Self {
        Self {
            path: Cow::Borrowed(path),
            help: Cow::Borrowed(help),
            kind,
            long: None,
            env: None,
            legacy: Vec::new(),
        }
    }

    /// A flag made at run time (from a registry).
    pub fn owned(path: String, kind: Kind, help: String) -> Self {
        Self {
            path: Cow::Owned(path),
            help: Cow::Owned(help),
            kind,
            long: None,
            env: None,
            legacy: Vec::new(),
        }
    }

    /// Another long name than the one derived from the key.
    pub fn long(mut self, long: impl Into<Cow<'static, str>>) -> Self {
        self.long = Some(long.into());
        self
    }

    /// Another variable than the one derived from the long name.
    pub fn env(mut self, env: impl Into<Cow<'static, str>>) -> Self {
        self.env = Some(env.into());
        self
    }

    /// Its variable named with `prefix` instead of `SWITCHYARD_`
    /// (`MOCK_VLLM_PORT` for `--port`), unless it has its own.
    pub fn env_prefix(self, prefix: &str) -> Self {
        if self.env.is_some() {
            return self;
        }
        let env = format!("{prefix}{}", upper(&self.long_name()));
        self.env(env)
    }

    /// An earlier name of this flag, still accepted.
    pub fn legacy(mut self, legacy: Legacy) -> Self {
        self.legacy.push(legacy);
        self
    }

    /// The long name, without `--`.
    pub fn long_name(&self) -> String {
        match &self.long {
            Some(long) => long.to_string(),
            None => self.path.replace(['.', '_'], "-"),
        }
    }

    /// The environment variable.
    pub fn env_name(&self) -> String {
        match &self.env {
            Some(env) => env.to_string(),
            None => env_of(&self.long_name()),
        }
    }

    /// The clap ids of the flag and its legacy names.
    pub(crate) fn ids(&self) -> Vec<(String, Option<&Legacy>)> {
        std::iter::once((self.path.to_string(), None))
            .chain(self.legacy.iter().map(|l| (legacy_id(l), Some(l))))
            .collect()
    }

    /// The flag (and which legacy name) whose flat file key is `key`:
    /// `eff_isl_tokens`, `ledger_ttl_ms`.
    pub(crate) fn by_flat_key(&self, key: &str) -> Option<(&Flag, Option<&Legacy>)> {
        if self.long_name().replace('-', "_") == key {
            return Some((self, None));
        }
        self.legacy
            .iter()
            .find(|l| l.long.replace('-', "_") == key)
            .map(|l| (self, Some(l)))
    }

    /// A given value as the config's value.
    pub(crate) fn value(&self, raw: &str, legacy: Option<&Legacy>) -> Result<Value, String> {
        let raw = match legacy {
            Some(legacy) => legacy.convert(raw)?,
            None => raw.to_owned(),
        };
        let text = raw.trim();
        Ok(match self.kind {
            Kind::Text => Value::String(raw),
            Kind::Number => {
                if let Ok(n) = text.parse::<i64>() {
                    Value::Integer(n)
                } else if let Ok(x) = text.parse::<f64>() {
                    Value::Float(x)
                } else {
                    return Err(format!("{raw:?} is not a number"));
                }
            }
            Kind::Switch => match text {
                "true" => Value::Boolean(true),
                "false" => Value::Boolean(false),
                _ => return Err(format!("{raw:?} is not true or false")),
            },
            Kind::List => Value::Array(
                text.split(',')
                    .map(|s| Value::String(s.trim().to_owned()))
                    .collect(),
            ),
            Kind::Duration => {
                parse_duration(text).map_err(|e| e.to_string())?;
                Value::String(text.to_owned())
            }
            Kind::Bytes => {
                parse_bytes(text).map_err(|e| e.to_string())?;
                Value::String(text.to_owned())
            }
        })
    }
}

fn env_of(long: &str) -> String {
    format!("SWITCHYARD_{}", upper(long))
}

fn upper(long: &str) -> String {
    long.replace('-', "_").to_ascii_uppercase()
}

fn legacy_id(legacy: &Legacy) -> String {
    format!("legacy:{}", legacy.long)
}

/// `command` with `--config` and every flag, their help showing the
/// defaults in `defaults` (the config's `Default`, as a table).
pub(crate) fn command(command: Command, flags: &[Flag], defaults: &Table) -> Command {
    let mut command = command.arg(
        Arg::new(CONFIG_ID)
            .long("config")
            .env("SWITCHYARD_CONFIG")
            .value_name("FILE")
            .value_parser(clap::value_parser!(PathBuf))
            .help("TOML config file of the settings (a key per flag: --a-b is `a_b`, or `b` in section `[a]` where the service has sections); flags beat variables, which beat the file"),
    );
    for flag in flags {
        let default = crate::layers::lookup(defaults, &flag.path)
            .map(show)
            .filter(|d| !d.is_empty());
        let help = match default {
            Some(d) => format!("{} [default: {d}]", flag.help),
            None => flag.help.to_string(),
        };
        command = command.arg(
            Arg::new(flag.path.to_string())
                .long(flag.long_name())
                .env(flag.env_name())
                .value_name(flag.kind.value_name())
                .allow_negative_numbers(flag.kind == Kind::Number)
                .action(ArgAction::Set)
                .help(help),
        );
        for legacy in &flag.legacy {
            command = command.arg(
                Arg::new(legacy_id(legacy))
                    .long(legacy.long)
                    .env(env_of(legacy.long))
                    .action(ArgAction::Set)
                    .conflicts_with(flag.path.to_string())
                    .hide(true),
            );
        }
    }
    command
}

/// A default as `--help` shows it.
fn show(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Array(items) => items.iter().map(show).collect::<Vec<_>>().join(","),
        other => other.to_string(),
    }
}
