//! `rebuild --shard I/N` and `merge DIR... --into OUT` with the real binary, read as users read
//! them: h5py (plain and SWMR), numpy for the `--npy` copies, and Debian 12's `h5dump` 1.10.8
//! (package hdf5-tools, installed by .ci/setup) as the HDF5 1.10 reader. Also the deploy files:
//! `bash -n` and shellcheck for the scripts, a YAML parse of the Kubernetes manifest.

use crate::common::{bin, ok, python};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const LABELS: [&str; 5] = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"];
const NAMES: [&str; 3] = [
    "TRAINING_DATASET.H5",
    "VALIDATION_DATASET.H5",
    "TESTING_DATASET.H5",
];

/// A configuration for recordings `rec` writing under `base/{out,state}`.
fn config(base: &Path, rec: &Path, extra: &str) -> PathBuf {
    std::fs::create_dir_all(base).unwrap();
    let path = base.join("ailhd.toml");
    std::fs::write(
        &path,
        format!(
            "[paths]\nrecordings = {:?}\noutput = {:?}\nstate = {:?}\n{extra}\n",
            rec,
            base.join("out"),
            base.join("state")
        ),
    )
    .unwrap();
    path
}

fn ailhd(config: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(bin());
    c.arg("--config").arg(config).args(args);
    c.env_remove("AILHD_CONFIG");
    for v in ["SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"] {
        c.env_remove(v);
    }
    c
}

fn run(config: &Path, args: &[&str]) -> Output {
    ailhd(config, args).output().unwrap()
}

fn refused(o: &Output, words: &[&str]) -> String {
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    assert_eq!(
        o.status.code(),
        Some(2),
        "expected exit 2 (refused); stdout {}; stderr {err}",
        String::from_utf8_lossy(&o.stdout)
    );
    for w in words {
        assert!(err.contains(w), "the reason should mention {w:?}: {err}");
    }
    err
}

fn status(config: &Path) -> serde_json::Value {
    serde_json::from_str(&ok(&run(config, &["status", "--json"]))).unwrap()
}

/// Synthetic clips in every label folder, a second path with the same bytes, and files that
/// are quarantined (truncated, unknown label folder, outside any label folder).
fn write_tree(rec: &Path, per_label: usize, seed: u64) -> Vec<PathBuf> {
    let files = ailhd::synth::write_tree(rec, &LABELS, per_label, seed).unwrap();
    let bytes = std::fs::read(&files[0]).unwrap();
    std::fs::write(rec.join("NORMAL/copy_of_first.wav"), &bytes).unwrap();
    std::fs::write(rec.join("LEAK/truncated.wav"), &bytes[..bytes.len() / 2]).unwrap();
    std::fs::create_dir_all(rec.join("PUMP")).unwrap();
    std::fs::write(rec.join("PUMP/unknown_label.wav"), &bytes[..1000]).unwrap();
    std::fs::write(rec.join("stray.wav"), &bytes[..2000]).unwrap();
    files
}

fn h5dump() -> PathBuf {
    let found = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("h5dump"))
            .find(|f| f.is_file())
    });
    found.expect(
        "h5dump is needed as the HDF5 1.10 reader (Debian 12: apt-get install hdf5-tools; \
         `. .ci/setup` installs it)",
    )
}

/// The bytes h5dump (`-b FILE`: as stored; its `-b LE` writes nothing for float16) (run from another folder, so the virtual datasets' relative source paths
/// must resolve against the merged file's folder) reads from `col` of each merged file.
fn h5dump_bins(merged: &Path, into: &Path) -> serde_json::Value {
    let mut spec = serde_json::Map::new();
    for name in NAMES {
        let mut cols = serde_json::Map::new();
        for col in ["segments_mel", "blake3", "labels"] {
            let out = into.join(format!("{name}.{col}.bin"));
            let o = Command::new(h5dump())
                .current_dir("/")
                .args(["-d", col, "-b", "FILE", "-o"])
                .arg(&out)
                .arg(merged.join(name))
                .output()
                .unwrap();
            assert!(
                o.status.success(),
                "h5dump {col} of {name}: {}{}",
                String::from_utf8_lossy(&o.stdout),
                String::from_utf8_lossy(&o.stderr)
            );
            cols.insert(col.into(), out.to_str().unwrap().into());
        }
        spec.insert(name.into(), cols.into());
    }
    spec.into()
}

