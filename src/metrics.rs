//! Metrics in the Prometheus text format (docs/operations.md, "Metrics"): the engine records
//! through the narrow functions below; `[metrics] textfile` rewrites a `*.prom` file atomically
//! for node_exporter's textfile collector, `[metrics] listen` serves `GET /metrics` over HTTP.
//! Both are off by default and then nothing is recorded at all (the functions are no-ops until
//! [`Exporter::start`] installs the recorder).
//!
//! Every documented family is there from the first scrape and the first textfile: counters,
//! their known label values and the histogram start at zero ([`zero_families`]), and neither
//! exporter shows anything until the service has recorded the manifest's figures once
//! ([`ready`]), so an alert on `ailhd_write_failing` or a `rate()` never meets a missing series.
//!
//! Recording goes through the `metrics` facade; `metrics-exporter-prometheus` keeps the values
//! and renders the classic text format (version 0.0.4), the one node_exporter's textfile
//! collector parses (it does not read OpenMetrics). The endpoint is `tiny_http` on its own thread.

use crate::config::Metrics as MetricsSettings;
use crate::status::StatusReport;
use anyhow::Context;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();

/// Set once the service has recorded its first figures: the exporters wait for it (at most
/// [`READY_WAIT`]) before the first textfile and the first answer to a scrape.
static READY: AtomicBool = AtomicBool::new(false);

/// How long the exporters wait for [`ready`] before they show what they have.
const READY_WAIT: Duration = Duration::from_secs(10);

/// The label values of `ailhd_files_quarantined_total{reason}` ([`reason_kind`]'s kinds).
pub const QUARANTINE_KINDS: [&str; 13] = [
    "not_wav",
    "truncated",
    "empty",
    "unsupported",
    "malformed",
    "incomplete",
    "label",
    "path_too_long",
    "path_not_utf8",
    "symlink",
    "not_a_file",
    "stopped_while_reading",
    "other",
];

/// The label values of `ailhd_errors_total{kind}`.
pub const ERROR_KINDS: [&str; 3] = ["write", "featurise", "rescan"];

/// How often the textfile is rewritten (node_exporter reads it at each scrape).
pub const TEXTFILE_INTERVAL: Duration = Duration::from_secs(5);

/// Completion-to-commit latency buckets, seconds.
const LATENCY_BUCKETS: [f64; 12] = [
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];

/// The process-wide recorder, installed on first use.
fn handle() -> &'static PrometheusHandle {
    HANDLE.get_or_init(|| {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                Matcher::Full("ailhd_commit_latency_seconds".into()),
                &LATENCY_BUCKETS,
            )
            .expect("latency buckets are not empty")
            .build_recorder();
        let handle = recorder.handle();
        // Fails only if another recorder was installed first: then ours renders nothing new.
        let _ = ::metrics::set_global_recorder(recorder);
        describe();
        handle
    })
}

fn describe() {
    use ::metrics::{describe_counter, describe_gauge, describe_histogram, Unit};
    describe_gauge!(
        "ailhd_up",
        "1 while the service runs; 0 in the file left at a clean stop"
    );
    describe_gauge!(
        "ailhd_start_time_seconds",
        Unit::Seconds,
        "start of this service process, Unix time"
    );
    describe_gauge!(
        "ailhd_device_info",
        "featuriser device of the running service (label device)"
    );
    describe_counter!(
        "ailhd_files_ingested_total",
        "recordings committed (a new row, or attached to an existing row) by this process"
    );
    describe_counter!(
        "ailhd_files_quarantined_total",
        "recordings quarantined by this process, by kind of reason"
    );
    describe_gauge!(
        "ailhd_files",
        "files known to the manifest, by state (committed, quarantined)"
    );
    describe_gauge!(
        "ailhd_files_pending",
        "files seen and not yet complete (still being written or settling)"
    );
    describe_gauge!(
        "ailhd_queue_depth",
        "files waiting: settling plus complete and not yet committed"
    );
    describe_gauge!(
        "ailhd_rows",
        "valid rows per split and label (rows with valid = 1)"
    );
    describe_gauge!(
        "ailhd_split_rows",
        "committed rows per split, valid or not (the datasets' committed_rows)"
    );
    describe_histogram!(
        "ailhd_commit_latency_seconds",
        Unit::Seconds,
        "time from a recording being complete to its row being committed"
    );
    describe_gauge!(
        "ailhd_stage_seconds",
        Unit::Seconds,
        "time spent per pipeline stage since the start (only grows while the process lives)"
    );
    describe_counter!("ailhd_errors_total", "errors, by kind");
    describe_gauge!(
        "ailhd_write_failing",
        "1 while writing the outputs or the manifest fails (disk full, I/O error); the service retries by itself"
    );
    describe_gauge!(
        "ailhd_unwatched_folders",
        "folders not watched for now (inotify limits, no permission): retried, and the tree rescanned meanwhile"
    );
    describe_gauge!(
        "ailhd_outputs_open",
        "1 while the output files are open for appending; 0 when closed while idle (ingest.idle_close_s) or while writing fails"
    );
    describe_counter!(
        "ailhd_config_reloads_total",
        "configuration reloads (SIGHUP), by result (accepted, refused)"
    );
}

