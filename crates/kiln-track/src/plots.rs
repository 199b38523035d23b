//! Metric curves as PNG and SVG (plotters), drawn from `metrics.jsonl` rows.
//!
//! Text uses the DejaVu Sans font embedded through the `dejavu` crate (plotters' `ab_glyph` backend), so plots
//! render identically on a bare machine without system fonts or fontconfig.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::TrackError;
use crate::jsonl::MetricsRow;

/// Metrics drawn first (and in the overview), in this order, when present.
pub const CURATED: &[&str] = &[
    "reward/mean",
    "kl/approx",
    "kl/ref",
    "loss/kl",
    "entropy",
    "response_len/mean",
    "clip_frac",
    "lr",
    "loss/policy",
    "grad_norm",
    "reward/std",
    "adv/mean",
    "adv/std",
];

/// Pixel size of single-metric PNG/SVG charts.
pub const CHART_SIZE: (u32, u32) = (800, 480);
/// Pixel size of the overview grid.
pub const OVERVIEW_SIZE: (u32, u32) = (1500, 900);

const FONT: &str = "sans-serif";

fn register_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        if plotters::style::register_font(FONT, FontStyle::Normal, dejavu::sans::regular()).is_err()
        {
            tracing::warn!("plots: the embedded DejaVu font did not load; labels may be missing");
        }
        let _ = plotters::style::register_font(FONT, FontStyle::Bold, dejavu::sans::bold());
    });
}

/// One drawn chart.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotFile {
    /// The metric key (or `overview`).
    pub key: String,
    /// The PNG, relative to the run directory (`plots/<name>.png`).
    pub png: PathBuf,
    /// The SVG, relative to the run directory.
    pub svg: PathBuf,
}

/// A metric's series: (step, value) with non-finite values kept (they are skipped when drawing).
type Series = Vec<(f64, f64)>;

/// Every numeric key of the rows in plotting order: curated keys first, then `eval/*`, then the rest sorted.
pub fn plot_order(rows: &[MetricsRow]) -> Vec<String> {
    let mut keys: Vec<String> = rows
        .iter()
        .flat_map(|r| r.values.keys().cloned())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let rank = |k: &str| {
        if let Some(i) = CURATED.iter().position(|c| *c == k) {
            (0, i)
        } else if k.starts_with("eval/") {
            (1, 0)
        } else {
            (2, 0)
        }
    };
    keys.sort_by(|a, b| rank(a).cmp(&rank(b)).then_with(|| a.cmp(b)));
    keys
}

fn series(rows: &[MetricsRow], key: &str) -> Series {
    rows.iter()
        .filter_map(|r| r.values.get(key).map(|v| (r.step as f64, *v)))
        .collect()
}

/// A file-name-safe stem for a metric key (`reward/mean` -> `reward_mean`).
pub fn file_stem(key: &str) -> String {
    let s: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() { "metric".into() } else { s }
}

/// Draw every metric (one PNG + SVG each) and an overview grid into `<run_dir>/plots/`. Returns the files in
/// report order (the overview first). Keys without a single finite value are skipped. `run_name`
/// heads the overview and prefixes every chart's title, so a plot copied out of its run still says
/// which run it shows.
pub fn write_plots(
    run_dir: &Path,
    rows: &[MetricsRow],
    run_name: &str,
) -> Result<Vec<PlotFile>, TrackError> {
    register_fonts();
    let dir = run_dir.join("plots");
    std::fs::create_dir_all(&dir).map_err(|e| TrackError::io(&dir, e))?;
    let mut all: Vec<(String, Series)> = plot_order(rows)
        .into_iter()
        .map(|k| {
            let s = series(rows, &k);
            (k, s)
        })
        .filter(|(_, s)| s.iter().any(|(_, v)| v.is_finite()))
        .collect();
    let mut out = Vec::new();
    let overview: Vec<&(String, Series)> = {
        let mut v: Vec<&(String, Series)> = all
            .iter()
            .filter(|(k, _)| CURATED[..8].contains(&k.as_str()) || k.starts_with("eval/"))
            .take(6)
            .collect();
        if v.is_empty() {
            v = all.iter().take(6).collect();
        }
        v
    };
    if !overview.is_empty() {
        let png = dir.join("overview.png");
        let svg = dir.join("overview.svg");
        draw_grid(
            BitMapBackend::new(&png, OVERVIEW_SIZE).into_drawing_area(),
            run_name,
            &overview,
        )
        .map_err(|msg| TrackError::Plot {
            path: png.clone(),
            msg,
        })?;
        draw_grid(
            SVGBackend::new(&svg, OVERVIEW_SIZE).into_drawing_area(),
            run_name,
            &overview,
        )
        .map_err(|msg| TrackError::Plot {
            path: svg.clone(),
            msg,
        })?;
        out.push(PlotFile {
            key: "overview".into(),
            png: PathBuf::from("plots/overview.png"),
            svg: PathBuf::from("plots/overview.svg"),
        });
    }
    let mut used = std::collections::BTreeSet::from(["overview".to_string()]);
    for (key, s) in all.drain(..) {
        let mut stem = file_stem(&key);
        let mut n = 1;
        while !used.insert(stem.clone()) {
            n += 1;
            stem = format!("{}_{n}", file_stem(&key));
        }
        let png = dir.join(format!("{stem}.png"));
        let svg = dir.join(format!("{stem}.svg"));
        let title = if run_name.is_empty() {
            key.clone()
        } else {
            format!("{run_name}: {key}")
        };
        draw_chart(
            BitMapBackend::new(&png, CHART_SIZE).into_drawing_area(),
            &title,
            &s,
            22,
        )
        .map_err(|msg| TrackError::Plot {
            path: png.clone(),
            msg,
        })?;
        draw_chart(
            SVGBackend::new(&svg, CHART_SIZE).into_drawing_area(),
            &title,
            &s,
            22,
        )
        .map_err(|msg| TrackError::Plot {
            path: svg.clone(),
            msg,
        })?;
        out.push(PlotFile {
            key,
            png: PathBuf::from(format!("plots/{stem}.png")),
            svg: PathBuf::from(format!("plots/{stem}.svg")),
        });
    }
    Ok(out)
}

