//! Figures per index and point, the best peer per metric, the tables and
//! the closing JSON line.

use crate::ours::Setup;

/// The targets of the comparison (issue 15): ours at least this many times
/// the best peer's apply rate, at most this fraction of its lookup latency
/// and of its bytes per pair.
pub const APPLY_TARGET: f64 = 1.5;
pub const FIND_TARGET: f64 = 0.5;
pub const BYTES_TARGET: f64 = 0.5;

/// Medians of one index's measurements at one point.
#[derive(Debug, Clone, Copy, Default)]
pub struct Figures {
    /// Blocks applied per second.
    pub apply: f64,
    /// Seconds per lookup (a full hit on the grid; the trace's own lookups
    /// on the replay).
    pub find: f64,
    /// Seconds per lookup that misses at the first block (grid only).
    pub miss: Option<f64>,
    /// Live heap bytes per (block, worker) pair.
    pub bytes: f64,
}

/// Samples of one index over the rounds.
#[derive(Debug, Default)]
pub struct Samples {
    pub apply: Vec<f64>,
    pub find: Vec<f64>,
    pub miss: Vec<f64>,
    pub bytes: f64,
}

pub fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

impl Samples {
    pub fn figures(&self) -> Figures {
        Figures {
            apply: median(&self.apply),
            find: median(&self.find),
            miss: (!self.miss.is_empty()).then(|| median(&self.miss)),
            bytes: self.bytes,
        }
    }
}

/// One grid point or the trace replay.
#[derive(Debug)]
pub struct Point {
    pub label: String,
    /// Ours as the services set it up (see `crate::ours`).
    pub ours: Figures,
    /// Ours from an empty index: printed, not compared.
    pub unreserved: Figures,
    pub peers: Vec<(String, Figures)>,
    pub notes: Vec<String>,
}

/// The best peer for one metric: its name and value.
#[derive(Debug, Clone)]
pub struct Best {
    pub peer: String,
    pub value: f64,
}

impl Point {
    fn best(&self, value: impl Fn(&Figures) -> f64, higher_is_better: bool) -> Best {
        let (name, f) = self
            .peers
            .iter()
            .max_by(|a, b| {
                let (x, y) = (value(&a.1), value(&b.1));
                if higher_is_better {
                    x.total_cmp(&y)
                } else {
                    y.total_cmp(&x)
                }
            })
            .expect("at least one peer");
        Best {
            peer: name.clone(),
            value: value(f),
        }
    }

    pub fn best_apply(&self) -> Best {
        self.best(|f| f.apply, true)
    }

    pub fn best_find(&self) -> Best {
        self.best(|f| f.find, false)
    }

    pub fn best_bytes(&self) -> Best {
        self.best(|f| f.bytes, false)
    }

    /// Ours / best peer, per metric.
    pub fn ratios(&self) -> (f64, f64, f64) {
        (
            self.ours.apply / self.best_apply().value,
            self.ours.find / self.best_find().value,
            self.ours.bytes / self.best_bytes().value,
        )
    }

    /// Every index's figures at this point.
    pub fn print_detail(&self) {
        println!("{}", self.label);
        println!(
            "  {:<28} {:>13} {:>10} {:>9} {:>8}",
            "index", "apply Mblk/s", "find us", "miss ns", "B/pair"
        );
        let row = |name: &str, f: &Figures| {
            let miss = f.miss.map_or("-".to_owned(), |m| format!("{:.1}", m * 1e9));
            println!(
                "  {:<28} {:>13.2} {:>10.3} {:>9} {:>8.1}",
                name,
                f.apply / 1e6,
                f.find * 1e6,
                miss,
                f.bytes
            );
        };
        row(Setup::Service.name(), &self.ours);
        row(Setup::Unreserved.name(), &self.unreserved);
        for (name, f) in &self.peers {
            row(name, f);
        }
        for note in &self.notes {
            println!("  note: {note}");
        }
    }
}

fn flag(met: bool) -> &'static str {
    if met {
        ""
    } else {
        " MISS"
    }
}

/// Ours against the best peer per metric, one line per point.
pub fn print_summary(points: &[Point]) {
    println!();
    println!(
        "ours vs the best peer per metric (apply: ours/best >= {APPLY_TARGET}; find, bytes: ours/best <= {FIND_TARGET}, {BYTES_TARGET})"
    );
    println!(
        "{:<22} | {:>7} {:>7} {:<26} {:>10} | {:>8} {:>8} {:<26} {:>10} | {:>6} {:>6} {:<26} {:>10}",
        "point",
        "apply",
        "best",
        "peer",
        "ours/best",
        "find us",
        "best",
        "peer",
        "ours/best",
        "B/pair",
        "best",
        "peer",
        "ours/best"
    );
    for p in points {
        let (a, f, b) = (p.best_apply(), p.best_find(), p.best_bytes());
        let (ra, rf, rb) = p.ratios();
        println!(
            "{:<22} | {:>7.2} {:>7.2} {:<26} {:>10} | {:>8.3} {:>8.3} {:<26} {:>10} | {:>6.1} {:>6.1} {:<26} {:>10}",
            p.label_short(),
            p.ours.apply / 1e6,
            a.value / 1e6,
            a.peer,
            format!("{ra:.2}{}", flag(ra >= APPLY_TARGET)),
            p.ours.find * 1e6,
            f.value * 1e6,
            f.peer,
            format!("{rf:.3}{}", flag(rf <= FIND_TARGET)),
            p.ours.bytes,
            b.value,
            b.peer,
            format!("{rb:.2}{}", flag(rb <= BYTES_TARGET)),
        );
    }
}

impl Point {
    /// The label up to its first colon.
    fn label_short(&self) -> &str {
        self.label.split(':').next().unwrap_or(&self.label)
    }
}

/// The closing line for scripts: the worst point of each ratio.
pub fn json_line(peers: &[String], points: &[Point]) -> String {
    let ratios: Vec<(f64, f64, f64)> = points.iter().map(Point::ratios).collect();
    let apply_min = ratios.iter().map(|r| r.0).fold(f64::INFINITY, f64::min);
    let find_max = ratios.iter().map(|r| r.1).fold(0.0, f64::max);
    let bytes_max = ratios.iter().map(|r| r.2).fold(0.0, f64::max);
    let names: Vec<String> = peers.iter().map(|p| format!("\"{p}\"")).collect();
    format!(
        "{{\"peers\": [{}], \"apply_ratio_min\": {apply_min:.3}, \"find_ratio_max\": {find_max:.4}, \"bytes_ratio_max\": {bytes_max:.3}}}",
        names.join(", ")
    )
}
