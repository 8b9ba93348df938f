//! `--plot FILE.png`: bus bandwidth and time against size, on log axes.
//!
//! Text needs a TrueType font read at run time: `CHORUS_PLOT_FONT` names one
//! (`none` draws no text), otherwise common system locations are tried; with
//! no font the chart is drawn without labels.

use std::path::Path;
use std::sync::OnceLock;

use chorus::env;
use plotters::coord::ranged1d::{AsRangedCoord, ValueFormatter};
use plotters::prelude::*;

use super::report::{g_str, Row};

/// Font files tried when `CHORUS_PLOT_FONT` is unset.
const FONT_PATHS: [&str; 5] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
];

/// The family name the font is registered under.
const FAMILY: &str = "sans-serif";

/// Registers a font once per process; whether text can be drawn.
///
/// Fails if `CHORUS_PLOT_FONT` names a file that is not a readable font.
fn text_available() -> Result<bool, String> {
    static FONT: OnceLock<Result<bool, String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let chosen = std::env::var(env::CHORUS_PLOT_FONT).ok();
        let path = match chosen.as_deref() {
            Some("none") => return Ok(false),
            Some(p) => p.to_string(),
            None => match FONT_PATHS.iter().find(|p| Path::new(p).is_file()) {
                Some(p) => p.to_string(),
                None => return Ok(false),
            },
        };
        let bytes = std::fs::read(&path)
            .map_err(|e| format!("CHORUS_PLOT_FONT={path}: cannot read it: {e}"))?;
        plotters::style::register_font(FAMILY, FontStyle::Normal, Box::leak(bytes.into()))
            .map_err(|_| format!("CHORUS_PLOT_FONT={path}: not a TrueType/OpenType font"))?;
        Ok(true)
    })
    .clone()
}

/// Draws `rows` (the first root's, sizes above 0) into the PNG file `path`.
///
/// Fails if there is nothing to draw (every size is 0) or the file cannot be written.
pub fn draw(path: &Path, title: &str, rows: &[Row]) -> Result<(), String> {
    let root = rows.first().map_or(-1, |r| r.root);
    let rows: Vec<&Row> = rows
        .iter()
        .filter(|r| r.root == root && r.size > 0)
        .collect();
    if rows.is_empty() {
        return Err(format!(
            "--plot {}: nothing to draw, every size is 0",
            path.display()
        ));
    }
    let text = text_available()?;
    let fail = |e: &dyn std::fmt::Display| format!("--plot {}: {e}", path.display());
    let area = BitMapBackend::new(path, (1280, 560)).into_drawing_area();
    area.fill(&WHITE).map_err(|e| fail(&e))?;
    let area = if text {
        area.titled(title, (FAMILY, 22)).map_err(|e| fail(&e))?
    } else {
        area
    };
    let (left, right) = area.split_horizontally(640);
    let sizes = (rows[0].size as f64, rows[rows.len() - 1].size as f64 * 1.05);
    let series = |pick: fn(&Row) -> [f64; 2]| -> [Vec<(f64, f64)>; 2] {
        [0, 1].map(|i| rows.iter().map(|r| (r.size as f64, pick(r)[i])).collect())
    };
    let busbw = series(|r| [r.out_of_place.busbw, r.in_place.busbw]);
    let time = series(|r| [r.out_of_place.time_us, r.in_place.time_us]);
    let top = busbw.iter().flatten().fold(0.0f64, |m, p| m.max(p.1));
    let (lo, hi) = time
        .iter()
        .flatten()
        .fold((f64::MAX, 0.0f64), |(lo, hi), p| (lo.min(p.1), hi.max(p.1)));
    panel(
        &left,
        text,
        "busbw (GB/s)",
        sizes,
        0.0..(top * 1.1).max(1e-3),
        &busbw,
    )
    .map_err(|e| fail(&e))?;
    panel(
        &right,
        text,
        "time (us)",
        sizes,
        ((lo * 0.8).max(1e-3)..hi * 1.25).log_scale(),
        &time,
    )
    .map_err(|e| fail(&e))?;
    area.present().map_err(|e| fail(&e))
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

/// One chart: `lines` (out of place, in place) against size on a log2 axis, `y` as given.
fn panel<Y>(
    area: &Area<'_>,
    text: bool,
    y_desc: &str,
    (x_lo, x_hi): (f64, f64),
    y: Y,
    lines: &[Vec<(f64, f64)>; 2],
) -> Result<(), Box<dyn std::error::Error>>
where
    Y: AsRangedCoord<Value = f64>,
    Y::CoordDescType: ValueFormatter<f64>,
{
    let label = if text { 48 } else { 0 };
    let x: plotters::coord::combinators::LogCoord<f64> = (x_lo..x_hi).log_scale().base(2.0).into();
    let mut chart = ChartBuilder::on(area)
        .margin(16)
        .x_label_area_size(label)
        .y_label_area_size(label + 16)
        .build_cartesian_2d(x, y)?;
    if text {
        chart
            .configure_mesh()
            .x_desc("size (bytes)")
            .y_desc(y_desc)
            .x_label_formatter(&|v| human_size(*v))
            .y_label_formatter(&|v| g_str(*v))
            .label_style((FAMILY, 14))
            .axis_desc_style((FAMILY, 16))
            .draw()?;
    }
    let styles = [BLUE, RED];
    for ((points, color), name) in lines.iter().zip(styles).zip(["out-of-place", "in-place"]) {
        chart.draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))?;
        let drawn = chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?;
        if text {
            drawn.label(name).legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2))
            });
        }
    }
    if text {
        chart
            .configure_series_labels()
            .label_font((FAMILY, 14))
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()?;
    }
    Ok(())
}

/// `8B`, `4K`, `256M`: a size in powers of 1024.
fn human_size(v: f64) -> String {
    let units = ["B", "K", "M", "G", "T"];
    let mut v = v;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < units.len() {
        v /= 1024.0;
        u += 1;
    }
    if v.fract().abs() < 1e-6 {
        format!("{v:.0}{}", units[u])
    } else {
        format!("{v:.1}{}", units[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_read_like_the_flags() {
        assert_eq!(human_size(8.0), "8B");
        assert_eq!(human_size(65536.0), "64K");
        assert_eq!(human_size(256.0 * 1024.0 * 1024.0), "256M");
        assert_eq!(human_size(1536.0), "1.5K");
    }
}
