//! Small, dependency-free SVG line charts for the simulator's reports.
//!
//! A [`Chart`] is a set of named [`Series`] drawn as polylines with a marker at every
//! point; [`Chart::to_svg`] renders one chart and [`panels_to_svg`] renders several side
//! by side with one shared legend. The output is meant to be opened in a browser or
//! embedded in a Markdown file (it has an opaque white background, so it stays readable
//! on dark themes).
//!
//! Rendering is deterministic: the same input always gives byte-identical SVG. Coordinates
//! are written with one decimal, axis ticks are "nice" (1, 2 or 5 times a power of ten),
//! points with a NaN or infinite coordinate are skipped, and all text is XML-escaped.
//!
//! A series keeps its color, marker and dash pattern by *name*: the n-th distinct name
//! (in order of first appearance over all panels) gets the n-th style, so one
//! deployment+policy looks the same in every panel.

use std::fmt::Write as _;

/// One curve.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Series {
    /// Legend label; also the key that picks the curve's color and marker.
    pub name: String,
    /// `(x, y)` points, joined in this order. Points with a non-finite coordinate are skipped.
    pub points: Vec<(f64, f64)>,
}

/// A line chart.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Chart {
    /// Printed above the plot.
    pub title: String,
    /// Label of the horizontal axis (include the unit, e.g. `"output tok/s per GPU"`).
    pub x_label: String,
    /// Label of the vertical axis.
    pub y_label: String,
    /// The curves; an empty list (or only empty curves) gives an empty plot saying "no data".
    pub series: Vec<Series>,
    /// Optional note printed under the title (e.g. workload and seed).
    pub subtitle: Option<String>,
}

impl Chart {
    /// Renders this chart, with its legend to the right of the plot, as a standalone SVG
    /// document.
    pub fn to_svg(&self) -> String {
        panels_to_svg(std::slice::from_ref(self))
    }
}

/// Several charts side by side in one SVG (e.g. p50 and p90 panels), sharing one legend.
///
/// Each chart gets its own axes. Series with the same name get the same style in every
/// panel and one legend entry.
pub fn panels_to_svg(charts: &[Chart]) -> String {
    let names = legend_names(charts);
    let top = if charts.iter().any(|c| c.subtitle.is_some()) {
        TOP_WITH_SUBTITLE
    } else {
        TOP
    };

    let legend_w = if names.is_empty() {
        0.0
    } else {
        let widest = names
            .iter()
            .map(|n| text_width(n, LEGEND_FONT))
            .fold(0.0, f64::max);
        LEGEND_TEXT_X + widest + LEGEND_PAD + LEGEND_GAP
    };
    let legend_h = LEGEND_PAD * 2.0 + LEGEND_ROW * names.len() as f64;
    let width = PANEL_W * charts.len().max(1) as f64 + legend_w;
    let height = PANEL_H.max(top + legend_h + LEGEND_PAD);

    let mut out = String::new();
    let _ = write!(
        out,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         viewBox=\"0 0 {w} {h}\" font-family=\"{FONT_FAMILY}\" font-size=\"12\">\n\
         <rect width=\"{w}\" height=\"{h}\" fill=\"#ffffff\"/>\n",
        w = num(width),
        h = num(height),
    );
    for (i, chart) in charts.iter().enumerate() {
        render_panel(&mut out, chart, PANEL_W * i as f64, top, &names);
    }
    if !names.is_empty() {
        render_legend(
            &mut out,
            PANEL_W * charts.len().max(1) as f64,
            top,
            legend_w - LEGEND_GAP,
            legend_h,
            &names,
        );
    }
    out.push_str("</svg>");
    out
}

// ---------------------------------------------------------------------------------------
// Layout and style constants.

const PANEL_W: f64 = 640.0;
const PANEL_H: f64 = 420.0;
/// Top of the plot area, without / with a subtitle line.
const TOP: f64 = 48.0;
const TOP_WITH_SUBTITLE: f64 = 64.0;
const MARGIN_RIGHT: f64 = 24.0;
const MARGIN_BOTTOM: f64 = 56.0;
const MAX_X_TICKS: usize = 10;
const MAX_Y_TICKS: usize = 7;

const FONT_FAMILY: &str = "system-ui, -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif";
const TITLE_FONT: f64 = 16.0;
const SUBTITLE_FONT: f64 = 12.0;
const TICK_FONT: f64 = 11.0;
const LABEL_FONT: f64 = 13.0;
const LEGEND_FONT: f64 = 12.0;

