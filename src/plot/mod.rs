//! Pictures (`inspect --png`, `status --png`), drawn with plotters on its bitmap backend.
//!
//! Text needs a font and the hosts that run `ailhd` may have none installed (a minimal server,
//! a container), so the binary carries one: DejaVu Sans (`assets/fonts/`, with its licence),
//! registered with plotters' `ab_glyph` renderer, which never looks at the system's fonts.
//!
//! - [`recording`]: one recording (waveform, spectrogram, the stored mel features);
//! - [`dataset`]: the outputs as a whole (rows per label and split, arrivals, gain);
//!
//! The per-row columns they show are read as a user's reader does, by [`crate::output::read`].

pub mod dataset;
pub mod recording;

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::sync::OnceLock;

/// DejaVu Sans 2.37 (Debian's fonts-dejavu-core); licence in `assets/fonts/LICENSE`.
static FONT_BYTES: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");

/// The family every text style of the pictures uses.
pub const FONT: &str = "sans-serif";

/// Draw a `width` x `height` picture with `draw` into memory, then write it to `out` in the
/// format its extension names (PNG for `.png`): a path that cannot be written or an extension
/// that is not a picture's fails with what is wrong, and a drawing that fails writes nothing.
pub fn draw_to_file(
    out: &std::path::Path,
    (width, height): (u32, u32),
    draw: impl FnOnce(&Area) -> Result<()>,
) -> Result<()> {
    use anyhow::Context;
    init_font()?;
    let mut pixels = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut pixels, (width, height)).into_drawing_area();
        draw(&root)?;
        root.present().map_err(err("picture"))?;
    }
    image::save_buffer(out, &pixels, width, height, image::ColorType::Rgb8)
        .with_context(|| format!("cannot write {}", out.display()))
}

/// Register the embedded font with plotters (once per process).
pub fn init_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE.get_or_init(|| {
        plotters::style::register_font(FONT, FontStyle::Normal, FONT_BYTES).is_ok()
    });
    if ok {
        Ok(())
    } else {
        Err(anyhow!(
            "the embedded font (DejaVu Sans) could not be loaded"
        ))
    }
}

pub type Area<'a> = DrawingArea<BitMapBackend<'a>, Shift>;

/// plotters' drawing errors carry the backend's error type; say what was being drawn.
pub fn err<E: std::fmt::Debug>(what: &'static str) -> impl FnOnce(E) -> anyhow::Error {
    move |e| anyhow!("drawing the {what}: {e:?}")
}

/// Distinct colours for labels and splits (Tableau 10, as matplotlib's default cycle).
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

pub fn palette(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// The colour for a value on the pictures' colour scale (viridis, `lo` dark to `hi` bright).
pub fn scale_colour(v: f32, lo: f32, hi: f32) -> RGBColor {
    let v = if v.is_finite() { v } else { lo };
    ViridisRGB::get_color_normalized(v.clamp(lo, hi), lo, hi.max(lo + 1e-6))
}

pub const OUT_OF_WATER: RGBColor = RGBColor(200, 0, 0);

/// A grid of values drawn as coloured cells, with axes and a colour bar.
pub struct Heatmap<'a> {
    pub caption: String,
    /// `values[c * rows + r]` is the cell in column `c` (left to right), row `r` (bottom up).
    pub values: &'a [f32],
    pub cols: usize,
    pub rows: usize,
    /// Where the cells lie: column `c` spans `x.0 + c * (x.1 - x.0) / cols`, likewise rows.
    pub x: (f64, f64),
    /// The x axis' extent (the cells' own when `None`).
    pub x_axis: Option<(f64, f64)>,
    pub y: (f64, f64),
    pub x_desc: String,
    pub y_desc: String,
    pub lo: f32,
    pub hi: f32,
    pub unit: &'a str,
}

