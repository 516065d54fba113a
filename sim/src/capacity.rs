//! Capacity by search: the highest load at which a deployment still serves
//! a target share of requests within the SLO, bracketed and bisected rather
//! than read off a fixed grid.
//!
//! The search assumes attainment falls with load. It starts from the loads
//! already run (a sweep's points): the highest passing load and the lowest
//! failing load above it bracket the capacity. Without a failing load it
//! doubles the highest passing one until a load fails (at most
//! `max_doublings` times: then the capacity is above that bound); without a
//! passing load it halves the lowest failing one likewise. Then it bisects
//! the bracket until it is narrower than `tolerance` of its upper end.
//! (Doubling is the default step; `growth` sets another.)
//!
//! Attainment does not always fall with load: on a closed-loop workload a
//! deployment can fail at one load and pass at higher ones (a dip). So a
//! failure found by bisection is confirmed: `confirm` loads above it, each
//! `confirm_step` of it further, must fail too. When one passes, the search
//! goes on from there, and the result names the dip (`dipped_at`).

/// How to search.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Search {
    /// Share of measured requests that must meet the SLO.
    pub target: f64,
    /// A load passes only if its TTFT p99 is within this too (ms; `None`:
    /// no bound), `sim compare` and `sim tune --ttft-p99-bound-ms`.
    pub ttft_p99_bound_ms: Option<f64>,
    /// The first load to try when nothing was run yet.
    pub start: f64,
    /// How many times the bracket may grow up (or shrink down) by `growth`
    /// from the loads tried before the search gives up and reports its
    /// bound.
    pub max_doublings: u32,
    /// The factor of each such step: 2, doubling (`sim tune` starts from a
    /// close guess and steps less).
    pub growth: f64,
    /// Bisect until `fails_at - load <= tolerance * fails_at`.
    pub tolerance: f64,
    /// Loads above a failure that must fail too before it is the
    /// capacity's (0: the first failure is taken).
    pub confirm: u32,
    /// How far apart those loads are, as a share of the failing load.
    pub confirm_step: f64,
}

impl Default for Search {
    fn default() -> Self {
        Self {
            target: 0.9,
            ttft_p99_bound_ms: None,
            start: 1.0,
            max_doublings: 4,
            growth: 2.0,
            tolerance: 0.03,
            confirm: 2,
            confirm_step: 0.1,
        }
    }
}

/// What the search found.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Capacity {
    /// `load` passes and `fails_at` (within the tolerance above it) fails,
    /// as do the confirmation loads above it. `dipped_at`: a lower load
    /// that failed (attainment is not monotone in load here).
    Found {
        load: f64,
        fails_at: f64,
        dipped_at: Option<f64>,
    },
    /// Every load up to `bound`, the search's upper bound after doubling,
    /// passed: the capacity is above it.
    AboveBound { bound: f64 },
    /// Every load down to `bound`, the lowest the search tried, failed.
    BelowBound { bound: f64 },
}

impl Capacity {
    /// The load to rank deployments by: the passing load, the bound when
    /// the capacity is above it, 0 when no load passed.
    pub fn load(&self) -> f64 {
        match *self {
            Capacity::Found { load, .. } => load,
            Capacity::AboveBound { bound } => bound,
            Capacity::BelowBound { .. } => 0.0,
        }
    }

    /// As JSON: `{"capacity": x, "fails_at": y}`, or with `"above": bound`
    /// or `"below": bound` when the search hit its bound.
    pub fn to_json(&self) -> serde_json::Value {
        match *self {
            Capacity::Found {
                load,
                fails_at,
                dipped_at: None,
            } => {
                serde_json::json!({"capacity": load, "fails_at": fails_at})
            }
            Capacity::Found {
                load,
                fails_at,
                dipped_at: Some(dip),
            } => {
                serde_json::json!({"capacity": load, "fails_at": fails_at, "dipped_at": dip})
            }
            Capacity::AboveBound { bound } => {
                serde_json::json!({"capacity": bound, "above": bound})
            }
            Capacity::BelowBound { bound } => serde_json::json!({"capacity": 0.0, "below": bound}),
        }
    }
}

impl Capacity {
    /// For a summary line: the load with its unit, and the bracket or the
    /// bound.
    pub fn describe(&self, unit: &str) -> String {
        match *self {
            Capacity::Found {
                load,
                fails_at,
                dipped_at: None,
            } => {
                format!("{load:.3} {unit} (fails at {fails_at:.3})")
            }
            Capacity::Found {
                load,
                fails_at,
                dipped_at: Some(dip),
            } => {
                format!("{load:.3} {unit} (fails at {fails_at:.3}; also failed lower, at {dip:.3})")
            }
            Capacity::AboveBound { bound } => {
                format!("above {bound:.3} {unit}, the search's upper bound (after doubling)")
            }
            Capacity::BelowBound { bound } => {
                format!("below {bound:.3} {unit}, the lowest load searched")
            }
        }
    }
}

