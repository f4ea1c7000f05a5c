//! The picture of the outputs as a whole (`ailhd status --png OUT.png`):
//!
//! - a title: the output folder, rows (valid and not), files per state, the writer, and
//!   where the columns were read from;
//! - valid rows per label, one bar per split;
//! - the gain distribution of valid rows (from the file names; 1 dB, out of the water, in red);
//! - arrivals over time: cumulative rows per label by `recorded_at`, the recording time in the
//!   file name (the outputs keep no commit time; rows without a time are counted in the caption).
//!
//! Everything but the title comes from the outputs' own columns, read as a trainer reads them
//! (see [`Columns`]); the title's file counts and writer come from the status report ([`Title`]).

use super::{draw_lines, err, palette, Area, FONT, OUT_OF_WATER};
use crate::output::read::Columns;
use anyhow::Result;
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::collections::BTreeMap;
use std::path::Path;

pub const WIDTH: u32 = 1400;
pub const HEIGHT: u32 = 950;
const HEADER: u32 = 100;

/// What the title says besides the columns: the files per state and the writer, as the
/// status report has them.
pub struct Title<'a> {
    pub files: &'a BTreeMap<String, u64>,
    pub writer: Option<&'a str>,
}

pub fn write(out: &Path, output_dir: &Path, title: &Title, cols: &Columns) -> Result<()> {
    super::draw_to_file(out, (WIDTH, HEIGHT), |root| {
        root.fill(&WHITE).map_err(err("background"))?;
        let (header, rest) = root.split_vertically(HEADER);
        let (top, bottom) = rest.split_vertically(430);
        let (left, right) = top.split_horizontally(WIDTH * 11 / 20);
        draw_header(&header, output_dir, title, cols)?;
        draw_rows_per_label(&left, cols)?;
        draw_gain(&right, cols)?;
        draw_arrivals(&bottom, cols)?;
        Ok(())
    })
}

fn draw_header(area: &Area, output_dir: &Path, r: &Title, cols: &Columns) -> Result<()> {
    let rows: usize = cols.splits.iter().map(|s| s.rows()).sum();
    let valid: usize = cols
        .splits
        .iter()
        .map(|s| s.valid.iter().filter(|&&v| v == 1).count())
        .sum();
    let per_split: Vec<String> = cols
        .splits
        .iter()
        .map(|s| format!("{} {}", s.split, s.rows()))
        .collect();
    let files: Vec<String> = r.files.iter().map(|(k, v)| format!("{k} {v}")).collect();
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let grey = RGBColor(80, 80, 80);
    draw_lines(
        area,
        &[
            (
                format!("ailhd dataset: {}", output_dir.display()),
                22,
                BLACK,
            ),
            (
                format!(
                    "{rows} committed rows ({valid} valid, {} superseded or deleted): {}   ·   files: {}",
                    rows - valid,
                    per_split.join(", "),
                    if files.is_empty() { "none".into() } else { files.join(", ") },
                ),
                17,
                BLACK,
            ),
            (
                format!(
                    "writer: {}   ·   columns read from {}   ·   drawn {}",
                    r.writer.unwrap_or("none (service not running)"),
                    cols.source,
                    super::utc(now)
                ),
                14,
                grey,
            ),
        ],
    )
}

/// Axis labels for categories placed at 0, 1, 2...: the name at an integer, nothing elsewhere.
fn category<'a>(names: &'a [String]) -> impl Fn(&f64) -> String + 'a {
    move |v| {
        let r = v.round();
        if (v - r).abs() < 1e-6 && r >= 0.0 && (r as usize) < names.len() {
            names[r as usize].clone()
        } else {
            String::new()
        }
    }
}

fn draw_rows_per_label(area: &Area, cols: &Columns) -> Result<()> {
    let names = &cols.label_names;
    let n = names.len().max(1);
    // counts[split][label], valid rows only.
    let counts: Vec<Vec<u64>> = cols
        .splits
        .iter()
        .map(|s| {
            let mut c = vec![0u64; n];
            for (l, v) in s.labels.iter().zip(&s.valid) {
                if *v == 1 && (*l as usize) < n && *l >= 0 {
                    c[*l as usize] += 1;
                }
            }
            c
        })
        .collect();
    // Headroom for the legend above the tallest bars.
    let top = (counts.iter().flatten().copied().max().unwrap_or(0) as f64 * 1.4).max(5.0);
    let mut chart = ChartBuilder::on(area)
        .caption("valid rows per label and split", (FONT, 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..top)
        .map_err(err("rows per label"))?;
    let fmt = category(names);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&fmt)
        .y_desc("rows")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err("rows per label"))?;
    let k = counts.len().max(1) as f64;
    let width = 0.8 / k;
    for (si, split) in cols.splits.iter().enumerate() {
        let colour = palette(si);
        let c = &counts[si];
        chart
            .draw_series((0..n).map(|li| {
                let x0 = li as f64 - 0.4 + si as f64 * width;
                Rectangle::new(
                    [(x0 + 0.01, 0.0), (x0 + width - 0.01, c[li] as f64)],
                    colour.filled(),
                )
            }))
            .map_err(err("rows per label"))?
            .label(format!("{} ({} valid)", split.split, c.iter().sum::<u64>()))
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], colour.filled()));
        chart
            .draw_series((0..n).filter(|&li| c[li] > 0).map(|li| {
                let x = li as f64 - 0.4 + (si as f64 + 0.5) * width;
                Text::new(
                    c[li].to_string(),
                    (x, c[li] as f64),
                    (FONT, 12)
                        .into_font()
                        .color(&BLACK)
                        .pos(Pos::new(HPos::Center, VPos::Bottom)),
                )
            }))
            .map_err(err("rows per label"))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err("rows per label legend"))?;
    Ok(())
}

