//! Who owns shared bytes in a `merge` (README, "Beyond one machine"): which inputs are the
//! shards of one tree ([`group`], refusing an incomplete or mixed set), then which row of each
//! content stays valid ([`settle`]).
//!
//! Over the shards of one tree the rule is one rebuild's: the smallest path (byte order)
//! holding the bytes owns their row, whichever shard saw it (each shard's row of a content is
//! owned by that shard's smallest path, so the row whose `source_path` is the smallest over
//! the shards is the one a rebuild of the whole tree would have made). Between different trees
//! (other hosts, or outputs that are not shards) the first input in argument order keeps it.

use crate::shard::{ShardRecord, SharedContent, RULE};
use crate::status::LabelConflict;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;

/// How the inputs were grouped, and the rule that follows.
#[derive(Debug, Clone)]
pub struct Grouping {
    /// Per input: the rank of its group (the position of the group's first input).
    pub group_of: Vec<usize>,
    /// Per input: whether its group is a set of shards (the smallest path owns).
    pub by_path: Vec<bool>,
    /// The rule applied, in words.
    pub rule: String,
    /// Whether the rule is one rebuild's (every input a shard of one tree), for the summary.
    pub one_tree: bool,
    /// What the merge noticed and went on with (shards that listed different trees).
    pub warnings: Vec<String>,
}

/// Group the inputs (folder, and its shard record if it is a shard) by tree. Refuses (the
/// reason, naming folders) a tree whose shards are incomplete, given twice, of two counts,
/// of another rule, or made with different label or split settings.
pub fn group(inputs: &[(PathBuf, Option<ShardRecord>)]) -> Result<Grouping, String> {
    let mut trees: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    let mut group_of: Vec<usize> = (0..inputs.len()).collect();
    let mut by_path = vec![false; inputs.len()];
    for (i, (dir, record)) in inputs.iter().enumerate() {
        let Some(r) = record else { continue };
        if r.rule != RULE {
            return Err(format!(
                "{}: a shard made by another rule ({:?}; this ailhd shards by {RULE:?}): rebuild \
                 every shard with one ailhd version",
                dir.display(),
                r.rule
            ));
        }
        trees.entry(&r.tree).or_default().push(i);
    }
    let mut warnings = Vec::new();
    for members in trees.values() {
        check_set(inputs, members, &mut warnings)?;
        for &i in members {
            group_of[i] = members[0];
            by_path[i] = true;
        }
    }
    let one_tree = trees.len() == 1 && by_path.iter().all(|&b| b);
    let rule = if one_tree {
        let r = inputs[0].1.as_ref().expect("a shard");
        format!(
            "shards of one tree ({}, {} shards): shared bytes belong to the smallest path (byte \
             order) that holds them, whichever shard saw it, as in one rebuild of the tree",
            r.tree, r.count
        )
    } else if trees.is_empty() {
        "first input wins: the first input (in argument order) holding the bytes as a valid row \
         keeps it"
            .to_string()
    } else {
        "shards of each tree as one rebuild of it (the smallest path owns shared bytes); between \
         trees and other outputs, the first input (in argument order) keeps them"
            .to_string()
    };
    Ok(Grouping {
        group_of,
        by_path,
        rule,
        one_tree,
        warnings,
    })
}

