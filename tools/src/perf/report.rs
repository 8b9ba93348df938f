//! The results in nccl-tests' text layout (banner, table, footer) and JSON layout.

use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{json, Value};

use super::args::Args;

/// One column group of a row: a measurement out of place or in place.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timing {
    /// Time per operation in microseconds.
    pub time_us: f64,
    /// Algorithm bandwidth in GB/s: size / time.
    pub algbw: f64,
    /// Bus bandwidth in GB/s: algbw times the collective's factor.
    pub busbw: f64,
    /// Wrong elements over all ranks, if checked.
    pub wrong: Option<u64>,
}

/// One row of the table.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// The size column in bytes.
    pub size: usize,
    /// The count column in elements.
    pub count: usize,
    /// The type column.
    pub dtype: &'static str,
    /// The redop column ("none" for collectives that do not reduce).
    pub redop: &'static str,
    /// The root column (-1 for collectives without a root).
    pub root: i64,
    /// Out-of-place measurement.
    pub out_of_place: Timing,
    /// In-place measurement.
    pub in_place: Timing,
}

/// One rank's line under "Using devices".
#[derive(Debug, Clone, PartialEq)]
pub struct Device {
    /// Global rank.
    pub rank: usize,
    /// Process id.
    pub pid: u32,
    /// Host name.
    pub hostname: String,
}

/// What Chorus runs on, in the device column.
const DEVICE_INFO: &str = "host memory";

/// The banner: versions, run parameters and one line per rank.
pub fn banner(program: &str, args: &Args, devices: &[Device]) -> String {
    let mut s = format!(
        "# Chorus perf tools version {}\n# Collective test starting: {program}\n",
        env!("CARGO_PKG_VERSION")
    );
    s += &format!(
        "# nThread {} nGpus {} minBytes {} maxBytes {} step: {} warmup iters: {} iters: {} agg iters: {} validation: {} graph: {} unalign: 0\n",
        args.nthreads,
        args.ngpus,
        args.min_bytes,
        args.max_bytes,
        args.step_label(),
        args.warmup,
        args.iters,
        args.agg_iters,
        args.check,
        args.cudagraph
    );
    s += "#\n# Using devices\n";
    for d in devices {
        s += &format!(
            "#  Rank {:2} Group {:2} Pid {:6} on {:>10} device {:2} [host] {DEVICE_INFO}\n",
            d.rank, 0, d.pid, d.hostname, -1
        );
    }
    s
}

/// The table's three header lines, preceded by "#".
pub fn column_header() -> String {
    let e = "";
    format!(
        "#\n# {e:>10}  {e:>12}  {e:>8}  {e:>6}  {e:>6}           out-of-place                       in-place          \n\
         # {:>10}  {:>12}  {:>8}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6}  {:>7}  {:>6}  {:>6}  {:>6} \n\
         # {:>10}  {:>12}  {e:>8}  {e:>6}  {e:>6}  {:>7}  {:>6}  {:>6}  {e:>6}  {:>7}  {:>6}  {:>6}  {e:>6} \n",
        "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
        "busbw", "#wrong", "(B)", "(elements)", "(us)", "(GB/s)", "(GB/s)", "(us)", "(GB/s)", "(GB/s)"
    )
}

/// One table row (no newline).
pub fn row_line(row: &Row) -> String {
    let mut s = format!(
        "{:12}  {:12}  {:>8}  {:>6}  {:>6}",
        row.size, row.count, row.dtype, row.redop, row.root
    );
    for t in [&row.out_of_place, &row.in_place] {
        s += &format!(
            "  {}  {}  {}  {}",
            float_str(t.time_us, 7),
            float_str(t.algbw, 6),
            float_str(t.busbw, 6),
            t.wrong
                .map_or("   N/A".to_string(), |w| format!("{:>6}", g_str(w as f64)))
        );
    }
    s
}

/// The footer: wrong values, average bus bandwidth, end marker.
pub fn footer(program: &str, wrong: u64, avg_busbw: f64) -> String {
    format!(
        "# {:<20} : {wrong} {}\n# {:<20} : {} \n#\n# Collective test concluded: {program}\n#\n\n",
        "Out of bounds values",
        if wrong == 0 { "OK" } else { "FAILED" },
        "Avg bus bandwidth",
        g_str(avg_busbw)
    )
}

/// The average bus bandwidth over every row, out of place and in place (as nccl-tests).
pub fn average_busbw(rows: &[Row]) -> f64 {
    if rows.is_empty() {
        return 0.0;
    }
    let sum: f64 = rows
        .iter()
        .map(|r| r.out_of_place.busbw + r.in_place.busbw)
        .sum();
    sum / (2 * rows.len()) as f64
}

