//! Model evaluation against history (design section V-D): RMSE overall and
//! by bins of actual usage, split into over- and under-estimates, with a
//! plain-text table printer for the CLI.

use crate::error::Result;
use crate::features::BuildTargetValues;
use crate::history::BuildRecord;
use crate::label::{parse_label, Label};
use crate::model::Models;
use crate::types::GB;
use serde::{Deserialize, Serialize};
use std::fmt;

/// Count and RMSE of a set of errors.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ErrStat {
    pub count: usize,
    pub rmse: f64,
}

#[derive(Debug, Clone, Copy, Default)]
struct Acc {
    n: usize,
    sq: f64,
}

impl Acc {
    fn add(&mut self, e: f64) {
        self.n += 1;
        self.sq += e * e;
    }
    fn stat(self) -> ErrStat {
        ErrStat { count: self.n, rmse: if self.n == 0 { 0.0 } else { (self.sq / self.n as f64).sqrt() } }
    }
}

/// Errors of builds whose *actual* usage fell in `[lo, hi)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BinStat {
    pub lo: f64,
    pub hi: f64,
    pub all: ErrStat,
    /// Estimate > actual.
    pub over: ErrStat,
    /// Estimate < actual.
    pub under: ErrStat,
}

/// Error breakdown of one model (values in `unit`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBreakdown {
    pub unit: String,
    pub all: ErrStat,
    pub over: ErrStat,
    pub under: ErrStat,
    pub bins: Vec<BinStat>,
}

impl ErrorBreakdown {
    /// `pairs` are (actual, estimate) in `unit`; bins of width `width` from
    /// 0 up to `top`, plus one open bin `[top, inf)`.
    pub fn from_pairs(unit: &str, pairs: &[(f64, f64)], width: f64, top: f64) -> Self {
        let nbins = (top / width).ceil() as usize + 1;
        let mut bins = vec![(Acc::default(), Acc::default(), Acc::default()); nbins];
        let (mut all, mut over, mut under) = (Acc::default(), Acc::default(), Acc::default());
        for &(actual, est) in pairs {
            let e = est - actual;
            let b = ((actual.max(0.0) / width) as usize).min(nbins - 1);
            all.add(e);
            bins[b].0.add(e);
            if e > 0.0 {
                over.add(e);
                bins[b].1.add(e);
            } else if e < 0.0 {
                under.add(e);
                bins[b].2.add(e);
            }
        }
        ErrorBreakdown {
            unit: unit.to_string(),
            all: all.stat(),
            over: over.stat(),
            under: under.stat(),
            bins: bins
                .into_iter()
                .enumerate()
                .filter(|(_, b)| b.0.n > 0)
                .map(|(i, b)| BinStat {
                    lo: i as f64 * width,
                    hi: if i + 1 == nbins { f64::INFINITY } else { (i + 1) as f64 * width },
                    all: b.0.stat(),
                    over: b.1.stat(),
                    under: b.2.stat(),
                })
                .collect(),
        }
    }
}

/// Evaluation of [`Models`] on a history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EvalReport {
    pub builds: usize,
    /// Builds skipped (invalid label, or model error).
    pub skipped: usize,
    /// Memory in GB, 1 GB bins up to 13 GB.
    pub memory: Option<ErrorBreakdown>,
    /// Occupancy in ESU, 50 ESU bins up to 600 ESU.
    pub occupancy: Option<ErrorBreakdown>,
}

