//! Shards of a recording tree for `rebuild --shard I/N` (docs/scale-out.md): which
//! recordings shard I of N owns, decided from the content hash alone, so that a recording's
//! shard never changes (whatever else is in the tree, on whichever machine) and N shards split
//! any tree evenly.
//!
//! The rule reads hash bytes 8..16 (the split uses bytes 0..8, see [`crate::identity::hash_split`],
//! so shards are independent of splits: every shard holds the configured split ratios) as a
//! little-endian u64 `x` and maps it to `floor(x * N / 2^64)`, the shard index in 0..N.

use crate::identity::Hash;
use std::fmt;

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

    /// Whether this shard owns the recording with content hash `hash`.
    pub fn contains(&self, hash: &Hash) -> bool {
        self.of(hash) == self.index
    }

    /// The shard (of `self.count`) that owns `hash`.
    pub fn of(&self, hash: &Hash) -> u32 {
        let x = u64::from_le_bytes(hash[8..16].try_into().expect("8 bytes"));
        ((x as u128 * self.count as u128) >> 64) as u32
    }

    /// Files that cannot be read at all have no hash: the first shard reports them, so that
    /// every such file is reported once over all shards.
    pub fn owns_unhashable(&self) -> bool {
        self.index == 0
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
            s.trim().parse::<u32>().map_err(|_| {
                err(format!(
                    "{what} `{s}` is not a whole number (expected I/N, auto or auto/N)"
                ))
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

    fn hashes(n: u32) -> Vec<Hash> {
        (0..n)
            .map(|i| content_hash(format!("recording {i}").as_bytes()))
            .collect()
    }

    #[test]
    fn every_recording_is_in_exactly_one_shard() {
        for count in [1, 2, 3, 4, 7, 16] {
            for h in hashes(2000) {
                let owners = (0..count)
                    .filter(|&i| Shard::new(i, count).unwrap().contains(&h))
                    .count();
                assert_eq!(owners, 1, "count {count}");
            }
        }
    }

    #[test]
    fn shards_are_balanced() {
        let all = hashes(40_000);
        for count in [2u32, 4, 10, 64] {
            let mut sizes = vec![0u32; count as usize];
            for h in &all {
                sizes[Shard::new(0, count).unwrap().of(h) as usize] += 1;
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
        // Each shard must hold the split ratios, not one split.
        let all = hashes(20_000);
        let ratios = [70, 20, 10];
        for index in 0..4 {
            let shard = Shard::new(index, 4).unwrap();
            let mut per_split = [0f64; 3];
            let mut n = 0f64;
            for h in all.iter().filter(|h| shard.contains(h)) {
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
        // Pinned: a recording's shard must never change between versions (outputs of shards
        // made by different versions are merged together).
        let h = content_hash(b"ailhd");
        let got: Vec<u32> = [2, 3, 4, 10, 1000]
            .iter()
            .map(|&n| Shard::new(0, n).unwrap().of(&h))
            .collect();
        let x = u64::from_le_bytes(h[8..16].try_into().unwrap()) as f64 / 2f64.powi(64);
        let expect: Vec<u32> = [2, 3, 4, 10, 1000]
            .iter()
            .map(|&n| (x * n as f64) as u32)
            .collect();
        assert_eq!(got, expect);
        assert!(Shard::ALL.contains(&h));
        assert!(Shard::new(0, 1).unwrap().is_all());
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