/// The results as nccl-tests' JSON output file (format version 3).
pub fn json(
    program: &str,
    args: &Args,
    devices: &[Device],
    rows: &[Row],
    start: SystemTime,
) -> Value {
    let timing = |t: &Timing| json!({"time": t.time_us, "alg_bw": t.algbw, "bus_bw": t.busbw, "nwrong": t.wrong});
    let wrong: u64 = rows
        .iter()
        .flat_map(|r| [r.out_of_place.wrong, r.in_place.wrong])
        .map(|w| w.unwrap_or(0))
        .sum();
    let step = match (args.step_bytes, args.step_factor) {
        (Some(i), _) => ("step_bytes", i),
        (None, f) => ("step_factor", f.unwrap_or(2)),
    };
    let mut config = json!({
        "nthreads": args.nthreads, "ngpus": args.ngpus,
        "minimum_bytes": args.min_bytes, "maximum_bytes": args.max_bytes,
        "warmup_iters": args.warmup, "iterations": args.iters,
        "aggregated_iterations": args.agg_iters, "validation": args.check, "graph": args.cudagraph,
        "devices": devices.iter().map(|d| json!({
            "rank": d.rank, "group": 0, "pid": d.pid, "hostname": d.hostname,
            "device": -1, "device_hex": "host", "device_info": DEVICE_INFO,
        })).collect::<Vec<_>>(),
    });
    config[step.0] = json!(step.1);
    json!({
        "version": 3,
        "program": program,
        "start_time": time_string(start),
        "args": std::env::args().collect::<Vec<_>>(),
        "env": std::env::vars()
            .filter(|(k, _)| k.starts_with(chorus::env::CHORUS_PREFIX))
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>(),
        "chorus_version": env!("CARGO_PKG_VERSION"),
        "config": config,
        "results": rows.iter().map(|r| json!({
            "size": r.size, "count": r.count, "type": r.dtype, "redop": r.redop,
            "root": format!("{:6}", r.root),
            "out_of_place": timing(&r.out_of_place), "in_place": timing(&r.in_place),
            "actual_iterations": args.iters, "experiment_name": "",
        })).collect::<Vec<_>>(),
        "out_of_bounds": {"count": wrong, "okay": wrong == 0},
        "average_bus_bandwidth": {"bandwidth": average_busbw(rows), "okay": "unchecked"},
        "errors": [],
        "end_time": time_string(SystemTime::now()),
    })
}

/// Writes `value` to `path`.
///
/// Fails with a message naming the file.
pub fn write_json(path: &Path, value: &Value) -> Result<(), String> {
    let text = serde_json::to_string_pretty(value).map_err(|e| e.to_string())?;
    std::fs::write(path, text + "\n")
        .map_err(|e| format!("cannot write the JSON results to {}: {e}", path.display()))
}

/// `YYYY-MM-DD HH:MM:SS` in UTC.
fn time_string(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Days since 1970-01-01 to a civil date (proleptic Gregorian calendar).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// `value` in at most `width` characters: two decimals, then one, then none, then an exponent.
pub fn float_str(value: f64, width: usize) -> String {
    for decimals in [2, 1, 0] {
        let s = format!("{value:>width$.decimals$}");
        if s.len() <= width {
            return s;
        }
    }
    let s = c_exponent(value, if width >= 7 { 1 } else { 0 });
    format!("{s:>width$}")
}

/// C's `%.{precision}e`: `1.5e+07`.
fn c_exponent(value: f64, precision: usize) -> String {
    let s = format!("{value:.precision$e}");
    let (mantissa, exp) = s.split_once('e').unwrap_or((&s, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    format!(
        "{mantissa}e{}{:02}",
        if exp < 0 { '-' } else { '+' },
        exp.abs()
    )
}

/// C's `%g`: six significant digits, trailing zeros dropped.
pub fn g_str(value: f64) -> String {
    if value == 0.0 || !value.is_finite() {
        return format!("{value}").to_lowercase();
    }
    let exp: i32 = format!("{value:.5e}")
        .split_once('e')
        .and_then(|(_, e)| e.parse().ok())
        .unwrap_or(0);
    let trim = |s: String| {
        if s.contains('.') {
            s.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            s
        }
    };
    if (-4..6).contains(&exp) {
        trim(format!("{value:.*}", (5 - exp) as usize))
    } else {
        let s = c_exponent(value, 5);
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, ""));
        format!("{}e{e}", trim(mantissa.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_format_like_printf() {
        assert_eq!(float_str(12.3456, 7), "  12.35");
        assert_eq!(float_str(12345.67, 7), "12345.7");
        assert_eq!(float_str(123456.7, 7), " 123457");
        assert_eq!(float_str(1234567.8, 7), "1234568");
        assert_eq!(float_str(123456789.0, 7), "1.2e+08");
        assert_eq!(float_str(99999.0, 6), " 99999");
        assert_eq!(float_str(1e7, 6), " 1e+07");
        assert_eq!(g_str(1.5), "1.5");
        assert_eq!(g_str(0.0), "0");
        assert_eq!(g_str(3.0), "3");
        assert_eq!(g_str(2.345678912), "2.34568");
        assert_eq!(g_str(1234567.0), "1.23457e+06");
        assert_eq!(g_str(0.00001234), "1.234e-05");
    }

    #[test]
    fn rows_line_up_under_the_header() {
        let t = Timing {
            time_us: 31.5,
            algbw: 0.25,
            busbw: 0.38,
            wrong: Some(0),
        };
        let row = Row {
            size: 8,
            count: 2,
            dtype: "float",
            redop: "sum",
            root: -1,
            out_of_place: t,
            in_place: Timing { wrong: None, ..t },
        };
        let line = row_line(&row);
        assert_eq!(
            line,
            "           8             2     float     sum      -1    31.50    0.25    0.38       0    31.50    0.25    0.38     N/A"
        );
        let header = column_header();
        let names = header.lines().nth(2).unwrap();
        assert_eq!(
            names.find("#wrong").unwrap() + 6,
            line.find("0    31").unwrap() + 1
        );
    }

    #[test]
    fn dates_are_civil() {
        let t = UNIX_EPOCH + std::time::Duration::from_secs(1_700_000_000);
        assert_eq!(time_string(t), "2023-11-14 22:13:20");
    }
}