/// The shards of one tree (`members`, indexes into `inputs`) must be one complete set.
fn check_set(
    inputs: &[(PathBuf, Option<ShardRecord>)],
    members: &[usize],
    warnings: &mut Vec<String>,
) -> Result<(), String> {
    let record = |i: usize| inputs[i].1.as_ref().expect("a shard");
    let dir = |i: usize| inputs[i].0.display().to_string();
    let first = record(members[0]);
    let tree = &first.tree;
    let mut counts: BTreeMap<u32, Vec<String>> = BTreeMap::new();
    for &i in members {
        counts.entry(record(i).count).or_default().push(dir(i));
    }
    if counts.len() > 1 {
        let listed: Vec<String> = counts
            .iter()
            .map(|(n, dirs)| format!("{n} shards ({})", dirs.join(", ")))
            .collect();
        return Err(format!(
            "a mixed set of shards of the tree {tree}: two shard counts, {}; merge the shards \
             of one `--shard I/N` run (one N)",
            listed.join(" and ")
        ));
    }
    let count = first.count;
    let mut at: Vec<Option<usize>> = vec![None; count as usize];
    for &i in members {
        let r = record(i);
        if let Some(j) = at[r.index as usize] {
            return Err(format!(
                "shard {}/{count} of the tree {tree} given twice: {} and {}",
                r.index,
                dir(j),
                dir(i)
            ));
        }
        at[r.index as usize] = Some(i);
        if r.settings != first.settings {
            return Err(format!(
                "the shards of the tree {tree} were made with different label or split \
                 settings: {} has {}, {} has {}; rebuild them with one configuration",
                dir(members[0]),
                first.settings,
                dir(i),
                r.settings
            ));
        }
    }
    let missing: Vec<String> = (0..count)
        .filter(|&k| at[k as usize].is_none())
        .map(|k| format!("{k}/{count}"))
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "an incomplete set of shards of the tree {tree}: shard {} missing (given: {}); \
             merge all {count} shards (run the missing ones first)",
            missing.join(", "),
            members
                .iter()
                .map(|&i| format!("{} from {}", record(i).shard(), dir(i)))
                .collect::<Vec<_>>()
                .join(", ")
        ));
    }
    let listings: BTreeMap<(&str, u64), Vec<String>> =
        members.iter().fold(BTreeMap::new(), |mut m, &i| {
            let r = record(i);
            m.entry((r.listing_blake3.as_str(), r.listed))
                .or_default()
                .push(r.shard().to_string());
            m
        });
    if listings.len() > 1 {
        let seen: Vec<String> = listings
            .iter()
            .map(|((_, n), shards)| format!("{n} files (shard {})", shards.join(", ")))
            .collect();
        warnings.push(format!(
            "the tree {tree} changed while its shards ran: they listed {}; files added or \
             removed meanwhile are in the merge or not depending on their shard. Re-run the \
             shards for a view of one moment's tree",
            seen.join(", ")
        ));
    }
    Ok(())
}

/// One split file of one input, as [`settle`] reads it.
#[derive(Clone)]
pub struct FileRows<'a> {
    pub blake3: &'a [[u8; 32]],
    pub valid: &'a [u8],
    /// Label ids in the merged numbering.
    pub labels: &'a [i16],
    /// `source_path`, `path_bytes` per row, NUL padded.
    pub paths: &'a [u8],
    pub path_bytes: usize,
    /// The shard's contents that several of its paths hold (empty for other outputs).
    pub shared: &'a [SharedContent],
}

impl FileRows<'_> {
    fn path(&self, row: usize) -> String {
        let b = &self.paths[row * self.path_bytes..(row + 1) * self.path_bytes];
        let end = b.iter().position(|&c| c == 0).unwrap_or(b.len());
        String::from_utf8_lossy(&b[..end]).into_owned()
    }
}

/// What the rule decided.
#[derive(Debug, Default)]
pub struct Settled {
    /// The merged `valid` column of each split (inputs' rows in argument order).
    pub valid: [Vec<u8>; 3],
    /// Valid rows of the inputs set to 0 because another row keeps their bytes.
    pub duplicates: u64,
    /// The same bytes under paths of different labels: every path (and its label), the one
    /// that owns the row first; then by group and path.
    pub conflicts: Vec<LabelConflict>,
}

/// A valid row of an input: (input, split, row).
type Candidate = (usize, usize, usize);