/// Gain categories of valid rows: each distinct value when there are few, else equal bins;
/// 1 dB (out of the water) and "none" (no gain in the file name) always on their own.
fn gain_categories(cols: &Columns) -> Vec<(String, u64, RGBColor)> {
    let gains: Vec<f32> = cols
        .splits
        .iter()
        .flat_map(|s| s.gain_db.iter().zip(&s.valid))
        .filter(|(_, v)| **v == 1)
        .map(|(g, _)| *g)
        .collect();
    let out_of_water = gains.iter().filter(|g| **g == 1.0).count() as u64;
    let none = gains.iter().filter(|g| g.is_nan()).count() as u64;
    let rest: Vec<f32> = gains
        .iter()
        .copied()
        .filter(|g| !g.is_nan() && *g != 1.0)
        .collect();
    let normal = RGBColor(31, 119, 180);
    let mut cats = Vec::new();
    if out_of_water > 0 {
        cats.push(("1 (out of water)".to_string(), out_of_water, OUT_OF_WATER));
    }
    let mut distinct: BTreeMap<i64, u64> = BTreeMap::new();
    for g in &rest {
        *distinct
            .entry((*g as f64 * 10.0).round() as i64)
            .or_default() += 1;
    }
    if distinct.len() <= 12 {
        for (k, c) in distinct {
            cats.push((format!("{}", k as f64 / 10.0), c, normal));
        }
    } else {
        let lo = rest.iter().copied().fold(f32::INFINITY, f32::min);
        let hi = rest.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let bins = 12;
        let w = (hi - lo) / bins as f32;
        let mut c = vec![0u64; bins];
        for g in &rest {
            c[(((g - lo) / w) as usize).min(bins - 1)] += 1;
        }
        for (i, c) in c.into_iter().enumerate() {
            let a = lo + i as f32 * w;
            cats.push((format!("{:.0}-{:.0}", a, a + w), c, normal));
        }
    }
    if none > 0 {
        cats.push(("none".to_string(), none, RGBColor(150, 150, 150)));
    }
    cats
}

fn draw_gain(area: &Area, cols: &Columns) -> Result<()> {
    let cats = gain_categories(cols);
    let names: Vec<String> = cats.iter().map(|c| c.0.clone()).collect();
    let n = cats.len().max(1);
    let top = (cats.iter().map(|c| c.1).max().unwrap_or(0) as f64 * 1.15).max(5.0);
    let mut chart = ChartBuilder::on(area)
        .caption("gain distribution of valid rows (file name)", (FONT, 18))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..top)
        .map_err(err("gain distribution"))?;
    let fmt = category(&names);
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n + 1)
        .x_label_formatter(&fmt)
        .x_desc("gain, dB")
        .y_desc("rows")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err("gain distribution"))?;
    chart
        .draw_series(cats.iter().enumerate().map(|(i, (_, c, colour))| {
            Rectangle::new(
                [(i as f64 - 0.35, 0.0), (i as f64 + 0.35, *c as f64)],
                colour.filled(),
            )
        }))
        .map_err(err("gain distribution"))?;
    chart
        .draw_series(cats.iter().enumerate().map(|(i, (_, c, _))| {
            Text::new(
                c.to_string(),
                (i as f64, *c as f64),
                (FONT, 12)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            )
        }))
        .map_err(err("gain distribution"))?;
    if cats.is_empty() {
        chart
            .draw_series(std::iter::once(Text::new(
                "no valid rows yet",
                (0.0, top / 2.0),
                (FONT, 16)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Center)),
            )))
            .map_err(err("gain distribution"))?;
    }
    Ok(())
}

/// (recorded_at, label) of every committed row that has a time, in time order, and the
/// number of rows without one.
fn arrival_events(cols: &Columns) -> (Vec<(i64, usize)>, usize) {
    let mut events: Vec<(i64, usize)> = Vec::new();
    let mut untimed = 0usize;
    for s in &cols.splits {
        for (t, l) in s.recorded_at.iter().zip(&s.labels) {
            if *t >= 0 {
                events.push((*t, (*l).max(0) as usize));
            } else {
                untimed += 1;
            }
        }
    }
    events.sort_unstable();
    (events, untimed)
}

