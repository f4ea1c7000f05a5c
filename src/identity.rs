//! Identify: what a recording is, apart from its sound. Content hash (the identity), label (first
//! folder level), split (from the hash, or from the top-level folder in directory mode), and the
//! metadata in the file name `sensor~recording~YYYYmmddHHMMSS~gain.wav`.

use crate::config::{Settings, SplitMode, UnknownLabel};
use crate::output::ID_BYTES;
use std::path::{Component, Path};

pub type Hash = [u8; 32];

pub fn content_hash(bytes: &[u8]) -> Hash {
    *blake3::hash(bytes).as_bytes()
}

pub fn hex(hash: &Hash) -> String {
    blake3::Hash::from(*hash).to_hex().to_string()
}

/// Metadata from a file name that follows the acquisition convention. When the name does not
/// follow it, every field is "absent" (empty strings, -1, NaN): half-parsed names would put
/// wrong values next to right ones.
#[derive(Debug, Clone, PartialEq)]
pub struct NameMeta {
    pub sensor_id: String,
    pub recording_id: String,
    pub recorded_at: i64,
    pub gain_db: f32,
}

impl NameMeta {
    pub fn absent() -> Self {
        NameMeta {
            sensor_id: String::new(),
            recording_id: String::new(),
            recorded_at: -1,
            gain_db: f32::NAN,
        }
    }
}

pub fn parse_name(file_name: &str) -> NameMeta {
    parse_name_strict(file_name).unwrap_or_else(NameMeta::absent)
}

fn parse_name_strict(file_name: &str) -> Option<NameMeta> {
    let meta = parse_fields(file_name)?;
    (id_too_long(&meta).is_none()).then_some(meta)
}

/// The fields of a name of the convention's shape, whatever the length of its ids.
fn parse_fields(file_name: &str) -> Option<NameMeta> {
    let stem = file_name
        .len()
        .checked_sub(4)
        .filter(|&n| file_name.is_char_boundary(n) && file_name[n..].eq_ignore_ascii_case(".wav"))
        .map(|n| &file_name[..n])?;
    let parts: Vec<&str> = stem.split('~').collect();
    let [sensor, recording, stamp, gain] = parts.as_slice() else {
        return None;
    };
    if sensor.is_empty() || recording.is_empty() {
        return None;
    }
    let gain_db: f32 = gain.parse().ok().filter(|g: &f32| g.is_finite())?;
    Some(NameMeta {
        sensor_id: sensor.to_string(),
        recording_id: recording.to_string(),
        recorded_at: parse_timestamp(stamp)?,
        gain_db,
    })
}

/// An id of `meta` longer than its column (`ID_BYTES`): which, and its length.
fn id_too_long(meta: &NameMeta) -> Option<(&'static str, usize)> {
    [
        ("sensor", &meta.sensor_id),
        ("recording", &meta.recording_id),
    ]
    .into_iter()
    .find(|(_, id)| id.len() > ID_BYTES)
    .map(|(which, id)| (which, id.len()))
}

/// `YYYYmmddHHMMSS` (UTC) -> Unix seconds.
fn parse_timestamp(s: &str) -> Option<i64> {
    if s.len() != 14 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n = |r: std::ops::Range<usize>| s[r].parse::<u32>().ok();
    let month = time::Month::try_from(n(4..6)? as u8).ok()?;
    let date = time::Date::from_calendar_date(n(0..4)? as i32, month, n(6..8)? as u8).ok()?;
    let t = time::Time::from_hms(n(8..10)? as u8, n(10..12)? as u8, n(12..14)? as u8).ok()?;
    Some(
        time::PrimitiveDateTime::new(date, t)
            .assume_utc()
            .unix_timestamp(),
    )
}

/// Where a recording goes, decided from its path and hash.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub label: i16,
    pub split: usize,
}

/// Why a recording cannot be placed (it is quarantined with this reason).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PlacementError {
    #[error(
        "not inside a label folder: recordings go in <label>/<file>.wav under paths.recordings"
    )]
    NoLabelFolder,
    #[error(
        "label folder `{0}` is not in labels.names (add it, or set labels.unknown = \"append\")"
    )]
    UnknownLabel(String),
    #[error("top-level folder `{0}` is not mapped to a split in splits.directories")]
    UnmappedSplitDir(String),
    #[error("path is {len} bytes, longer than outputs.path_bytes ({max})")]
    PathTooLong { len: usize, max: usize },
    #[error("path is not valid UTF-8")]
    NotUtf8,
    #[error(
        "the file name's {which} id is {len} bytes, longer than the {max} its column holds: \
         splits.mode = \"sensor\" cannot keep this sensor's recordings in one split (shorten \
         the id in the name, or use another splits.mode)"
    )]
    IdTooLong {
        which: &'static str,
        len: usize,
        max: usize,
    },
}

