//! Configuration: where it comes from (file, `$AILHD_CONFIG`, `/etc/ailhd/ailhd.toml`, defaults,
//! `AILHD_<SECTION>__<KEY>` overrides) and what is allowed. Parsing only validates; the objects
//! that do work (featurisers, writers) are built from a validated [`Settings`].

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG_PATH: &str = "/etc/ailhd/ailhd.toml";

/// A configuration problem: which key, and what is wrong with it.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("configuration file {path}: {message}")]
    Load { path: String, message: String },
    #[error("configuration: {0}")]
    Parse(String),
    /// An `AILHD_<SECTION>__<KEY>` override that does not parse: named as the operator set it,
    /// not blamed on the configuration file.
    #[error("environment variable {var}: {message}")]
    Env { var: String, message: String },
    #[error("configuration key `{key}`: {message}")]
    Invalid { key: String, message: String },
}

fn invalid(key: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key: key.to_string(),
        message: message.into(),
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub paths: Paths,
    pub labels: Labels,
    pub splits: Splits,
    pub features: FeatureSettings,
    pub outputs: Outputs,
    pub ingest: Ingest,
    pub metrics: Metrics,
    pub gpu: Gpu,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Paths {
    /// The labelled recording tree (first folder level = label).
    pub recordings: PathBuf,
    /// Where the per-split HDF5 files and `npy/<split>/` go.
    pub output: PathBuf,
    /// Manifest (sled) and the writer lock.
    pub state: PathBuf,
}

impl Paths {
    /// The output and state folders lie outside the recordings tree: inside it, the service
    /// would watch its own writes (an inotify event for every write of every commit) and every
    /// listing would walk its outputs.
    fn validate(&self) -> Result<(), ConfigError> {
        let tree = resolved(&self.recordings);
        for (key, path) in [("paths.output", &self.output), ("paths.state", &self.state)] {
            if resolved(path).starts_with(&tree) {
                return Err(invalid(
                    key,
                    format!(
                        "{} is inside paths.recordings = {}: the service would watch its own \
                         writes; put it beside the recordings folder, not in it",
                        path.display(),
                        self.recordings.display()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// `path` made absolute, without `.` and `..`, and with the links of the part that exists
/// resolved (so that two spellings of one folder compare equal).
pub(crate) fn resolved(path: &Path) -> PathBuf {
    let absolute = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let mut lexical = PathBuf::new();
    for part in absolute.components() {
        match part {
            std::path::Component::ParentDir => {
                lexical.pop();
            }
            std::path::Component::CurDir => {}
            other => lexical.push(other),
        }
    }
    let mut rest = Vec::new();
    let mut base = lexical.as_path();
    loop {
        if let Ok(real) = base.canonicalize() {
            return rest.iter().rev().fold(real, |p, part| p.join(part));
        }
        match (base.parent(), base.file_name()) {
            (Some(parent), Some(name)) => {
                rest.push(name.to_os_string());
                base = parent;
            }
            _ => return lexical,
        }
    }
}

impl Default for Paths {
    fn default() -> Self {
        Paths {
            recordings: PathBuf::from("/srv/ailhd/MASTER_DATASET"),
            output: PathBuf::from("/var/lib/ailhd/output"),
            state: PathBuf::from("/var/lib/ailhd/state"),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum UnknownLabel {
    Quarantine,
    Append,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Labels {
    pub names: Vec<String>,
    pub unknown: UnknownLabel,
}

impl Default for Labels {
    fn default() -> Self {
        Labels {
            names: ["BACKGROUND", "CRACK", "LEAK", "NORMAL", "UNCLASSIFIED"]
                .iter()
                .map(|s| s.to_string())
                .collect(),
            unknown: UnknownLabel::Quarantine,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum SplitMode {
    /// From the content hash.
    Hash,
    /// From the sensor id in the file name (no sensor in two splits); the content hash when the
    /// name does not follow the convention.
    Sensor,
    /// From the top-level folder (`splits.directories`).
    Directory,
}

/// The three splits, in a fixed order (also the order of `splits.ratios`).
pub const SPLITS: [&str; 3] = ["training", "validation", "testing"];

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Ratios {
    pub training: u32,
    pub validation: u32,
    pub testing: u32,
}

impl Ratios {
    pub fn as_array(&self) -> [u32; 3] {
        [self.training, self.validation, self.testing]
    }
}

impl Default for Ratios {
    fn default() -> Self {
        Ratios {
            training: 70,
            validation: 20,
            testing: 10,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Splits {
    pub mode: SplitMode,
    pub ratios: Ratios,
    /// Directory mode: top-level folder name -> split name.
    pub directories: std::collections::BTreeMap<String, String>,
}

impl Default for Splits {
    fn default() -> Self {
        Splits {
            mode: SplitMode::Hash,
            ratios: Ratios::default(),
            directories: Default::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MelScale {
    Htk,
    Slaney,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum MelNorm {
    None,
    Slaney,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum DbMode {
    Log10,
    AmplitudeToDb,
}

/// The feature definition (docs/design.md, "What a row is"). Changing any of these makes existing outputs
/// incompatible, which is why they are fingerprinted into every output file.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct FeatureSettings {
    pub sample_rate: u32,
    pub duration_sec: f64,
    pub long_window: usize,
    pub long_hop: usize,
    pub short_window: usize,
    pub short_hop: usize,
    pub n_fft: usize,
    pub hop_length: usize,
    pub n_mels: usize,
    pub power: f64,
    pub mel_scale: MelScale,
    pub mel_norm: MelNorm,
    pub f_min: f64,
    /// `None` means sample_rate / 2.
    pub f_max: Option<f64>,
    pub db: DbMode,
    pub top_db: Option<f64>,
    pub store_waveform: bool,
}

impl Default for FeatureSettings {
    fn default() -> Self {
        FeatureSettings {
            sample_rate: 4096,
            duration_sec: 10.0,
            long_window: 1024,
            long_hop: 1024,
            short_window: 512,
            short_hop: 512,
            n_fft: 512,
            hop_length: 128,
            n_mels: 64,
            power: 1.0,
            mel_scale: MelScale::Htk,
            mel_norm: MelNorm::None,
            f_min: 0.0,
            f_max: None,
            db: DbMode::Log10,
            top_db: None,
            store_waveform: false,
        }
    }
}

impl FeatureSettings {
    /// The second setup users run (`config/overlap32.toml`).
    pub fn overlap32() -> Self {
        FeatureSettings {
            long_hop: 512,
            short_hop: 256,
            n_mels: 32,
            power: 2.0,
            mel_norm: MelNorm::Slaney,
            db: DbMode::AmplitudeToDb,
            top_db: Some(80.0),
            ..FeatureSettings::default()
        }
    }

    pub fn f_max_hz(&self) -> f64 {
        self.f_max.unwrap_or(self.sample_rate as f64 / 2.0)
    }

    /// The same settings with `f_max` written out at its default (`sample_rate / 2`) taken as
    /// unset: the same features, so the same fingerprint as a configuration that leaves it out.
    pub fn canonical(mut self) -> Self {
        if self.f_max == Some(self.sample_rate as f64 / 2.0) {
            self.f_max = None;
        }
        self
    }

    /// Whether outputs whose `feature_fingerprint` is `stored` hold rows of these settings: the
    /// fingerprint of the settings, or of the same with the default `f_max` written out (as
    /// ailhd wrote it before it took such a configuration as [`FeatureSettings::canonical`]).
    pub fn made(&self, stored: &str) -> bool {
        if stored == self.fingerprint() {
            return true;
        }
        let nyquist = self.sample_rate as f64 / 2.0;
        self.f_max.is_none()
            && stored
                == FeatureSettings {
                    f_max: Some(nyquist),
                    ..self.clone()
                }
                .fingerprint()
    }

    /// Shapes derived from the settings (integer division, as in the contract).
    pub fn shape(&self) -> FeatureShape {
        let num_samples = (self.sample_rate as f64 * self.duration_sec).round() as usize;
        FeatureShape {
            num_samples,
            num_long: 1 + (num_samples - self.long_window) / self.long_hop,
            num_short: 1 + (self.long_window - self.short_window) / self.short_hop,
            n_mels: self.n_mels,
            t_frames: 1 + (self.short_window - self.n_fft) / self.hop_length,
            n_fft: self.n_fft,
            short_window: self.short_window,
        }
    }

    /// The settings as stored in `config_json` and hashed into `feature_fingerprint`.
    /// `store_waveform` is included: it changes the layout of the outputs.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("feature settings serialise")
    }

    /// blake3 of the canonical JSON: equal fingerprints mean compatible outputs.
    pub fn fingerprint(&self) -> String {
        blake3::hash(self.to_json().as_bytes()).to_hex().to_string()
    }

    fn validate(&self) -> Result<(), ConfigError> {
        let k = |name: &str| format!("features.{name}");
        if !(1..=1_000_000).contains(&self.sample_rate) {
            return Err(invalid(
                &k("sample_rate"),
                "must be between 1 and 1000000 Hz",
            ));
        }
        if !(self.duration_sec.is_finite()
            && self.duration_sec > 0.0
            && self.duration_sec <= 3600.0)
        {
            return Err(invalid(&k("duration_sec"), "must be > 0 and at most 3600"));
        }
        let n = (self.sample_rate as f64 * self.duration_sec).round() as usize;
        for (name, v) in [
            ("long_window", self.long_window),
            ("long_hop", self.long_hop),
            ("short_window", self.short_window),
            ("short_hop", self.short_hop),
            ("n_fft", self.n_fft),
            ("hop_length", self.hop_length),
            ("n_mels", self.n_mels),
        ] {
            if v == 0 {
                return Err(invalid(&k(name), "must be at least 1"));
            }
        }
        if self.long_window > n {
            return Err(invalid(
                &k("long_window"),
                format!(
                    "{} is longer than the clip ({} samples = sample_rate * duration_sec)",
                    self.long_window, n
                ),
            ));
        }
        if self.short_window > self.long_window {
            return Err(invalid(
                &k("short_window"),
                format!(
                    "{} is longer than long_window ({})",
                    self.short_window, self.long_window
                ),
            ));
        }
        if self.n_fft > self.short_window {
            return Err(invalid(
                &k("n_fft"),
                format!(
                    "{} is longer than short_window ({})",
                    self.n_fft, self.short_window
                ),
            ));
        }
        if self.n_fft < 2 || self.n_fft > 65536 {
            return Err(invalid(&k("n_fft"), "must be between 2 and 65536"));
        }
        if self.n_mels > 4096 {
            return Err(invalid(&k("n_mels"), "must be at most 4096"));
        }
        if !(self.power.is_finite() && self.power > 0.0) {
            return Err(invalid(
                &k("power"),
                "must be a positive number (1.0 = magnitude, 2.0 = power)",
            ));
        }
        let nyquist = self.sample_rate as f64 / 2.0;
        if !(self.f_min.is_finite() && self.f_min >= 0.0) {
            return Err(invalid(&k("f_min"), "must be >= 0"));
        }
        if let Some(f_max) = self.f_max {
            if !(f_max.is_finite() && f_max <= nyquist) {
                return Err(invalid(
                    &k("f_max"),
                    format!("must be at most sample_rate / 2 ({nyquist})"),
                ));
            }
        }
        if self.f_min >= self.f_max_hz() {
            return Err(invalid(
                &k("f_min"),
                format!("{} must be below f_max ({})", self.f_min, self.f_max_hz()),
            ));
        }
        match (self.db, self.top_db) {
            (_, Some(t)) if !(t.is_finite() && t > 0.0) => {
                return Err(invalid(&k("top_db"), "must be a positive number of dB"))
            }
            (DbMode::Log10, Some(_)) => {
                return Err(invalid(
                    &k("top_db"),
                    "only applies with db = \"amplitude_to_db\"; remove it or change features.db",
                ))
            }
            _ => {}
        }
        Ok(())
    }
}

/// Shapes of one row, derived from [`FeatureSettings`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureShape {
    /// Samples per recording after pad/trim.
    pub num_samples: usize,
    pub num_long: usize,
    pub num_short: usize,
    pub n_mels: usize,
    pub t_frames: usize,
    pub n_fft: usize,
    pub short_window: usize,
}

impl FeatureShape {
    /// float16 values in one row of `segments_mel`.
    pub fn row_len(&self) -> usize {
        self.num_long * self.num_short * self.n_mels * self.t_frames
    }
    pub fn row_dims(&self) -> [usize; 4] {
        [self.num_long, self.num_short, self.n_mels, self.t_frames]
    }
    /// Number of short windows (each gets its own mel spectrogram).
    pub fn num_windows(&self) -> usize {
        self.num_long * self.num_short
    }
    /// float32 values in one row of `segments_waveform`.
    pub fn waveform_len(&self) -> usize {
        self.num_windows() * self.short_window
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct HdfNames {
    pub training: String,
    pub validation: String,
    pub testing: String,
}

impl Default for HdfNames {
    fn default() -> Self {
        HdfNames {
            training: "TRAINING_DATASET.H5".into(),
            validation: "VALIDATION_DATASET.H5".into(),
            testing: "TESTING_DATASET.H5".into(),
        }
    }
}

impl HdfNames {
    pub fn for_split(&self, split: usize) -> &str {
        [&self.training, &self.validation, &self.testing][split]
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Outputs {
    pub hdf5: bool,
    pub npy: bool,
    pub hdf5_names: HdfNames,
    /// Fixed length of the `source_path` strings (bytes of UTF-8).
    pub path_bytes: usize,
}

impl Default for Outputs {
    fn default() -> Self {
        Outputs {
            hdf5: true,
            npy: true,
            hdf5_names: HdfNames::default(),
            path_bytes: 256,
        }
    }
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DeviceChoice {
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(DeviceChoice::Auto),
            "cpu" => Ok(DeviceChoice::Cpu),
            "cuda" => Ok(DeviceChoice::Cuda),
            other => Err(format!("unknown device `{other}` (auto, cpu or cuda)")),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Ingest {
    pub device: DeviceChoice,
    pub max_batch_files: usize,
    pub max_batch_latency_ms: u64,
    /// A file must be unchanged (size, mtime) this long before it is taken as complete.
    pub settle_ms: u64,
    /// A file still incomplete after this long is quarantined.
    pub quarantine_after_s: u64,
    /// A file that could not be read (an I/O error, a permission refused) is quarantined and
    /// read again after this long, then after twice as long each time, up to an hour; 0 = only
    /// when it changes.
    pub unreadable_retry_s: u64,
    /// Periodic safety rescan; 0 disables it.
    pub rescan_interval_s: u64,
    /// Decode/hash/featurise threads; 0 = one per core.
    pub workers: usize,
    /// After this many seconds without work the service closes its files cleanly, so any
    /// reader opens them plainly; the next file reopens them. 0 = keep them open.
    pub idle_close_s: u64,
    /// Memory (MiB) the manifest may keep as a cache of its records (in sled's count: about
    /// twice that resident). sled keeps a structure per page of the open manifest on top, until
    /// the manifest closes (docs/operations.md).
    pub manifest_cache_mb: u64,
}

impl Default for Ingest {
    fn default() -> Self {
        Ingest {
            device: DeviceChoice::Auto,
            max_batch_files: 256,
            max_batch_latency_ms: 20,
            settle_ms: 200,
            quarantine_after_s: 300,
            unreadable_retry_s: 30,
            rescan_interval_s: 3600,
            workers: 0,
            idle_close_s: 60,
            manifest_cache_mb: 4,
        }
    }
}

/// `[metrics]`: both off by default; the service opens no port unless told to.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Metrics {
    /// A Prometheus text-format file, rewritten atomically (node_exporter's textfile collector).
    pub textfile: Option<PathBuf>,
    /// `host:port` of an HTTP endpoint serving `GET /metrics`.
    pub listen: Option<String>,
}

impl Metrics {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(p) = &self.textfile {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
            if !p.is_absolute() || !name.ends_with(".prom") {
                return Err(invalid(
                    "metrics.textfile",
                    format!(
                        "`{}` must be an absolute path to a *.prom file (node_exporter's textfile collector reads only *.prom)",
                        p.display()
                    ),
                ));
            }
        }
        if let Some(addr) = &self.listen {
            if addr.parse::<std::net::SocketAddr>().is_err() {
                return Err(invalid(
                    "metrics.listen",
                    format!("`{addr}` is not an address and port, e.g. \"127.0.0.1:9187\""),
                ));
            }
        }
        Ok(())
    }
}

/// `[gpu]`: where to find the CUDA libraries beyond the usual places (the dynamic loader's
/// search, then the active Python environment's and the user's `site-packages/nvidia/*/lib`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Gpu {
    /// A folder holding NVRTC (with its builtins library), cuFFT or the driver, searched before
    /// anywhere else (e.g. `<venv>/lib/python3.12/site-packages/nvidia/cu13/lib`).
    pub library_path: Option<PathBuf>,
}

impl Gpu {
    fn validate(&self) -> Result<(), ConfigError> {
        if let Some(p) = &self.library_path {
            if !p.is_absolute() {
                return Err(invalid(
                    "gpu.library_path",
                    format!(
                        "`{}` must be an absolute path to a folder of CUDA libraries",
                        p.display()
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// The override a value error came from, when it came from the environment (the `config`
/// crate's origin for `Environment` is "the environment"): `ingest.workers` is
/// `AILHD_INGEST__WORKERS`. An unknown key carries no origin: it is the environment's when one
/// of the `overrides` names it.
fn from_environment(
    e: &config::ConfigError,
    overrides: &config::Map<String, String>,
) -> Option<ConfigError> {
    const ENVIRONMENT: &str = "the environment";
    if let Some(unknown) = unknown_override(e, overrides) {
        return Some(unknown);
    }
    let (key, message) = match e {
        config::ConfigError::Type {
            origin: Some(origin),
            unexpected,
            expected,
            key: Some(key),
        } if origin == ENVIRONMENT => (
            key,
            format!("invalid type: {unexpected}, expected {expected}"),
        ),
        config::ConfigError::At {
            error,
            origin: Some(origin),
            key: Some(key),
        } if origin == ENVIRONMENT => (key, error.to_string()),
        // A value none of an enum's ("enum DeviceChoice does not have variant constructor gpu
        // for key `ingest.device`"), which `config` reports without its origin: the override's
        // when one sets that key (it wins over the file).
        _ => {
            let message = e.to_string();
            let (_, after) = message.split_once(" for key ")?;
            let key = after.trim().trim_matches('`').to_string();
            let var = overrides.keys().find(|var| override_key(var) == key)?;
            return Some(ConfigError::Env {
                var: var.clone(),
                message: with_accepted_values(message),
            });
        }
    };
    let var = format!("AILHD_{}", key.to_uppercase().replace('.', "__"));
    Some(ConfigError::Env {
        var,
        message: format!("{message} (key `{key}`)"),
    })
}

/// The key an override sets (`AILHD_FEATURES__N_MELS` -> `features.n_mels`), as the `config`
/// crate reads its name.
fn override_key(var: &str) -> String {
    var["AILHD_".len()..].to_lowercase().replace("__", ".")
}

/// serde's "unknown field `nmels`, expected one of `sample_rate`, ..." under section `key`
/// (None: at the top), when an override names that key (`AILHD_FEATURES__NMELS`, or a key
/// below it): said as the variable's, with the keys that exist there.
fn unknown_override(
    e: &config::ConfigError,
    overrides: &config::Map<String, String>,
) -> Option<ConfigError> {
    let (section, message) = match e {
        config::ConfigError::At {
            error,
            key: Some(k),
            ..
        } => match error.as_ref() {
            config::ConfigError::Message(m) => (Some(k.as_str()), m),
            _ => return None,
        },
        config::ConfigError::Message(m) => (None, m),
        _ => return None,
    };
    let (field, rest) = message.strip_prefix("unknown field `")?.split_once('`')?;
    let key = match section {
        Some(s) => format!("{s}.{field}"),
        None => field.to_string(),
    };
    // The key an override sets, as the `config` crate reads its name.
    let var = overrides.keys().find(|var| {
        let k = override_key(var);
        k == key || k.starts_with(&format!("{key}."))
    })?;
    let known = rest
        .trim_start_matches(", expected one of ")
        .trim_start_matches(", expected ")
        .replace('`', "");
    let known = match section {
        Some(s) => format!("known keys in [{s}]: {known}"),
        None => format!("known sections: {known}"),
    };
    Some(ConfigError::Env {
        var: var.clone(),
        message: format!("unknown key {key}; {known}"),
    })
}

/// `config`'s message for a value that is none of an enum's ("enum SplitMode does not have
/// variant constructor foo for key `splits.mode`"), with the values the key accepts added.
fn with_accepted_values(message: String) -> String {
    /// The values `T` accepts, as serde names them ("\"hash\", \"sensor\", \"directory\"").
    fn accepted<T: serde::de::DeserializeOwned>() -> Option<String> {
        let none = serde::de::value::StrDeserializer::<serde::de::value::Error>::new("");
        let e = T::deserialize(none).err()?.to_string();
        Some(e.split_once("expected one of ")?.1.replace('`', "\""))
    }
    let Some((_, after)) = message.split_once("enum ") else {
        return message;
    };
    let Some((name, _)) = after.split_once(" does not have variant constructor") else {
        return message;
    };
    let values = match name {
        "SplitMode" => accepted::<SplitMode>(),
        "DeviceChoice" => accepted::<DeviceChoice>(),
        "UnknownLabel" => accepted::<UnknownLabel>(),
        "MelScale" => accepted::<MelScale>(),
        "MelNorm" => accepted::<MelNorm>(),
        "DbMode" => accepted::<DbMode>(),
        _ => None,
    };
    match values {
        Some(values) => format!("{message}; accepted values: {values}"),
        None => message,
    }
}

impl Settings {
    /// Load as the contract says: `explicit` (from `--config`), else `$AILHD_CONFIG`, else
    /// `/etc/ailhd/ailhd.toml` if it exists, else built-in defaults; then `AILHD_<SECTION>__<KEY>`
    /// environment overrides; then validation.
    pub fn load(explicit: Option<&Path>) -> Result<Settings, ConfigError> {
        let env_path = std::env::var_os("AILHD_CONFIG").map(PathBuf::from);
        let file = match (explicit, env_path) {
            (Some(p), _) => Some((p.to_path_buf(), true)),
            (None, Some(p)) => Some((p, true)),
            (None, None) => {
                let p = PathBuf::from(DEFAULT_CONFIG_PATH);
                p.exists().then_some((p, false))
            }
        };
        let mut builder = config::Config::builder();
        if let Some((path, _required)) = &file {
            if !path.is_file() {
                return Err(ConfigError::Load {
                    path: path.display().to_string(),
                    message: "no such file".into(),
                });
            }
            builder = builder
                .add_source(config::File::from(path.as_path()).format(config::FileFormat::Toml));
        }
        // Only AILHD_<SECTION>__<KEY> variables are settings: AILHD_CONFIG names the file, and
        // other AILHD_* variables (a test harness's, say) are not keys.
        let overrides: config::Map<String, String> = std::env::vars()
            .filter(|(k, _)| k.starts_with("AILHD_") && k["AILHD_".len()..].contains("__"))
            .collect();
        builder = builder.add_source(
            config::Environment::with_prefix("AILHD")
                .source(Some(overrides.clone()))
                .prefix_separator("_")
                .separator("__")
                .list_separator(",")
                .with_list_parse_key("labels.names")
                .try_parsing(true),
        );
        let source = |e: config::ConfigError| match (from_environment(&e, &overrides), &file) {
            (Some(env), _) => env,
            (None, Some((p, _))) => ConfigError::Load {
                path: p.display().to_string(),
                message: with_accepted_values(e.to_string()),
            },
            (None, None) => ConfigError::Parse(with_accepted_values(e.to_string())),
        };
        let built = builder.build().map_err(source)?;
        let mut settings: Settings = built.try_deserialize().map_err(source)?;
        settings.features = settings.features.canonical();
        settings.validate()?;
        Ok(settings)
    }

    /// Parse a TOML string (tests, and `check-config` on a given text), with validation.
    pub fn from_toml_str(text: &str) -> Result<Settings, ConfigError> {
        let built = config::Config::builder()
            .add_source(config::File::from_str(text, config::FileFormat::Toml))
            .build()
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        let mut settings: Settings = built
            .try_deserialize()
            .map_err(|e| ConfigError::Parse(e.to_string()))?;
        settings.features = settings.features.canonical();
        settings.validate()?;
        Ok(settings)
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        self.features.validate()?;
        if self.labels.names.is_empty() {
            return Err(invalid("labels.names", "must name at least one label"));
        }
        if self.labels.names.len() > i16::MAX as usize {
            return Err(invalid(
                "labels.names",
                "at most 32767 labels (ids are int16)",
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for name in &self.labels.names {
            if name.is_empty() || name.contains('/') {
                return Err(invalid(
                    "labels.names",
                    format!("`{name}` is not a folder name"),
                ));
            }
            // A label folder with spaces around its name is nearly always a list written
            // "A, B" in AILHD_LABELS__NAMES (names are separated by "," alone, no brackets or
            // quotes), whose names would then match no folder.
            if name.trim() != name || name.starts_with(['[', '"']) || name.ends_with([']', '"']) {
                return Err(invalid(
                    "labels.names",
                    format!(
                        "`{name}` has spaces, brackets or quotes around it (in \
                         AILHD_LABELS__NAMES, separate the names with \",\" alone: A,B,C)"
                    ),
                ));
            }
            if !seen.insert(name) {
                return Err(invalid("labels.names", format!("`{name}` is listed twice")));
            }
        }
        let sum: u32 = self.splits.ratios.as_array().iter().sum();
        if sum != 100 {
            return Err(invalid(
                "splits.ratios",
                format!("training + validation + testing must sum to 100, not {sum}"),
            ));
        }
        if self.splits.mode == SplitMode::Directory {
            if self.splits.directories.is_empty() {
                return Err(invalid(
                    "splits.directories",
                    "directory mode needs a map of top-level folder -> split (training, validation, testing)",
                ));
            }
            for (dir, split) in &self.splits.directories {
                if !SPLITS.contains(&split.as_str()) {
                    return Err(invalid(
                        &format!("splits.directories.{dir}"),
                        format!("`{split}` is not a split (training, validation, testing)"),
                    ));
                }
            }
        }
        let names = [
            &self.outputs.hdf5_names.training,
            &self.outputs.hdf5_names.validation,
            &self.outputs.hdf5_names.testing,
        ];
        for (i, n) in names.iter().enumerate() {
            if n.is_empty() || n.contains('/') || n.as_str() == "npy" {
                return Err(invalid(
                    &format!("outputs.hdf5_names.{}", SPLITS[i]),
                    format!("`{n}` is not a plain file name"),
                ));
            }
        }
        if names[0] == names[1] || names[1] == names[2] || names[0] == names[2] {
            return Err(invalid(
                "outputs.hdf5_names",
                "the three file names must differ",
            ));
        }
        if !(8..=4096).contains(&self.outputs.path_bytes) {
            return Err(invalid("outputs.path_bytes", "must be between 8 and 4096"));
        }
        if !self.outputs.hdf5 && !self.outputs.npy {
            return Err(invalid(
                "outputs",
                "at least one of hdf5 and npy must be true",
            ));
        }
        if self.ingest.manifest_cache_mb == 0 {
            return Err(invalid("ingest.manifest_cache_mb", "must be at least 1"));
        }
        if self.ingest.max_batch_files == 0 {
            return Err(invalid("ingest.max_batch_files", "must be at least 1"));
        }
        if self.ingest.workers > 1024 {
            return Err(invalid(
                "ingest.workers",
                "must be at most 1024 (0 = one per core)",
            ));
        }
        self.metrics.validate()?;
        self.gpu.validate()?;
        self.paths.validate()
    }

    /// What the service needs at start, beyond a valid configuration (`check-config`, the unit's
    /// ExecStartPre): the recordings folder exists and can be listed; the output and state
    /// folders, and the metrics textfile's folder, exist and are writable, or can be created
    /// (tested by creating and removing a probe file; nothing else is created). The error names
    /// the key and the path. What only the configuration can mend (a missing recordings folder,
    /// which `run` waits for instead: [`Settings::check_paths_for_run`]; no permission, a
    /// read-only mount over a writable file system, a file where a folder belongs) is a
    /// [`ConfigError`]; a condition that may pass (an I/O error, a full disk, a file system that
    /// does not answer, a file system read-only as a whole) is a [`PathUnavailable`], which
    /// `run` waits out ([`crate::service::wait_for_paths`]) and the other commands report as a
    /// run-time failure (exit 1).
    pub fn check_paths(&self) -> Result<(), PathsError> {
        self.check_data_folders()?;
        self.check_metrics_folder()
    }

    /// [`Settings::check_paths`] for the service, which waits for a recordings folder that is
    /// not there (a disk not mounted yet at boot) instead of refusing to start: it says so in
    /// the log and starts watching the folder once it appears (docs/operations.md). Anything
    /// else wrong with it is refused as `check-config` refuses it.
    pub fn check_paths_for_run(&self) -> Result<(), PathsError> {
        let rec = &self.paths.recordings;
        match std::fs::symlink_metadata(rec) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                log::warn!(
                    "paths.recordings = {}: no such folder (is its disk mounted?); the service \
                     starts and takes recordings once it is there",
                    rec.display()
                );
                self.check_output_and_state()?;
                self.check_metrics_folder()
            }
            _ => self.check_paths(),
        }
    }

    fn check_metrics_folder(&self) -> Result<(), PathsError> {
        if let Some(t) = &self.metrics.textfile {
            let dir = t.parent().unwrap_or(Path::new("/"));
            check_writable_dir("metrics.textfile", dir, false)?;
        }
        Ok(())
    }

    /// The part of [`Settings::check_paths`] that `rebuild` needs too (it writes no metrics): the
    /// recordings folder, and the output and state folders.
    pub fn check_data_folders(&self) -> Result<(), PathsError> {
        let rec = &self.paths.recordings;
        match std::fs::metadata(rec) {
            Err(e) => {
                let waits = if e.kind() == std::io::ErrorKind::NotFound {
                    " (`ailhd run` starts all the same and waits for it, as for a disk not mounted yet)"
                } else {
                    ""
                };
                return Err(path_error(
                    "paths.recordings",
                    format!("{}: {}{waits}", rec.display(), io_reason(&e)),
                    &e,
                ));
            }
            Ok(m) if !m.is_dir() => {
                return Err(invalid(
                    "paths.recordings",
                    format!("{} is not a folder", rec.display()),
                )
                .into())
            }
            Ok(_) => {}
        }
        if let Err(e) = std::fs::read_dir(rec) {
            return Err(path_error(
                "paths.recordings",
                format!("{}: cannot be read: {}", rec.display(), io_reason(&e)),
                &e,
            ));
        }
        self.check_output_and_state()
    }

    /// `paths.output` is not a folder `ailhd merge` wrote (it holds [`crate::merge::MARKER`]):
    /// a merged view is read-only; `run` and `rebuild` over it would replace it with outputs of
    /// their own (and a later merge into it would then remove those), and `status` has no
    /// manifest for it.
    pub fn check_not_a_merge(&self) -> Result<(), ConfigError> {
        let out = &self.paths.output;
        if out.join(crate::merge::MARKER).exists() {
            return Err(invalid(
                "paths.output",
                format!(
                    "{} holds a merge ({} is there): a merged view is for readers (h5py, \
                     ailhd_reader) and for `ailhd merge` to replace; `run`, `rebuild` and \
                     `status` work on outputs of their own: set paths.output to another folder",
                    out.display(),
                    crate::merge::MARKER
                ),
            ));
        }
        Ok(())
    }

    /// The output and state folders are writable, or can be created.
    fn check_output_and_state(&self) -> Result<(), PathsError> {
        self.check_not_a_merge()?;
        check_writable_dir("paths.output", &self.paths.output, true)?;
        check_writable_dir("paths.state", &self.paths.state, true)
    }

    /// Split index for a top-level folder in directory mode.
    pub fn directory_split(&self, top: &str) -> Option<usize> {
        self.splits
            .directories
            .get(top)
            .and_then(|s| SPLITS.iter().position(|x| x == s))
    }

    /// The defaults with the recordings, the outputs and the state in one folder (`rec`, `out`,
    /// `state` under `dir`): for tests and benchmarks.
    pub fn in_folder(dir: &Path) -> Settings {
        let mut s = Settings::default();
        s.paths.recordings = dir.join("rec");
        s.paths.output = dir.join("out");
        s.paths.state = dir.join("state");
        s
    }

    pub fn worker_threads(&self) -> usize {
        if self.ingest.workers == 0 {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
        } else {
            self.ingest.workers
        }
    }
}

fn io_reason(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such folder".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        _ => e.to_string(),
    }
}

/// What [`Settings::check_paths`] found wrong: the configuration, or a condition that may pass.
#[derive(Debug, thiserror::Error)]
pub enum PathsError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    Unavailable(#[from] PathUnavailable),
}

/// A configured folder cannot be used now for a reason that may pass (an I/O error, a full
/// disk, a file system that does not answer): not a configuration error (exit 1, not 2).
#[derive(Debug, thiserror::Error)]
#[error("`{key}`: {message} (a condition that may pass, not a configuration error)")]
pub struct PathUnavailable {
    pub key: String,
    pub message: String,
}

/// Whether an I/O error says the configuration is wrong (a missing folder, no permission, a
/// read-only file system, a file where a folder belongs), rather than that the disk fails now.
pub(crate) fn is_configuration(e: &std::io::Error) -> bool {
    use std::io::ErrorKind as K;
    matches!(
        e.kind(),
        K::NotFound | K::PermissionDenied | K::ReadOnlyFilesystem | K::NotADirectory
    ) || matches!(e.raw_os_error(), Some(libc::ENAMETOOLONG | libc::ELOOP))
}

fn path_error(key: &str, message: String, e: &std::io::Error) -> PathsError {
    if is_configuration(e) {
        invalid(key, message).into()
    } else {
        PathUnavailable {
            key: key.to_string(),
            message,
        }
        .into()
    }
}

/// `dir` is a writable folder, or (when `may_create`) a missing one whose nearest existing
/// ancestor is a writable folder. Probed by creating and removing a file.
fn check_writable_dir(key: &str, dir: &Path, may_create: bool) -> Result<(), PathsError> {
    let mut at = dir.to_path_buf();
    loop {
        match std::fs::metadata(&at) {
            Ok(m) if m.is_dir() => break,
            Ok(_) => {
                return Err(invalid(
                    key,
                    format!("{}: {} is not a folder", dir.display(), at.display()),
                )
                .into())
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && may_create => {
                if !at.pop() || at.as_os_str().is_empty() {
                    at = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("/"));
                    break;
                }
            }
            Err(e) => {
                return Err(path_error(
                    key,
                    format!("{}: {}", dir.display(), io_reason(&e)),
                    &e,
                ))
            }
        }
    }
    let probe = at.join(format!(".ailhd-check-{}", std::process::id()));
    match std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&probe)
    {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => {
            let what = if at == dir {
                "is not writable".to_string()
            } else {
                format!("cannot be created in {}", at.display())
            };
            let message = format!("{} {what}: {}", dir.display(), io_reason(&e));
            // A file system read-only as a whole (remounted so by the kernel after disk errors,
            // say) may be writable again after a repair: a condition that may pass. A mount
            // made read-only on its own (a systemd unit's ProtectSystem, a read-only bind
            // mount over a writable file system) is the configuration's.
            if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem && file_system_read_only(&at) {
                return Err(PathUnavailable {
                    key: key.to_string(),
                    message: format!(
                        "{message} (the whole file system is read-only: remounted so after disk \
                         errors, or mounted so)"
                    ),
                }
                .into());
            }
            Err(path_error(key, message, &e))
        }
    }
}

/// Whether the file system holding `path` is read-only as a whole (its super block: the last
/// field of its line in `/proc/self/mountinfo`), rather than only the mount `path` is seen
/// through. False when it cannot be told.
pub(crate) fn file_system_read_only(path: &Path) -> bool {
    let Ok(path) = std::fs::canonicalize(path) else {
        return false;
    };
    let Ok(table) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    // The mount with the longest mount point above the path; of mounts on the same point, the
    // last listed (the one on top).
    let mut best: Option<(usize, bool)> = None;
    for line in table.lines() {
        let Some((mount, fs)) = line.split_once(" - ") else {
            continue;
        };
        let Some(point) = mount.split(' ').nth(4) else {
            continue;
        };
        let point = PathBuf::from(unescape_mountinfo(point));
        if !path.starts_with(&point) {
            continue;
        }
        let depth = point.components().count();
        if best.is_none_or(|(d, _)| depth >= d) {
            let super_ro = fs.split(' ').nth(2).is_some_and(super_options_read_only);
            best = Some((depth, super_ro));
        }
    }
    best.is_some_and(|(_, ro)| ro)
}

/// Whether a file system's options in mountinfo say it is read-only: `ro`, or ext4's
/// `emergency_ro` (Linux 6.x keeps `rw` beside it once it stopped writing after an error).
fn super_options_read_only(options: &str) -> bool {
    options.split(',').any(|o| o == "ro" || o == "emergency_ro")
}

/// A mountinfo field with its octal escapes (`\040` for a space) undone.
fn unescape_mountinfo(field: &str) -> String {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = b
            .get(i + 1..i + 4)
            .filter(|d| d.iter().all(|c| (b'0'..=b'7').contains(c)))
            .and_then(|d| {
                let v = d.iter().fold(0u16, |v, c| v * 8 + u16::from(c - b'0'));
                u8::try_from(v).ok()
            });
        match (b[i], octal) {
            (b'\\', Some(c)) => {
                out.push(c);
                i += 4;
            }
            (c, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_system_is_read_only_by_ro_or_ext4s_emergency_ro() {
        assert!(super_options_read_only("ro,errors=remount-ro"));
        assert!(super_options_read_only("rw,errors=remount-ro,emergency_ro"));
        assert!(!super_options_read_only("rw,errors=remount-ro"));
        assert!(!super_options_read_only("rw,size=65536k,mode=755"));
    }

    #[test]
    fn mountinfo_escapes_are_undone() {
        assert_eq!(unescape_mountinfo(r"/mnt/a\040b\011c"), "/mnt/a b\tc");
        assert_eq!(unescape_mountinfo(r"/x\\y\9"), r"/x\\y\9");
        assert_eq!(unescape_mountinfo(r"/end\04"), r"/end\04");
    }

    #[test]
    fn defaults_validate_and_give_contract_shapes() {
        let s = Settings::default();
        s.validate().unwrap();
        assert_eq!(s.features.shape().row_dims(), [40, 2, 64, 1]);
        assert_eq!(
            FeatureSettings::overlap32().shape().row_dims(),
            [79, 3, 32, 1]
        );
    }

    /// Exit 2 (configuration) only for what the user must mend; a failing disk is exit 1.
    #[test]
    fn io_errors_that_may_pass_are_not_configuration_errors() {
        use std::io::Error;
        for errno in [libc::EACCES, libc::EROFS, libc::ENOTDIR, libc::ENOENT] {
            let e = path_error("paths.output", "x".into(), &Error::from_raw_os_error(errno));
            assert!(matches!(e, PathsError::Config(_)), "errno {errno}: {e}");
        }
        for errno in [libc::EIO, libc::ENOSPC, libc::ENOTCONN, libc::ETIMEDOUT] {
            let e = path_error("paths.output", "x".into(), &Error::from_raw_os_error(errno));
            assert!(
                matches!(e, PathsError::Unavailable(_)),
                "errno {errno}: {e}"
            );
        }
    }

    /// Outputs or state inside the recordings tree (however spelt: `..`, a link to a folder
    /// of it) are refused by name; beside it, or holding it, they are not.
    #[test]
    fn outputs_and_state_inside_the_recordings_tree_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("data/MASTER_DATASET/LEAK")).unwrap();
        std::os::unix::fs::symlink(d.join("data/MASTER_DATASET"), d.join("tree")).unwrap();
        let with = |output: PathBuf, state: PathBuf| Settings {
            paths: Paths {
                recordings: d.join("data/MASTER_DATASET"),
                output,
                state,
            },
            ..Settings::default()
        };
        let outside = d.join("data/state");
        for (output, key) in [
            (d.join("data/MASTER_DATASET"), "paths.output"),
            (d.join("data/MASTER_DATASET/out"), "paths.output"),
            (
                d.join("data/x/../MASTER_DATASET/LEAK/new/out"),
                "paths.output",
            ),
            (d.join("tree/out"), "paths.output"),
        ] {
            let err = with(output.clone(), outside.clone())
                .validate()
                .unwrap_err();
            assert!(
                err.to_string().contains(key) && err.to_string().contains("inside"),
                "{}: {err}",
                output.display()
            );
        }
        let err = with(d.join("data/out"), d.join("tree/.state"))
            .validate()
            .unwrap_err();
        assert!(err.to_string().contains("paths.state"), "{err}");
        with(d.join("data"), outside.clone()).validate().unwrap();
        with(d.join("data/MASTER_DATASET.out"), outside)
            .validate()
            .unwrap();
    }

    #[test]
    fn unknown_key_is_rejected_with_its_name() {
        let err = Settings::from_toml_str("[features]\nn_ffft = 512\n").unwrap_err();
        assert!(err.to_string().contains("n_ffft"), "{err}");
    }

    #[test]
    fn impossible_values_name_the_key() {
        let cases = [
            ("[features]\nshort_window = 2048\n", "features.short_window"),
            ("[features]\nn_fft = 1024\n", "features.n_fft"),
            ("[splits.ratios]\ntraining = 80\n", "splits.ratios"),
            ("[features]\nf_max = 5000.0\n", "features.f_max"),
            ("[features]\ntop_db = 80.0\n", "features.top_db"),
            ("[splits]\nmode = \"directory\"\n", "splits.directories"),
            ("[metrics]\nlisten = \"localhost\"\n", "metrics.listen"),
            ("[metrics]\ntextfile = \"ailhd.prom\"\n", "metrics.textfile"),
            ("[gpu]\nlibrary_path = \"lib\"\n", "gpu.library_path"),
        ];
        for (text, key) in cases {
            let err = Settings::from_toml_str(text).unwrap_err().to_string();
            assert!(err.contains(key), "{text:?} gave {err}");
        }
    }

    #[test]
    fn fingerprint_changes_with_any_feature_setting() {
        let a = FeatureSettings::default();
        let mut b = a.clone();
        b.n_mels = 32;
        assert_ne!(a.fingerprint(), b.fingerprint());
        assert_eq!(a.fingerprint(), FeatureSettings::default().fingerprint());
    }

    /// `f_max` written out at its default (config/ailhd.toml's comment says `2048.0`) is the
    /// default: the same fingerprint as leaving it out, so existing outputs take it. Outputs
    /// made while such a configuration kept its own fingerprint are taken too, and another
    /// f_max still differs.
    #[test]
    fn the_default_f_max_written_out_is_the_default() {
        let written = Settings::from_toml_str("[features]\nf_max = 2048.0\n").unwrap();
        let default = FeatureSettings::default();
        assert_eq!(written.features.fingerprint(), default.fingerprint());
        let before = FeatureSettings {
            f_max: Some(2048.0),
            ..default.clone()
        };
        assert_ne!(before.fingerprint(), default.fingerprint());
        assert!(default.made(&before.fingerprint()));
        let other = Settings::from_toml_str("[features]\nf_max = 2000.0\n").unwrap();
        assert!(!other.features.made(&default.fingerprint()));
        assert!(!other.features.made(&before.fingerprint()));
        assert!(!default.made(&other.features.fingerprint()));
    }
}

#[cfg(test)]
mod shipped_files {
    use super::*;

    fn shipped(name: &str) -> String {
        std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("config")
                .join(name),
        )
        .unwrap()
    }

    #[test]
    fn documented_defaults_are_the_defaults() {
        assert_eq!(
            Settings::from_toml_str(&shipped("ailhd.toml")).unwrap(),
            Settings::default()
        );
    }

    #[test]
    fn overlap32_file_is_the_overlap32_setup() {
        let s = Settings::from_toml_str(&shipped("overlap32.toml")).unwrap();
        assert_eq!(s.features, FeatureSettings::overlap32());
    }
}
