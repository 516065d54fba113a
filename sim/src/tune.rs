//! `sim tune`: for a workload and a number of workers, the best
//! configuration of each family of deployments, by capacity
//! ([`crate::capacity`]): aggregated; disaggregated at its best P:D split;
//! and C/D with each policy at its best split and thresholds.
//!
//! The search per family, to keep the runs few: the split on a coarse grid
//! (1, a quarter, half and three quarters of the workers as prefill
//! workers), refined by halving steps around the best; then each tunable
//! parameter in turn over its grid from the policy registry
//! ([`router::ParamSpec::tune`]), the others at their best so far (one
//! pass of coordinate search); then the split again, one worker either
//! way. A candidate's capacity search starts at its family's best capacity
//! so far and steps by a small factor, so most searches take a few runs.
//! Candidates of one step run in parallel.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use router::Policy;

use crate::capacity::{self, Capacity, Search};
use crate::cluster::SimError;
use crate::compare::{mean_attainment, parallel_map, Scenario};
use crate::deployment::Deployment;

/// One family's best configuration.
#[derive(Debug, Clone)]
pub struct Best {
    /// `aggregated`, `disaggregated`, or the C/D policy's name.
    pub family: String,
    pub deployment: Deployment,
    pub capacity: Capacity,
    /// Configurations whose capacity was searched.
    pub tried: usize,
}

/// What to tune.
#[derive(Debug, Clone)]
pub struct Tune<'a> {
    /// A capacity search judges each load by the mean attainment over
    /// these (one per seed; at least one).
    pub scenarios: &'a [Scenario],
    pub workers: u32,
    /// The C/D policies with the parameters they start from (defaults).
    pub policies: &'a [Policy],
    /// Each candidate's capacity search (its `start` is the first
    /// family's guess; later ones start at their family's best).
    pub search: Search,
    pub threads: usize,
}

/// Counts of the work done, for the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    pub searches: AtomicUsize,
    pub runs: AtomicUsize,
}

/// A family's candidate: its split and policy.
type Candidate = (u32, Policy);

