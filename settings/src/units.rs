//! Durations and sizes, in one form everywhere: `500ms`, `30s`, `10m`,
//! `24h`, `1h 30m` (humantime) and `1GiB`, `512MiB`, `64KiB`, `1GB`, or a
//! bare number of bytes (bytesize). Flags, variables and files all go
//! through these; the `serde` modules let a config struct hold them.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// A duration or a size that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{text:?} is not a {what} ({example}): {reason}")]
pub struct UnitError {
    text: String,
    what: &'static str,
    example: &'static str,
    reason: String,
}

/// `500ms`, `30s`, `10m`, `24h`, `1h 30m`; a unit is required.
pub fn parse_duration(text: &str) -> Result<Duration, UnitError> {
    humantime::parse_duration(text.trim()).map_err(|e| UnitError {
        text: text.to_owned(),
        what: "duration",
        example: "like 500ms, 30s, 10m, 24h",
        reason: e.to_string(),
    })
}

/// The text of a duration in the largest unit that divides it (`24h`,
/// `10m`, `1500ms`), as `--help` shows defaults.
pub fn format_duration(duration: Duration) -> String {
    const UNITS: [(u128, &str); 4] = [
        (3_600_000_000_000, "h"),
        (60_000_000_000, "m"),
        (1_000_000_000, "s"),
        (1_000_000, "ms"),
    ];
    let nanos = duration.as_nanos();
    for (unit, name) in UNITS {
        if nanos != 0 && nanos % unit == 0 {
            return format!("{}{name}", nanos / unit);
        }
    }
    humantime::format_duration(duration).to_string()
}

/// `1GiB`, `512MiB`, `1GB` (10^9), `4096` (bytes).
pub fn parse_bytes(text: &str) -> Result<u64, UnitError> {
    bytesize::ByteSize::from_str(text.trim())
        .map(|b| b.as_u64())
        .map_err(|reason| UnitError {
            text: text.to_owned(),
            what: "size",
            example: "like 512MiB, 1GiB, or a number of bytes",
            reason,
        })
}

/// The exact text of a size: the largest binary unit that divides it
/// (`1GiB`, `640KiB`), else bytes.
pub fn format_bytes(bytes: u64) -> String {
    const UNITS: [(u32, &str); 4] = [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")];
    for (shift, unit) in UNITS {
        if bytes != 0 && bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

/// A [`Duration`] field as text (`#[serde(with = "settings::duration")]`).
pub mod duration {
    use super::*;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &Duration, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_duration(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        let text = String::deserialize(d)?;
        parse_duration(&text).map_err(serde::de::Error::custom)
    }
}

/// A duration held as whole milliseconds (`u64`), written as text:
/// `#[serde(with = "settings::duration_ms")]`.
pub mod duration_ms {
    use super::*;
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        duration::serialize(&Duration::from_millis(*value), s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        let duration = duration::deserialize(d)?;
        u64::try_from(duration.as_millis()).map_err(serde::de::Error::custom)
    }
}

/// A size in bytes (`u64`), written as text or as a number of bytes:
/// `#[serde(with = "settings::bytes")]`.
pub mod bytes {
    use super::*;
    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    pub fn serialize<S: Serializer>(value: &u64, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&format_bytes(*value))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        struct Size;
        impl Visitor<'_> for Size {
            type Value = u64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a size like 512MiB or 1GiB, or a number of bytes")
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<u64, E> {
                Ok(v)
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<u64, E> {
                u64::try_from(v).map_err(|_| E::custom("a size cannot be negative"))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<u64, E> {
                parse_bytes(v).map_err(E::custom)
            }
        }
        d.deserialize_any(Size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration(" 5m "), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("1h 30m"), Ok(Duration::from_secs(5400)));
        let e = parse_duration("2").unwrap_err().to_string();
        assert!(e.starts_with("\"2\" is not a duration (like 500ms"), "{e}");
        assert!(parse_duration("5 parsecs").is_err());
        assert_eq!(format_duration(Duration::from_secs(600)), "10m");
        assert_eq!(format_duration(Duration::from_secs(86_400)), "24h");
        assert_eq!(format_duration(Duration::from_millis(1_500)), "1500ms");
        assert_eq!(format_duration(Duration::from_millis(50)), "50ms");
        for d in [
            Duration::ZERO,
            Duration::from_micros(1_500),
            Duration::from_secs(90),
        ] {
            assert_eq!(parse_duration(&format_duration(d)), Ok(d), "{d:?}");
        }
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_bytes("1GiB"), Ok(1 << 30));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1GB"), Ok(1_000_000_000));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("0"), Ok(0));
        assert!(parse_bytes("MiB").is_err());
        assert!(parse_bytes("lots")
            .unwrap_err()
            .to_string()
            .contains("512MiB"));
        for n in [0, 1, 1023, 1024, 640 << 10, 1 << 30, 3 << 40, (1 << 30) + 1] {
            assert_eq!(parse_bytes(&format_bytes(n)), Ok(n), "{n}");
        }
        assert_eq!(format_bytes(1 << 30), "1GiB");
        assert_eq!(format_bytes(32 << 20), "32MiB");
    }
}