fn check(mode: &str, spec: serde_json::Value, dir: &Path) -> String {
    let path = dir.join(format!("spec-{mode}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&spec).unwrap()).unwrap();
    python("merge_check.py", &[mode, path.to_str().unwrap()])
}

/// Copies of `files`' bytes under other paths, chosen (by the path rule, for `n` shards) so
/// that the tree holds shared bytes within one shard and across shards, under one label and
/// under two. Returns (original, copy) relative paths.
fn write_shared_copies(rec: &Path, files: &[PathBuf], n: u32) -> Vec<(String, String)> {
    let shard_of = |rel: &str| ailhd::shard::Shard::new(0, n).unwrap().of(rel);
    let rel = |f: &Path| f.strip_prefix(rec).unwrap().to_str().unwrap().to_string();
    let mut written = Vec::new();
    // (label folder of the copy, whether it must sit in the original's shard)
    let wanted = [
        ("NORMAL", true),
        ("NORMAL", false),
        ("LEAK", true),
        ("LEAK", false),
    ];
    for (k, (folder, same)) in wanted.into_iter().enumerate() {
        let original = &files[3 * k + 1];
        let home = shard_of(&rel(original));
        let copy = (0..)
            .map(|m| format!("{folder}/copy_{k}_{m}.wav"))
            .find(|c| (shard_of(c) == home) == same)
            .unwrap();
        std::fs::copy(original, rec.join(&copy)).unwrap();
        written.push((rel(original), copy));
    }
    written
}

/// Start `rebuild --shard I/n` of `config` for each (I, config), at the same time as a
/// scheduler runs them, and wait for all.
fn run_shards(configs: &[(u32, &Path)], n: u32) {
    let children: Vec<_> = configs
        .iter()
        .map(|(i, c)| {
            ailhd(
                c,
                &["rebuild", "--device", "cpu", "--shard", &format!("{i}/{n}")],
            )
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for ((i, _), child) in configs.iter().zip(children) {
        let out = ok(&child.wait_with_output().unwrap());
        assert!(out.contains(&format!("shard {i}/{n}")), "{out}");
    }
}

fn merge_args(config: &Path, inputs: &[PathBuf], into: &Path, extra: &[&str]) -> Output {
    let mut args: Vec<String> = vec!["merge".into()];
    args.extend(inputs.iter().map(|d| d.display().to_string()));
    args.extend(["--into".into(), into.display().to_string()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    run(config, &args)
}

/// Label conflicts as sorted (path, label) lists, from `status --json` or `merge --json`.
fn conflicts(list: &serde_json::Value) -> Vec<Vec<(String, String)>> {
    let mut out: Vec<Vec<(String, String)>> =
        serde_json::from_value::<Vec<ailhd::status::LabelConflict>>(list.clone())
            .unwrap()
            .into_iter()
            .map(|c| c.paths.into_iter().map(|p| (p.path, p.label)).collect())
            .collect();
    out.sort();
    out
}

#[test]
fn shards_then_merge_equal_one_rebuild() {
    let tmp = tempfile::tempdir().unwrap();
    // Everything under one folder that is moved before reading: the merged files must follow
    // their inputs.
    let site = tmp.path().join("site");
    let rec = site.join("rec");
    let n = 3;
    let files = write_tree(&rec, 12, 7);
    let copies = write_shared_copies(&rec, &files, n);
    let reference = config(&site.join("full"), &rec, "");
    ok(&run(&reference, &["rebuild", "--device", "cpu"]));

    let shard_configs: Vec<PathBuf> = (0..n)
        .map(|i| config(&site.join(format!("shard-{i}")), &rec, ""))
        .collect();
    let indexed: Vec<(u32, &Path)> = (0..n)
        .zip(shard_configs.iter().map(|c| c.as_path()))
        .collect();
    run_shards(&indexed, n);

    // Each file is recorded by exactly one shard, and nowhere quarantined for being elsewhere.
    let full = status(&reference);
    let shards: Vec<serde_json::Value> = shard_configs.iter().map(|c| status(c)).collect();
    // Each says which shard it is; the whole tree's says none.
    assert!(full["shard"].is_null(), "{}", full["shard"]);
    for (i, s) in shards.iter().enumerate() {
        assert_eq!(s["shard"], format!("{i}/{n}"));
    }
    let count = |s: &serde_json::Value, k: &str| s["files"][k].as_u64().unwrap_or(0);
    for k in ["committed", "quarantined"] {
        let sum: u64 = shards.iter().map(|s| count(s, k)).sum();
        assert_eq!(
            sum,
            count(&full, k),
            "{k} files over the shards vs one rebuild"
        );
    }
    let quarantined = |s: &serde_json::Value| -> Vec<(String, String)> {
        s["quarantined"]
            .as_array()
            .unwrap()
            .iter()
            .map(|q| {
                (
                    q["path"].as_str().unwrap().into(),
                    q["reason"].as_str().unwrap().into(),
                )
            })
            .collect()
    };
    let mut from_shards: Vec<_> = shards.iter().flat_map(quarantined).collect();
    from_shards.sort();
    let mut from_full = quarantined(&full);
    from_full.sort();
    assert_eq!(from_shards, from_full);
    assert_eq!(from_full.len(), 3, "{from_full:?}");

    // Shards given in reverse: the smallest path owns shared bytes, not the first input.
    let merged = site.join("merged");
    let inputs: Vec<PathBuf> = (0..n)
        .rev()
        .map(|i| site.join(format!("shard-{i}/out")))
        .collect();
    let report: serde_json::Value = serde_json::from_str(&ok(&merge_args(
        &reference,
        &inputs,
        &merged,
        &["--npy", "--json"],
    )))
    .unwrap();
    assert!(
        report["rule"].as_str().unwrap().contains("smallest path"),
        "{report}"
    );
    // A copy held by another shard than its original's: that shard's row of it is not valid.
    let shard_of = |rel: &str| ailhd::shard::Shard::new(0, n).unwrap().of(rel);
    let first = files[0]
        .strip_prefix(&rec)
        .unwrap()
        .to_str()
        .unwrap()
        .to_string();
    let across = copies
        .iter()
        .chain([&(first, "NORMAL/copy_of_first.wav".to_string())])
        .filter(|(a, b)| shard_of(a) != shard_of(b))
        .count();
    assert!(across >= 2);
    assert_eq!(
        report["duplicates"].as_u64(),
        Some(across as u64),
        "{report}"
    );
    let listed = conflicts(&report["label_conflict_list"]);
    assert_eq!(
        listed,
        conflicts(&full["label_conflicts"]),
        "label conflicts as one rebuild's status lists them"
    );
    assert!(listed.len() >= 3, "{listed:?}");
    let text = ok(&merge_args(&reference, &inputs, &merged, &["--npy"]));
    assert!(
        text.contains("COPIES") && text.contains("the smallest path keeps it"),
        "{text}"
    );
    assert!(
        text.contains("copy_0_") && text.contains("copy_1_"),
        "{text}"
    );
    let spec = serde_json::json!({
        "merged": merged,
        "reference": site.join("full/out"),
        "names": NAMES,
        "npy": true,
    });
    let digest = |checked: &str| checked.lines().last().unwrap().to_string();
    let before = digest(&check("same", spec, tmp.path()));

    // Shard 1 failed and runs again alone. Until the merge runs again, it shows what it
    // merged (it reads the inputs' files through hard links of its own: a snapshot), with the
    // shard's folder gone and after the shard's new files took its place; merged again, it
    // gives the same view.
    std::fs::remove_dir_all(site.join("shard-1")).unwrap();
    let spec = serde_json::json!({
        "merged": merged,
        "reference": site.join("full/out"),
        "names": NAMES,
        "npy": true,
    });
    assert_eq!(
        digest(&check("same", spec.clone(), tmp.path())),
        before,
        "the merged view with shard 1's folder removed"
    );
    let again = config(&site.join("shard-1"), &rec, "");
    run_shards(&[(1, &again)], n);
    assert_eq!(digest(&check("same", spec, tmp.path())), before);
    for _ in 0..3 {
        ok(&merge_args(&reference, &inputs, &merged, &["--npy"]));
    }
    let generations = std::fs::read_dir(merged.join(".inputs")).unwrap().count();
    assert_eq!(generations, 2, "the merge's links and the one before");
    println!("{}", python("merge_reader.py", &[&merged]));

    let moved = tmp.path().join("moved");
    std::fs::rename(&site, &moved).unwrap();
    let merged = moved.join("merged");
    let bins = tmp.path().join("h5dump");
    std::fs::create_dir_all(&bins).unwrap();
    let spec = serde_json::json!({
        "merged": merged,
        "reference": moved.join("full/out"),
        "names": NAMES,
        "npy": true,
        "h5dump": h5dump_bins(&merged, &bins),
    });
    let checked = check("same", spec, tmp.path());
    println!("{checked}");
    assert_eq!(
        digest(&checked),
        before,
        "the merged view after shard 1 ran again"
    );
}

#[test]
fn merging_overlapping_hosts_keeps_one_valid_row_per_content() {
    let tmp = tempfile::tempdir().unwrap();
    let append = "[labels]\nunknown = \"append\"\n";
    // Host A: its clips and a label folder of its own (appended: id 5).
    let rec_a = tmp.path().join("rec-a");
    let files_a = ailhd::synth::write_tree(&rec_a, &LABELS, 6, 1).unwrap();
    ailhd::synth::write_tree(&rec_a, &["VALVE"], 3, 3).unwrap();
    // Host B: half of A's recordings (one under another label: a label conflict), clips of its
    // own, and another label folder of its own (appended: id 5 there, 6 once merged).
    let rec_b = tmp.path().join("rec-b");
    ailhd::synth::write_tree(&rec_b, &LABELS, 4, 2).unwrap();
    ailhd::synth::write_tree(&rec_b, &["PUMP"], 3, 4).unwrap();
    let shared: Vec<&PathBuf> = files_a.iter().step_by(2).collect();
    for (k, f) in shared.iter().enumerate() {
        let rel = f.strip_prefix(&rec_a).unwrap();
        let to = if k == 0 {
            rec_b.join("NORMAL/relabelled_on_b.wav")
        } else {
            rec_b.join(rel)
        };
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(f, to).unwrap();
    }
    let a = config(&tmp.path().join("host-a"), &rec_a, append);
    let b = config(&tmp.path().join("host-b"), &rec_b, append);
    ok(&run(&a, &["rebuild", "--device", "cpu"]));
    ok(&run(&b, &["rebuild", "--device", "cpu"]));
    let dir_a = tmp.path().join("host-a/out");
    let dir_b = tmp.path().join("host-b/out");

    for (order, labels) in [
        ([&dir_a, &dir_b], ["VALVE", "PUMP"]),
        ([&dir_b, &dir_a], ["PUMP", "VALVE"]),
    ] {
        let merged = tmp.path().join(format!("merged-{}", labels[0]));
        let out = ok(&run(
            &a,
            &[
                "merge",
                order[0].to_str().unwrap(),
                order[1].to_str().unwrap(),
                "--into",
                merged.to_str().unwrap(),
            ],
        ));
        assert!(
            out.contains(&format!(
                "{} rows set valid = 0 (the first input keeps it)",
                shared.len()
            )),
            "{out}"
        );
        assert!(
            out.contains("label conflicts (same content, other label): 1"),
            "{out}"
        );
        assert!(out.contains("relabelled_on_b.wav"), "{out}");
        assert!(out.contains("(label ids remapped)"), "{out}");
        assert!(out.contains("rule: first input wins"), "{out}");
        let mut names: Vec<&str> = LABELS.to_vec();
        names.extend(labels);
        let spec = serde_json::json!({
            "merged": merged,
            "inputs": order,
            "names": NAMES,
            "labels": names,
            "remapped": true,
        });
        println!("{}", check("hosts", spec, tmp.path()));
    }
    // A merge is a snapshot; merging again into the same folder replaces it.
    let again = run(
        &a,
        &[
            "merge",
            dir_a.to_str().unwrap(),
            "--into",
            tmp.path().join("merged-VALVE").to_str().unwrap(),
        ],
    );
    assert!(ok(&again).contains("merged 1 inputs"));
}

#[test]
fn incompatible_inputs_and_bad_targets_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let rec = tmp.path().join("rec");
    ailhd::synth::write_tree(&rec, &LABELS, 2, 5).unwrap();
    let overlap32 = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("config/overlap32.toml"),
    )
    .unwrap();
    let a = config(&tmp.path().join("a"), &rec, "");
    let c = config(&tmp.path().join("c"), &rec, &overlap32);
    let d = config(&tmp.path().join("d"), &rec, "[outputs]\npath_bytes = 128\n");
    for cfg in [&a, &c, &d] {
        ok(&run(cfg, &["rebuild", "--device", "cpu"]));
    }
    let dir = |x: &str| tmp.path().join(x).join("out").display().to_string();
    let into = tmp.path().join("merged").display().to_string();

    refused(
        &run(&a, &["merge", &dir("a"), &dir("c"), "--into", &into]),
        &["different feature settings", &dir("c")],
    );
    refused(
        &run(&a, &["merge", &dir("a"), &dir("d"), "--into", &into]),
        &["outputs.path_bytes"],
    );
    refused(
        &run(
            &a,
            &["merge", &dir("a"), "/nonexistent/out", "--into", &into],
        ),
        &["/nonexistent/out"],
    );
    refused(
        &run(&a, &["merge", &dir("a"), &dir("a"), "--into", &into]),
        &["given twice"],
    );
    assert!(
        !Path::new(&into).exists(),
        "a refused merge leaves no folder behind"
    );
    // Never into an input, nor over a folder that is not a previous merge.
    refused(
        &run(&a, &["merge", &dir("a"), "--into", &dir("a")]),
        &["input"],
    );
    // Nor into a folder yet to be made inside one.
    let inside = format!("{}/merged/here", dir("a"));
    refused(
        &run(&a, &["merge", &dir("a"), "--into", &inside]),
        &["is (inside) the input"],
    );
    assert!(!Path::new(&dir("a")).join("merged").exists());
    refused(
        &run(&a, &["merge", &dir("a"), "--into", &dir("d")]),
        &["not a previous merge"],
    );
    assert!(
        Path::new(&dir("d")).join(NAMES[0]).exists(),
        "the refused target is untouched"
    );
    // A merge is not an input.
    ok(&run(&a, &["merge", &dir("a"), "--into", &into]));
    // Nor an output of `run` or `rebuild`, nor what `status` reads: each says so (exit 2), and
    // the merged files stay as they are.
    let merged_file = Path::new(&into).join(NAMES[0]);
    let written = std::fs::read(&merged_file).unwrap();
    for args in [
        &["rebuild", "--device", "cpu"][..],
        &["check-config"],
        &["status"],
        &["run"],
    ] {
        let o = ailhd(&a, args)
            .env("AILHD_PATHS__OUTPUT", &into)
            .output()
            .unwrap();
        refused(&o, &["paths.output", "MERGED.json"]);
    }
    assert_eq!(std::fs::read(&merged_file).unwrap(), written);
    refused(
        &run(
            &a,
            &[
                "merge",
                &into,
                "--into",
                &tmp.path().join("m2").display().to_string(),
            ],
        ),
        &["itself a merge"],
    );
    // Bad shard values.
    refused(
        &run(&a, &["rebuild", "--device", "cpu", "--shard", "3/3"]),
        &["not below the count"],
    );
    refused(
        &run(&a, &["rebuild", "--device", "cpu", "--shard", "auto"]),
        &["SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX"],
    );
    // auto/N from a Kubernetes Indexed Job's index.
    let out = ok(
        &ailhd(&a, &["rebuild", "--device", "cpu", "--shard", "auto/2"])
            .env("JOB_COMPLETION_INDEX", "1")
            .output()
            .unwrap(),
    );
    assert!(out.contains("shard 1/2"), "{out}");
}

/// What a shard reads is its own files (and a few KB of its own: configuration, manifest),
/// from `/proc/<pid>/io` (rchar: every read(2), from the page cache or not): the shell that
/// runs it reaps it and so holds its counts.
#[test]
fn a_shard_reads_only_its_own_files() {
    let tmp = tempfile::tempdir().unwrap();
    let rec = tmp.path().join("rec");
    let files = ailhd::synth::write_tree(&rec, &LABELS, 8, 21).unwrap();
    let n = 4;
    let cfg = config(&tmp.path().join("s1"), &rec, "");
    let rel = |f: &PathBuf| f.strip_prefix(&rec).unwrap().to_str().unwrap().to_string();
    let size = |f: &PathBuf| std::fs::metadata(f).unwrap().len();
    let tree: u64 = files.iter().map(size).sum();
    let own: u64 = files
        .iter()
        .filter(|f| ailhd::shard::Shard::new(1, n).unwrap().contains(&rel(f)))
        .map(size)
        .sum();
    let o = Command::new("sh")
        .arg("-c")
        .arg(r#""$@" >/dev/null && awk '/^rchar/ {print $2}' /proc/$$/io"#)
        .arg("sh")
        .arg(bin())
        .arg("--config")
        .arg(&cfg)
        .args(["rebuild", "--device", "cpu", "--shard", "1/4"])
        .env_remove("AILHD_CONFIG")
        .output()
        .unwrap();
    let read: u64 = ok(&o).trim().parse().unwrap();
    assert!(
        own > 0 && own < tree / 2,
        "shard 1/4 holds {own} of {tree} bytes"
    );
    assert!(
        read >= own && read - own < 256 * 1024,
        "shard 1/4 read {read} bytes; its own files hold {own}, the tree {tree}"
    );
}

#[test]
fn incomplete_or_mixed_sets_of_shards_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let rec = tmp.path().join("rec");
    ailhd::synth::write_tree(&rec, &LABELS, 3, 11).unwrap();
    let other = tmp.path().join("other-host");
    ailhd::synth::write_tree(&other, &LABELS, 2, 12).unwrap();
    let cfg = |name: &str, rec: &Path, extra: &str| config(&tmp.path().join(name), rec, extra);
    let (a0, a1) = (cfg("a0", &rec, ""), cfg("a1", &rec, ""));
    let b0 = cfg("b0", &rec, "");
    let sensor = cfg("s1", &rec, "[splits]\nmode = \"sensor\"\n");
    let host = cfg("host", &other, "");
    run_shards(&[(0, &a0), (1, &a1), (1, &sensor)], 2);
    run_shards(&[(0, &b0)], 3);
    ok(&run(&host, &["rebuild", "--device", "cpu"]));
    let dir = |x: &str| tmp.path().join(x).join("out");
    let into = tmp.path().join("merged");
    let twice = tmp.path().join("a1-copy");
    std::fs::create_dir_all(&twice).unwrap();
    for name in NAMES {
        std::fs::copy(dir("a1").join(name), twice.join(name)).unwrap();
    }

    let e = refused(
        &merge_args(&a0, &[dir("a0")], &into, &[]),
        &[
            "incomplete",
            "shard 1/2 missing",
            dir("a0").to_str().unwrap(),
        ],
    );
    assert!(!into.join(NAMES[0]).exists(), "{e}");
    refused(
        &merge_args(&a0, &[dir("a0"), dir("a1"), dir("b0")], &into, &[]),
        &["mixed set", "two shard counts", dir("b0").to_str().unwrap()],
    );
    refused(
        &merge_args(&a0, &[dir("a0"), dir("a1"), twice.clone()], &into, &[]),
        &["shard 1/2", "given twice", twice.to_str().unwrap()],
    );
    refused(
        &merge_args(&a0, &[dir("a0"), dir("s1")], &into, &[]),
        &["different label or split settings", "sensor"],
    );
    // A complete set of one tree with another host's output: each tree's shards as one
    // rebuild, the first input between trees; the merge says so.
    let out = ok(&merge_args(
        &a0,
        &[dir("host"), dir("a1"), dir("a0")],
        &into,
        &[],
    ));
    assert!(out.contains("between trees"), "{out}");
    assert!(out.contains("merged 3 inputs"), "{out}");
}

#[test]
fn deploy_files_check_and_run() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
    let scripts = [
        "slurm/ailhd-shards.sbatch",
        "slurm/submit.sh",
        "slurm/try-local.sh",
        "run-shard.sh",
    ];
    for s in scripts {
        let path = root.join(s);
        assert!(path.is_file(), "{} missing", path.display());
        let o = Command::new("bash").arg("-n").arg(&path).output().unwrap();
        assert!(
            o.status.success(),
            "bash -n {s}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        let o = Command::new("shellcheck")
            .arg("-x")
            .arg(&path)
            .output()
            .expect("shellcheck is needed to check deploy/ (`. .ci/setup` installs it)");
        assert!(
            o.status.success(),
            "shellcheck {s}:\n{}",
            String::from_utf8_lossy(&o.stdout)
        );
    }

    let tmp = tempfile::tempdir().unwrap();
    let rec = tmp.path().join("rec");
    ailhd::synth::write_tree(&rec, &LABELS, 2, 9).unwrap();
    // The settings every shard shares; its paths are overridden per shard by the scripts.
    let cfg = config(&tmp.path().join("settings"), &rec, "");

    // What the Slurm array tasks run (ailhd-shards.sbatch execs run-shard.sh): an array 1-2.
    let work = tmp.path().join("slurm-work");
    for task in [1, 2] {
        let o = Command::new(root.join("run-shard.sh"))
            .args(["shard", rec.to_str().unwrap(), work.to_str().unwrap()])
            .env("AILHD", bin())
            .env("AILHD_CONFIG", &cfg)
            .env("SLURM_ARRAY_TASK_ID", task.to_string())
            .env("SLURM_ARRAY_TASK_MIN", "1")
            .env("SLURM_ARRAY_TASK_COUNT", "2")
            .env_remove("JOB_COMPLETION_INDEX")
            .output()
            .unwrap();
        let out = ok(&o);
        assert!(out.contains(&format!("shard {}/2", task - 1)), "{out}");
    }
    let o = Command::new(root.join("run-shard.sh"))
        .args(["merge", work.to_str().unwrap(), "2"])
        .env("AILHD", bin())
        .env("AILHD_CONFIG", &cfg)
        .output()
        .unwrap();
    assert!(ok(&o).contains("merged 2 inputs"));
    assert!(work.join("merged").join(NAMES[0]).is_file());
    // The merge step refuses while a shard is not done.
    std::fs::remove_file(work.join("shard-1/DONE")).unwrap();
    let o = Command::new(root.join("run-shard.sh"))
        .args(["merge", work.to_str().unwrap(), "2"])
        .env("AILHD", bin())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("shard 1 of 2 is not done"));

    // submit.sh with relative paths (its tasks run in WORK): it hands sbatch absolute ones.
    let fake = tmp.path().join("fake-bin");
    std::fs::create_dir_all(&fake).unwrap();
    let calls = tmp.path().join("sbatch-calls");
    std::fs::write(
        fake.join("sbatch"),
        format!("#!/bin/sh\necho \"$*\" >> {calls:?}\necho 42\n"),
    )
    .unwrap();
    std::fs::set_permissions(
        fake.join("sbatch"),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let o = Command::new(root.join("slurm/submit.sh"))
        .args(["rec", "slurm-rel", "2"])
        .current_dir(tmp.path())
        .env(
            "PATH",
            format!("{}:{}", fake.display(), std::env::var("PATH").unwrap()),
        )
        .output()
        .unwrap();
    ok(&o);
    let calls = std::fs::read_to_string(&calls).unwrap();
    let (rec_abs, work_abs) = (
        rec.canonicalize().unwrap(),
        tmp.path().join("slurm-rel").canonicalize().unwrap(),
    );
    assert!(
        calls.contains(&format!(
            "shard {} {}",
            rec_abs.display(),
            work_abs.display()
        )) && calls.contains(&format!("merge {} 2", work_abs.display())),
        "{calls}"
    );

    // The Kubernetes manifest: parsed, and its pods' scripts run for real.
    println!(
        "{}",
        python(
            "merge_deploy_check.py",
            &[
                root.join("kubernetes/ailhd-shards.yaml").to_str().unwrap(),
                bin().parent().unwrap().to_str().unwrap(),
                rec.to_str().unwrap(),
                tmp.path().join("k8s-work").to_str().unwrap(),
                cfg.to_str().unwrap(),
            ]
        )
    );
}