/// The label list in force: `labels.names`, then folders appended under
/// `labels.unknown = "append"`, in the order they were first seen. Ids never change.
#[derive(Debug, Clone, PartialEq)]
pub struct LabelSet {
    pub names: Vec<String>,
    pub unknown: UnknownLabel,
}

impl LabelSet {
    pub fn new(configured: &[String], appended: &[String], unknown: UnknownLabel) -> Self {
        let mut names = configured.to_vec();
        for a in appended {
            if !names.contains(a) {
                names.push(a.clone());
            }
        }
        LabelSet { names, unknown }
    }

    /// The id of `folder`, appending it when allowed. Returns (id, appended?).
    pub fn resolve(&mut self, folder: &str) -> Result<(i16, bool), PlacementError> {
        if let Some(i) = self.names.iter().position(|n| n == folder) {
            return Ok((i as i16, false));
        }
        match self.unknown {
            UnknownLabel::Quarantine => Err(PlacementError::UnknownLabel(folder.to_string())),
            UnknownLabel::Append if self.names.len() < i16::MAX as usize => {
                self.names.push(folder.to_string());
                Ok(((self.names.len() - 1) as i16, true))
            }
            UnknownLabel::Append => Err(PlacementError::UnknownLabel(folder.to_string())),
        }
    }
}

/// Relative path as the `/`-separated UTF-8 string stored in `source_path`.
pub fn rel_string(rel: &Path) -> Result<String, PlacementError> {
    let mut out = String::new();
    for c in rel.components() {
        if let Component::Normal(part) = c {
            if !out.is_empty() {
                out.push('/');
            }
            out.push_str(part.to_str().ok_or(PlacementError::NotUtf8)?);
        }
    }
    Ok(out)
}

/// A relative path as the manifest keys it and `status` shows it: [`rel_string`]'s for a UTF-8
/// path; otherwise its UTF-8 runs as they are and each byte that is not UTF-8 as `\xNN`, so that
/// two names that differ only in such bytes keep records of their own (a lossy conversion made
/// both U+FFFD, one record for two files). Such a path is only ever quarantined.
pub fn rel_key(rel: &Path) -> String {
    if let Ok(s) = rel_string(rel) {
        return s;
    }
    let mut out = String::new();
    for c in rel.components() {
        if let Component::Normal(part) = c {
            if !out.is_empty() {
                out.push('/');
            }
            push_escaped(&mut out, part.as_encoded_bytes());
        }
    }
    out
}

/// `name`'s UTF-8 runs, and each other byte as `\xNN` (see [`rel_key`]).
pub fn push_escaped(out: &mut String, name: &[u8]) {
    use std::fmt::Write;
    for chunk in name.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            let _ = write!(out, "\\x{b:02x}");
        }
    }
}

/// The label folder of a relative path, if it has one.
pub fn label_folder<'a>(settings: &Settings, rel: &'a str) -> Option<&'a str> {
    let mut parts = rel.split('/');
    let n = rel.split('/').count();
    match settings.splits.mode {
        SplitMode::Hash | SplitMode::Sensor if n >= 2 => parts.next(),
        SplitMode::Directory if n >= 3 => parts.nth(1),
        _ => None,
    }
}