/// Evaluate models on history records (typically a window the models were
/// not trained on). Estimates are set-semantics predictions of exactly the
/// recorded target list.
pub fn eval(models: &Models, history: &[BuildRecord]) -> Result<EvalReport> {
    let mut mem_pairs = Vec::new();
    let mut occ_pairs = Vec::new();
    let mut skipped = 0;
    for r in history {
        let parsed: Result<Vec<Label<'_>>> = r.targets.iter().map(|t| parse_label(t)).collect();
        let Ok(parsed) = parsed else {
            skipped += 1;
            continue;
        };
        let ctx = r.context();
        let mut ok = true;
        // The model the planner uses: the shared-cost one when there is one.
        if let Some(shared) = &models.shared {
            let labels: Vec<&str> = r.targets.iter().map(String::as_str).collect();
            match shared.estimate(&ctx, &labels) {
                Ok((mem, occ)) => {
                    mem_pairs.push((r.peak_memory_bytes as f64 / GB as f64, mem / GB as f64));
                    if let Some(actual) = r.occupancy_esu() {
                        occ_pairs.push((actual, occ));
                    }
                }
                Err(_) => skipped += 1,
            }
            continue;
        }
        let btv = BuildTargetValues::from_labels(parsed.iter());
        if let Some(m) = &models.memory {
            match m.predict_values(&ctx, &btv) {
                Ok(est) => mem_pairs.push((r.peak_memory_bytes as f64 / GB as f64, est / GB as f64)),
                Err(_) => ok = false,
            }
        }
        if let (Some(o), Some(actual)) = (&models.occupancy, r.occupancy_esu()) {
            match o.predict_values(&ctx, &btv) {
                Ok(est) => occ_pairs.push((actual, est)),
                Err(_) => ok = false,
            }
        }
        if !ok {
            skipped += 1;
        }
    }
    Ok(EvalReport {
        builds: history.len(),
        skipped,
        memory: models.memory.as_ref().map(|_| ErrorBreakdown::from_pairs("GB", &mem_pairs, 1.0, 13.0)),
        occupancy: models.occupancy.as_ref().map(|_| ErrorBreakdown::from_pairs("ESU", &occ_pairs, 50.0, 600.0)),
    })
}

impl fmt::Display for ErrorBreakdown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{:>16} {:>8} {:>10} {:>8} {:>10} {:>8} {:>10}",
            format!("actual ({})", self.unit),
            "builds",
            "rmse",
            "over",
            "rmse_over",
            "under",
            "rmse_under"
        )?;
        let row = |f: &mut fmt::Formatter<'_>, name: String, a: ErrStat, o: ErrStat, u: ErrStat| {
            writeln!(
                f,
                "{:>16} {:>8} {:>10.3} {:>8} {:>10.3} {:>8} {:>10.3}",
                name, a.count, a.rmse, o.count, o.rmse, u.count, u.rmse
            )
        };
        for b in &self.bins {
            let name = if b.hi.is_infinite() { format!(">= {}", b.lo) } else { format!("[{}, {})", b.lo, b.hi) };
            row(f, name, b.all, b.over, b.under)?;
        }
        row(f, "all".to_string(), self.all, self.over, self.under)
    }
}

impl fmt::Display for EvalReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "evaluated {} builds ({} skipped)", self.builds, self.skipped)?;
        if let Some(m) = &self.memory {
            writeln!(f, "\nmemory model (max of long/short window)")?;
            write!(f, "{m}")?;
        }
        if let Some(o) = &self.occupancy {
            writeln!(f, "\noccupancy model")?;
            write!(f, "{o}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn breakdown_bins_and_signs() {
        let pairs = [(0.5, 1.5), (0.7, 0.7), (5.2, 4.2), (20.0, 10.0)];
        let b = ErrorBreakdown::from_pairs("GB", &pairs, 1.0, 13.0);
        assert_eq!(b.all.count, 4);
        assert_eq!(b.over.count, 1);
        assert_eq!(b.under.count, 2);
        assert!((b.over.rmse - 1.0).abs() < 1e-12);
        // under: errors -1 and -10 -> sqrt((1+100)/2)
        assert!((b.under.rmse - (101.0f64 / 2.0).sqrt()).abs() < 1e-12);
        assert_eq!(b.bins.len(), 3);
        assert_eq!(b.bins[0].all.count, 2);
        assert_eq!((b.bins[1].lo, b.bins[1].hi), (5.0, 6.0));
        assert!(b.bins[2].hi.is_infinite());
        let text = b.to_string();
        assert!(text.contains(">= 13"), "{text}");
        assert!(text.lines().last().unwrap().trim_start().starts_with("all"));
    }
}