fn draw_grid<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    run_name: &str,
    charts: &[&(String, Series)],
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    let root = if run_name.is_empty() {
        root
    } else {
        root.titled(run_name, (FONT, 26).into_font())
            .map_err(|e| e.to_string())?
    };
    let cols = if charts.len() <= 2 { charts.len() } else { 3 };
    let rows = charts.len().div_ceil(cols);
    let areas = root.split_evenly((rows, cols));
    for (area, (key, s)) in areas.into_iter().zip(charts.iter().map(|c| (&c.0, &c.1))) {
        draw_on(&area, key, s, 18)?;
    }
    root.present().map_err(|e| e.to_string())
}

fn draw_chart<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    key: &str,
    s: &Series,
    font: u32,
) -> Result<(), String> {
    root.fill(&WHITE).map_err(|e| e.to_string())?;
    draw_on(&root, key, s, font)?;
    root.present().map_err(|e| e.to_string())
}

/// Exponential moving average over the finite values (for a smoothed line over noisy curves).
fn ema(points: &[(f64, f64)], span: f64) -> Vec<(f64, f64)> {
    let alpha = 2.0 / (span + 1.0);
    let mut acc: Option<f64> = None;
    points
        .iter()
        .map(|&(x, y)| {
            let a = acc.map_or(y, |a| a + alpha * (y - a));
            acc = Some(a);
            (x, a)
        })
        .collect()
}

