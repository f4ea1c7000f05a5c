//! Shards of a recording tree for `rebuild --shard I/N` (docs/scale-out.md): which
//! recordings shard I of N owns, decided from the recording's path alone (no byte of the file
//! is read to decide), so that each shard lists the tree and reads only its own files, and a
//! path's shard never changes (whatever else is in the tree, on whichever machine).
//!
//! The rule: the blake3 hash of the path relative to `paths.recordings` (UTF-8, `/`-separated,
//! as `source_path` holds it), bytes 0..8 as a little-endian u64 `x`, mapped to
//! `floor(x * N / 2^64)`, the shard index in 0..N. The same bytes under several paths may so
//! land in several shards: `merge` settles their ownership (see [`crate::merge`]). A shard's
//! outputs say what they are in a [`ShardRecord`].

use serde::{Deserialize, Serialize};
use std::fmt;

/// The rule, as shard outputs name it (a shard made by another rule cannot be merged with
/// these).
pub const RULE: &str = "path: floor(u64_le(blake3(relative path)[0..8]) * N / 2^64)";

/// The HDF5 attribute of each split file of a shard's outputs that holds its [`ShardRecord`].
pub const ATTRIBUTE: &str = "shard_json";

/// Shard `index` of `count` (0 <= index < count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: u32,
    pub count: u32,
}

/// Why a `--shard` value cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--shard {value}: {why}")]
pub struct ShardError {
    pub value: String,
    pub why: String,
}

/// What a shard's outputs are (attribute [`ATTRIBUTE`] of each split file, JSON), for `merge`
/// to settle ownership across shards and to refuse an incomplete or mixed set.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardRecord {
    pub index: u32,
    pub count: u32,
    /// [`RULE`].
    pub rule: String,
    /// The recordings folder, absolute: shards of one tree name the same.
    pub tree: String,
    /// Files listed in the whole tree (every shard lists all of it), and the blake3 of the
    /// sorted relative paths: shards that listed different trees (it changed while they ran)
    /// differ here.
    pub listed: u64,
    pub listing_blake3: String,
    /// The label and split settings (`[labels]`, `[splits]`), which every shard must share.
    pub settings: serde_json::Value,
    /// The contents of this file's rows that several paths of this shard hold: every path
    /// (byte order; the first owns the row here) with its label folder.
    #[serde(default)]
    pub shared: Vec<SharedContent>,
}

/// One content several paths of a shard hold.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SharedContent {
    pub blake3: String,
    pub paths: Vec<(String, String)>,
}

impl ShardRecord {
    /// The record of `shard` over the listing `rels` (every relative path found, sorted) of
    /// `tree`, with `settings`' label and split settings; `shared` is filled in per file.
    pub fn new<'a>(
        shard: Shard,
        tree: &std::path::Path,
        rels: impl Iterator<Item = &'a str>,
        settings: &crate::config::Settings,
    ) -> ShardRecord {
        let mut listing = blake3::Hasher::new();
        let mut listed = 0;
        for rel in rels {
            listing.update(rel.as_bytes());
            listing.update(b"\0");
            listed += 1;
        }
        // Absolute, and without a trailing `/` or `/./`: one folder, however spelt, names one
        // tree (a shard run with `.../MASTER_DATASET/` made a tree of its own).
        let tree: std::path::PathBuf = std::path::absolute(tree)
            .unwrap_or_else(|_| tree.to_path_buf())
            .components()
            .collect();
        ShardRecord {
            index: shard.index,
            count: shard.count,
            rule: RULE.to_string(),
            tree: tree.to_string_lossy().into_owned(),
            listed,
            listing_blake3: listing.finalize().to_hex().to_string(),
            settings: serde_json::json!({
                "labels": settings.labels,
                "splits": settings.splits,
            }),
            shared: Vec::new(),
        }
    }

    /// This record's shard.
    pub fn shard(&self) -> Shard {
        Shard {
            index: self.index,
            count: self.count,
        }
    }
}