impl Tune<'_> {
    /// Every family's best, aggregated first.
    pub fn run(
        &self,
        progress: &Progress,
        stage: &(dyn Fn(&str) + Sync),
    ) -> Result<Vec<Best>, SimError> {
        let mut out = Vec::new();
        stage("aggregated");
        let agg = Deployment::Aggregated {
            workers: self.workers,
        };
        let capacity = self.capacity(&agg, self.search.start, progress)?;
        let guess = capacity.load();
        out.push(Best {
            family: "aggregated".into(),
            deployment: agg,
            capacity,
            tried: 1,
        });
        let families = std::iter::once(("disaggregated".to_owned(), None)).chain(
            self.policies
                .iter()
                .map(|p| (p.name().to_owned(), Some(p.clone()))),
        );
        for (family, policy) in families {
            stage(&family);
            out.push(self.family(&family, policy, guess, progress, stage)?);
        }
        Ok(out)
    }

    fn deployment(&self, (prefill, policy): &Candidate, disagg: bool) -> Deployment {
        let decode = self.workers - prefill;
        if disagg {
            Deployment::Disaggregated {
                prefill: *prefill,
                decode,
            }
        } else {
            Deployment::Conditional {
                prefill: *prefill,
                decode,
                policy: policy.clone(),
            }
        }
    }

    fn capacity(
        &self,
        deployment: &Deployment,
        guess: f64,
        progress: &Progress,
    ) -> Result<Capacity, SimError> {
        let s = Search {
            start: if guess > 0.0 {
                guess
            } else {
                self.search.start
            },
            ..self.search
        };
        let (c, _) = capacity::search(&s, &[], |load| {
            progress
                .runs
                .fetch_add(self.scenarios.len(), Ordering::Relaxed);
            mean_attainment(self.scenarios, deployment, load)
        })?;
        progress.searches.fetch_add(1, Ordering::Relaxed);
        Ok(c)
    }

    /// The best of one family (`policy` `None`: disaggregated).
    fn family(
        &self,
        family: &str,
        policy: Option<Policy>,
        guess: f64,
        progress: &Progress,
        stage: &(dyn Fn(&str) + Sync),
    ) -> Result<Best, SimError> {
        let disagg = policy.is_none();
        let start = policy.unwrap_or_else(|| router::AlwaysDisagg.into());
        let w = self.workers;
        let mut tried: HashMap<String, Capacity> = HashMap::new();
        let key = |(p, policy): &Candidate| format!("{p} {:?}", policy.params());
        let mut best: Option<(Candidate, Capacity)> = None;
        // Runs the candidates not tried yet (in parallel) and keeps the
        // best; ties keep the earlier best.
        let mut evaluate = |candidates: Vec<Candidate>,
                            best: &mut Option<(Candidate, Capacity)>|
         -> Result<(), SimError> {
            let mut fresh: Vec<Candidate> = Vec::new();
            for c in candidates {
                if !tried.contains_key(&key(&c)) && !fresh.iter().any(|f| key(f) == key(&c)) {
                    fresh.push(c);
                }
            }
            let hint = best.as_ref().map_or(guess, |(_, c)| c.load());
            let results = parallel_map(&fresh, self.threads, &|_, _| {}, |c| {
                self.capacity(&self.deployment(c, disagg), hint, progress)
            });
            for (c, r) in fresh.into_iter().zip(results) {
                let capacity = r?;
                tried.insert(key(&c), capacity);
                if best
                    .as_ref()
                    .is_none_or(|(_, b)| capacity.load() > b.load())
                {
                    *best = Some((c, capacity));
                }
            }
            Ok(())
        };
        // The split: a coarse grid, then halving steps around the best.
        let mut grid: Vec<u32> = vec![1, w / 4, w / 2, 3 * w / 4];
        grid.retain(|p| (1..w).contains(p));
        grid.dedup();
        stage(&format!("{family}: P:D split"));
        evaluate(
            grid.iter().map(|&p| (p, start.clone())).collect(),
            &mut best,
        )?;
        let mut step = (w / 8).max(1);
        loop {
            let ((p, policy), _) = best.clone().expect("the grid is not empty");
            let around = [p.saturating_sub(step), p + step]
                .into_iter()
                .filter(|q| (1..w).contains(q) && *q != p)
                .map(|q| (q, policy.clone()))
                .collect();
            evaluate(around, &mut best)?;
            if step == 1 {
                break;
            }
            step /= 2;
        }
        // Each tunable parameter over its grid, the others at their best.
        let params: Vec<_> = start
            .spec()
            .params()
            .filter(|p| !p.tune.is_empty())
            .collect();
        for param in &params {
            stage(&format!("{family}: {}", param.name));
            let ((p, policy), _) = best.clone().expect("evaluated");
            let candidates = param
                .tune
                .iter()
                .filter_map(|&v| {
                    let mut q = policy.clone();
                    q.set(param.name, v).ok()?;
                    q.validate().ok()?;
                    Some((p, q))
                })
                .collect();
            evaluate(candidates, &mut best)?;
        }
        if !params.is_empty() {
            stage(&format!("{family}: P:D split again"));
            let ((p, policy), _) = best.clone().expect("evaluated");
            let around = [p.saturating_sub(1), p + 1]
                .into_iter()
                .filter(|q| (1..w).contains(q) && *q != p)
                .map(|q| (q, policy.clone()))
                .collect();
            evaluate(around, &mut best)?;
        }
        let (candidate, capacity) = best.expect("evaluated");
        Ok(Best {
            family: family.to_owned(),
            deployment: self.deployment(&candidate, disagg),
            capacity,
            tried: tried.len(),
        })
    }
}

/// The tunable parameters of a deployment's policy, `name=value`, or `-`.
pub fn tuned_params(deployment: &Deployment) -> String {
    let Deployment::Conditional { policy, .. } = deployment else {
        return "-".into();
    };
    let spec = policy.spec();
    let shown: Vec<String> = policy
        .params()
        .into_iter()
        .filter(|(name, _)| spec.param(name).is_some_and(|p| !p.tune.is_empty()))
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    if shown.is_empty() {
        "defaults (nothing to tune)".into()
    } else {
        shown.join(" ")
    }
}
