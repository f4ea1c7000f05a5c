//! The JSON the commands print (`--json` of `rebuild`, `status`, `merge`, `doctor`, `inspect`;
//! docs/json.md has every field): one `schema_version` first in every document, plain units
//! (seconds as `*_s` numbers, counts per split or stage as objects keyed by name).

use serde::ser::{SerializeMap, SerializeSeq};
use serde::{Serialize, Serializer};
use std::time::Duration;

/// Bumped when a field of any command's JSON changes meaning or goes away; fields may be added
/// without a bump.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Serialize)]
struct Versioned<'a, T: Serialize> {
    schema_version: u32,
    #[serde(flatten)]
    report: &'a T,
}

/// `report` as one pretty-printed JSON object, `schema_version` first.
pub fn render<T: Serialize>(report: &T) -> serde_json::Result<String> {
    serde_json::to_string_pretty(&Versioned {
        schema_version: SCHEMA_VERSION,
        report,
    })
}

/// A duration as seconds (a number).
pub fn seconds<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64())
}

/// `(name, value)` pairs (stages, phases) as an object keyed by name, in their order.
pub fn keyed<S: Serializer, V: Serialize>(
    pairs: &[(&'static str, V)],
    s: S,
) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(pairs.len()))?;
    for (k, v) in pairs {
        m.serialize_entry(k, v)?;
    }
    m.end()
}

/// One figure per split (in [`crate::config::SPLITS`] order) as an object keyed by split.
pub fn per_split<S: Serializer>(v: &[u64; 3], s: S) -> Result<S::Ok, S::Error> {
    let mut m = s.serialize_map(Some(3))?;
    for (split, n) in crate::config::SPLITS.iter().zip(v) {
        m.serialize_entry(split, n)?;
    }
    m.end()
}

/// `(path, reason)` pairs as a list of `{"path", "reason"}` objects.
pub fn path_reasons<S: Serializer>(v: &[(String, String)], s: S) -> Result<S::Ok, S::Error> {
    #[derive(Serialize)]
    struct Item<'a> {
        path: &'a str,
        reason: &'a str,
    }
    let mut q = s.serialize_seq(Some(v.len()))?;
    for (path, reason) in v {
        q.serialize_element(&Item { path, reason })?;
    }
    q.end()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize)]
    struct Report {
        #[serde(rename = "elapsed_s", serialize_with = "seconds")]
        elapsed: Duration,
        #[serde(rename = "stages_s", serialize_with = "keyed")]
        stages: Vec<(&'static str, f64)>,
        #[serde(serialize_with = "per_split")]
        rows: [u64; 3],
    }

    #[test]
    fn plain_units_and_the_version_first() {
        let r = Report {
            elapsed: Duration::from_millis(1500),
            stages: vec![("read", 0.25), ("hash", 0.5)],
            rows: [3, 1, 2],
        };
        let text = render(&r).unwrap();
        assert!(text.starts_with("{\n  \"schema_version\": 1,"), "{text}");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["elapsed_s"], 1.5);
        assert_eq!(v["stages_s"]["hash"], 0.5);
        assert_eq!(v["rows"]["validation"], 1);
    }
}
