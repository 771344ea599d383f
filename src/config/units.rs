//! Durations and sizes as the config writes them.

use std::time::Duration;

use serde::Deserialize;

/// A duration written as a string: `"250ms"`, `"30s"`, `"5m"`, `"24h"`, `"7d"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dur(pub Duration);

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl serde::de::Visitor<'_> for V {
            type Value = Dur;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a duration as a string with a unit, such as \"3s\"")
            }
            fn visit_str<E: serde::de::Error>(self, s: &str) -> Result<Dur, E> {
                parse_duration(s).map(Dur).map_err(E::custom)
            }
            fn visit_i64<E: serde::de::Error>(self, n: i64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "durations are strings with a unit: write \"{n}s\" (or \"{n}ms\"), not {n}"
                )))
            }
            fn visit_u64<E: serde::de::Error>(self, n: u64) -> Result<Dur, E> {
                self.visit_i64(n as i64)
            }
            fn visit_f64<E: serde::de::Error>(self, n: f64) -> Result<Dur, E> {
                Err(E::custom(format!(
                    "durations are strings with a unit: write \"{n}s\", not {n}"
                )))
            }
        }
        d.deserialize_any(V)
    }
}

pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("duration {s:?} needs a unit (ms, s, m, h, d)"))?;
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("duration {s:?} must start with a whole number"))?;
    let ms = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => {
            return Err(format!(
                "duration {s:?}: unknown unit {unit:?} (ms, s, m, h, d)"
            ))
        }
    };
    n.checked_mul(ms)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("duration {s:?} is too large"))
}

/// A size written as a string: `"512B"`, `"64KiB"`, `"10MiB"`, `"1GiB"` (KB/MB/GB are decimal).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Size(pub u64);

impl<'de> Deserialize<'de> for Size {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        parse_size(&s).map(Size).map_err(serde::de::Error::custom)
    }
}

pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {s:?} must start with a whole number"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        other => {
            return Err(format!(
                "size {s:?}: unknown unit {other:?} (B, KiB, MiB, GiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} is too large"))
}