/// The time axis of the arrivals: in days, hours or minutes since midnight UTC of the first
/// day, so that the ticks fall on round times; the labels turn them back into dates and times.
#[derive(Clone, Copy)]
struct TimeAxis {
    origin: f64,
    unit: f64,
    span: f64,
    /// The first and last event on the axis, and the margin beyond them.
    x0: f64,
    x1: f64,
    pad: f64,
}

impl TimeAxis {
    fn new(events: &[(i64, usize)]) -> TimeAxis {
        let (t0, t1) = match (events.first(), events.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => (a.0 as f64, b.0 as f64),
            (Some(a), _) => (a.0 as f64 - 3600.0, a.0 as f64 + 3600.0),
            _ => (0.0, 1.0),
        };
        let span = t1 - t0;
        let unit = if span > 5.0 * 86400.0 {
            86400.0
        } else if span > 3.0 * 3600.0 {
            3600.0
        } else {
            60.0
        };
        let origin = (t0 / 86400.0).floor() * 86400.0;
        let mut axis = TimeAxis {
            origin,
            unit,
            span,
            x0: 0.0,
            x1: 0.0,
            pad: 0.0,
        };
        (axis.x0, axis.x1) = (axis.x(t0), axis.x(t1));
        axis.pad = (axis.x1 - axis.x0) * 0.02;
        axis
    }

    fn x(&self, t: f64) -> f64 {
        (t - self.origin) / self.unit
    }

    fn label(&self, v: &f64) -> String {
        let Ok(t) =
            time::OffsetDateTime::from_unix_timestamp((self.origin + v * self.unit).round() as i64)
        else {
            return String::new();
        };
        let f = if self.unit >= 86400.0 {
            time::macros::format_description!("[year]-[month]-[day]")
        } else if self.span > 86400.0 {
            time::macros::format_description!("[month]-[day] [hour]:[minute]")
        } else {
            time::macros::format_description!("[hour]:[minute]")
        };
        t.format(f).unwrap_or_default()
    }

    /// The cumulative count of the events `pick` takes, as a step line across the axis.
    fn steps(&self, events: &[(i64, usize)], pick: &dyn Fn(usize) -> bool) -> Vec<(f64, f64)> {
        let mut pts = vec![(self.x0 - self.pad, 0.0)];
        let mut n = 0f64;
        for (t, l) in events {
            if pick(*l) {
                pts.push((self.x(*t as f64), n));
                n += 1.0;
                pts.push((self.x(*t as f64), n));
            }
        }
        pts.push((self.x1 + self.pad, n));
        pts
    }
}

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordf64, RangedCoordf64>>;

fn draw_arrivals(area: &Area, cols: &Columns) -> Result<()> {
    let (events, untimed) = arrival_events(cols);
    let total = events.len();
    let axis = TimeAxis::new(&events);
    let TimeAxis { x0, x1, pad, .. } = axis;
    let caption = format!(
        "arrivals: cumulative rows by recording time (recorded_at from the file name, UTC){}",
        if untimed > 0 {
            format!("; {untimed} rows without one")
        } else {
            String::new()
        }
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, (FONT, 18))
        .margin(10)
        .margin_right(30)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(x0 - pad..x1 + pad, 0f64..(total.max(1) as f64 * 1.05))
        .map_err(err("arrivals"))?;
    chart
        .configure_mesh()
        .x_labels(8)
        .x_label_formatter(&|v| axis.label(v))
        .x_desc(if axis.unit >= 86400.0 {
            "recorded_at (date, UTC)"
        } else {
            "recorded_at (UTC)"
        })
        .y_desc("rows")
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err("arrivals"))?;
    if total == 0 {
        chart
            .draw_series(std::iter::once(Text::new(
                "no rows with a recording time yet",
                ((x0 + x1) / 2.0, 0.5),
                (FONT, 16)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Center)),
            )))
            .map_err(err("arrivals"))?;
        return Ok(());
    }
    draw_arrival_steps(&mut chart, &axis, &events, &cols.label_names)
}

/// A step line per label and one for all rows, with their legend.
fn draw_arrival_steps<'a, 'b: 'a>(
    chart: &mut Chart<'a, 'b>,
    axis: &TimeAxis,
    events: &[(i64, usize)],
    names: &[String],
) -> Result<()> {
    let total = events.len();
    chart
        .draw_series(LineSeries::new(
            axis.steps(events, &|_| true),
            BLACK.stroke_width(2),
        ))
        .map_err(err("arrivals"))?
        .label(format!("all ({total})"))
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLACK.stroke_width(2)));
    let label_count = names
        .len()
        .max(events.iter().map(|e| e.1 + 1).max().unwrap_or(0));
    for li in 0..label_count {
        let count = events.iter().filter(|e| e.1 == li).count();
        if count == 0 {
            continue;
        }
        let colour = palette(li + 3);
        let name = names.get(li).cloned().unwrap_or_else(|| format!("#{li}"));
        chart
            .draw_series(LineSeries::new(
                axis.steps(events, &|l| l == li),
                colour.stroke_width(2),
            ))
            .map_err(err("arrivals"))?
            .label(format!("{name} ({count})"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 16, y)], colour.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font((FONT, 14))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(err("arrivals legend"))?;
    Ok(())
}