const LEGEND_GAP: f64 = 16.0;
const LEGEND_PAD: f64 = 10.0;
const LEGEND_ROW: f64 = 20.0;
/// Offset of the legend text from the box's left edge (after the line+marker sample).
const LEGEND_TEXT_X: f64 = 46.0;

const GRID: &str = "#e6e6e6";
const AXIS: &str = "#444444";
const TEXT: &str = "#222222";
const MUTED: &str = "#666666";

/// Okabe-Ito, ordered so that the first colors have the best contrast on white
/// (yellow last).
const PALETTE: [&str; 8] = [
    "#0072B2", "#E69F00", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#000000", "#F0E442",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Marker {
    Circle,
    Square,
    TriangleUp,
    Diamond,
    TriangleDown,
    Plus,
    Cross,
    Star,
}

const MARKERS: [Marker; 8] = [
    Marker::Circle,
    Marker::Square,
    Marker::TriangleUp,
    Marker::Diamond,
    Marker::TriangleDown,
    Marker::Plus,
    Marker::Cross,
    Marker::Star,
];

/// Dash patterns, changing once all colors have been used.
const DASHES: [Option<&str>; 3] = [None, Some("7 4"), Some("2 3")];

/// The look of the `i`-th distinct series: color, marker and dash all cycle, with
/// different periods, so that the first 24 series are all distinct.
fn style(i: usize) -> (&'static str, Marker, Option<&'static str>) {
    (
        PALETTE[i % PALETTE.len()],
        MARKERS[(i + i / PALETTE.len()) % MARKERS.len()],
        DASHES[(i / PALETTE.len()) % DASHES.len()],
    )
}

