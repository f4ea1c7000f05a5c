//! Logging: to the journal (with structured fields such as FILE, SPLIT, REASON) when systemd
//! started us, to stderr otherwise.

use log::{Level, LevelFilter, Log, Metadata, Record};
use std::cell::Cell;
use std::io::Write;

thread_local! {
    /// Set while [`contain`] runs on this thread.
    static CONTAINED: Cell<bool> = const { Cell::new(false) };
}

/// Run `f`, catching a panic in it: sled panics when its files fail half-way through an open or
/// a close, cudarc on a missing library or symbol. The caller turns the panic into an error or
/// a log line that says what failed and what happens next, so the panic's own message goes to
/// the log at debug level instead of the default hook's "thread ... panicked at" lines on
/// stderr (the journal, under systemd). A panic anywhere else is reported as before.
pub fn contain<R>(f: impl FnOnce() -> R) -> std::thread::Result<R> {
    static HOOK: std::sync::Once = std::sync::Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if CONTAINED.with(Cell::get) {
                log::debug!("contained panic: {info}");
            } else {
                default(info);
            }
        }));
    });
    let was = CONTAINED.replace(true);
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    CONTAINED.set(was);
    run
}

/// `verbosity`: 0 = warnings, 1 = `--verbose` (info), 2 = `--debug`. The service logs at info.
pub fn init(verbosity: u8, service: bool) {
    let level = match (verbosity, service) {
        (0, false) => LevelFilter::Warn,
        (0, true) | (1, _) => LevelFilter::Info,
        _ => LevelFilter::Debug,
    };
    if systemd_journal_logger::connected_to_journal() {
        if let Ok(j) = systemd_journal_logger::JournalLog::new() {
            if log::set_boxed_logger(Box::new(QuietSled::new(j, level))).is_ok() {
                log::set_max_level(level);
                return;
            }
        }
    }
    if log::set_boxed_logger(Box::new(QuietSled::new(Stderr { level }, level))).is_ok() {
        log::set_max_level(level);
    }
}

/// sled's own messages at debug level, whatever level sled gave them. sled logs from its
/// background threads, e.g. "failed to fsync from periodic flush thread" every 500 ms while a
/// disk fails: two errors a second in the journal for as long as the fault lasts. Every sled
/// failure that matters also comes back as an error from the call that met it, and the service
/// reports those itself (once, then at each retry); `--debug` shows sled's own as well.
struct QuietSled<L> {
    inner: L,
    level: LevelFilter,
}

impl<L: Log> QuietSled<L> {
    fn new(inner: L, level: LevelFilter) -> Self {
        QuietSled { inner, level }
    }

    fn is_sled(target: &str) -> bool {
        target == "sled" || target.starts_with("sled::")
    }
}

impl<L: Log> Log for QuietSled<L> {
    fn enabled(&self, metadata: &Metadata) -> bool {
        let level = if Self::is_sled(metadata.target()) {
            Level::Debug
        } else {
            metadata.level()
        };
        level <= self.level && self.inner.enabled(metadata)
    }

    fn log(&self, record: &Record) {
        if !Self::is_sled(record.target()) {
            return self.inner.log(record);
        }
        if Level::Debug > self.level {
            return;
        }
        self.inner.log(
            &Record::builder()
                .args(*record.args())
                .level(Level::Debug)
                .target(record.target())
                .module_path(record.module_path())
                .file(record.file())
                .line(record.line())
                .build(),
        );
    }

    fn flush(&self) {
        self.inner.flush()
    }
}

/// Whether the output is for a person at a terminal (progress bars) and not for systemd.
pub fn interactive() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal() && !systemd_journal_logger::connected_to_journal()
}

struct Stderr {
    level: LevelFilter,
}

struct KvText(String);

impl<'kvs> log::kv::VisitSource<'kvs> for KvText {
    fn visit_pair(
        &mut self,
        key: log::kv::Key<'kvs>,
        value: log::kv::Value<'kvs>,
    ) -> Result<(), log::kv::Error> {
        use std::fmt::Write;
        let _ = write!(self.0, " {key}={value}");
        Ok(())
    }
}

impl Log for Stderr {
    fn enabled(&self, metadata: &Metadata) -> bool {
        metadata.level() <= self.level
    }
    fn log(&self, record: &Record) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let mut kv = KvText(String::new());
        let _ = record.key_values().visit(&mut kv);
        let tag = match record.level() {
            Level::Error => "error",
            Level::Warn => "warning",
            Level::Info => "info",
            Level::Debug => "debug",
            Level::Trace => "trace",
        };
        let _ = writeln!(
            std::io::stderr().lock(),
            "ailhd: {tag}: {}{}",
            record.args(),
            kv.0
        );
    }
    fn flush(&self) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// Keeps (level, target, text) of what reaches it.
    #[derive(Default)]
    struct Kept(Mutex<Vec<(Level, String, String)>>);

    impl Log for &Kept {
        fn enabled(&self, _: &Metadata) -> bool {
            true
        }
        fn log(&self, r: &Record) {
            self.0
                .lock()
                .unwrap()
                .push((r.level(), r.target().to_string(), r.args().to_string()));
        }
        fn flush(&self) {}
    }

    fn emit(logger: &dyn Log, level: Level, target: &str, text: &str) {
        logger.log(
            &Record::builder()
                .args(format_args!("{text}"))
                .level(level)
                .target(target)
                .build(),
        );
    }

    #[test]
    fn sleds_own_messages_go_to_debug_and_ours_stay_as_they_are() {
        let kept = Kept::default();
        let info = QuietSled::new(&kept, LevelFilter::Info);
        emit(
            &info,
            Level::Error,
            "sled::flusher",
            "failed to fsync from periodic flush thread: Input/output error",
        );
        emit(&info, Level::Warn, "sled", "sled at its root");
        emit(&info, Level::Error, "ailhd::service", "writing failed");
        emit(&info, Level::Warn, "sledgehammer", "not sled's");
        assert!(!info.enabled(
            &Metadata::builder()
                .level(Level::Error)
                .target("sled::pagecache")
                .build()
        ));
        assert_eq!(
            *kept.0.lock().unwrap(),
            vec![
                (
                    Level::Error,
                    "ailhd::service".to_string(),
                    "writing failed".to_string()
                ),
                (
                    Level::Warn,
                    "sledgehammer".to_string(),
                    "not sled's".to_string()
                ),
            ]
        );
        let kept = Kept::default();
        let debug = QuietSled::new(&kept, LevelFilter::Debug);
        emit(&debug, Level::Error, "sled::flusher", "failed to fsync");
        assert_eq!(
            *kept.0.lock().unwrap(),
            vec![(
                Level::Debug,
                "sled::flusher".to_string(),
                "failed to fsync".to_string()
            )]
        );
    }
}