/// One valid row per content: the rule of [`group`] over `files` (per input, its three split
/// files); `names` are the merged label names.
pub fn settle(files: &[[FileRows; 3]], grouping: &Grouping, names: &[String]) -> Settled {
    let mut settled = Settled::default();
    let mut holders: HashMap<[u8; 32], Vec<Candidate>> = HashMap::new();
    for (i, input) in files.iter().enumerate() {
        for (split, f) in input.iter().enumerate() {
            settled.valid[split].extend(f.valid.iter().map(|&v| (v != 0) as u8));
            for row in (0..f.valid.len()).filter(|&r| f.valid[r] != 0) {
                holders
                    .entry(f.blake3[row])
                    .or_default()
                    .push((i, split, row));
            }
        }
    }
    let shared = shared_paths(files, grouping);
    let offsets: Vec<[usize; 3]> = row_offsets(files);
    let mut conflicts = Vec::new();
    for (hash, mut cands) in holders {
        let key = |&(i, split, row): &Candidate| {
            let path = if grouping.by_path[i] {
                files[i][split].path(row)
            } else {
                String::new()
            };
            (grouping.group_of[i], path, i, split, row)
        };
        cands.sort_by_cached_key(key);
        for &(i, split, row) in &cands[1..] {
            settled.valid[split][offsets[i][split] + row] = 0;
            settled.duplicates += 1;
        }
        let extra = shared.get(&hash).map_or(&[][..], |v| &v[..]);
        if cands.len() > 1 || !extra.is_empty() {
            if let Some(c) = conflict(&hash, &cands, extra, files, grouping, names) {
                conflicts.push(c);
            }
        }
    }
    conflicts.sort_by(|a, b| a.paths.cmp(&b.paths));
    settled.conflicts = conflicts;
    settled
}

/// Where each input's rows start in each merged split.
fn row_offsets(files: &[[FileRows; 3]]) -> Vec<[usize; 3]> {
    let mut next = [0usize; 3];
    files
        .iter()
        .map(|input| {
            let here = next;
            for (split, f) in input.iter().enumerate() {
                next[split] += f.valid.len();
            }
            here
        })
        .collect()
}

/// Every shard's shared contents by hash: (group, path, label folder).
fn shared_paths(
    files: &[[FileRows; 3]],
    grouping: &Grouping,
) -> HashMap<[u8; 32], Vec<(usize, String, String)>> {
    let mut out: HashMap<[u8; 32], Vec<(usize, String, String)>> = HashMap::new();
    for (i, input) in files.iter().enumerate() {
        for c in input.iter().flat_map(|f| f.shared) {
            let Ok(hash) = blake3::Hash::from_hex(&c.blake3) else {
                continue;
            };
            let entry = out.entry(*hash.as_bytes()).or_default();
            for (path, folder) in &c.paths {
                entry.push((grouping.group_of[i], path.clone(), folder.clone()));
            }
        }
    }
    out
}

