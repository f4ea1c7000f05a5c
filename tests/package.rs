//! The Debian package as `cargo deb` builds it: the man pages and shell completions it ships
//! (packaging/) are what the command line makes (`ailhd man DIR`, `ailhd completions SHELL`),
//! the changelog's top entry is this version with the maintainer from Cargo.toml, and lintian
//! finds no error and no warning in the .deb (where cargo-deb and lintian are installed; the
//! test says when it skipped and why).

use crate::common::*;
use serial_test::serial;
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

const COMPLETIONS: [(&str, &str); 3] = [
    ("bash", "ailhd.bash"),
    ("zsh", "_ailhd"),
    ("fish", "ailhd.fish"),
];

const REFRESH: &str = "refresh them: ailhd man packaging/man; \
    for s in bash zsh fish; do ailhd completions $s > ...; done (names in tests/package.rs)";

fn files(dir: &Path) -> Vec<(String, String)> {
    let mut out: Vec<(String, String)> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| {
            let p = e.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().to_string();
            (name, std::fs::read_to_string(&p).unwrap())
        })
        .collect();
    out.sort();
    out
}

#[test]
#[serial]
fn packaged_man_pages_and_completions_are_what_the_command_line_makes() {
    let tmp = tempfile::tempdir().unwrap();
    let man = tmp.path().join("man");
    ok(&Command::new(bin()).arg("man").arg(&man).output().unwrap());
    let made = files(&man);
    let names: Vec<&str> = made.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.contains(&"ailhd.1") && names.contains(&"ailhd-rebuild.1"),
        "{names:?}"
    );
    assert!(
        made == files(&repo().join("packaging/man")),
        "packaging/man differs from `ailhd man`: {REFRESH}"
    );
    for (shell, file) in COMPLETIONS {
        let text = ok(&Command::new(bin())
            .args(["completions", shell])
            .output()
            .unwrap());
        assert!(
            text.contains("rebuild") && text.contains("json"),
            "{shell}: {text}"
        );
        let kept = std::fs::read_to_string(repo().join("packaging/completions").join(file))
            .unwrap_or_default();
        assert!(
            text == kept,
            "packaging/completions/{file} differs from `ailhd completions {shell}`: {REFRESH}"
        );
    }
}

#[test]
#[serial]
fn the_changelog_names_this_version_and_the_maintainer() {
    let changelog = std::fs::read_to_string(repo().join("packaging/changelog")).unwrap();
    let first = changelog.lines().next().unwrap();
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        first.starts_with(&format!("ailhd ({version}-1) ")),
        "packaging/changelog's top entry is {first:?}: add an entry for {version}-1"
    );
    let maintainer = env!("CARGO_PKG_AUTHORS").split(':').next().unwrap();
    assert!(
        !maintainer.is_empty() && !maintainer.contains("@localhost"),
        "Cargo.toml's authors give the package's Maintainer: {maintainer:?}"
    );
    let signed = changelog
        .lines()
        .find(|l| l.starts_with(" -- "))
        .unwrap_or("");
    assert!(
        signed.starts_with(&format!(" -- {maintainer}  ")),
        "the changelog's entry is signed {signed:?}, not by {maintainer:?}"
    );
}

fn have(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .output()
        .is_ok_and(|o| o.status.success())
}

#[test]
#[serial]
fn the_deb_is_lintian_clean() {
    if !have("cargo", &["deb", "--version"]) {
        return cannot_run(
            "cargo-deb is not installed (cargo install cargo-deb; .ci/setup does in CI)",
        );
    }
    if !have("lintian", &["--version"]) {
        return cannot_run("lintian is not installed (apt-get install lintian; .ci/setup does)");
    }
    // cargo-deb packs target/release/ailhd: this test's binary, in a target folder of its own
    // (--no-build), stripped as the release build is.
    let tmp = tempfile::tempdir().unwrap();
    let release = tmp.path().join("target/release");
    std::fs::create_dir_all(&release).unwrap();
    std::fs::copy(bin(), release.join("ailhd")).unwrap();
    let out = tmp.path().join("deb");
    let o = Command::new("cargo")
        .args([
            "deb",
            "--no-build",
            "--no-dbgsym",
            "--strip",
            "--fast",
            "--output",
        ])
        .arg(&out)
        .current_dir(repo())
        .env("CARGO_TARGET_DIR", tmp.path().join("target"))
        .output()
        .unwrap();
    ok(&o);
    let deb = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "deb"))
        .expect("cargo deb made no .deb");
    let contents = ok(&Command::new("dpkg-deb")
        .arg("--contents")
        .arg(&deb)
        .output()
        .unwrap());
    for want in [
        "./usr/bin/ailhd",
        "./usr/share/man/man1/ailhd.1.gz",
        "./usr/share/man/man1/ailhd-rebuild.1.gz",
        "./usr/share/bash-completion/completions/ailhd",
        "./usr/share/zsh/vendor-completions/_ailhd",
        "./usr/share/fish/vendor_completions.d/ailhd.fish",
        "./usr/share/doc/ailhd/changelog.Debian.gz",
        "./usr/share/doc/ailhd/copyright",
        "./usr/share/doc/ailhd/docs/operations.md",
        "./usr/share/lintian/overrides/ailhd",
        "./etc/ailhd/ailhd.toml",
    ] {
        assert!(
            contents.contains(want),
            "{want} not in the .deb:\n{contents}"
        );
    }
    let info = ok(&Command::new("dpkg-deb")
        .arg("--field")
        .arg(&deb)
        .arg("Maintainer")
        .output()
        .unwrap());
    assert_eq!(
        info.trim(),
        env!("CARGO_PKG_AUTHORS").split(':').next().unwrap()
    );
    let lint = Command::new("lintian")
        .args(["--fail-on", "error,warning"])
        .arg(&deb)
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&lint.stdout),
        String::from_utf8_lossy(&lint.stderr)
    );
    println!("lintian {}:\n{said}", deb.display());
    assert!(lint.status.success(), "lintian:\n{said}");
}

/// A check that cannot run here: a failure in CI (`CI` set; .ci/setup installs what it needs),
/// a printed skip elsewhere.
fn cannot_run(why: &str) {
    assert!(
        std::env::var_os("CI").is_none_or(|v| v.is_empty()),
        "cannot run: {why}"
    );
    println!("SKIPPED: {why}");
}
