//! What the benchmark programs share.

/// A memory figure of `/proc/<pid>/status` (`VmRSS`, `VmHWM`, ...) in MB, for `pid` a process
/// id or "self"; NaN when it cannot be read.
pub fn status_mb(pid: &str, field: &str) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|k| k.parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}