/// The folder that names the label, and the folder that names the split in directory mode.
/// Hash mode: `LABEL/.../file.wav`. Directory mode: `SPLITDIR/LABEL/.../file.wav`.
pub fn place(
    settings: &Settings,
    labels: &mut LabelSet,
    rel: &str,
    hash: &Hash,
) -> Result<Placement, PlacementError> {
    if rel.len() > settings.outputs.path_bytes {
        return Err(PlacementError::PathTooLong {
            len: rel.len(),
            max: settings.outputs.path_bytes,
        });
    }
    let parts: Vec<&str> = rel.split('/').collect();
    let ratios = settings.splits.ratios.as_array();
    let (split, label_folder) = match settings.splits.mode {
        SplitMode::Hash => {
            if parts.len() < 2 {
                return Err(PlacementError::NoLabelFolder);
            }
            (hash_split(hash, &ratios), parts[0])
        }
        SplitMode::Sensor => {
            if parts.len() < 2 {
                return Err(PlacementError::NoLabelFolder);
            }
            // A name of the convention's shape whose ids do not fit their columns would be
            // "outside the convention", its split taken from its content: its sensor's
            // recordings would land in every split.
            let split = match parse_fields(parts[parts.len() - 1]) {
                Some(meta) => {
                    if let Some((which, len)) = id_too_long(&meta) {
                        let max = ID_BYTES;
                        return Err(PlacementError::IdTooLong { which, len, max });
                    }
                    hash_split(&content_hash(meta.sensor_id.as_bytes()), &ratios)
                }
                None => hash_split(hash, &ratios),
            };
            (split, parts[0])
        }
        SplitMode::Directory => {
            if parts.len() < 3 {
                return Err(PlacementError::NoLabelFolder);
            }
            let split = settings
                .directory_split(parts[0])
                .ok_or_else(|| PlacementError::UnmappedSplitDir(parts[0].to_string()))?;
            (split, parts[1])
        }
    };
    let (label, _) = labels.resolve(label_folder)?;
    Ok(Placement { label, split })
}

