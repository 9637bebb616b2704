//! PNG charts of benchmark results: one measure against the Service count, one line per
//! proxy, each point the median over rounds with a bar from the smallest to the largest round.
//!
//! The font is compiled in (the `dejavu` crate), so a chart looks the same on a machine without
//! fonts installed, as CI machines and containers are.

use std::path::Path;
use std::sync::OnceLock;

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

/// One round-aggregated figure.
#[derive(Clone, Copy, Debug)]
pub struct Point {
    pub x: f64,
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// One proxy's figures for one measure, by Service count.
#[derive(Clone, Debug)]
pub struct Line {
    pub label: String,
    pub points: Vec<Point>,
}

pub struct Chart<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: &'a str,
    pub lines: &'a [Line],
}

const SIZE: (u32, u32) = (900, 560);
const FONT: &str = "sans-serif";
/// Above this spread of the values a linear axis squeezes the smaller lines onto the floor
/// (svc's change latency of tens of ms next to kube-proxy's second): the axis goes logarithmic.
const LOG_SPREAD: f64 = 30.0;

/// A colour per line, in order; the first is svc's.
const COLOURS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn register_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_ok()
    });
    ok.then_some(())
        .ok_or_else(|| anyhow!("the embedded DejaVu Sans font does not parse"))
}

/// Draws `chart` into a PNG at `path`. The Service count axis is logarithmic (counts grow by
/// factors); the value axis starts at zero unless the values spread by more than [`LOG_SPREAD`].
pub fn write_png(path: &Path, chart: &Chart) -> Result<()> {
    register_font()?;
    let points = || chart.lines.iter().flat_map(|l| l.points.iter());
    let (mut x_lo, mut x_hi) = points().fold((f64::MAX, f64::MIN), |(lo, hi), p| {
        (lo.min(p.x), hi.max(p.x))
    });
    if x_lo > x_hi || x_lo <= 0.0 {
        return Err(anyhow!("{}: nothing to plot", chart.title));
    }
    // Room on both sides for the bars and the markers.
    x_lo /= 1.6;
    x_hi *= 1.6;
    let y_hi = points()
        .map(|p| p.max)
        .fold(0.0, f64::max)
        .max(f64::MIN_POSITIVE);
    let y_lo = points().map(|p| p.min).fold(f64::MAX, f64::min);
    // Ticks at the Service counts measured, and nowhere else.
    let mut ticks: Vec<f64> = points().map(|p| p.x).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let x = (x_lo..x_hi).log_scale().with_key_points(ticks);
    // The headroom above the lines is the legend's.
    if y_lo > 0.0 && y_hi / y_lo > LOG_SPREAD {
        draw(path, chart, x, (y_lo / 1.5..y_hi * 8.0).log_scale())
    } else {
        draw(path, chart, x, 0.0..y_hi * 1.45)
    }
}

fn draw<X, Y>(path: &Path, chart: &Chart, x: X, y: Y) -> Result<()>
where
    X: AsRangedCoord<Value = f64>,
    Y: AsRangedCoord<Value = f64>,
    X::CoordDescType: ValueFormatter<f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let e = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE).map_err(|x| e(&x))?;
    let mut c = ChartBuilder::on(&root)
        .caption(chart.title, (FONT, 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(72)
        .build_cartesian_2d(x, y)
        .map_err(|x| e(&x))?;
    c.configure_mesh()
        .x_desc(chart.x_label)
        .y_desc(chart.y_label)
        .x_label_formatter(&|v| thousands(*v))
        .y_label_formatter(&|v| short(*v))
        .label_style((FONT, 14))
        .light_line_style(WHITE)
        .axis_desc_style((FONT, 16))
        .draw()
        .map_err(|x| e(&x))?;
    for (i, line) in chart.lines.iter().enumerate() {
        let colour = COLOURS[i % COLOURS.len()];
        let mut pts = line.points.clone();
        pts.sort_by(|a, b| a.x.total_cmp(&b.x));
        c.draw_series(LineSeries::new(
            pts.iter().map(|p| (p.x, p.median)),
            colour.stroke_width(2),
        ))
        .map_err(|x| e(&x))?
        .label(&line.label)
        .legend(move |(x, y)| PathElement::new([(x, y), (x + 20, y)], colour.stroke_width(2)));
        c.draw_series(
            pts.iter()
                .map(|p| ErrorBar::new_vertical(p.x, p.min, p.median, p.max, colour.filled(), 8)),
        )
        .map_err(|x| e(&x))?;
    }
    c.configure_series_labels()
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|x| e(&x))?;
    root.present().map_err(|x| e(&x))?;
    Ok(())
}

/// `30,000`: Service counts as people read them.
fn thousands(v: f64) -> String {
    let n = v.round() as u64;
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Axis values without a tail of zeros or of float noise.
fn short(v: f64) -> String {
    if v == 0.0 || v.abs() >= 100.0 {
        format!("{v:.0}")
    } else if v.abs() >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_as_people_write_them() {
        assert_eq!(thousands(1000.0), "1,000");
        assert_eq!(thousands(30000.0), "30,000");
        assert_eq!(thousands(999.6), "1,000");
        assert_eq!(thousands(100000.0), "100,000");
        assert_eq!(short(0.0), "0");
        assert_eq!(short(1104.4), "1104");
        assert_eq!(short(2.25), "2.2");
    }

    #[test]
    fn writes_a_png_with_a_line_per_proxy() {
        let dir = std::env::temp_dir().join(format!("svc-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("chart.png");
        let line = |label: &str, k: f64| Line {
            label: label.into(),
            points: [1000.0, 10000.0, 30000.0]
                .iter()
                .map(|&x| Point {
                    x,
                    median: k * x,
                    min: 0.9 * k * x,
                    max: 1.1 * k * x,
                })
                .collect(),
        };
        // Values spread by far more than LOG_SPREAD: the logarithmic value axis.
        let lines = [line("svc", 0.001), line("kube-proxy", 1.0)];
        let chart = Chart {
            title: "t",
            x_label: "Services",
            y_label: "s",
            lines: &lines,
        };
        write_png(&path, &chart).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        // An empty chart is an error, not a blank picture.
        let empty = Chart {
            lines: &[],
            ..chart
        };
        assert!(write_png(&dir.join("empty.png"), &empty).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