fn draw_on<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    key: &str,
    s: &Series,
    font: u32,
) -> Result<(), String> {
    // Keep the range finite and non-empty even for extreme values (|v| near f64::MAX).
    const LIM: f64 = f64::MAX / 8.0;
    let finite: Vec<(f64, f64)> = s
        .iter()
        .filter(|(_, v)| v.is_finite())
        .map(|&(x, v)| (x, v.clamp(-LIM, LIM)))
        .collect();
    let bad = s.len() - finite.len();
    let (mut x0, mut x1) = finite
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (x, _)| {
            (a.min(*x), b.max(*x))
        });
    let (mut y0, mut y1) = finite
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), (_, y)| {
            (a.min(*y), b.max(*y))
        });
    if x0 >= x1 {
        x0 -= 1.0;
        x1 += 1.0;
    }
    y0 = y0.clamp(-LIM, LIM);
    y1 = y1.clamp(-LIM, LIM);
    if y0 >= y1 {
        let d = if y0 == 0.0 { 1.0 } else { y0.abs() * 0.1 };
        y0 -= d;
        y1 += d;
    } else {
        let pad = (y1 / 2.0 - y0 / 2.0) * 0.1;
        y0 -= pad;
        y1 += pad;
    }
    let title = if bad > 0 {
        format!("{key}  ({bad} non-finite)")
    } else {
        key.to_string()
    };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, font).into_font())
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(x0..x1, y0..y1)
        .map_err(|e| e.to_string())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .label_style((FONT, 14).into_font())
        .axis_desc_style((FONT, 14).into_font())
        .y_label_formatter(&|v| crate::console::short(*v))
        .x_label_formatter(&|v| format!("{}", v.round() as i64))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()
        .map_err(|e| e.to_string())?;
    // Draw finite runs as separate segments so that a NaN leaves a visible gap.
    let smooth = finite.len() >= 30;
    let raw_color = if smooth {
        RGBColor(150, 180, 225)
    } else {
        RGBColor(31, 119, 180)
    };
    let mut segment: Vec<(f64, f64)> = Vec::new();
    let mut segments = Vec::new();
    for &(x, y) in s {
        let y = if y.is_finite() { y.clamp(-LIM, LIM) } else { y };
        if y.is_finite() {
            segment.push((x, y));
        } else if !segment.is_empty() {
            segments.push(std::mem::take(&mut segment));
        }
    }
    if !segment.is_empty() {
        segments.push(segment);
    }
    for seg in &segments {
        if seg.len() == 1 {
            chart
                .draw_series(std::iter::once(Circle::new(seg[0], 2, raw_color.filled())))
                .map_err(|e| e.to_string())?;
        } else {
            chart
                .draw_series(LineSeries::new(
                    seg.iter().copied(),
                    raw_color.stroke_width(1),
                ))
                .map_err(|e| e.to_string())?;
        }
    }
    if smooth {
        let span = (finite.len() as f64 / 20.0).clamp(5.0, 100.0);
        chart
            .draw_series(LineSeries::new(
                ema(&finite, span),
                RGBColor(31, 119, 180).stroke_width(2),
            ))
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Last, min, max and mean of every key over finite values, plus the count of non-finite values.
#[derive(Debug, Clone, PartialEq)]
pub struct KeyStats {
    /// Last logged value (may be non-finite).
    pub last: f64,
    /// Step of the last value.
    pub last_step: u64,
    /// Minimum finite value.
    pub min: f64,
    /// Maximum finite value.
    pub max: f64,
    /// Mean of the finite values.
    pub mean: f64,
    /// Number of values.
    pub count: usize,
    /// Number of NaN/infinite values.
    pub non_finite: usize,
}

/// Statistics of every key.
pub fn key_stats(rows: &[MetricsRow]) -> BTreeMap<String, KeyStats> {
    let mut out: BTreeMap<String, KeyStats> = BTreeMap::new();
    for r in rows {
        for (k, &v) in &r.values {
            let st = out.entry(k.clone()).or_insert(KeyStats {
                last: v,
                last_step: r.step,
                min: f64::INFINITY,
                max: f64::NEG_INFINITY,
                mean: 0.0,
                count: 0,
                non_finite: 0,
            });
            st.last = v;
            st.last_step = r.step;
            st.count += 1;
            if v.is_finite() {
                st.min = st.min.min(v);
                st.max = st.max.max(v);
                st.mean += v; // sum for now
            } else {
                st.non_finite += 1;
            }
        }
    }
    for st in out.values_mut() {
        let n = st.count - st.non_finite;
        st.mean = if n > 0 { st.mean / n as f64 } else { f64::NAN };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(vals: &[(&str, &[f64])]) -> Vec<MetricsRow> {
        let n = vals.iter().map(|(_, v)| v.len()).max().unwrap_or(0);
        (0..n)
            .map(|i| MetricsRow {
                step: i as u64 * 1_000_000_000,
                values: vals
                    .iter()
                    .filter_map(|(k, v)| v.get(i).map(|x| (k.to_string(), *x)))
                    .collect(),
            })
            .collect()
    }

    #[test]
    fn extreme_and_degenerate_series_draw_without_panicking() {
        let dir = tempfile::tempdir().unwrap();
        let r = rows(&[
            ("huge", &[f64::MAX, -f64::MAX, 1.0, f64::MIN_POSITIVE]),
            ("constant", &[2.0, 2.0, 2.0]),
            ("single", &[5.0]),
            ("zero", &[0.0, 0.0]),
            ("all_nan", &[f64::NAN, f64::INFINITY]),
            ("gaps", &[1.0, f64::NAN, 3.0, f64::NEG_INFINITY]),
        ]);
        let files = write_plots(dir.path(), &r, "plot-test").unwrap();
        let keys: Vec<&str> = files.iter().map(|f| f.key.as_str()).collect();
        assert!(!keys.contains(&"all_nan"), "{keys:?}");
        for f in &files {
            assert!(dir.path().join(&f.png).is_file() && dir.path().join(&f.svg).is_file());
        }
        let stats = key_stats(&r);
        assert_eq!(stats["gaps"].non_finite, 2);
        assert_eq!(stats["gaps"].last, f64::NEG_INFINITY);
        assert_eq!(stats["gaps"].mean, 2.0);
        assert!(stats["all_nan"].mean.is_nan());
    }

    #[test]
    fn curated_keys_first_then_eval_then_rest() {
        let r = rows(&[
            ("zeta", &[1.0]),
            ("eval/em", &[1.0]),
            ("entropy", &[1.0]),
            ("reward/mean", &[1.0]),
        ]);
        assert_eq!(
            plot_order(&r),
            vec!["reward/mean", "entropy", "eval/em", "zeta"]
        );
        assert_eq!(file_stem("reward/mean"), "reward_mean");
    }
}
