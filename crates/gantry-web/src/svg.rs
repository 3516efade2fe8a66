//! Plots as inline SVG, drawn on the server: a page that shows a plot needs no script and
//! fetches nothing. Three kinds serve every page: a scatter (estimate against actual, with
//! the line where they are equal), lines over time (queue depth), and lanes of bars (an
//! invocation's actions per worker). Every label goes through maud, so it is escaped.

use maud::{html, Markup};

/// Plot area in pixels, inside margins for the axes' labels.
const WIDTH: f64 = 760.0;
const LEFT: f64 = 64.0;
const RIGHT: f64 = 16.0;
const TOP: f64 = 12.0;
const BOTTOM: f64 = 40.0;

/// Colours for series and bars, told apart also by their legend.
pub const PALETTE: [&str; 8] = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];

/// A linear map from data values to pixels.
#[derive(Debug, Clone, Copy)]
pub struct Scale {
    lo: f64,
    hi: f64,
    px_lo: f64,
    px_hi: f64,
}

impl Scale {
    /// Maps `[lo, hi]` onto `[px_lo, px_hi]`; an empty or inverted range is widened so
    /// every value still has a place.
    pub fn new(lo: f64, hi: f64, px_lo: f64, px_hi: f64) -> Self {
        let (lo, hi) =
            if lo.is_finite() && hi.is_finite() && hi > lo { (lo, hi) } else { (lo.min(0.0), lo.max(0.0) + 1.0) };
        Scale { lo, hi, px_lo, px_hi }
    }

    pub fn at(&self, v: f64) -> f64 {
        let v = v.clamp(self.lo, self.hi);
        self.px_lo + (v - self.lo) / (self.hi - self.lo) * (self.px_hi - self.px_lo)
    }

    /// About `n` round tick values inside the range (steps of 1, 2 or 5 × 10^k).
    pub fn ticks(&self, n: usize) -> Vec<f64> {
        let span = self.hi - self.lo;
        let raw = span / n.max(1) as f64;
        let mag = 10f64.powf(raw.log10().floor());
        let step =
            [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * mag).find(|s| *s >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * mag);
        // Each tick as a whole multiple of the step, so errors do not add up.
        let first = (self.lo / step - 1e-9).ceil() as i64;
        (first..).map(|k| k as f64 * step).take_while(|t| *t <= self.hi + step * 1e-9).take(2 * n + 2).collect()
    }
}