/// Split from a hash (of the content, or of the sensor id in sensor mode): the first 8 bytes as an integer, mod 100, against the
/// cumulative ratios. The same bytes always land in the same split, on any host.
pub fn hash_split(hash: &Hash, ratios: &[u32; 3]) -> usize {
    let bucket = (u64::from_le_bytes(hash[..8].try_into().unwrap()) % 100) as u32;
    let mut acc = 0;
    for (i, r) in ratios.iter().enumerate() {
        acc += r;
        if bucket < acc {
            return i;
        }
    }
    2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_of_names_that_are_not_utf8_stay_apart() {
        use std::os::unix::ffi::OsStrExt;
        let key = |b: &[u8]| rel_key(Path::new(std::ffi::OsStr::from_bytes(b)));
        assert_eq!(key(b"LEAK/a.wav"), "LEAK/a.wav");
        assert_eq!(key(b"LEAK/x\xff.wav"), "LEAK/x\\xff.wav");
        assert_ne!(key(b"LEAK/x\xff.wav"), key(b"LEAK/x\xfe.wav"));
        // A folder that is not UTF-8, and a name with a valid multi-byte character beside.
        assert_eq!(key(b"\xc3(/\xc3\xa9\xff.wav"), "\\xc3(/\u{e9}\\xff.wav");
    }

    #[test]
    fn parses_the_acquisition_convention() {
        let m = parse_name("S001~R123~20250118120530~100.wav");
        assert_eq!(m.sensor_id, "S001");
        assert_eq!(m.recording_id, "R123");
        assert_eq!(m.recorded_at, 1737201930); // 2025-01-18T12:05:30Z
        assert_eq!(m.gain_db, 100.0);
        assert_eq!(parse_name("S9~R1~20240229000000~1.5.WAV").gain_db, 1.5);
    }

    #[test]
    fn names_off_the_convention_are_absent_not_half_parsed() {
        for name in [
            "clip.wav",
            "S001~R123~2025011812053~100.wav",
            "S001~R123~20251318120530~100.wav",
            "S001~R123~20250118120530~loud.wav",
            "S001~R123~20250118120530~100~x.wav",
            "~R123~20250118120530~100.wav",
            "S001~R123~20250118120530~100.txt",
        ] {
            let m = parse_name(name);
            assert_eq!(m.sensor_id, "", "{name}");
            assert_eq!(m.recorded_at, -1, "{name}");
            assert!(m.gain_db.is_nan(), "{name}");
        }
    }

    #[test]
    fn hash_split_follows_ratios() {
        let mut counts = [0usize; 3];
        for i in 0u32..20000 {
            let h = content_hash(&i.to_le_bytes());
            counts[hash_split(&h, &[70, 20, 10])] += 1;
        }
        let frac: Vec<f64> = counts.iter().map(|&c| c as f64 / 20000.0).collect();
        assert!(
            (frac[0] - 0.7).abs() < 0.02 && (frac[1] - 0.2).abs() < 0.02,
            "{frac:?}"
        );
        assert_eq!(hash_split(&content_hash(b"x"), &[0, 0, 100]), 2);
        assert_eq!(hash_split(&content_hash(b"x"), &[100, 0, 0]), 0);
    }

    #[test]
    fn labels_resolve_quarantine_or_append_with_stable_ids() {
        let names = vec!["A".to_string(), "B".to_string()];
        let mut q = LabelSet::new(&names, &[], UnknownLabel::Quarantine);
        assert_eq!(q.resolve("B").unwrap(), (1, false));
        assert!(matches!(
            q.resolve("C"),
            Err(PlacementError::UnknownLabel(_))
        ));
        let mut a = LabelSet::new(&names, &["D".to_string()], UnknownLabel::Append);
        assert_eq!(a.resolve("D").unwrap(), (2, false));
        assert_eq!(a.resolve("C").unwrap(), (3, true));
        assert_eq!(a.resolve("C").unwrap(), (3, false));
    }

    #[test]
    fn placement_checks_folder_and_path_length() {
        let mut s = Settings::default();
        s.outputs.path_bytes = 20;
        let mut labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
        let h = content_hash(b"abc");
        assert_eq!(place(&s, &mut labels, "LEAK/a.wav", &h).unwrap().label, 2);
        assert_eq!(
            place(&s, &mut labels, "a.wav", &h),
            Err(PlacementError::NoLabelFolder)
        );
        assert!(matches!(
            place(&s, &mut labels, "LEAK/aaaaaaaaaaaaaaaaaaaaa.wav", &h),
            Err(PlacementError::PathTooLong { .. })
        ));
    }

    #[test]
    fn sensor_mode_keeps_each_sensor_in_one_split() {
        let mut s = Settings::default();
        s.splits.mode = SplitMode::Sensor;
        let mut labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
        let mut per_sensor: std::collections::HashMap<String, std::collections::HashSet<usize>> =
            Default::default();
        let mut splits_seen = std::collections::HashSet::new();
        for i in 0..600u32 {
            let sensor = format!("S{:03}", i % 40);
            let rel = format!("LEAK/{sensor}~R{i}~20250118120530~100.wav");
            let h = content_hash(&i.to_le_bytes());
            let p = place(&s, &mut labels, &rel, &h).unwrap();
            per_sensor.entry(sensor).or_default().insert(p.split);
            splits_seen.insert(p.split);
        }
        assert!(per_sensor.values().all(|s| s.len() == 1), "{per_sensor:?}");
        assert_eq!(splits_seen.len(), 3, "40 sensors spread over all splits");
        // Off the convention: the content hash decides, as in hash mode.
        let h = content_hash(b"x");
        let p = place(&s, &mut labels, "LEAK/clip.wav", &h).unwrap();
        assert_eq!(p.split, hash_split(&h, &s.splits.ratios.as_array()));
        // An id its column cannot hold (a UUID is 36 bytes) is refused with why, not taken as
        // "off the convention" (which would scatter that sensor over every split).
        let uuid = "6f1c2a9e-0b7d-4c3e-9a51-2f8d7e6b4c10";
        for (rel, which) in [
            (
                format!("LEAK/{uuid}~R1~20250118120530~100.wav"),
                "sensor id is 36 bytes",
            ),
            (
                format!("LEAK/S001~{uuid}~20250118120530~100.wav"),
                "recording id is 36 bytes",
            ),
        ] {
            let e = place(&s, &mut labels, &rel, &h).unwrap_err();
            assert!(e.to_string().contains(which), "{rel}: {e}");
            assert!(e.to_string().contains("longer than the 32"), "{e}");
            // Hash mode has no use for the sensor: the name is outside the convention.
            let hash_mode = Settings::default();
            assert!(place(&hash_mode, &mut labels, &rel, &h).is_ok());
            let meta = parse_name(rel.rsplit('/').next().unwrap());
            assert_eq!(
                (meta.sensor_id.as_str(), meta.recorded_at),
                ("", -1),
                "{rel}"
            );
        }
    }

    #[test]
    fn directory_mode_takes_split_then_label() {
        let mut s = Settings::default();
        s.splits.mode = SplitMode::Directory;
        s.splits
            .directories
            .insert("val".into(), "validation".into());
        let mut labels = LabelSet::new(&s.labels.names, &[], s.labels.unknown);
        let h = content_hash(b"abc");
        let p = place(&s, &mut labels, "val/NORMAL/x.wav", &h).unwrap();
        assert_eq!((p.split, p.label), (1, 3));
        assert!(matches!(
            place(&s, &mut labels, "train/NORMAL/x.wav", &h),
            Err(PlacementError::UnmappedSplitDir(_))
        ));
    }
}