/// Distinct series names over all charts, in order of first appearance.
fn legend_names(charts: &[Chart]) -> Vec<&str> {
    let mut names: Vec<&str> = Vec::new();
    for s in charts.iter().flat_map(|c| &c.series) {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    names
}

fn style_of(names: &[&str], name: &str) -> (&'static str, Marker, Option<&'static str>) {
    style(names.iter().position(|n| *n == name).unwrap_or(0))
}

// ---------------------------------------------------------------------------------------
// Rendering.

fn render_panel(out: &mut String, chart: &Chart, x0: f64, top: f64, names: &[&str]) {
    let finite = |s: &Series| -> Vec<(f64, f64)> {
        s.points
            .iter()
            .copied()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    };
    let curves: Vec<(&Series, Vec<(f64, f64)>)> =
        chart.series.iter().map(|s| (s, finite(s))).collect();
    let xs: Vec<f64> = curves
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .collect();
    let ys: Vec<f64> = curves
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .collect();

    let (xlo, xhi) = data_range(&xs, false);
    let (ylo, yhi) = data_range(&ys, true);
    let xt = nice_ticks(xlo, xhi, MAX_X_TICKS);
    let yt = nice_ticks(ylo, yhi, MAX_Y_TICKS);
    let x_labels: Vec<String> = xt.values.iter().map(|&v| tick_label(v, xt.exp)).collect();
    let y_labels: Vec<String> = yt.values.iter().map(|&v| tick_label(v, yt.exp)).collect();
    let y_label_w = y_labels
        .iter()
        .map(|l| text_width(l, TICK_FONT))
        .fold(0.0, f64::max);

    let left = x0 + (y_label_w + 36.0).clamp(52.0, 200.0);
    let right = x0 + PANEL_W - MARGIN_RIGHT;
    let bottom = PANEL_H - MARGIN_BOTTOM;
    let px = |v: f64| lerp(v, xlo, xhi, left, right);
    let py = |v: f64| lerp(v, ylo, yhi, bottom, top);
    let mid_x = (left + right) / 2.0;

    out.push_str("<g>\n");

    // Title and subtitle.
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"{}\" font-weight=\"bold\" \
         fill=\"{TEXT}\">{}</text>",
        num(mid_x),
        num(24.0),
        num(TITLE_FONT),
        escape(&chart.title)
    );
    if let Some(sub) = &chart.subtitle {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"{}\" \
             fill=\"{MUTED}\">{}</text>",
            num(mid_x),
            num(43.0),
            num(SUBTITLE_FONT),
            escape(sub)
        );
    }

    // Grid.
    let _ = write!(out, "<g stroke=\"{GRID}\" stroke-width=\"1\">");
    for &v in &xt.values {
        let x = num(px(v));
        let _ = write!(
            out,
            "<line x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\"/>",
            num(top),
            num(bottom)
        );
    }
    for &v in &yt.values {
        let y = num(py(v));
        let _ = write!(
            out,
            "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\"/>",
            num(left),
            num(right)
        );
    }
    out.push_str("</g>\n");

    // Axes, tick marks and tick labels.
    let _ = writeln!(
        out,
        "<path d=\"M{l} {t}V{b}H{r}\" fill=\"none\" stroke=\"{AXIS}\" stroke-width=\"1\"/>",
        l = num(left),
        t = num(top),
        b = num(bottom),
        r = num(right)
    );
    let _ = write!(
        out,
        "<g font-size=\"{}\" fill=\"{MUTED}\" text-anchor=\"middle\">",
        num(TICK_FONT)
    );
    for (&v, label) in xt.values.iter().zip(&x_labels) {
        let x = num(px(v));
        let _ = write!(
            out,
            "<line x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" stroke=\"{AXIS}\"/>\
             <text x=\"{x}\" y=\"{}\">{}</text>",
            num(bottom),
            num(bottom + 4.0),
            num(bottom + 17.0),
            escape(label)
        );
    }
    out.push_str("</g>\n");
    let _ = write!(
        out,
        "<g font-size=\"{}\" fill=\"{MUTED}\" text-anchor=\"end\">",
        num(TICK_FONT)
    );
    for (&v, label) in yt.values.iter().zip(&y_labels) {
        let y = py(v);
        let _ = write!(
            out,
            "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{AXIS}\"/>\
             <text x=\"{}\" y=\"{}\">{}</text>",
            num(left - 4.0),
            num(left),
            num(left - 7.0),
            num(y + 4.0),
            escape(label),
            y = num(y)
        );
    }
    out.push_str("</g>\n");

    // Axis labels.
    let _ = writeln!(
        out,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"{}\" \
         fill=\"{TEXT}\">{}</text>",
        num(mid_x),
        num(bottom + 40.0),
        num(LABEL_FONT),
        escape(&chart.x_label)
    );
    let (lx, ly) = (x0 + 18.0, (top + bottom) / 2.0);
    let _ = writeln!(
        out,
        "<text x=\"{x}\" y=\"{y}\" transform=\"rotate(-90 {x} {y})\" text-anchor=\"middle\" \
         font-size=\"{}\" fill=\"{TEXT}\">{}</text>",
        num(LABEL_FONT),
        escape(&chart.y_label),
        x = num(lx),
        y = num(ly)
    );

    // Data.
    if xs.is_empty() {
        let _ = writeln!(
            out,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"{}\" \
             fill=\"{MUTED}\">no data</text>",
            num(mid_x),
            num((top + bottom) / 2.0),
            num(LABEL_FONT)
        );
    }
    for (series, points) in &curves {
        if points.is_empty() {
            continue;
        }
        let (color, marker, dash) = style_of(names, &series.name);
        let _ = write!(out, "<g><title>{}</title>", escape(&series.name));
        if points.len() > 1 {
            let mut pts = String::new();
            for (i, &(x, y)) in points.iter().enumerate() {
                if i > 0 {
                    pts.push(' ');
                }
                let _ = write!(pts, "{},{}", num(px(x)), num(py(y)));
            }
            let _ = write!(
                out,
                "<polyline points=\"{pts}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"2\" \
                 stroke-linejoin=\"round\" stroke-linecap=\"round\"{}/>",
                dash_attr(dash)
            );
        }
        let _ = write!(
            out,
            "<g fill=\"{color}\" stroke=\"#ffffff\" stroke-width=\"0.75\">"
        );
        for &(x, y) in points {
            draw_marker(out, marker, px(x), py(y));
        }
        out.push_str("</g></g>\n");
    }

    out.push_str("</g>\n");
}