/// A tick label: integers plainly, else two significant decimals at most.
pub fn tick_label(v: f64) -> String {
    if (v - v.round()).abs() < 1e-9 {
        format!("{}", v.round() as i64)
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

/// Labels for ticks `step` apart: as many decimals as the step needs, so that small
/// ranges (0.005, 0.010, 0.015) do not print the same label twice.
pub fn tick_labels(ticks: &[f64]) -> Vec<String> {
    let step = match ticks {
        [a, b, ..] => (b - a).abs(),
        _ => return ticks.iter().map(|t| tick_label(*t)).collect(),
    };
    let decimals = if step > 0.0 { (-step.log10().floor()).max(0.0) as usize } else { 0 };
    ticks.iter().map(|t| if decimals == 0 { tick_label(*t) } else { format!("{t:.decimals$}") }).collect()
}

fn axes(x: &Scale, y: &Scale, height: f64, x_label: &str, y_label: &str, x_fmt: &dyn Fn(f64) -> String) -> Markup {
    let bottom = height - BOTTOM;
    html! {
        line x1=(LEFT) y1=(bottom) x2=(WIDTH - RIGHT) y2=(bottom) stroke="#444" {}
        line x1=(LEFT) y1=(TOP) x2=(LEFT) y2=(bottom) stroke="#444" {}
        @for t in x.ticks(6) {
            line x1=(x.at(t)) y1=(bottom) x2=(x.at(t)) y2=(bottom + 4.0) stroke="#444" {}
            text x=(x.at(t)) y=(bottom + 16.0) text-anchor="middle" font-size="11" { (x_fmt(t)) }
        }
        @let yt = y.ticks(5);
        @for (t, label) in yt.iter().zip(tick_labels(&yt)) {
            line x1=(LEFT - 4.0) y1=(y.at(*t)) x2=(WIDTH - RIGHT) y2=(y.at(*t)) stroke="#eee" {}
            text x=(LEFT - 6.0) y=(y.at(*t) + 4.0) text-anchor="end" font-size="11" { (label) }
        }
        text x=((LEFT + WIDTH - RIGHT) / 2.0) y=(height - 6.0) text-anchor="middle" font-size="12" { (x_label) }
        text x="12" y=((TOP + bottom) / 2.0) text-anchor="middle" font-size="12"
            transform=(format!("rotate(-90 12 {})", (TOP + bottom) / 2.0)) { (y_label) }
    }
}

/// One point of a scatter: where it is, its hover text, and its colour's index.
#[derive(Debug, Clone)]
pub struct Point {
    pub x: f64,
    pub y: f64,
    pub title: String,
    pub series: usize,
}

/// Points on shared axes starting at 0, with the diagonal y = x drawn when `diagonal`
/// (estimate against actual: points above it were underestimated).
pub fn scatter(points: &[Point], x_label: &str, y_label: &str, diagonal: bool) -> Markup {
    let height = 360.0;
    let max_x = points.iter().map(|p| p.x).fold(0.0, f64::max);
    let max_y = points.iter().map(|p| p.y).fold(0.0, f64::max);
    let (max_x, max_y) = if diagonal { (max_x.max(max_y), max_x.max(max_y)) } else { (max_x, max_y) };
    let x = Scale::new(0.0, max_x * 1.05, LEFT, WIDTH - RIGHT);
    let y = Scale::new(0.0, max_y * 1.05, height - BOTTOM, TOP);
    html! {
        svg class="plot" viewBox=(format!("0 0 {WIDTH} {height}")) width=(WIDTH) height=(height) role="img"
            aria-label=(format!("{y_label} against {x_label}")) {
            (axes(&x, &y, height, x_label, y_label, &tick_label))
            @if diagonal {
                line x1=(x.at(0.0)) y1=(y.at(0.0)) x2=(x.at(max_x * 1.05)) y2=(y.at(max_x * 1.05))
                    stroke="#999" stroke-dasharray="4 3" {}
            }
            @for p in points {
                circle cx=(x.at(p.x)) cy=(y.at(p.y)) r="3.5" fill=(PALETTE[p.series % PALETTE.len()]) fill-opacity="0.75" {
                    title { (p.title) }
                }
            }
        }
    }
}

/// One line of a [`lines`] plot: its name for the legend and its points (x ascending).
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Step lines over a shared x axis (y from 0), e.g. queue depth over time; `x_fmt`
/// labels the x ticks.
pub fn lines(series: &[Series], x_label: &str, y_label: &str, x_fmt: &dyn Fn(f64) -> String) -> Markup {
    let height = 280.0;
    let all = || series.iter().flat_map(|s| s.points.iter());
    let (lo, hi) = all().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
    let max_y = all().map(|p| p.1).fold(0.0, f64::max).max(1.0);
    let x = Scale::new(lo, hi, LEFT, WIDTH - RIGHT);
    let y = Scale::new(0.0, max_y * 1.1, height - BOTTOM, TOP);
    let path = |s: &Series| {
        let mut d = String::new();
        let mut last: Option<f64> = None;
        for &(px, py) in &s.points {
            match last {
                None => d.push_str(&format!("M{:.1},{:.1}", x.at(px), y.at(py))),
                Some(prev) => {
                    d.push_str(&format!(" L{:.1},{:.1} L{:.1},{:.1}", x.at(px), y.at(prev), x.at(px), y.at(py)))
                }
            }
            last = Some(py);
        }
        d
    };
    html! {
        svg class="plot" viewBox=(format!("0 0 {WIDTH} {height}")) width=(WIDTH) height=(height) role="img"
            aria-label=(format!("{y_label} over {x_label}")) {
            (axes(&x, &y, height, x_label, y_label, x_fmt))
            @for (i, s) in series.iter().enumerate() {
                path d=(path(s)) fill="none" stroke=(PALETTE[i % PALETTE.len()]) stroke-width="1.5" { title { (s.name) } }
            }
        }
        (legend(series.iter().map(|s| s.name.as_str())))
    }
}

/// Coloured names matching the palette's order.
pub fn legend<'a>(names: impl Iterator<Item = &'a str>) -> Markup {
    html! {
        p class="legend" {
            @for (i, n) in names.enumerate() {
                span style=(format!("color:{}", PALETTE[i % PALETTE.len()])) { "■ " } (n) " "
            }
        }
    }
}

/// One bar of a [`lanes`] plot, in seconds from the plot's start.
#[derive(Debug, Clone)]
pub struct Bar {
    pub lane: String,
    pub start: f64,
    pub end: f64,
    pub title: String,
    /// Drawn emphasised (the critical path).
    pub marked: bool,
    /// Where a click on the bar goes.
    pub link: Option<String>,
    pub series: usize,
}

/// Bars on lanes: each distinct `lane` gets rows enough that its overlapping bars never
/// cover each other (a worker with four slots shows up to four rows).
pub fn lanes(bars: &[Bar], x_label: &str) -> Markup {
    // Lanes in first-seen order; inside a lane, each bar takes the first row free at its start.
    let mut names: Vec<&str> = Vec::new();
    let mut rows: Vec<Vec<f64>> = Vec::new(); // per lane: each row's end
    let mut placed = Vec::with_capacity(bars.len());
    let mut order: Vec<usize> = (0..bars.len()).collect();
    order.sort_by(|&a, &b| bars[a].start.total_cmp(&bars[b].start));
    for &i in &order {
        let b = &bars[i];
        let lane = match names.iter().position(|n| *n == b.lane) {
            Some(l) => l,
            None => {
                names.push(&b.lane);
                rows.push(Vec::new());
                names.len() - 1
            }
        };
        let row = match rows[lane].iter().position(|end| *end <= b.start) {
            Some(r) => r,
            None => {
                rows[lane].push(0.0);
                rows[lane].len() - 1
            }
        };
        rows[lane][row] = b.end;
        placed.push((i, lane, row));
    }
    let row_h = 14.0;
    let first_row: Vec<usize> = rows
        .iter()
        .scan(0, |acc, r| {
            let at = *acc;
            *acc += r.len().max(1);
            Some(at)
        })
        .collect();
    let total_rows: usize = rows.iter().map(|r| r.len().max(1)).sum();
    let label_w = 150.0;
    let height = TOP + total_rows as f64 * row_h + BOTTOM;
    let end = bars.iter().map(|b| b.end).fold(0.0, f64::max);
    let x = Scale::new(0.0, end.max(0.001), label_w, WIDTH - RIGHT);
    let bottom = height - BOTTOM;
    html! {
        svg class="plot" viewBox=(format!("0 0 {WIDTH} {height}")) width=(WIDTH) height=(height) role="img"
            aria-label="timeline" {
            @for (l, name) in names.iter().enumerate() {
                @let y0 = TOP + first_row[l] as f64 * row_h;
                rect x="0" y=(y0) width=(WIDTH) height=(rows[l].len().max(1) as f64 * row_h)
                    fill=(if l % 2 == 0 { "#fafafa" } else { "#f0f0f0" }) {}
                text x="4" y=(y0 + 11.0) font-size="11" { (crate::pages::shorten(name, 22)) }
            }
            line x1=(label_w) y1=(bottom) x2=(WIDTH - RIGHT) y2=(bottom) stroke="#444" {}
            @for t in x.ticks(6) {
                line x1=(x.at(t)) y1=(TOP) x2=(x.at(t)) y2=(bottom + 4.0) stroke="#ddd" {}
                text x=(x.at(t)) y=(bottom + 16.0) text-anchor="middle" font-size="11" { (tick_label(t)) }
            }
            text x=((label_w + WIDTH - RIGHT) / 2.0) y=(height - 6.0) text-anchor="middle" font-size="12" { (x_label) }
            @for &(i, lane, row) in &placed {
                @let b = &bars[i];
                @let y0 = TOP + (first_row[lane] + row) as f64 * row_h + 2.0;
                @let w = (x.at(b.end) - x.at(b.start)).max(1.5);
                @let bar = html! {
                    rect x=(x.at(b.start)) y=(y0) width=(w) height=(row_h - 4.0)
                        fill=(PALETTE[b.series % PALETTE.len()])
                        stroke=(if b.marked { "#000" } else { "none" }) stroke-width=(if b.marked { "2" } else { "0" })
                        class=(if b.marked { "critical" } else { "bar" }) { title { (b.title) } }
                };
                @match &b.link {
                    Some(href) => a href=(href) { (bar) },
                    None => (bar),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_inside_the_range() {
        let s = Scale::new(0.0, 97.0, 0.0, 100.0);
        assert_eq!(s.ticks(5), vec![0.0, 20.0, 40.0, 60.0, 80.0]);
        let s = Scale::new(0.3, 0.9, 0.0, 100.0);
        let t = s.ticks(3);
        assert_eq!(t.len(), 3, "{t:?}");
        assert!(t.iter().zip([0.4, 0.6, 0.8]).all(|(a, b)| (a - b).abs() < 1e-9), "{t:?}");
        // An empty range still maps somewhere.
        let s = Scale::new(5.0, 5.0, 0.0, 10.0);
        assert!(s.at(5.0).is_finite());
        assert_eq!(Scale::new(0.0, 10.0, 100.0, 0.0).at(2.5), 75.0);
        assert_eq!(tick_label(20.0), "20");
        assert_eq!(tick_label(0.25), "0.25");
        assert_eq!(tick_labels(&[0.0, 0.005, 0.01, 0.015]), ["0.000", "0.005", "0.010", "0.015"]);
        assert_eq!(tick_labels(&[0.0, 20.0, 40.0]), ["0", "20", "40"]);
    }

    #[test]
    fn overlapping_bars_of_a_lane_take_separate_rows() {
        let bar = |lane: &str, start: f64, end: f64| Bar {
            lane: lane.into(),
            start,
            end,
            title: "<script>x</script>".into(),
            marked: false,
            link: None,
            series: 0,
        };
        let svg = lanes(&[bar("w1", 0.0, 2.0), bar("w1", 1.0, 3.0), bar("w1", 2.0, 4.0), bar("w2", 0.0, 1.0)], "s")
            .into_string();
        // w1 needs two rows (the third bar reuses the first's), w2 one: three rows of 14 px.
        let ys: std::collections::BTreeSet<String> = svg
            .match_indices("class=\"bar\"")
            .map(|(i, _)| {
                let before = &svg[..i];
                let y = before.rfind(" y=\"").unwrap();
                before[y + 4..].split('"').next().unwrap().to_string()
            })
            .collect();
        assert_eq!(ys.len(), 3, "{ys:?}");
        assert!(!svg.contains("<script>") && svg.contains("&lt;script&gt;"));
    }

    #[test]
    fn a_scatter_escapes_titles_and_draws_every_point() {
        let pts: Vec<Point> =
            (0..5).map(|i| Point { x: i as f64, y: 2.0 * i as f64, title: format!("<b>{i}</b>"), series: i }).collect();
        let svg = scatter(&pts, "actual", "estimate", true).into_string();
        assert_eq!(svg.matches("<circle").count(), 5);
        assert!(svg.contains("stroke-dasharray"), "the diagonal");
        assert!(!svg.contains("<b>"));
        let empty = scatter(&[], "a", "b", false).into_string();
        assert!(empty.contains("<svg") && !empty.contains("NaN"));
        let l = lines(&[Series { name: "q".into(), points: vec![(0.0, 1.0), (1.0, 3.0)] }], "t", "n", &tick_label)
            .into_string();
        assert!(l.contains("M") && !l.contains("NaN"));
    }
}
