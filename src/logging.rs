//! Logging: to the journal (with structured fields such as FILE, SPLIT, REASON) when systemd
//! started us, to stderr otherwise.

use log::{Level, LevelFilter, Log, Metadata, Record};
use std::io::Write;

/// `verbosity`: 0 = warnings, 1 = `--verbose` (info), 2 = `--debug`. The service logs at info.
pub fn init(verbosity: u8, service: bool) {
    let level = match (verbosity, service) {
        (0, false) => LevelFilter::Warn,
        (0, true) | (1, _) => LevelFilter::Info,
        _ => LevelFilter::Debug,
    };
    if systemd_journal_logger::connected_to_journal() {
        if let Ok(j) = systemd_journal_logger::JournalLog::new() {
            if j.install().is_ok() {
                log::set_max_level(level);
                return;
            }
        }
    }
    if log::set_boxed_logger(Box::new(Stderr { level })).is_ok() {
        log::set_max_level(level);
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
