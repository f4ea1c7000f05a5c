//! The `ailhd` command line: parses flags (and only validates them), builds the real objects
//! through the library, and turns errors into one clear message and an exit code
//! (0 success, 1 failure at run time, 2 bad usage or configuration).

use ailhd::config::{DeviceChoice, Settings};
use ailhd::rebuild::Ui;
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

// Chunks of recordings are allocated and freed in bulk; glibc's allocator hands such memory back
// to the kernel and faults it in again (measured: a tenth of rebuild's time in page faults).
// mimalloc, with large zeroed blocks mapped fresh (see the type).
#[global_allocator]
static GLOBAL: ailhd::memory::Allocator = ailhd::memory::Allocator;

#[derive(Parser)]
#[command(
    name = "ailhd",
    version,
    about = "Acoustic leak detection ingestion: WAV recordings -> segmented mel-spectrogram datasets (HDF5 + npy)"
)]
struct Cli {
    /// Configuration file (else $AILHD_CONFIG, else /etc/ailhd/ailhd.toml, else built-in defaults).
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Say more (info messages).
    #[arg(long, global = true, conflicts_with = "debug")]
    verbose: bool,
    /// Say everything (debug messages).
    #[arg(long, global = true)]
    debug: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The ingestion service (what systemd starts): watch the tree, ingest new or changed recordings.
    Run,
    /// Regenerate every output from the tree; the old outputs stay until the new ones are complete.
    Rebuild {
        /// Where to featurise (default: ingest.device from the configuration).
        #[arg(long, value_parser = ["auto", "cpu", "cuda"])]
        device: Option<String>,
        /// Print the report as JSON (docs/json.md).
        #[arg(long)]
        json: bool,
        /// Only the recordings of shard I of N (by a hash of the path, I from 0; each shard reads
        /// only its own files), for a scheduler's array job; `auto` or `auto/N` take I (and N) from SLURM_ARRAY_TASK_ID/_COUNT or
        /// JOB_COMPLETION_INDEX.
        #[arg(long, value_name = "I/N|auto|auto/N")]
        shard: Option<String>,
        /// Empty the outputs when the recordings folder holds nothing (refused without it while
        /// the outputs hold recordings: the disk may not be mounted).
        #[arg(long)]
        allow_empty: bool,
    },
    /// One set of outputs over several (shards, or several hosts) without copying features:
    /// HDF5 virtual datasets; one valid row per content (over the shards of one tree, the
    /// smallest path's, as one rebuild; between other outputs, the first input keeps it).
    Merge {
        /// Output folders to merge (each holding the three split files), in priority order.
        #[arg(required = true, value_name = "DIR")]
        inputs: Vec<PathBuf>,
        /// Folder for the merged files (empty, or a previous merge).
        #[arg(long, value_name = "OUT")]
        into: PathBuf,
        /// Also write npy/<split>/ columns: COPIES of the merged rows.
        #[arg(long)]
        npy: bool,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Files per state, rows per split and label, quarantined files with reasons.
    Status {
        /// Print the report as JSON (docs/json.md).
        #[arg(long)]
        json: bool,
        /// Also draw the dataset (rows per label and split, arrivals, gains) as a PNG.
        #[arg(long, value_name = "OUT.png")]
        png: Option<PathBuf>,
    },
    /// Validate the configuration and what the service needs at start (exit 0, or 2 with the reason).
    CheckConfig,
    /// Copy the manifest's records into a fresh manifest that takes its place, in about 40% of
    /// the space one written by `rebuild` or the service takes. For a stopped service (it holds
    /// the state folder while it runs).
    Compact,
    /// Make the running service reload its configuration and wait for its answer (systemd's
    /// ExecReload): exit 0 when accepted, 2 when refused.
    Reload {
        /// The service's pid as systemd knows it ($MAINPID); checked against the lock holder.
        #[arg(long)]
        pid: Option<u32>,
    },
    /// Decode and featurise one recording; print a summary, optionally a picture.
    Inspect {
        /// The WAV file (anywhere: its label is read from its place under paths.recordings).
        #[arg(value_name = "FILE.wav")]
        file: PathBuf,
        /// Print the summary as JSON (docs/json.md).
        #[arg(long)]
        json: bool,
        /// Also draw the recording (waveform, spectrogram, stored features) as a PNG.
        #[arg(long, value_name = "OUT.png")]
        png: Option<PathBuf>,
    },
    /// Make a small synthetic labelled tree, build it, show the result.
    Demo {
        /// Folder to create the demo in.
        #[arg(default_value = "ailhd-demo")]
        dir: PathBuf,
    },
    /// What this host offers (CPU features, CUDA driver and GPU, NVRTC) and a CPU/GPU parity self-test.
    Doctor {
        /// Print the findings as JSON (docs/json.md).
        #[arg(long)]
        json: bool,
    },
    /// Print the shell's completion script (the Debian package installs those of bash, zsh and
    /// fish); e.g. `ailhd completions bash > ~/.local/share/bash-completion/completions/ailhd`.
    Completions {
        /// The shell: bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Write the man pages (ailhd.1, ailhd-COMMAND.1: roff) into DIR, as the Debian package
    /// installs them.
    #[command(hide = true)]
    Man {
        #[arg(value_name = "DIR")]
        dir: PathBuf,
    },
}

/// Failures that are the user's input rather than the run (exit 2).
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct UsageError(String);

fn main() -> ExitCode {
    // Test builds only (Cargo.toml, feature `failpoints`): fail points from FAILPOINTS.
    #[cfg(feature = "failpoints")]
    let _failpoints = fail::FailScenario::setup();
    let cli = Cli::parse();
    if matches!(cli.command, Command::Run) {
        ailhd::service::hold_signals();
        ailhd::service::name_after_program();
    } else {
        // A reader that goes away (`ailhd inspect f --json | head -1`) ends the command quietly,
        // as Unix tools do: Rust ignores SIGPIPE, and every print would then panic with "Broken
        // pipe". Not for `run`, which writes to sockets (metrics) whose peers may go away.
        // SAFETY: set once, before any thread is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
    let verbosity = if cli.debug { 2 } else { u8::from(cli.verbose) };
    ailhd::logging::init(verbosity, matches!(cli.command, Command::Run));
    match dispatch(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // Exit 2 only for what the user must mend (also a configuration that disagrees with
            // the outputs: restarting cannot mend it); an I/O error (even at start) is a run-time
            // failure (exit 1), which systemd's Restart=on-failure retries.
            let usage = e.downcast_ref::<UsageError>().is_some()
                || e.downcast_ref::<ailhd::config::ConfigError>().is_some()
                || e.downcast_ref::<ailhd::output::SettingsDiffer>().is_some()
                || e.downcast_ref::<ailhd::output::OutputsIncomplete>()
                    .is_some()
                || matches!(
                    e.downcast_ref::<ailhd::config::PathsError>(),
                    Some(ailhd::config::PathsError::Config(_))
                );
            eprintln!("ailhd: error: {e:#}");
            ExitCode::from(if usage { 2 } else { 1 })
        }
    }
}

fn load_settings(cli: &Cli) -> anyhow::Result<Settings> {
    Ok(Settings::load(cli.config.as_deref())?)
}

fn device(arg: &Option<String>, settings: &Settings) -> anyhow::Result<DeviceChoice> {
    match arg {
        Some(d) => d.parse().map_err(|e: String| UsageError(e).into()),
        None => Ok(settings.ingest.device),
    }
}

fn dispatch(cli: Cli) -> anyhow::Result<()> {
    let ui = Ui {
        progress: ailhd::logging::interactive(),
    };
    match &cli.command {
        Command::CheckConfig => check_config(&load_settings(&cli)?),
        Command::Compact => compact(&load_settings(&cli)?),
        Command::Rebuild {
            device: d,
            json,
            shard,
            allow_empty,
        } => {
            ailhd::memory::release_at_once();
            rebuild(&load_settings(&cli)?, d, *json, shard, *allow_empty, &ui)
        }
        Command::Merge {
            inputs,
            into,
            npy,
            json,
        } => merge(&load_settings(&cli)?, inputs, into, *npy, *json),
        Command::Status { json, png } => status(&load_settings(&cli)?, *json, png),
        Command::Inspect { file, json, png } => inspect(&load_settings(&cli)?, file, *json, png),
        Command::Demo { dir } => {
            let s = load_settings(&cli)?;
            anyhow::Context::with_context(std::fs::create_dir_all(dir), || {
                format!(
                    "cannot make the demo folder {}: give `ailhd demo` a new folder",
                    dir.display()
                )
            })?;
            ailhd::demo::run(dir, s.ingest.device, &ui)
        }
        Command::Doctor { json } => {
            let s = load_settings(&cli)?;
            ailhd::doctor::run_doctor(&s.features, &s.gpu, *json)
        }
        Command::Reload { pid } => reload(&load_settings(&cli)?, *pid),
        // Generated from the command line itself (clap_complete, clap_mangen), so they always
        // match it; packaging/ holds copies for the .deb (tests/package.rs keeps them current).
        Command::Completions { shell } => {
            use clap::CommandFactory;
            let mut out = std::io::stdout().lock();
            clap_complete::generate(*shell, &mut Cli::command(), "ailhd", &mut out);
            Ok(())
        }
        Command::Man { dir } => {
            use clap::CommandFactory;
            std::fs::create_dir_all(dir)?;
            clap_mangen::generate_to(Cli::command(), dir)?;
            Ok(())
        }
        Command::Run => {
            // Tests hold the start here to signal it while it configures (tests/daemon.rs).
            fail::fail_point!("run-configure");
            let s = load_settings(&cli)?;
            if !ailhd::service::wait_until_startable(&s, cli.config.as_deref())? {
                return Ok(());
            }
            ailhd::service::run(s, cli.config.clone())
        }
    }
}

fn check_config(s: &Settings) -> anyhow::Result<()> {
    s.check_paths()?;
    for p in ailhd::staging::remove_stale(s)? {
        println!("removed {}, left by an interrupted rebuild", p.display());
    }
    if let Some(pending) = ailhd::engine::check_outputs(s)? {
        println!("{pending}; the outputs are checked after it");
    }
    if s.ingest.device == ailhd::config::DeviceChoice::Cuda {
        // Not a configuration error (a driver may be installed later), but worth saying now.
        let search = ailhd::features::cuda::LibrarySearch::for_featuriser(&s.gpu);
        let probe = ailhd::features::cuda::probe_with(&search);
        if !probe.problems.is_empty() {
            println!(
                "warning: ingest.device = cuda, but featurising on a GPU is not possible here now: {}. \
                 `ailhd rebuild` fails until it is, and `ailhd run` waits for it (looking again \
                 every 10 s); `ailhd doctor` says more, and device = auto would use the CPU meanwhile",
                probe.problems.join("; ")
            );
        }
    }
    let shape = s.features.shape();
    println!(
        "configuration OK: recordings {}, output {}, state {}; rows of {:?}",
        s.paths.recordings.display(),
        s.paths.output.display(),
        s.paths.state.display(),
        shape.row_dims()
    );
    Ok(())
}

fn rebuild(
    s: &Settings,
    d: &Option<String>,
    json: bool,
    shard: &Option<String>,
    allow_empty: bool,
    ui: &Ui,
) -> anyhow::Result<()> {
    let dev = device(d, s)?;
    let ui = Ui {
        progress: ui.progress && !json,
    };
    let shard = match shard {
        Some(v) => Some(
            ailhd::shard::Shard::parse(v, &|k| std::env::var(k).ok())
                .map_err(|e| UsageError(e.to_string()))?,
        ),
        None => None,
    };
    let scope = ailhd::rebuild::Scope { shard, allow_empty };
    let report = ailhd::rebuild::rebuild_shard(s, dev, &ui, scope)?;
    if json {
        println!("{}", ailhd::json::render(&report)?);
    } else {
        print!("{}", ailhd::rebuild::summary(s, &report));
    }
    Ok(())
}

fn merge(
    s: &Settings,
    inputs: &[PathBuf],
    into: &Path,
    npy: bool,
    json: bool,
) -> anyhow::Result<()> {
    let report = ailhd::merge::merge(&s.outputs.hdf5_names, inputs, into, npy).map_err(|e| {
        match e.downcast::<ailhd::merge::Refused>() {
            Ok(r) => UsageError(format!("merge refused: {r}")).into(),
            Err(e) => e,
        }
    })?;
    if json {
        println!("{}", ailhd::json::render(&report)?);
    } else {
        print!("{}", ailhd::merge::summary(&report));
    }
    Ok(())
}

fn status(s: &Settings, json: bool, png: &Option<PathBuf>) -> anyhow::Result<()> {
    s.check_not_a_merge()?;
    let r = ailhd::status::load(s)?;
    if let Some(out) = png {
        ailhd::status::write_png(s, &r, out)?;
    }
    if json {
        println!("{}", ailhd::json::render(&r)?);
    } else {
        print!("{}", ailhd::status::render(&r));
        if let Some(out) = png {
            println!("picture: {}", out.display());
        }
    }
    Ok(())
}

fn inspect(s: &Settings, file: &Path, json: bool, png: &Option<PathBuf>) -> anyhow::Result<()> {
    let found = ailhd::inspect::inspect(s, file)?;
    if let Some(out) = png {
        ailhd::inspect::write_png(s, &found, out)?;
    }
    if json {
        println!("{}", ailhd::json::render(&found.info)?);
    } else {
        print!("{}", ailhd::inspect::render(&found.info));
        if let Some(out) = png {
            println!("  picture: {}", out.display());
        }
    }
    Ok(())
}

fn compact(s: &Settings) -> anyhow::Result<()> {
    let _lock = ailhd::lock::WriterLock::acquire(&s.paths.state, "compact")?;
    let dir = ailhd::staging::manifest_dir(s);
    let t = std::time::Instant::now();
    // The same records: `status` keeps reading its report instead of the whole manifest.
    let kept = ailhd::status::read_stopped(s);
    let done = ailhd::engine::compact::compact(&dir)?;
    if let Some(report) = kept {
        let _ = ailhd::status::save_stopped(s, &report);
    }
    let mb = |b: u64| b as f64 / 1e6;
    if done.swapped {
        println!(
            "{}: compacted from {:.1} MB to {:.1} MB on disk ({} records) in {:.1} s",
            dir.display(),
            mb(done.before),
            mb(done.after),
            done.records,
            t.elapsed().as_secs_f64()
        );
    } else {
        println!(
            "{}: left as it was: a compacted copy would not save a tenth of its {:.1} MB on disk ({} records; sled's log takes whole segments)",
            dir.display(),
            mb(done.before),
            done.records
        );
    }
    Ok(())
}

fn reload(s: &Settings, pid: Option<u32>) -> anyhow::Result<()> {
    let wait = std::time::Duration::from_secs(30);
    match ailhd::reload::request(s, pid, wait)? {
        ailhd::reload::Outcome::Accepted(r) => {
            println!("pid {}: {} (reload {})", r.pid, r.message, r.generation);
            Ok(())
        }
        ailhd::reload::Outcome::Refused(r) => Err(UsageError(format!(
            "pid {} refused the new configuration and keeps the running one: {}",
            r.pid, r.message
        ))
        .into()),
    }
}