/// What one load's runs measured (over several seeds: their means).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Outcome {
    /// Share of requests within the SLO.
    pub attainment: f64,
    pub ttft_p99_ms: f64,
}

impl Search {
    /// Whether a load with this outcome passes: its attainment at the
    /// target, and its TTFT p99 within the bound, if any.
    pub fn passes(&self, o: &Outcome) -> bool {
        o.attainment >= self.target && self.ttft_p99_bound_ms.is_none_or(|b| o.ttft_p99_ms <= b)
    }
}

/// One load tried and what it measured.
pub type Probe = (f64, Outcome);

/// Searches the capacity, starting from `known` probes; `measure` runs one
/// load. Returns the capacity and every probe it ran itself, in order.
pub fn search<E>(
    s: &Search,
    known: &[Probe],
    mut measure: impl FnMut(f64) -> Result<Outcome, E>,
) -> Result<(Capacity, Vec<Probe>), E> {
    let mut ran = Vec::new();
    let mut run = |load: f64, ran: &mut Vec<Probe>| -> Result<bool, E> {
        let o = measure(load)?;
        ran.push((load, o));
        Ok(s.passes(&o))
    };
    let passes = |(_, o): &Probe| s.passes(o);
    let mut pass = known
        .iter()
        .filter(|p| passes(p))
        .map(|p| p.0)
        .reduce(f64::max);
    let mut fail = known
        .iter()
        .filter(|p| !passes(p) && pass.is_none_or(|l| p.0 > l))
        .map(|p| p.0)
        .reduce(f64::min);
    if pass.is_none() && fail.is_none() {
        if run(s.start, &mut ran)? {
            pass = Some(s.start);
        } else {
            fail = Some(s.start);
        }
    }
    let (mut lo, mut hi) = match (pass, fail) {
        (Some(lo), Some(hi)) => (lo, hi),
        (Some(lo), None) => match grow(s, lo, &mut ran, &mut run)? {
            Ok(bracket) => bracket,
            Err(bound) => return Ok((Capacity::AboveBound { bound }, ran)),
        },
        (None, Some(mut hi)) => {
            let mut lo = None;
            for _ in 0..s.max_doublings {
                let probe = hi / s.growth;
                if run(probe, &mut ran)? {
                    lo = Some(probe);
                    break;
                }
                hi = probe;
            }
            match lo {
                Some(lo) => (lo, hi),
                None => return Ok((Capacity::BelowBound { bound: hi }, ran)),
            }
        }
        (None, None) => unreachable!("the start load was run"),
    };
    let mut dipped_at = None;
    // Each round starts above the last one's failure; a bound on rounds
    // keeps a noisy attainment from searching for ever.
    for round in 1..=MAX_ROUNDS {
        while hi - lo > s.tolerance * hi {
            let mid = (lo + hi) / 2.0;
            if run(mid, &mut ran)? {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if round == MAX_ROUNDS {
            break;
        }
        // Confirm the failure: the loads above it fail too.
        let mut passed_above = None;
        for k in 1..=s.confirm {
            let probe = hi * (1.0 + s.confirm_step * f64::from(k));
            if run(probe, &mut ran)? {
                passed_above = Some(probe);
                break;
            }
        }
        let Some(above) = passed_above else { break };
        dipped_at.get_or_insert(hi);
        (lo, hi) = match grow(s, above, &mut ran, &mut run)? {
            Ok(bracket) => bracket,
            Err(bound) => return Ok((Capacity::AboveBound { bound }, ran)),
        };
    }
    Ok((
        Capacity::Found {
            load: lo,
            fails_at: hi,
            dipped_at,
        },
        ran,
    ))
}

/// How many times the search may go on above a failure that a higher
/// load contradicted.
const MAX_ROUNDS: u32 = 4;

/// From a passing load, steps up by `growth` until a load fails: the
/// bracket, or the last passing load when every step passed.
fn grow<E>(
    s: &Search,
    mut lo: f64,
    ran: &mut Vec<Probe>,
    run: &mut impl FnMut(f64, &mut Vec<Probe>) -> Result<bool, E>,
) -> Result<Result<(f64, f64), f64>, E> {
    for _ in 0..s.max_doublings {
        let probe = lo * s.growth;
        if run(probe, ran)? {
            lo = probe;
        } else {
            return Ok(Ok((lo, probe)));
        }
    }
    Ok(Err(lo))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    /// An outcome of this attainment, with a TTFT p99 of 1 s.
    fn attained(attainment: f64) -> Outcome {
        Outcome {
            attainment,
            ttft_p99_ms: 1_000.0,
        }
    }

    /// Attainment that drops below 90% above `capacity`.
    fn step(capacity: f64) -> impl FnMut(f64) -> Result<Outcome, Infallible> {
        move |load| Ok(attained(if load <= capacity { 0.95 } else { 0.5 }))
    }

    /// Probes of attainments alone.
    fn probes(known: &[(f64, f64)]) -> Vec<Probe> {
        known.iter().map(|&(l, a)| (l, attained(a))).collect()
    }

    /// A found capacity's load, failing load and dip.
    fn found(c: Capacity) -> (f64, f64, Option<f64>) {
        match c {
            Capacity::Found {
                load,
                fails_at,
                dipped_at,
            } => (load, fails_at, dipped_at),
            other => panic!("not found: {other:?}"),
        }
    }

    #[test]
    fn bisects_inside_the_bracket_the_sweep_gave() {
        let known = probes(&[(0.5, 0.99), (1.0, 0.97), (1.5, 0.6), (2.0, 0.2)]);
        let (c, ran) = search(&Search::default(), &known, step(1.37)).unwrap();
        let (load, fails_at, dipped_at) = found(c);
        assert!(load <= 1.37 && 1.37 < fails_at, "{c:?}");
        assert!(fails_at - load <= 0.03 * fails_at);
        assert_eq!(dipped_at, None);
        // Bisection inside the bracket, then the two confirmations above.
        let (inside, above) = ran.split_at(ran.len() - 2);
        assert!(
            inside.iter().all(|(l, _)| (1.0..1.5).contains(l)),
            "{ran:?}"
        );
        assert!(
            above
                .iter()
                .all(|&(l, o)| l > fails_at && o.attainment < 0.9),
            "{ran:?}"
        );
    }

    #[test]
    fn doubles_past_the_loads_tried_and_halves_below_them() {
        let known = probes(&[(0.5, 0.99), (1.0, 0.97)]);
        let (c, _) = search(&Search::default(), &known, step(5.1)).unwrap();
        assert!(
            matches!(c, Capacity::Found { load, fails_at, .. } if load <= 5.1 && fails_at > 5.1)
        );
        let known = probes(&[(1.0, 0.2)]);
        let (c, _) = search(&Search::default(), &known, step(0.2)).unwrap();
        assert!(
            matches!(c, Capacity::Found { load, fails_at, .. } if load <= 0.2 && fails_at > 0.2)
        );
    }

    #[test]
    fn a_dip_below_the_capacity_is_stepped_over_and_named() {
        // Fails between 1.3 and 1.4 only, and above 1.8.
        let dip = |load: f64| -> Result<Outcome, Infallible> {
            Ok(attained(if (1.3..1.4).contains(&load) || load > 1.8 {
                0.85
            } else {
                0.95
            }))
        };
        let known = probes(&[(1.0, 0.95), (1.35, 0.85)]);
        let (c, _) = search(&Search::default(), &known, dip).unwrap();
        let (load, fails_at, dipped_at) = found(c);
        assert!(load <= 1.8 && fails_at > 1.8 && load > 1.7, "{c:?}");
        assert!(dipped_at.is_some_and(|d| (1.3..1.4).contains(&d)), "{c:?}");
        assert!(
            c.describe("x").contains("also failed lower"),
            "{}",
            c.describe("x")
        );
        // Without confirmation, the first failure is taken.
        let first = Search {
            confirm: 0,
            ..Search::default()
        };
        let (c, _) = search(&first, &known, dip).unwrap();
        assert!(c.load() < 1.35, "{c:?}");
    }

    #[test]
    fn a_load_past_the_tail_bound_fails_whatever_its_attainment() {
        // Every load keeps 95% within the SLO; the TTFT p99 grows with it,
        // 5 s at 2.0.
        let tail = |load: f64| -> Result<Outcome, Infallible> {
            Ok(Outcome {
                attainment: 0.95,
                ttft_p99_ms: 2_500.0 * load,
            })
        };
        let bounded = Search {
            ttft_p99_bound_ms: Some(5_000.0),
            ..Search::default()
        };
        let (c, ran) = search(&bounded, &[], tail).unwrap();
        let (load, fails_at, _) = found(c);
        assert!(load <= 2.0 && 2.0 < fails_at, "{c:?}");
        assert!(
            ran.iter().all(|(l, o)| bounded.passes(o) == (*l <= 2.0)),
            "{ran:?}"
        );
        // Without the bound every load passes, up to the search's bound.
        let (c, _) = search(&Search::default(), &[], tail).unwrap();
        assert!(matches!(c, Capacity::AboveBound { .. }), "{c:?}");
    }

    #[test]
    fn says_when_the_capacity_is_beyond_its_bounds() {
        let s = Search {
            max_doublings: 3,
            ..Search::default()
        };
        let (c, ran) = search(&s, &[], step(100.0)).unwrap();
        assert_eq!(c, Capacity::AboveBound { bound: 8.0 });
        assert_eq!(ran.len(), 4, "the start, then three doublings");
        assert!(c.describe("x").starts_with("above 8.000 x"));
        let (c, _) = search(&s, &[], step(0.01)).unwrap();
        assert_eq!(c, Capacity::BelowBound { bound: 0.125 });
    }
}
