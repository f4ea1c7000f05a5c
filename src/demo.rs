//! `ailhd demo [DIR]`: the first thing a new user runs. Makes a small synthetic labelled tree
//! (a few hundred clips that sound different per label, plus a duplicate and a broken file to
//! show what happens to those), writes a configuration for it, rebuilds it, and says where
//! everything is and how to read it.

use crate::config::{DeviceChoice, Settings};
use crate::rebuild::{self, Ui};
use crate::synth;
use anyhow::Context;
use std::path::Path;

pub const DEMO_LABELS: [&str; 5] = ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"];
const PER_LABEL: usize = 60;

pub fn run(dir: &Path, device: DeviceChoice, ui: &Ui) -> anyhow::Result<()> {
    let recordings = dir.join("MASTER_DATASET");
    if recordings.exists() {
        anyhow::bail!(
            "{} already exists: give `ailhd demo` a new folder (or remove that one)",
            recordings.display()
        );
    }
    let written = synth::write_tree(&recordings, &DEMO_LABELS, PER_LABEL, 7)
        .with_context(|| format!("cannot write the demo tree under {}", recordings.display()))?;
    // A copy of a leak under another name (one row, two paths) and a truncated recording
    // (quarantined with its reason).
    std::fs::copy(
        &written[2 * PER_LABEL],
        recordings.join("LEAK").join("copy_of_a_leak.wav"),
    )?;
    let bytes = std::fs::read(&written[0])?;
    std::fs::write(
        recordings.join("NORMAL").join("cut_short.wav"),
        &bytes[..bytes.len() / 3],
    )?;

    let abs = std::fs::canonicalize(dir)?;
    let mut settings = Settings::default();
    settings.paths.recordings = abs.join("MASTER_DATASET");
    settings.paths.output = abs.join("output");
    settings.paths.state = abs.join("state");
    let config_path = abs.join("ailhd.toml");
    std::fs::write(
        &config_path,
        format!(
            "# Written by `ailhd demo`; every other key has its default (see config/ailhd.toml).\n[paths]\nrecordings = {:?}\noutput = {:?}\nstate = {:?}\n",
            settings.paths.recordings, settings.paths.output, settings.paths.state
        ),
    )?;
    println!(
        "demo: wrote {} synthetic recordings under {}",
        written.len() + 2,
        settings.paths.recordings.display()
    );
    let report = rebuild::rebuild(&settings, device, ui)?;
    print!("{}", rebuild::summary(&settings, &report));
    let h5 = crate::output::hdf5_path(&settings.paths.output, &settings.outputs.hdf5_names, 0);
    println!(
        "\nRead it as the trainer does:\n  python3 -c 'import h5py; f = h5py.File(\"{}\", \"r\"); print(f[\"segments_mel\"].shape, f.attrs[\"labels_json\"])'\n  python3 -c 'import numpy as np; print(np.load(\"{}/segments_mel.npy\", mmap_mode=\"r\").shape)'\nMore:\n  ailhd --config {} status\n  ailhd --config {} inspect {}\n  ailhd --config {} run      # watch the tree and ingest new recordings as they land",
        h5.display(),
        crate::output::npy_dir(&settings.paths.output, 0).display(),
        config_path.display(),
        config_path.display(),
        written[2 * PER_LABEL].display(),
        config_path.display(),
    );
    Ok(())
}