fn render_legend(out: &mut String, x: f64, y: f64, w: f64, h: f64, names: &[&str]) {
    let _ = writeln!(
        out,
        "<g font-size=\"{}\" fill=\"{TEXT}\">\n<rect x=\"{}\" y=\"{}\" width=\"{}\" \
         height=\"{}\" rx=\"4\" fill=\"#ffffff\" stroke=\"#cccccc\"/>",
        num(LEGEND_FONT),
        num(x),
        num(y),
        num(w),
        num(h)
    );
    for (i, name) in names.iter().enumerate() {
        let (color, marker, dash) = style(i);
        let cy = y + LEGEND_PAD + LEGEND_ROW * (i as f64 + 0.5);
        let _ = write!(
            out,
            "<line x1=\"{}\" y1=\"{cy}\" x2=\"{}\" y2=\"{cy}\" stroke=\"{color}\" \
             stroke-width=\"2\"{}/><g fill=\"{color}\" stroke=\"#ffffff\" stroke-width=\"0.75\">",
            num(x + 10.0),
            num(x + 36.0),
            dash_attr(dash),
            cy = num(cy)
        );
        draw_marker(out, marker, x + 23.0, cy);
        let _ = writeln!(
            out,
            "</g><text x=\"{}\" y=\"{}\">{}</text>",
            num(x + LEGEND_TEXT_X),
            num(cy + 4.0),
            escape(name)
        );
    }
    out.push_str("</g>\n");
}

fn dash_attr(dash: Option<&str>) -> String {
    dash.map(|d| format!(" stroke-dasharray=\"{d}\""))
        .unwrap_or_default()
}

fn draw_marker(out: &mut String, marker: Marker, x: f64, y: f64) {
    const SQUARE: [(f64, f64); 4] = [(-3.6, -3.6), (3.6, -3.6), (3.6, 3.6), (-3.6, 3.6)];
    const TRIANGLE_UP: [(f64, f64); 3] = [(0.0, -5.2), (4.5, 2.6), (-4.5, 2.6)];
    const TRIANGLE_DOWN: [(f64, f64); 3] = [(0.0, 5.2), (4.5, -2.6), (-4.5, -2.6)];
    const DIAMOND: [(f64, f64); 4] = [(0.0, -5.0), (4.6, 0.0), (0.0, 5.0), (-4.6, 0.0)];
    const PLUS: [(f64, f64); 12] = [
        (-1.6, -5.0),
        (1.6, -5.0),
        (1.6, -1.6),
        (5.0, -1.6),
        (5.0, 1.6),
        (1.6, 1.6),
        (1.6, 5.0),
        (-1.6, 5.0),
        (-1.6, 1.6),
        (-5.0, 1.6),
        (-5.0, -1.6),
        (-1.6, -1.6),
    ];
    // Unit vectors every 36 degrees, starting straight up.
    const STAR_DIRS: [(f64, f64); 10] = [
        (0.0, -1.0),
        (0.5878, -0.809),
        (0.9511, -0.309),
        (0.9511, 0.309),
        (0.5878, 0.809),
        (0.0, 1.0),
        (-0.5878, 0.809),
        (-0.9511, 0.309),
        (-0.9511, -0.309),
        (-0.5878, -0.809),
    ];

    let polygon = |out: &mut String, pts: &mut dyn Iterator<Item = (f64, f64)>| {
        out.push_str("<path d=\"");
        for (i, (dx, dy)) in pts.enumerate() {
            let _ = write!(
                out,
                "{}{} {}",
                if i == 0 { 'M' } else { 'L' },
                num(x + dx),
                num(y + dy)
            );
        }
        out.push_str("Z\"/>");
    };
    match marker {
        Marker::Circle => {
            let _ = write!(out, "<circle cx=\"{}\" cy=\"{}\" r=\"4\"/>", num(x), num(y));
        }
        Marker::Square => polygon(out, &mut SQUARE.into_iter()),
        Marker::TriangleUp => polygon(out, &mut TRIANGLE_UP.into_iter()),
        Marker::TriangleDown => polygon(out, &mut TRIANGLE_DOWN.into_iter()),
        Marker::Diamond => polygon(out, &mut DIAMOND.into_iter()),
        Marker::Plus => polygon(out, &mut PLUS.into_iter()),
        Marker::Cross => {
            let c = std::f64::consts::FRAC_1_SQRT_2;
            polygon(
                out,
                &mut PLUS
                    .into_iter()
                    .map(|(dx, dy)| ((dx - dy) * c, (dx + dy) * c)),
            )
        }
        Marker::Star => polygon(
            out,
            &mut STAR_DIRS.into_iter().enumerate().map(|(i, (ux, uy))| {
                let r = if i % 2 == 0 { 5.6 } else { 2.4 };
                (ux * r, uy * r)
            }),
        ),
    }
}

// ---------------------------------------------------------------------------------------
// Scales and numbers.