impl Shard {
    /// The whole tree (what a rebuild without `--shard` is).
    pub const ALL: Shard = Shard { index: 0, count: 1 };

    pub fn new(index: u32, count: u32) -> Result<Shard, String> {
        if count == 0 {
            return Err("the shard count must be at least 1".into());
        }
        if index >= count {
            return Err(format!(
                "shard index {index} is not below the count {count} (indexes run from 0 to {})",
                count - 1
            ));
        }
        Ok(Shard { index, count })
    }

    /// Whether this shard owns the recording at `rel` (relative to `paths.recordings`).
    pub fn contains(&self, rel: &str) -> bool {
        self.of(rel) == self.index
    }

    /// The shard (of `self.count`) that owns the recording at `rel`.
    pub fn of(&self, rel: &str) -> u32 {
        let h = blake3::hash(rel.as_bytes());
        let x = u64::from_le_bytes(h.as_bytes()[0..8].try_into().expect("8 bytes"));
        ((x as u128 * self.count as u128) >> 64) as u32
    }

    pub fn is_all(&self) -> bool {
        self.count == 1
    }

    /// Parse a `--shard` value: `I/N` (0 <= I < N), or `auto` / `auto/N`, which take the index
    /// (and the count) from the scheduler's environment through `env`:
    /// - Slurm array job: `SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN` (0 when the minimum is
    ///   unset) of `SLURM_ARRAY_TASK_COUNT` tasks;
    /// - Kubernetes Indexed Job: `JOB_COMPLETION_INDEX`, with the count from `auto/N` (the
    ///   Job's `completions`; Kubernetes does not put it in the environment).
    pub fn parse(value: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Shard, ShardError> {
        let err = |why: String| ShardError {
            value: value.to_string(),
            why,
        };
        let number = |what: &str, s: &str| -> Result<u32, ShardError> {
            let s = s.trim();
            s.parse::<u32>().map_err(|e| {
                err(match e.kind() {
                    std::num::IntErrorKind::PosOverflow => {
                        format!("{what} `{s}` is too large (at most {})", u32::MAX)
                    }
                    _ => {
                        format!("{what} `{s}` is not a whole number (expected I/N, auto or auto/N)")
                    }
                })
            })
        };
        let (first, count) = match value.split_once('/') {
            Some((a, b)) => (a, Some(number("the count", b)?)),
            None => (value, None),
        };
        if first != "auto" {
            let Some(count) = count else {
                return Err(err(
                    "expected I/N (shard I of N, counting from 0), auto or auto/N".into(),
                ));
            };
            return Shard::new(number("the index", first)?, count).map_err(err);
        }
        let var = |name: &str| -> Result<Option<u32>, ShardError> {
            match env(name) {
                None => Ok(None),
                Some(v) if v.trim().is_empty() => Ok(None),
                Some(v) => v
                    .trim()
                    .parse()
                    .map(Some)
                    .map_err(|_| err(format!("${name} = `{v}` is not a whole number"))),
            }
        };
        let (index, env_count, from) = if let Some(id) = var("SLURM_ARRAY_TASK_ID")? {
            let min = var("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
            let index = id.checked_sub(min).ok_or_else(|| {
                err(format!(
                    "$SLURM_ARRAY_TASK_ID = {id} is below $SLURM_ARRAY_TASK_MIN = {min}"
                ))
            })?;
            (index, var("SLURM_ARRAY_TASK_COUNT")?, "Slurm")
        } else if let Some(index) = var("JOB_COMPLETION_INDEX")? {
            (index, None, "Kubernetes")
        } else {
            return Err(err(
                "neither $SLURM_ARRAY_TASK_ID (a Slurm array job) nor $JOB_COMPLETION_INDEX (a \
                 Kubernetes Indexed Job) is set: give the shard as I/N"
                    .into(),
            ));
        };
        let count = match (count, env_count) {
            (Some(a), Some(b)) if a != b => {
                return Err(err(format!(
                    "the count {a} differs from $SLURM_ARRAY_TASK_COUNT = {b}"
                )))
            }
            (Some(n), _) | (None, Some(n)) => n,
            (None, None) => {
                return Err(err(format!(
                    "the index comes from {from}, but nothing gives the shard count: write \
                     auto/N (N = the number of tasks)"
                )))
            }
        };
        Shard::new(index, count).map_err(|why| err(format!("from {from}: {why}")))
    }
}

impl fmt::Display for Shard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::content_hash;
    use std::collections::HashMap;

    fn no_env(_: &str) -> Option<String> {
        None
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| map.get(k).cloned()
    }

    /// Paths as a tree holds them: label folders, sensor~recording~time~gain names.
    fn paths(n: u32) -> Vec<String> {
        (0..n)
            .map(|i| format!("LEAK/S{:03}~R{i:07}~20250118120530~100.wav", i % 97))
            .collect()
    }

    #[test]
    fn every_recording_is_in_exactly_one_shard() {
        for count in [1, 2, 3, 4, 7, 16] {
            for p in paths(2000) {
                let owners = (0..count)
                    .filter(|&i| Shard::new(i, count).unwrap().contains(&p))
                    .count();
                assert_eq!(owners, 1, "count {count}");
            }
        }
    }

    #[test]
    fn shards_are_balanced() {
        let all = paths(40_000);
        for count in [2u32, 4, 10, 64] {
            let mut sizes = vec![0u32; count as usize];
            for p in &all {
                sizes[Shard::new(0, count).unwrap().of(p) as usize] += 1;
            }
            let mean = all.len() as f64 / count as f64;
            // Binomial: 5 standard deviations around the mean.
            let tolerance = 5.0 * (mean * (1.0 - 1.0 / count as f64)).sqrt();
            for (i, &s) in sizes.iter().enumerate() {
                assert!(
                    (s as f64 - mean).abs() < tolerance,
                    "count {count}: shard {i} holds {s}, mean {mean}"
                );
            }
        }
    }

    #[test]
    fn shards_are_independent_of_splits() {
        // Each shard must hold the split ratios (splits come from the content), not one split.
        let all: Vec<(String, crate::identity::Hash)> = paths(20_000)
            .into_iter()
            .map(|p| {
                let h = content_hash(format!("bytes of {p}").as_bytes());
                (p, h)
            })
            .collect();
        let ratios = [70, 20, 10];
        for index in 0..4 {
            let shard = Shard::new(index, 4).unwrap();
            let mut per_split = [0f64; 3];
            let mut n = 0f64;
            for (_, h) in all.iter().filter(|(p, _)| shard.contains(p)) {
                per_split[crate::identity::hash_split(h, &ratios)] += 1.0;
                n += 1.0;
            }
            for (s, r) in ratios.iter().enumerate() {
                let share = 100.0 * per_split[s] / n;
                assert!(
                    (share - *r as f64).abs() < 2.5,
                    "shard {index}: split {s} has {share:.1}%, configured {r}%"
                );
            }
        }
    }

    #[test]
    fn the_rule_is_stable() {
        // Pinned: a path's shard must never change between versions (outputs of shards made by
        // different versions are merged together).
        let p = "LEAK/S001~R123~20250118120530~100.wav";
        let got: Vec<u32> = [2, 3, 4, 10, 1000]
            .iter()
            .map(|&n| Shard::new(0, n).unwrap().of(p))
            .collect();
        let h = blake3::hash(p.as_bytes());
        let x = u64::from_le_bytes(h.as_bytes()[0..8].try_into().unwrap()) as f64 / 2f64.powi(64);
        let expect: Vec<u32> = [2, 3, 4, 10, 1000]
            .iter()
            .map(|&n| (x * n as f64) as u32)
            .collect();
        assert_eq!(got, expect);
        assert_eq!(got, [0, 1, 1, 4, 463], "the pinned shards of {p}");
        assert!(Shard::ALL.contains(p));
        assert!(Shard::new(0, 1).unwrap().is_all());
    }

    #[test]
    fn records_of_one_tree_agree_and_name_their_listing() {
        let settings = crate::config::Settings::default();
        let tree = std::path::Path::new("/data/rec");
        let all = paths(10);
        let a = ShardRecord::new(
            Shard::new(0, 2).unwrap(),
            tree,
            all.iter().map(|s| s.as_str()),
            &settings,
        );
        let b = ShardRecord::new(
            Shard::new(1, 2).unwrap(),
            tree,
            all.iter().map(|s| s.as_str()),
            &settings,
        );
        assert_eq!((a.listed, &a.listing_blake3), (10, &b.listing_blake3));
        for spelt in ["/data/rec/", "/data/./rec", "/data//rec/."] {
            let c = ShardRecord::new(
                Shard::new(1, 2).unwrap(),
                std::path::Path::new(spelt),
                all.iter().map(|s| s.as_str()),
                &settings,
            );
            assert_eq!(c.tree, a.tree, "{spelt}");
        }
        assert_eq!((a.rule.as_str(), &a.settings), (RULE, &b.settings));
        let fewer = ShardRecord::new(
            Shard::new(1, 2).unwrap(),
            tree,
            all[1..].iter().map(|s| s.as_str()),
            &settings,
        );
        assert_ne!(fewer.listing_blake3, a.listing_blake3);
        let back: ShardRecord = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        assert_eq!(back, a);
        assert_eq!(back.shard(), Shard::new(0, 2).unwrap());
    }

    #[test]
    fn explicit_values_parse_and_bad_ones_say_why() {
        assert_eq!(
            Shard::parse("2/4", &no_env).unwrap(),
            Shard { index: 2, count: 4 }
        );
        assert_eq!(Shard::parse("0/1", &no_env).unwrap(), Shard::ALL);
        let e = |v: &str| Shard::parse(v, &no_env).unwrap_err().to_string();
        assert!(e("4/4").contains("not below the count"), "{}", e("4/4"));
        assert!(e("0/0").contains("at least 1"));
        assert!(e("x/4").contains("not a whole number"));
        assert!(
            e("0/99999999999").contains("too large"),
            "{}",
            e("0/99999999999")
        );
        assert!(e("3").contains("expected I/N"));
        assert!(e("auto").contains("SLURM_ARRAY_TASK_ID"));
        assert_eq!(Shard::new(1, 3).unwrap().to_string(), "1/3");
    }

    #[test]
    fn auto_takes_the_index_from_slurm_or_kubernetes() {
        let slurm = env_of(&[
            ("SLURM_ARRAY_TASK_ID", "5"),
            ("SLURM_ARRAY_TASK_MIN", "3"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
        ]);
        assert_eq!(
            Shard::parse("auto", &slurm).unwrap(),
            Shard { index: 2, count: 4 }
        );
        assert_eq!(
            Shard::parse("auto/4", &slurm).unwrap(),
            Shard { index: 2, count: 4 }
        );
        assert!(Shard::parse("auto/8", &slurm)
            .unwrap_err()
            .to_string()
            .contains("SLURM_ARRAY_TASK_COUNT = 4"));
        let k8s = env_of(&[("JOB_COMPLETION_INDEX", "3")]);
        assert_eq!(
            Shard::parse("auto/4", &k8s).unwrap(),
            Shard { index: 3, count: 4 }
        );
        assert!(Shard::parse("auto", &k8s)
            .unwrap_err()
            .to_string()
            .contains("auto/N"));
        assert!(Shard::parse("auto/3", &k8s)
            .unwrap_err()
            .to_string()
            .contains("not below"));
        let bad = env_of(&[("JOB_COMPLETION_INDEX", "three")]);
        assert!(Shard::parse("auto/4", &bad)
            .unwrap_err()
            .to_string()
            .contains("JOB_COMPLETION_INDEX"));
    }
}