/// The label conflict of one content, if its paths have more than one label: the rows holding
/// it (`cands`, the owner first) and the other paths of the shards that hold it (`extra`).
fn conflict(
    hash: &[u8; 32],
    cands: &[Candidate],
    extra: &[(usize, String, String)],
    files: &[[FileRows; 3]],
    grouping: &Grouping,
    names: &[String],
) -> Option<LabelConflict> {
    let label = |id: i16| {
        usize::try_from(id)
            .ok()
            .and_then(|k| names.get(k))
            .cloned()
            .unwrap_or_else(|| format!("#{id}"))
    };
    // (owner first, group, path) -> label; a path a shard lists and holds a row for once.
    let mut paths: BTreeMap<(bool, usize, String), String> = BTreeMap::new();
    for (k, &(i, split, row)) in cands.iter().enumerate() {
        let f = &files[i][split];
        let key = (k != 0, grouping.group_of[i], f.path(row));
        paths.entry(key).or_insert_with(|| label(f.labels[row]));
    }
    let (_, owner_group, owner_path) = paths.keys().next().cloned()?;
    for (group, path, folder) in extra {
        let first = *group == owner_group && *path == owner_path;
        paths
            .entry((!first, *group, path.clone()))
            .or_insert_with(|| folder.clone());
    }
    let mut labels = paths.values();
    let first = labels.next()?;
    if labels.all(|l| l == first) {
        return None;
    }
    // The same path with the same label in several inputs (a tree's shards merged with a
    // rebuild of that tree, say) is listed once.
    let mut listed = Vec::<crate::status::LabelledPath>::new();
    for ((_, _, path), label) in paths {
        if !listed.iter().any(|l| l.path == path && l.label == label) {
            listed.push(crate::status::LabelledPath { path, label });
        }
    }
    Some(LabelConflict {
        blake3: crate::identity::hex(hash),
        paths: listed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;
    use crate::shard::Shard;

    fn record(index: u32, count: u32, tree: &str) -> ShardRecord {
        let listing = ["LEAK/a.wav", "NORMAL/b.wav"];
        ShardRecord::new(
            Shard::new(index, count).unwrap(),
            std::path::Path::new(tree),
            listing.into_iter(),
            &Settings::default(),
        )
    }

    fn inputs(records: Vec<Option<ShardRecord>>) -> Vec<(PathBuf, Option<ShardRecord>)> {
        records
            .into_iter()
            .enumerate()
            .map(|(i, r)| (PathBuf::from(format!("/work/in-{i}")), r))
            .collect()
    }

    #[test]
    fn a_complete_set_of_one_tree_is_settled_by_path() {
        let g = group(&inputs(vec![
            Some(record(1, 3, "/t")),
            Some(record(0, 3, "/t")),
            Some(record(2, 3, "/t")),
        ]))
        .unwrap();
        assert!(g.one_tree && g.by_path.iter().all(|&b| b));
        assert_eq!(g.group_of, [0, 0, 0]);
        assert!(g.rule.contains("smallest path"), "{}", g.rule);
        assert!(g.warnings.is_empty());
        let plain = group(&inputs(vec![None, None])).unwrap();
        assert_eq!(
            (plain.group_of, plain.by_path),
            (vec![0, 1], vec![false; 2])
        );
        assert!(plain.rule.starts_with("first input wins"));
        // Two trees: each its own group, the first input wins between them.
        let two = group(&inputs(vec![
            Some(record(0, 1, "/a")),
            None,
            Some(record(0, 1, "/b")),
        ]))
        .unwrap();
        assert_eq!(two.group_of, [0, 1, 2]);
        assert!(!two.one_tree && two.rule.contains("between trees"));
    }

    #[test]
    fn incomplete_or_mixed_sets_are_refused_by_name() {
        let e = group(&inputs(vec![
            Some(record(0, 4, "/t")),
            Some(record(2, 4, "/t")),
        ]))
        .unwrap_err();
        assert!(
            e.contains("incomplete") && e.contains("shard 1/4, 3/4 missing"),
            "{e}"
        );
        assert!(e.contains("0/4 from /work/in-0"), "{e}");
        let e = group(&inputs(vec![
            Some(record(0, 2, "/t")),
            Some(record(1, 2, "/t")),
            Some(record(1, 2, "/t")),
        ]))
        .unwrap_err();
        assert!(e.contains("1/2") && e.contains("given twice"), "{e}");
        assert!(e.contains("/work/in-1 and /work/in-2"), "{e}");
        let e = group(&inputs(vec![
            Some(record(0, 2, "/t")),
            Some(record(1, 2, "/t")),
            Some(record(0, 1, "/t")),
        ]))
        .unwrap_err();
        assert!(e.contains("two shard counts"), "{e}");
        assert!(e.contains("1 shards (/work/in-2)"), "{e}");
        let mut other = record(1, 2, "/t");
        other.settings["splits"]["mode"] = "sensor".into();
        let e = group(&inputs(vec![Some(record(0, 2, "/t")), Some(other)])).unwrap_err();
        assert!(e.contains("different label or split settings"), "{e}");
        let mut old = record(1, 2, "/t");
        old.rule = "content".into();
        let e = group(&inputs(vec![Some(record(0, 2, "/t")), Some(old)])).unwrap_err();
        assert!(e.contains("another rule"), "{e}");
    }

    #[test]
    fn a_tree_that_changed_between_shards_is_merged_with_a_warning() {
        let mut later = record(1, 2, "/t");
        later.listed = 3;
        later.listing_blake3 = "other".into();
        let g = group(&inputs(vec![Some(record(0, 2, "/t")), Some(later)])).unwrap();
        assert_eq!(g.warnings.len(), 1);
        assert!(g.warnings[0].contains("changed while its shards ran"));
    }

    fn padded(paths: &[&str], width: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for p in paths {
            let mut b = p.as_bytes().to_vec();
            b.resize(width, 0);
            out.extend(b);
        }
        out
    }

    #[test]
    fn the_smallest_path_owns_across_shards_and_conflicts_list_every_path() {
        let names: Vec<String> = ["LEAK", "NORMAL"].map(String::from).to_vec();
        let (x, y) = ([1u8; 32], [2u8; 32]);
        // Shard 0 holds x at NORMAL/b.wav (and, sharing its row, NORMAL/c.wav); shard 1 holds
        // x at LEAK/a.wav and y alone.
        let p0 = padded(&["NORMAL/b.wav"], 16);
        let p1 = padded(&["LEAK/a.wav", "LEAK/y.wav"], 16);
        let shared0 = vec![SharedContent {
            blake3: crate::identity::hex(&x),
            paths: vec![
                ("NORMAL/b.wav".into(), "NORMAL".into()),
                ("NORMAL/c.wav".into(), "NORMAL".into()),
            ],
        }];
        let (h0, h1) = ([x], [x, y]);
        let empty = || FileRows {
            blake3: &[],
            valid: &[],
            labels: &[],
            paths: &[],
            path_bytes: 16,
            shared: &[],
        };
        let files = vec![
            [
                FileRows {
                    blake3: &h0,
                    valid: &[1],
                    labels: &[1],
                    paths: &p0,
                    path_bytes: 16,
                    shared: &shared0,
                },
                empty(),
                empty(),
            ],
            [
                FileRows {
                    blake3: &h1,
                    valid: &[1, 1],
                    labels: &[0, 0],
                    paths: &p1,
                    path_bytes: 16,
                    shared: &[],
                },
                empty(),
                empty(),
            ],
        ];
        let shards = group(&inputs(vec![
            Some(record(0, 2, "/t")),
            Some(record(1, 2, "/t")),
        ]))
        .unwrap();
        let s = settle(&files, &shards, &names);
        assert_eq!(s.valid[0], [0, 1, 1], "LEAK/a.wav (shard 1) owns x");
        assert_eq!(s.duplicates, 1);
        assert_eq!(s.conflicts.len(), 1);
        let want: Vec<crate::status::LabelledPath> = [
            ("LEAK/a.wav", "LEAK"),
            ("NORMAL/b.wav", "NORMAL"),
            ("NORMAL/c.wav", "NORMAL"),
        ]
        .iter()
        .map(|(p, l)| crate::status::LabelledPath {
            path: p.to_string(),
            label: l.to_string(),
        })
        .collect();
        assert_eq!(s.conflicts[0].paths, want);
        // The two shards and a rebuild of the same tree (another input, as another host's): x
        // there again at NORMAL/b.wav, listed once.
        let h2 = [x];
        let mut three = files.clone();
        three.push([
            FileRows {
                blake3: &h2,
                valid: &[1],
                labels: &[1],
                paths: &p0,
                path_bytes: 16,
                shared: &[],
            },
            empty(),
            empty(),
        ]);
        let mixed = group(&inputs(vec![
            Some(record(0, 2, "/t")),
            Some(record(1, 2, "/t")),
            None,
        ]))
        .unwrap();
        let s = settle(&three, &mixed, &names);
        assert_eq!(s.conflicts.len(), 1);
        assert_eq!(s.conflicts[0].paths, want, "each path and label once");
        // The same files as outputs of two hosts: the first input keeps x.
        let hosts = group(&inputs(vec![None, None])).unwrap();
        let s = settle(&files, &hosts, &names);
        assert_eq!(s.valid[0], [1, 0, 1]);
        assert_eq!(
            s.conflicts[0].paths[0],
            crate::status::LabelledPath {
                path: "NORMAL/b.wav".into(),
                label: "NORMAL".into()
            }
        );
    }
}