/// The axis range for finite `values`: the data range plus 5% on each side, never
/// crossing below 0 when all values are non-negative; with `zero_based`, it starts at
/// exactly 0 in that case. Always returns finite `lo < hi`.
fn data_range(values: &[f64], zero_based: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &v| {
            (lo.min(v), hi.max(v))
        });
    if lo > hi {
        return (0.0, 1.0);
    }
    let non_negative = lo >= 0.0;
    if zero_based && non_negative {
        lo = 0.0;
    }
    // Half-width, computed without overflowing for extreme values.
    let half = hi * 0.5 - lo * 0.5;
    if half <= lo.abs().max(hi.abs()) * 1e-9 {
        // All (nearly) equal: center the value in a range of +-10% of it (or +-1 around 0).
        let v = hi;
        if v == 0.0 {
            return if zero_based { (0.0, 1.0) } else { (-1.0, 1.0) };
        }
        let spread = v.abs() * 0.1;
        return (clamp_finite(v - spread), clamp_finite(v + spread));
    }
    let pad = half * 0.1;
    let mut new_lo = if zero_based && non_negative {
        0.0
    } else {
        lo - pad
    };
    if non_negative && new_lo < 0.0 {
        new_lo = 0.0;
    }
    hi = clamp_finite(hi + pad);
    (clamp_finite(new_lo), hi)
}

fn clamp_finite(v: f64) -> f64 {
    v.clamp(-f64::MAX, f64::MAX)
}

/// Maps `v` from `[lo, hi]` onto `[a, b]` (overflow-safe; a degenerate range maps to the
/// middle).
fn lerp(v: f64, lo: f64, hi: f64, a: f64, b: f64) -> f64 {
    let den = hi * 0.5 - lo * 0.5;
    let t = if den > 0.0 && den.is_finite() {
        (v * 0.5 - lo * 0.5) / den
    } else {
        0.5
    };
    a + (b - a) * t
}

/// Tick positions on an axis.
#[derive(Debug, Clone, PartialEq)]
struct Ticks {
    /// Distance between ticks, `m * 10^exp` with `m` in {1, 2, 5}.
    step: f64,
    /// Decimal exponent of `step`, used to choose the label precision.
    exp: i32,
    /// Multiples of `step` inside `[lo, hi]`, ascending.
    values: Vec<f64>,
}

/// The finest step of the form 1, 2 or 5 times a power of ten that puts at most
/// `max_ticks` ticks in `[lo, hi]`, and those ticks. Gives no ticks for an invalid range.
fn nice_ticks(lo: f64, hi: f64, max_ticks: usize) -> Ticks {
    let none = Ticks {
        step: 0.0,
        exp: 0,
        values: Vec::new(),
    };
    if !(lo.is_finite() && hi.is_finite() && hi > lo && max_ticks >= 2) {
        return none;
    }
    let raw = (hi * 0.5 - lo * 0.5) / max_ticks as f64 * 2.0;
    if !(raw > 0.0 && raw.is_finite()) {
        return none;
    }
    let e0 = raw.log10().floor() as i32;
    for exp in e0 - 1..=e0 + 1 {
        for m in [1, 2, 5] {
            // Parsing gives the double nearest to m * 10^exp, unlike `powi`.
            let step: f64 = match format!("{m}e{exp}").parse() {
                Ok(s) => s,
                Err(_) => continue,
            };
            if !(step > 0.0 && step.is_finite()) {
                continue;
            }
            let first = (lo / step - 1e-9).ceil();
            let last = (hi / step + 1e-9).floor();
            let count = last - first + 1.0;
            if count.is_finite() && count <= max_ticks as f64 {
                let values = (0..count.max(0.0) as usize)
                    .map(|i| {
                        // Nearest double to k * m * 10^exp (avoids 1.5000000000000002e-5).
                        let k = (first + i as f64) * f64::from(m);
                        format!("{k}e{exp}")
                            .parse()
                            .unwrap_or(k * step / f64::from(m))
                    })
                    .collect();
                return Ticks { step, exp, values };
            }
        }
    }
    none
}