fn enabled() -> bool {
    HANDLE.get().is_some()
}

/// A recording committed.
pub fn file_ingested(n: u64) {
    if enabled() {
        ::metrics::counter!("ailhd_files_ingested_total").increment(n);
    }
}

/// A recording quarantined, with its reason (reduced to a bounded kind for the label).
pub fn file_quarantined(reason: &str) {
    if enabled() {
        ::metrics::counter!("ailhd_files_quarantined_total", "reason" => reason_kind(reason))
            .increment(1);
    }
}

/// Files seen and not yet complete.
pub fn pending(n: usize) {
    if enabled() {
        ::metrics::gauge!("ailhd_files_pending").set(n as f64);
    }
}

/// Files waiting in all (settling + queued for the ingest worker).
pub fn queue_depth(n: usize) {
    if enabled() {
        ::metrics::gauge!("ailhd_queue_depth").set(n as f64);
    }
}

/// Valid rows of one split and label.
pub fn rows(split: &str, label: &str, n: u64) {
    if enabled() {
        ::metrics::gauge!("ailhd_rows", "split" => split.to_string(), "label" => label.to_string())
            .set(n as f64);
    }
}

/// Completion-to-commit latency of one recording.
pub fn commit_latency(seconds: f64) {
    if enabled() {
        ::metrics::histogram!("ailhd_commit_latency_seconds").record(seconds);
    }
}

/// Cumulative seconds spent in a stage since the start (the engine keeps the totals; the
/// facade's counters are integers, so this is a gauge that only grows).
pub fn stage_seconds(stage: &str, total_seconds: f64) {
    if enabled() {
        ::metrics::gauge!("ailhd_stage_seconds", "stage" => stage.to_string()).set(total_seconds);
    }
}

/// The featuriser device the service runs on.
pub fn device(name: &str) {
    if enabled() {
        ::metrics::gauge!("ailhd_device_info", "device" => name.to_string()).set(1.0);
    }
}

/// An error of some kind (`write`, `rescan`, `snapshot`, `featurise`, ...).
pub fn error(kind: &'static str) {
    if enabled() {
        ::metrics::counter!("ailhd_errors_total", "kind" => kind).increment(1);
    }
}

/// A configuration reload, accepted or refused.
pub fn write_failing(yes: bool) {
    if enabled() {
        ::metrics::gauge!("ailhd_write_failing").set(yes as u8 as f64);
    }
}

pub fn unwatched(folders: usize) {
    if enabled() {
        ::metrics::gauge!("ailhd_unwatched_folders").set(folders as f64);
    }
}

pub fn outputs_open(yes: bool) {
    if enabled() {
        ::metrics::gauge!("ailhd_outputs_open").set(yes as u8 as f64);
    }
}

pub fn reload(accepted: bool) {
    if enabled() {
        let result = if accepted { "accepted" } else { "refused" };
        ::metrics::counter!("ailhd_config_reloads_total", "result" => result).increment(1);
    }
}

/// Figures that come from a status report: files per state, rows per split and label. Every
/// state, split and label in `labels` gets a value, 0 when the report has none (so a label
/// whose last valid row went away reads 0, not its old count).
pub fn record_status(r: &StatusReport, labels: &[String]) {
    if !enabled() {
        return;
    }
    for state in ["committed", "quarantined"] {
        let n = r.files.get(state).copied().unwrap_or(0);
        ::metrics::gauge!("ailhd_files", "state" => state).set(n as f64);
    }
    for split in crate::config::SPLITS {
        let sr = r.splits.get(split);
        let total = sr.map_or(0, |sr| sr.rows);
        ::metrics::gauge!("ailhd_split_rows", "split" => split).set(total as f64);
        let named = sr.map(|sr| &sr.per_label);
        let known = labels
            .iter()
            .chain(named.into_iter().flat_map(|m| m.keys()));
        for label in known {
            let n = named.and_then(|m| m.get(label)).copied().unwrap_or(0);
            rows(split, label, n);
        }
    }
}