/// Draw `h` into `area`: the cells with their axes on the left, the colour bar on the right.
pub fn draw_heatmap(area: &Area, h: &Heatmap) -> Result<()> {
    let (w, _) = area.dim_in_pixel();
    let (main, bar) = area.split_horizontally(w.saturating_sub(110));
    let mut chart = ChartBuilder::on(&main)
        .caption(&h.caption, (FONT, 18))
        .margin(6)
        .x_label_area_size(42)
        .y_label_area_size(64)
        .build_cartesian_2d(
            h.x_axis.map_or(h.x.0, |a| a.0)..h.x_axis.map_or(h.x.1, |a| a.1),
            h.y.0..h.y.1,
        )
        .map_err(err("heatmap axes"))?;
    let dx = (h.x.1 - h.x.0) / h.cols.max(1) as f64;
    let dy = (h.y.1 - h.y.0) / h.rows.max(1) as f64;
    chart
        .draw_series((0..h.cols).flat_map(|c| {
            (0..h.rows).map(move |r| {
                let x0 = h.x.0 + c as f64 * dx;
                let y0 = h.y.0 + r as f64 * dy;
                Rectangle::new(
                    [(x0, y0), (x0 + dx, y0 + dy)],
                    scale_colour(h.values[c * h.rows + r], h.lo, h.hi).filled(),
                )
            })
        }))
        .map_err(err("heatmap cells"))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .x_desc(h.x_desc.as_str())
        .y_desc(h.y_desc.as_str())
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .draw()
        .map_err(err("heatmap axes"))?;
    draw_colour_bar(&bar, h.lo, h.hi, h.unit)
}

/// A vertical colour bar for the range `lo..hi`, labelled in `unit`.
pub fn draw_colour_bar(area: &Area, lo: f32, hi: f32, unit: &str) -> Result<()> {
    let (lo, hi) = (lo as f64, (hi as f64).max(lo as f64 + 1e-6));
    let mut chart = ChartBuilder::on(area)
        .margin_top(34)
        .margin_bottom(48)
        .margin_left(8)
        .margin_right(16)
        .y_label_area_size(0)
        .right_y_label_area_size(60)
        .build_cartesian_2d(0f64..1f64, lo..hi)
        .map_err(err("colour bar"))?;
    let steps = 128;
    let step = (hi - lo) / steps as f64;
    chart
        .draw_series((0..steps).map(|i| {
            let a = lo + i as f64 * step;
            Rectangle::new(
                [(0.0, a), (1.0, a + step)],
                scale_colour((a + step / 2.0) as f32, lo as f32, hi as f32).filled(),
            )
        }))
        .map_err(err("colour bar"))?;
    chart
        .configure_mesh()
        .disable_mesh()
        .disable_x_axis()
        .y_desc(unit)
        .y_labels(8)
        .label_style((FONT, 13))
        .axis_desc_style((FONT, 14))
        .draw()
        .map_err(err("colour bar"))?;
    Ok(())
}

/// Lines of text from the top left of `area`; each line `(text, size, colour)`.
pub fn draw_lines(area: &Area, lines: &[(String, u32, RGBColor)]) -> Result<()> {
    // Clear of the red frame round out-of-water pictures.
    let mut y = 12;
    for (text, size, colour) in lines {
        area.draw(&Text::new(
            text.as_str(),
            (14, y),
            (FONT, *size).into_font().color(colour),
        ))
        .map_err(err("title"))?;
        y += *size as i32 + 8;
    }
    Ok(())
}

/// `2025-01-18 12:05:30 UTC` for Unix seconds (`-` when absent).
pub fn utc(secs: i64) -> String {
    if secs < 0 {
        return "-".into();
    }
    let fmt =
        time::macros::format_description!("[year]-[month]-[day] [hour]:[minute]:[second] UTC");
    time::OffsetDateTime::from_unix_timestamp(secs)
        .ok()
        .and_then(|t| t.format(fmt).ok())
        .unwrap_or_else(|| secs.to_string())
}