/// A compact tick label for `v`, a multiple of a step `m * 10^exp`: plain decimals with
/// just enough digits for the step ("0.25", "500"), k/M/G/T suffixes for large values
/// ("1.5k", "2M"), and scientific notation for very small or very large ones ("5e-6").
fn tick_label(v: f64, exp: i32) -> String {
    if !v.is_finite() {
        return String::new();
    }
    let a = v.abs();
    if a == 0.0 || a < 1e-16 * 10f64.powi(exp.max(-300)) {
        return "0".to_string();
    }
    if !(1e-4..1e15).contains(&a) {
        // Mantissa digits: enough to tell ticks `10^exp` apart.
        let ev = a.log10().floor() as i32;
        let digits = (ev - exp).clamp(0, 15) as usize;
        let s = format!("{v:.digits$e}");
        let (mantissa, e) = s.split_once('e').unwrap_or((&s, "0"));
        return format!("{}e{e}", trim_zeros(mantissa));
    }
    for (power, suffix) in [(12, "T"), (9, "G"), (6, "M"), (3, "k")] {
        let decimals = power - exp;
        if a >= 10f64.powi(power) && (decimals <= 1 || (a >= 1e5 && decimals <= 3)) {
            let scaled = v / 10f64.powi(power);
            return format!(
                "{}{suffix}",
                trim_zeros(&format!("{scaled:.0$}", decimals.max(0) as usize))
            );
        }
    }
    let decimals = (-exp).clamp(0, 17) as usize;
    trim_zeros(&format!("{v:.decimals$}"))
}

/// Drops trailing zeros after a decimal point (and the point), and a sign on zero.
fn trim_zeros(s: &str) -> String {
    let t = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.')
    } else {
        s
    };
    if t == "-0" {
        "0".to_string()
    } else {
        t.to_string()
    }
}

/// A coordinate or size with at most one decimal ("12", "12.5"); never NaN or infinite.
fn num(v: f64) -> String {
    let v = if v.is_finite() {
        v.clamp(-1e7, 1e7)
    } else {
        0.0
    };
    trim_zeros(&format!("{v:.1}"))
}

/// Approximate rendered width of `s` in a sans-serif font of size `font`.
fn text_width(s: &str, font: f64) -> f64 {
    s.chars().count() as f64 * font * 0.6
}