/// The service has recorded its first figures (the manifest's): the exporters show them.
pub fn ready() {
    READY.store(true, Ordering::Relaxed);
}

/// Wait (in small steps) until [`ready`], `stop`, or [`READY_WAIT`]; true when asked to stop.
fn wait_ready(stop: &AtomicBool) -> bool {
    let t = std::time::Instant::now();
    while !READY.load(Ordering::Relaxed) && t.elapsed() < READY_WAIT {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    stop.load(Ordering::Relaxed)
}

/// Every family whose series otherwise appear only at their first event, at zero: counters
/// with each known label value, the latency histogram (empty), the gauges of the service's
/// state, and the stage times.
fn zero_families() {
    ::metrics::counter!("ailhd_files_ingested_total").absolute(0);
    for kind in QUARANTINE_KINDS {
        ::metrics::counter!("ailhd_files_quarantined_total", "reason" => kind).absolute(0);
    }
    for kind in ERROR_KINDS {
        ::metrics::counter!("ailhd_errors_total", "kind" => kind).absolute(0);
    }
    for result in ["accepted", "refused"] {
        ::metrics::counter!("ailhd_config_reloads_total", "result" => result).absolute(0);
    }
    // Registered without a sample: rendered with every bucket at 0.
    let _ = ::metrics::histogram!("ailhd_commit_latency_seconds");
    for name in [
        "ailhd_files_pending",
        "ailhd_queue_depth",
        "ailhd_write_failing",
        "ailhd_unwatched_folders",
        "ailhd_outputs_open",
    ] {
        ::metrics::gauge!(name).set(0.0);
    }
    for (stage, _) in crate::engine::stages::StageTimes::default().seconds() {
        ::metrics::gauge!("ailhd_stage_seconds", "stage" => stage).set(0.0);
    }
}

/// A bounded label value for a quarantine reason (the full reason is in `status` and the
/// journal's REASON field).
pub fn reason_kind(reason: &str) -> &'static str {
    let r = reason.to_ascii_lowercase();
    let kinds: [(&[&str], &'static str); 12] = [
        (
            &["stopped twice", "in a row while reading it"],
            "stopped_while_reading",
        ),
        (&["not valid utf-8"], "path_not_utf8"),
        (&["symbolic link", "symlink"], "symlink"),
        (&["not a regular file"], "not_a_file"),
        (&["does not fit", "path_bytes", "too long"], "path_too_long"),
        (&["label"], "label"),
        (
            &[
                "in progress",
                "incomplete",
                "still being written",
                "never completed",
            ],
            "incomplete",
        ),
        (
            &["truncated", "ends at byte", "more than the file"],
            "truncated",
        ),
        (&["empty file", "no audio frames", "no data chunk"], "empty"),
        (&["not a wav", "unsupported container"], "not_wav"),
        (
            &[
                "unsupported",
                "channels",
                "sample rate",
                "resample",
                "encoding",
                "subformat",
            ],
            "unsupported",
        ),
        (&["fmt", "chunk", "frame", "header"], "malformed"),
    ];
    for (needles, kind) in kinds {
        if needles.iter().any(|n| r.contains(n)) {
            return kind;
        }
    }
    "other"
}

/// The metrics text as it is scraped now (also what the textfile holds).
pub fn render() -> String {
    handle().render()
}

/// Write `text` to `path` atomically and durably ([`crate::durable::replace`]: a temporary
/// file beside it, a name node_exporter does not read). A reader sees the old or the new file,
/// never a part.
pub fn write_atomically(path: &Path, text: &str) -> anyhow::Result<()> {
    crate::durable::replace(path, text.as_bytes(), crate::durable::Sync::Full)
        .with_context(|| format!("cannot write the metrics file {}", path.display()))
}

/// The running exporters; dropping it stops them (the textfile gets a last write, `ailhd_up 0`).
pub struct Exporter {
    stop: Arc<AtomicBool>,
    /// The endpoint's server once it listens (at once, or after [`LISTEN_RETRY`]s).
    server: Arc<std::sync::Mutex<Option<Arc<tiny_http::Server>>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    textfile: Option<PathBuf>,
    /// Where the HTTP endpoint listens (the port actually bound, also for port 0).
    pub listening: Option<std::net::SocketAddr>,
}

impl Exporter {
    /// Start what `[metrics]` asks for; `None` when it asks for nothing.
    pub fn start(settings: &MetricsSettings) -> anyhow::Result<Option<Exporter>> {
        if settings.textfile.is_none() && settings.listen.is_none() {
            return Ok(None);
        }
        let h = handle();
        zero_families();
        ::metrics::gauge!("ailhd_up").set(1.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        ::metrics::gauge!("ailhd_start_time_seconds").set(now.as_secs_f64());
        let stop = Arc::new(AtomicBool::new(false));
        let mut ex = Exporter {
            stop: stop.clone(),
            server: Arc::default(),
            threads: Vec::new(),
            textfile: settings.textfile.clone(),
            listening: None,
        };
        if let Some(addr) = &settings.listen {
            // An address that is taken (another exporter, the previous process not gone yet)
            // may come free: the service ingests without the endpoint meanwhile and tries again,
            // as with any condition that may pass.
            let first = tiny_http::Server::http(addr.as_str()).map(Arc::new);
            match &first {
                Ok(server) => {
                    ex.listening = server.server_addr().to_ip();
                    log::info!("metrics: serving http://{addr}/metrics");
                }
                Err(e) => log::warn!(
                    "[metrics] listen = {addr:?}: cannot listen there: {e}; the service runs \
                     without the endpoint and tries again every {LISTEN_RETRY:?}"
                ),
            }
            let (addr, slot, stop) = (addr.clone(), ex.server.clone(), stop.clone());
            ex.threads.push(
                std::thread::Builder::new()
                    .name("ailhd-metrics-http".into())
                    .spawn(move || listen_and_serve(&addr, first.ok(), &slot, &stop))?,
            );
        }
        // The textfile writer also does the recorder's upkeep (histogram bookkeeping), which an
        // endpoint nobody scrapes would otherwise never run. The first file is written once the
        // service is ready (its folder was checked with the configuration: `check_paths`).
        let textfile = settings.textfile.clone();
        if let Some(p) = &textfile {
            log::info!(
                "metrics: writing {} every {TEXTFILE_INTERVAL:?}",
                p.display()
            );
        }
        ex.threads.push(
            std::thread::Builder::new()
                .name("ailhd-metrics-file".into())
                .spawn(move || {
                    let mut last_error = false;
                    let mut stopped = wait_ready(&stop);
                    while !stopped {
                        h.run_upkeep();
                        if let Some(p) = &textfile {
                            match write_atomically(p, &h.render()) {
                                Ok(()) => last_error = false,
                                Err(e) if !last_error => {
                                    log::warn!("{e:#}");
                                    last_error = true;
                                }
                                Err(_) => {}
                            }
                        }
                        stopped = sleep_unless_stopped(&stop, TEXTFILE_INTERVAL);
                    }
                })?,
        );
        Ok(Some(ex))
    }
}

impl Drop for Exporter {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let server = self.server.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(s) = &server {
            s.unblock();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
        // tiny_http's Server connects to itself when dropped, to wake its accept thread; if
        // the unit's IP filter changed underneath (a drop-in removed, then daemon-reload), that
        // connect hangs until the TCP timeout. Never let it hold up the stop: close it aside.
        if let Some(server) = server {
            let _ = std::thread::Builder::new()
                .name("ailhd-metrics-close".into())
                .spawn(move || drop(server));
        }
        if let Some(p) = &self.textfile {
            ::metrics::gauge!("ailhd_up").set(0.0);
            if let Err(e) = write_atomically(p, &render()) {
                log::warn!("{e:#}");
            }
        }
    }
}

/// Sleep `d` in small steps; true when asked to stop.
fn sleep_unless_stopped(stop: &AtomicBool, d: Duration) -> bool {
    let step = Duration::from_millis(100);
    let mut left = d;
    while !left.is_zero() {
        if stop.load(Ordering::Relaxed) {
            return true;
        }
        let s = left.min(step);
        std::thread::sleep(s);
        left -= s;
    }
    stop.load(Ordering::Relaxed)
}

/// How often an endpoint address that could not be bound is tried again.
pub const LISTEN_RETRY: Duration = Duration::from_secs(5);

/// Serve `server`, or once `addr` can be bound (tried every [`LISTEN_RETRY`]); the server is
/// kept in `slot` for the stop to unblock it.
fn listen_and_serve(
    addr: &str,
    mut server: Option<Arc<tiny_http::Server>>,
    slot: &std::sync::Mutex<Option<Arc<tiny_http::Server>>>,
    stop: &AtomicBool,
) {
    let server = loop {
        if let Some(s) = server.take() {
            break s;
        }
        if sleep_unless_stopped(stop, LISTEN_RETRY) {
            return;
        }
        if let Ok(s) = tiny_http::Server::http(addr) {
            log::info!("metrics: serving http://{addr}/metrics (the address is free now)");
            server = Some(Arc::new(s));
        }
    };
    *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(server.clone());
    // A stop that came while the server was being made found no server to unblock: the
    // loop below sees the flag within its timeout.
    serve_http(&server, stop);
    // Never the last handle to drop on this thread, which the stop joins (see `Drop`).
    let _ = std::thread::Builder::new()
        .name("ailhd-metrics-close".into())
        .spawn(move || drop(server));
}

fn serve_http(server: &tiny_http::Server, stop: &AtomicBool) {
    // Scrapes that come before the first figures wait for them (queued by tiny_http).
    if wait_ready(stop) {
        return;
    }
    while !stop.load(Ordering::Relaxed) {
        let req = match server.recv_timeout(Duration::from_millis(500)) {
            Ok(Some(r)) => r,
            Ok(None) => continue,
            Err(_) => break,
        };
        let response = if *req.method() != tiny_http::Method::Get {
            tiny_http::Response::from_string("only GET\n").with_status_code(405)
        } else if req.url() == "/metrics" || req.url().starts_with("/metrics?") {
            tiny_http::Response::from_string(render()).with_header(
                tiny_http::Header::from_bytes(
                    &b"Content-Type"[..],
                    &b"text/plain; version=0.0.4; charset=utf-8"[..],
                )
                .expect("a valid header"),
            )
        } else {
            tiny_http::Response::from_string("ailhd: metrics are at /metrics\n")
                .with_status_code(404)
        };
        let _ = req.respond(response);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    /// One test drives the process-wide recorder from start to end (tests run in parallel, and
    /// there is one recorder per process).
    #[test]
    fn families_render_and_both_exporters_serve_them() {
        let dir = tempfile::tempdir().unwrap();
        let prom = dir.path().join("ailhd.prom");
        let settings = MetricsSettings {
            textfile: Some(prom.clone()),
            listen: Some("127.0.0.1:0".into()),
        };
        let ex = Exporter::start(&settings).unwrap().unwrap();
        // Before the first event: every family, at zero.
        let zero = render();
        for want in [
            "ailhd_files_ingested_total 0",
            "ailhd_files_quarantined_total{reason=\"stopped_while_reading\"} 0",
            "ailhd_errors_total{kind=\"write\"} 0",
            "ailhd_config_reloads_total{result=\"accepted\"} 0",
            "ailhd_commit_latency_seconds_count 0",
            "ailhd_commit_latency_seconds_bucket{le=\"+Inf\"} 0",
            "ailhd_write_failing 0",
            "ailhd_unwatched_folders 0",
            "ailhd_stage_seconds{stage=\"featurise\"} 0",
        ] {
            assert!(zero.contains(want), "missing {want:?} in:\n{zero}");
        }
        ready();
        file_ingested(3);
        file_quarantined("not a WAV file (no RIFF/WAVE header)");
        file_quarantined("truncated: data chunk declares 100 bytes but only 10 are present");
        pending(2);
        queue_depth(5);
        rows("training", "LEAK", 7);
        commit_latency(0.03);
        commit_latency(0.2);
        stage_seconds("featurise", 1.5);
        device("cpu");
        error("write");
        reload(false);
        let text = render();
        for want in [
            "# TYPE ailhd_files_ingested_total counter",
            "ailhd_files_ingested_total 3",
            "ailhd_files_quarantined_total{reason=\"not_wav\"} 1",
            "ailhd_files_quarantined_total{reason=\"truncated\"} 1",
            "ailhd_files_pending 2",
            "ailhd_queue_depth 5",
            "ailhd_rows{split=\"training\",label=\"LEAK\"} 7",
            "# TYPE ailhd_commit_latency_seconds histogram",
            "ailhd_commit_latency_seconds_bucket{le=\"0.05\"} 1",
            "ailhd_commit_latency_seconds_bucket{le=\"0.25\"} 2",
            "ailhd_commit_latency_seconds_count 2",
            "ailhd_stage_seconds{stage=\"featurise\"} 1.5",
            "ailhd_device_info{device=\"cpu\"} 1",
            "ailhd_errors_total{kind=\"write\"} 1",
            "ailhd_config_reloads_total{result=\"refused\"} 1",
            "ailhd_up 1",
            "# HELP ailhd_files_pending files seen and not yet complete",
        ] {
            assert!(text.contains(want), "missing {want:?} in:\n{text}");
        }
        assert!(!text.contains("# EOF"), "OpenMetrics, not the text format");

        // The endpoint, on a loopback port chosen by the kernel.
        let addr = ex.listening.unwrap();
        assert!(addr.ip().is_loopback());
        let get = |path: &str| {
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
            write!(
                s,
                "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
            )
            .unwrap();
            let mut body = String::new();
            s.read_to_string(&mut body).unwrap();
            body
        };
        let page = get("/metrics");
        assert!(page.starts_with("HTTP/1.1 200"), "{page}");
        assert!(page.contains("text/plain; version=0.0.4"), "{page}");
        assert!(page.contains("ailhd_files_ingested_total 3"), "{page}");
        assert!(get("/").starts_with("HTTP/1.1 404"));

        // The textfile: first written once the service's first figures are in (it may not be
        // there yet), rewritten with the figures, last write on stop.
        let t = std::time::Instant::now();
        while !std::fs::read_to_string(&prom)
            .is_ok_and(|text| text.contains("ailhd_files_ingested_total 3"))
        {
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "textfile never rewritten"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        drop(ex);
        let last = std::fs::read_to_string(&prom).unwrap();
        assert!(last.contains("ailhd_up 0"), "{last}");
        // Only the .prom file is left: no temporary beside it.
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names, vec![std::ffi::OsString::from("ailhd.prom")]);
        // The port is closed again (by a thread of its own, a moment later).
        let t = std::time::Instant::now();
        while std::net::TcpStream::connect(addr).is_ok() {
            assert!(t.elapsed() < Duration::from_secs(10), "port still open");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    #[test]
    fn textfile_is_replaced_whole_never_partly() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("x.prom");
        write_atomically(&p, "a 1\n").unwrap();
        // A reader holding the old file keeps reading the old content: the file was replaced
        // (a new inode), not rewritten in place.
        let mut old = std::fs::File::open(&p).unwrap();
        let big = "b 2\n".repeat(100_000);
        write_atomically(&p, &big).unwrap();
        let mut seen = String::new();
        old.read_to_string(&mut seen).unwrap();
        assert_eq!(seen, "a 1\n");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), big);
        // A folder that cannot take the file: an error naming it, and no temporary left.
        let missing = dir.path().join("nope").join("x.prom");
        let err = write_atomically(&missing, "a 1\n").unwrap_err().to_string();
        assert!(err.contains("nope/x.prom"), "{err}");
    }

    #[test]
    fn quarantine_reasons_map_to_bounded_kinds() {
        for (reason, kind) in [
            ("not a WAV file (no RIFF/WAVE header)", "not_wav"),
            ("empty file (0 bytes)", "empty"),
            (
                "truncated: the file ends at byte 30, inside the header of a chunk",
                "truncated",
            ),
            ("path is not valid UTF-8", "path_not_utf8"),
            (
                &crate::engine::outcome::Reason::NotAFile("a named pipe (FIFO)").to_string(),
                "not_a_file",
            ),
            (
                "fmt declares 9 channels; at most 8 are supported",
                "unsupported",
            ),
            ("something new", "other"),
            (
                &crate::engine::outcome::Reason::StoppedWhileReading { deaths: 2 }.to_string(),
                "stopped_while_reading",
            ),
            (
                &crate::engine::outcome::Reason::StoppedWhileReading { deaths: 3 }.to_string(),
                "stopped_while_reading",
            ),
        ] {
            assert_eq!(reason_kind(reason), kind, "{reason}");
            assert!(
                QUARANTINE_KINDS.contains(&kind),
                "{kind} is exported at zero"
            );
        }
    }
}
