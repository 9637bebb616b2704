//! What the benchmarks share when they report: the machine they ran on, its load, and one
//! section of `docs/benchmarks.md` each.
//!
//! `docs/benchmarks.md` is the entry point for every committed figure. Each benchmark owns one
//! section of it, between `<!-- bench:NAME:begin -->` and `<!-- bench:NAME:end -->`, and
//! `--write` replaces only that section, so one benchmark can be run again without touching
//! the figures of the others.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// The title and introduction a new `docs/benchmarks.md` starts with.
const HEADER: &str = "# Benchmarks\n\n\
     Every section below is written by one benchmark, as measured on the machine it names; \
     `cargo xtask bench` runs them all (release build, as root) and prints the tables, \
     `cargo xtask bench --write` rewrites their sections of this file.\n";

/// "2 cores (AMD EPYC ...), kernel 6.18.44".
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{} cores ({cpu}), kernel {}",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        kernel.trim()
    )
}

/// This process's arguments that shape a bench's measures: all but `outputs` (flags naming
/// where it writes) and their values, in either `--flag value` or `--flag=value` form.
pub fn shaping_arguments(outputs: &[&str]) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if outputs.contains(&a.as_str()) {
            args.next();
        } else if !outputs
            .iter()
            .any(|o| a.strip_prefix(o).is_some_and(|rest| rest.starts_with('=')))
        {
            out.push(a);
        }
    }
    out
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg gives them ("0.91 2.41 3.43").
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

/// Today's date (UTC), "2026-11-30".
pub fn today() -> String {
    k8s_openapi::jiff::Timestamp::now()
        .strftime("%Y-%m-%d")
        .to_string()
}

/// Of sorted, non-empty `v`; the mean of the middle two for an even count.
pub fn median(v: &[f64]) -> f64 {
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `[median, min, max]` of `values`, or None when there are none.
pub fn spread(mut values: Vec<f64>) -> Option<[f64; 3]> {
    if values.is_empty() {
        return None;
    }
    values.sort_by(f64::total_cmp);
    Some([median(&values), values[0], values[values.len() - 1]])
}

/// `median (min–max)` with `digits` decimals, `—` for none.
pub fn fmt3(v: Option<[f64; 3]>, digits: usize) -> String {
    match v {
        Some([m, lo, hi]) => format!("{m:.digits$} ({lo:.digits$}–{hi:.digits$})"),
        None => "—".into(),
    }
}

/// What a benchmark prints, and where `--json` and `--write` asked it to go: the markdown to
/// stdout, `json` (pretty) to its file, the markdown to section `section` of its file.
pub fn publish(
    md: &str,
    section: &str,
    json: (Option<&Path>, serde_json::Value),
    write: Option<&Path>,
) -> Result<()> {
    println!("{md}");
    if let (Some(path), value) = json {
        std::fs::write(path, serde_json::to_string_pretty(&value)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = write {
        write_section(path, section, md)?;
    }
    Ok(())
}

/// The first two lines of a comparison table: `measure`, then each column's label, followed
/// by a ratio column where one is named (`× none`).
pub fn table_header(columns: impl IntoIterator<Item = (String, Option<&'static str>)>) -> String {
    let (mut names, mut rule) = (String::from("| measure |"), String::from("|---|"));
    for (label, ratio) in columns {
        names += &format!(" {label} |");
        rule += "---|";
        if let Some(r) = ratio {
            names += &format!(" {r} |");
            rule += "---|";
        }
    }
    format!("{names}\n{rule}\n")
}

fn markers(name: &str) -> (String, String) {
    (
        format!("<!-- bench:{name}:begin -->"),
        format!("<!-- bench:{name}:end -->"),
    )
}

/// `doc` with the section `name` replaced by `body`, or with the section appended when the
/// document has none yet.
pub fn replace_section(doc: &str, name: &str, body: &str) -> Result<String> {
    let (begin, end) = markers(name);
    let section = format!("{begin}\n{}\n{end}", body.trim());
    match (doc.find(&begin), doc.find(&end)) {
        (Some(b), Some(e)) if b < e => {
            Ok(format!("{}{section}{}", &doc[..b], &doc[e + end.len()..]))
        }
        (None, None) => {
            let doc = if doc.trim().is_empty() { HEADER } else { doc };
            Ok(format!("{}\n\n{section}\n", doc.trim_end()))
        }
        _ => bail!("the markers of section {name:?} are broken: fix them by hand"),
    }
}

/// Replaces the section `name` of the markdown file at `path` (created when missing).
pub fn write_section(path: &Path, name: &str, body: &str) -> Result<()> {
    let doc = match std::fs::read_to_string(path) {
        Ok(d) => d,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(e) => return Err(e).with_context(|| format!("reading {}", path.display())),
    };
    let doc = replace_section(&doc, name, body)?;
    std::fs::write(path, doc).with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_section_is_replaced_in_place_and_others_stay() {
        let doc = replace_section("", "a", "first").unwrap();
        assert!(doc.starts_with("# Benchmarks"));
        let doc = replace_section(&doc, "b", "second").unwrap();
        let doc = replace_section(&doc, "a", "third").unwrap();
        assert!(!doc.contains("first"));
        let (a, b) = (doc.find("third").unwrap(), doc.find("second").unwrap());
        assert!(a < b, "section a stays before b:\n{doc}");
        assert_eq!(doc.matches("<!-- bench:a:begin -->").count(), 1);
    }

    #[test]
    fn a_table_header_has_a_rule_for_every_column_and_ratio() {
        let h = table_header([
            ("none".to_string(), None),
            ("svc".to_string(), Some("× none")),
        ]);
        assert_eq!(h, "| measure | none | svc | × none |\n|---|---|---|---|\n");
    }

    #[test]
    fn broken_markers_are_refused() {
        let doc = "x\n<!-- bench:a:begin -->\nno end\n";
        assert!(replace_section(doc, "a", "y").is_err());
    }
}