/// Escapes XML special characters and drops characters that XML 1.0 does not allow
/// (line breaks become spaces).
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            '\n' | '\r' | '\t' => out.push(' '),
            '\u{0}'..='\u{1f}' | '\u{fffe}' | '\u{ffff}' => {}
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, points: &[(f64, f64)]) -> Series {
        Series {
            name: name.to_string(),
            points: points.to_vec(),
        }
    }

    fn chart(series: Vec<Series>) -> Chart {
        Chart {
            title: "TTFT p90 vs load".to_string(),
            x_label: "offered load (req/s)".to_string(),
            y_label: "TTFT p90 (ms)".to_string(),
            series,
            subtitle: Some("workload=chat seed=7".to_string()),
        }
    }

    /// Structural checks every rendered SVG must pass.
    fn check_svg(svg: &str) {
        assert!(svg.starts_with("<svg"), "{svg}");
        assert!(svg.ends_with("</svg>"), "{svg}");
        assert_eq!(svg.matches("<svg").count(), 1);
        assert_eq!(
            svg.matches("<g>").count() + svg.matches("<g ").count(),
            svg.matches("</g>").count(),
            "unbalanced <g> in {svg}"
        );
        assert_eq!(svg.matches("<text").count(), svg.matches("</text>").count());
        assert_eq!(
            svg.matches("<title>").count(),
            svg.matches("</title>").count()
        );
        for bad in ["NaN", "nan", "inf", "Infinity"] {
            assert!(!svg.contains(bad), "{bad} in {svg}");
        }
        // Every '&' starts an entity.
        for (i, _) in svg.match_indices('&') {
            let rest = &svg[i..];
            assert!(
                ["&amp;", "&lt;", "&gt;", "&quot;", "&#39;"]
                    .iter()
                    .any(|e| rest.starts_with(e)),
                "raw & in {svg}"
            );
        }
    }

    fn example() -> Vec<Chart> {
        let curve = |scale: f64, knee: f64| -> Vec<(f64, f64)> {
            (1..=8)
                .map(|i| {
                    let load = i as f64;
                    let thr = 180.0 * load * scale;
                    let itl = 9.0 + 1.6 * load * load / knee;
                    (thr, 1000.0 / itl)
                })
                .collect()
        };
        let names = [
            ("agg-8 + round-robin", 1.0, 1.0),
            ("agg-8 + kv-aware", 1.08, 1.25),
            ("disagg-2P6D + round-robin", 1.15, 1.6),
            ("disagg-2P6D + kv-aware <overlap & load>", 1.22, 2.2),
        ];
        let panel = |title: &str, slow: f64| Chart {
            title: title.to_string(),
            x_label: "output throughput per GPU (tok/s)".to_string(),
            y_label: "interactivity (tok/s/user = 1000/ITL ms)".to_string(),
            series: names
                .iter()
                .map(|&(n, s, k)| Series {
                    name: n.to_string(),
                    points: curve(s, k / slow),
                })
                .collect(),
            subtitle: Some("workload=chat-mooncake, 8 GPUs, seed=7".to_string()),
        };
        vec![
            panel("Interactivity at p50 ITL", 1.0),
            panel("Interactivity at p90 ITL", 1.6),
        ]
    }

    #[test]
    fn renders_well_formed_deterministic_svg() {
        let c = chart(vec![
            series("a & <b>", &[(1.0, 10.0), (2.0, 30.0), (3.0, 20.0)]),
            series("\"quoted\" 'x'", &[(1.5, 5.0), (2.5, 7.0)]),
        ]);
        let svg = c.to_svg();
        check_svg(&svg);
        assert!(svg.contains("a &amp; &lt;b&gt;"));
        assert!(svg.contains("&quot;quoted&quot; &#39;x&#39;"));
        assert!(svg.contains("workload=chat seed=7"));
        assert_eq!(svg, c.to_svg());
        assert_eq!(svg.matches("<polyline").count(), 2);

        let charts = example();
        let a = panels_to_svg(&charts);
        check_svg(&a);
        assert_eq!(a, panels_to_svg(&charts));
        // One legend entry per distinct name, though each name is in both panels.
        assert_eq!(a.matches("agg-8 + kv-aware</text>").count(), 1);
        assert!(a.contains("&lt;overlap &amp; load&gt;"));
    }

    #[test]
    fn skips_non_finite_points() {
        let c = chart(vec![
            series(
                "s",
                &[
                    (1.0, f64::NAN),
                    (f64::INFINITY, 2.0),
                    (2.0, 3.0),
                    (3.0, f64::NEG_INFINITY),
                    (4.0, 5.0),
                ],
            ),
            series("all bad", &[(f64::NAN, f64::NAN)]),
        ]);
        let svg = c.to_svg();
        check_svg(&svg);
        assert_eq!(svg.matches("<polyline").count(), 1);
    }

    #[test]
    fn degenerate_inputs_do_not_panic() {
        let cases: Vec<Vec<Series>> = vec![
            vec![],
            vec![series("", &[])],
            vec![series("one", &[(3.0, 4.0)])],
            vec![series("zero", &[(0.0, 0.0)])],
            vec![series("flat", &[(1.0, 5.0), (2.0, 5.0), (3.0, 5.0)])],
            vec![series("vertical", &[(2.0, 1.0), (2.0, 3.0)])],
            vec![series("negative", &[(-5.0, -1.0), (-1.0, -3.0)])],
            vec![series(
                "huge",
                &[(-f64::MAX, f64::MAX), (f64::MAX, -f64::MAX)],
            )],
            vec![series("max", &[(f64::MAX, f64::MAX)])],
            vec![series("tiny", &[(5e-324, 1e-310), (1e-323, 2e-310)])],
            vec![series(
                "near",
                &[(1.0, 1000.0), (1.0 + 1e-12, 1000.0 + 1e-9)],
            )],
            vec![series("ctrl\u{1}\n", &[(1.0, 1.0), (2.0, 2.0)])],
        ];
        for s in cases {
            let c = Chart {
                series: s,
                ..Chart::default()
            };
            check_svg(&c.to_svg());
        }
        check_svg(&panels_to_svg(&[]));
        check_svg(&panels_to_svg(&[Chart::default(), Chart::default()]));
        assert!(Chart::default().to_svg().contains("no data"));
    }

    #[test]
    fn many_series_get_distinct_styles() {
        let styles: Vec<_> = (0..24).map(style).collect();
        for i in 0..styles.len() {
            for j in 0..i {
                assert_ne!(styles[i], styles[j], "series {i} and {j}");
            }
        }
        for (i, &marker) in MARKERS.iter().enumerate() {
            assert_eq!(style(i).1, marker);
        }
    }

    #[test]
    fn nice_tick_steps() {
        // (lo, hi, max ticks) -> (step, first tick, last tick, count)
        let table: &[(f64, f64, usize, f64, f64, f64, usize)] = &[
            (0.0, 1000.0, 8, 200.0, 0.0, 1000.0, 6),
            (0.0, 1050.0, 7, 200.0, 0.0, 1000.0, 6),
            (0.0, 1.0, 7, 0.2, 0.0, 1.0, 6),
            (0.0, 7.3, 8, 1.0, 0.0, 7.0, 8),
            (-3.0, 3.0, 7, 1.0, -3.0, 3.0, 7),
            (0.01, 0.027, 7, 0.005, 0.01, 0.025, 4),
            (1234.0, 5678.0, 7, 1000.0, 2000.0, 5000.0, 4),
            (0.0, 1.5e6, 7, 5e5, 0.0, 1.5e6, 4),
            (0.0, 2600.0, 8, 500.0, 0.0, 2500.0, 6),
            (95.0, 105.0, 8, 2.0, 96.0, 104.0, 5),
            (0.0, 3.2e-5, 7, 5e-6, 0.0, 3e-5, 7),
            (0.0, 3.2e-5, 5, 1e-5, 0.0, 3e-5, 4),
        ];
        for &(lo, hi, max, step, first, last, count) in table {
            let t = nice_ticks(lo, hi, max);
            let ctx = format!("[{lo}, {hi}] max {max}: {t:?}");
            assert!((t.step - step).abs() <= step * 1e-12, "{ctx}");
            assert_eq!(t.values.len(), count, "{ctx}");
            assert!((t.values[0] - first).abs() <= step * 1e-9, "{ctx}");
            assert!((t.values[count - 1] - last).abs() <= step * 1e-9, "{ctx}");
            assert!(t
                .values
                .iter()
                .all(|&v| v >= lo - step * 1e-6 && v <= hi + step * 1e-6));
        }
        // Any valid range gives between 2 and max ticks with a 1/2/5 step.
        for &(lo, hi) in &[
            (0.0, 1e-300),
            (-1e300, 1e300),
            (3.0, 3.000001),
            (0.0, 123456.0),
        ] {
            let t = nice_ticks(lo, hi, 7);
            assert!((2..=7).contains(&t.values.len()), "[{lo}, {hi}]: {t:?}");
            let mantissa = t.step / format!("1e{}", t.exp).parse::<f64>().unwrap();
            assert!(
                [1.0, 2.0, 5.0].iter().any(|m| (mantissa - m).abs() < 1e-9),
                "{t:?}"
            );
        }
        assert!(nice_ticks(1.0, 1.0, 7).values.is_empty());
        assert!(nice_ticks(f64::NAN, 1.0, 7).values.is_empty());
    }

    #[test]
    fn tick_labels_are_compact() {
        let table: &[(f64, i32, &str)] = &[
            (0.0, 2, "0"),
            (-0.0, 0, "0"),
            (250.0, 1, "250"),
            (500.0, 2, "500"),
            (1000.0, 2, "1k"),
            (1500.0, 2, "1.5k"),
            (12000.0, 3, "12k"),
            (1250.0, 1, "1250"),
            (1.21e6, 4, "1.21M"),
            (1010.0, 1, "1010"),
            (2e6, 6, "2M"),
            (2.5e9, 8, "2.5G"),
            (0.25, -2, "0.25"),
            (0.2, -1, "0.2"),
            (0.30000000000000004, -1, "0.3"),
            (-1.5, -1, "-1.5"),
            (7.0, 0, "7"),
            (1e-5, -5, "1e-5"),
            (2.5e-5, -6, "2.5e-5"),
            (3e20, 20, "3e20"),
            (1.2e-16, -17, "1.2e-16"),
        ];
        for &(v, exp, want) in table {
            assert_eq!(tick_label(v, exp), want, "tick_label({v}, {exp})");
        }
    }

    #[test]
    fn numbers_and_escaping() {
        assert_eq!(num(12.0), "12");
        assert_eq!(num(12.345), "12.3");
        assert_eq!(num(-0.04), "0");
        assert_eq!(num(f64::NAN), "0");
        assert_eq!(escape("a<b>&\"c'\u{7}"), "a&lt;b&gt;&amp;&quot;c&#39;");
        assert_eq!(data_range(&[], true), (0.0, 1.0));
        assert_eq!(data_range(&[5.0, 5.0], true).0, 0.0);
        let (lo, hi) = data_range(&[10.0, 20.0], false);
        assert!(lo < 10.0 && hi > 20.0 && lo >= 0.0);
    }

    /// `PLOT_EXAMPLE_SVG=/tmp/plot-example.svg cargo test -p sim plot::tests::write_example`
    /// writes an example two-panel chart for eyeballing.
    #[test]
    fn write_example() {
        if let Some(path) = std::env::var_os("PLOT_EXAMPLE_SVG") {
            std::fs::write(path, panels_to_svg(&example())).unwrap();
        }
    }
}
