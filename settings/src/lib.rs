//! How every Switchyard service reads its settings.
//!
//! A service describes its flags once, as a list of [`Flag`]s, each naming
//! the config key it sets (`decode.overlap_credit`). From that list:
//!
//! * the command line: `--decode-overlap-credit`, with the variable
//!   `SWITCHYARD_DECODE_OVERLAP_CREDIT`, and `--help` showing the default
//!   read from the config's `Default` (the only place defaults live);
//! * the layers: a TOML file (`--config`), then the variables, then the
//!   flags, each over the one before ([`Args::layered`]);
//! * the typed config: the layered table deserialized into the service's
//!   `Config` (sections are the cores' own config structs), with the
//!   failing key named ([`deserialize`]).
//!
//! Earlier spellings still work for one release and are reported as
//! [`Deprecation`]s, for the service to log: old flags (`--ledger-ttl-ms
//! 600000` for `--ledger-ttl 10m`) and flat file keys (`eff_isl_tokens = 512`
//! at the top of the file for `[policy] eff_isl_tokens`).
//!
//! Durations and sizes have one form everywhere ([`units`]).

#[cfg(feature = "layers")]
mod flags;
#[cfg(feature = "layers")]
mod layers;
pub mod units;

#[cfg(feature = "layers")]
pub use flags::{Flag, Kind, Legacy};
#[cfg(feature = "layers")]
pub use layers::{command, deserialize, Args, Deprecation, SettingsError};
pub use units::{
    bytes, duration, duration_ms, format_bytes, format_duration, parse_bytes, parse_duration,
};
