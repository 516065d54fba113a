//! `sim tune`: for a workload and a number of workers, the best
//! configuration of each family of deployments, by capacity
//! ([`crate::capacity`]): aggregated at its best router settings;
//! disaggregated at its best P:D split and router settings; and C/D with
//! each policy at its best split, router settings and thresholds.
//!
//! The search per family, to keep the runs few: the split on a coarse grid
//! (1, a quarter, half and three quarters of the workers as prefill
//! workers); the router settings every family shares
//! ([`router::TUNED_PARAMS`]: how much a decode worker's cached prefix
//! counts against its load), each over its grid, unless `--router-param`
//! fixed them; the coarse grid again (the best split moves with them);
//! the split refined by halving steps around the best; each tunable
//! parameter in turn over its grid from the policy registry
//! ([`router::ParamSpec::tune`]), the others at their best so far (one
//! pass of coordinate search; a parameter `--param` fixed is not tuned); the split again, one worker either way; and
//! the router settings again (a change there does not revisit the split).
//! Aggregated, which has neither split nor thresholds, tries every
//! combination of the router settings' grids. A candidate's capacity
//! search starts at its family's best capacity so far and steps by a small
//! factor, so most searches take a few runs. Candidates of one step run in
//! parallel; aggregated's one after another, each from the best so far.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};

use router::Policy;

use crate::capacity::{self, Capacity, Search};
use crate::cluster::SimError;
use crate::compare::{outcome, parallel_map, run_scenarios, Scenario};
use crate::deployment::Deployment;

/// One family's best configuration.
#[derive(Debug, Clone)]
pub struct Best {
    /// `aggregated`, `disaggregated`, or the C/D policy's name.
    pub family: String,
    pub deployment: Deployment,
    pub capacity: Capacity,
    /// Its TTFT p99 at its capacity on each scenario, in their order, from
    /// the capacity search's own runs (empty when no load passed).
    pub tail: Vec<f64>,
    /// The router settings tuned for it ([`router::TUNED_PARAMS`]), by
    /// name, over the scenarios' own.
    pub router_params: Vec<(String, f64)>,
    /// Configurations whose capacity was searched.
    pub tried: usize,
}

impl Best {
    /// `scenarios` with this family's tuned router settings: what its
    /// capacity was measured on.
    pub fn scenarios(&self, scenarios: &[Scenario]) -> Vec<Scenario> {
        with_router_params(scenarios, &self.router_params)
    }
}

/// A candidate's capacity, and its TTFT p99 there on each scenario
/// ([`Best::tail`]).
#[derive(Debug, Clone)]
struct Measured {
    capacity: Capacity,
    tail: Vec<f64>,
}

impl Measured {
    fn load(&self) -> f64 {
        self.capacity.load()
    }
}

/// `scenarios` with `params` set over their router settings.
fn with_router_params(scenarios: &[Scenario], params: &[(String, f64)]) -> Vec<Scenario> {
    scenarios
        .iter()
        .map(|s| {
            let mut s = s.clone();
            s.config.router_params.extend(params.iter().cloned());
            s
        })
        .collect()
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
    /// Policy parameters fixed over their defaults (`--param`), set on
    /// each policy that has them and not tuned.
    pub policy_params: &'a [(String, f64)],
    /// Each candidate's capacity search (its `start` is the first
    /// family's guess; later ones start at their family's best; a TTFT p99
    /// bound is on the mean over the scenarios).
    pub search: Search,
    pub threads: usize,
}

/// Counts of the work done, for the progress line.
#[derive(Debug, Default)]
pub struct Progress {
    pub searches: AtomicUsize,
    pub runs: AtomicUsize,
}

/// A family's candidate.
#[derive(Debug, Clone)]
struct Candidate {
    prefill: u32,
    policy: Policy,
    /// Tuned router settings ([`router::TUNED_PARAMS`]) over the
    /// scenarios' own.
    router: Vec<(String, f64)>,
}

impl Candidate {
    fn key(&self) -> String {
        format!(
            "{} {:?} {:?}",
            self.prefill,
            self.policy.params(),
            self.router
        )
    }

    fn with_prefill(&self, prefill: u32) -> Self {
        Self {
            prefill,
            ..self.clone()
        }
    }

    /// This candidate with `step` prefill workers fewer and more, those
    /// of the splits of `workers` that leave both sides at least one.
    fn splits_around(&self, step: u32, workers: u32) -> Vec<Self> {
        let p = self.prefill;
        [p.saturating_sub(step), p + step]
            .into_iter()
            .filter(|q| (1..workers).contains(q) && *q != p)
            .map(|q| self.with_prefill(q))
            .collect()
    }

    /// This candidate with router setting `name` at `value`, in its place
    /// if it has one (so that the same settings give the same key).
    fn with_router(&self, name: &str, value: f64) -> Self {
        let mut c = self.clone();
        match c.router.iter_mut().find(|(n, _)| n == name) {
            Some(setting) => setting.1 = value,
            None => c.router.push((name.to_owned(), value)),
        }
        c
    }
}

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
        let mut agg_best: Option<(Vec<(String, f64)>, Measured)> = None;
        let mut tried = 0;
        for router in self.router_grid() {
            let c = self.capacity(
                &agg,
                &router,
                agg_best
                    .as_ref()
                    .map_or(self.search.start, |(_, c)| c.load()),
                progress,
            )?;
            tried += 1;
            if agg_best.as_ref().is_none_or(|(_, b)| c.load() > b.load()) {
                agg_best = Some((router, c));
            }
        }
        let (router_params, measured) = agg_best.expect("the grid is not empty");
        let guess = measured.load();
        out.push(Best {
            family: "aggregated".into(),
            deployment: agg,
            capacity: measured.capacity,
            tail: measured.tail,
            router_params,
            tried,
        });
        let policies = self.tuned_policies()?;
        let families = std::iter::once(("disaggregated".to_owned(), None))
            .chain(policies.into_iter().map(|p| (p.name().to_owned(), Some(p))));
        for (family, policy) in families {
            stage(&family);
            out.push(self.family(&family, policy, guess, progress, stage)?);
        }
        Ok(out)
    }

    /// The C/D policies as tuned: each with the fixed parameters it has
    /// ([`Tune::policy_params`]), checked (call it first to refuse a bad
    /// value before anything runs).
    pub fn tuned_policies(&self) -> Result<Vec<Policy>, SimError> {
        self.policies
            .iter()
            .map(|policy| {
                let mut policy = policy.clone();
                for (name, value) in self.policy_params {
                    if policy.spec().param(name).is_some() {
                        policy
                            .set(name, *value)
                            .map_err(router::ConfigError::from)?;
                    }
                }
                policy.validate().map_err(router::ConfigError::from)?;
                Ok(policy)
            })
            .collect()
    }

    /// Whether `--param` fixed the policy parameter `name`.
    fn fixed(&self, name: &str) -> bool {
        self.policy_params.iter().any(|(n, _)| n == name)
    }

    fn deployment(&self, c: &Candidate, disagg: bool) -> Deployment {
        let decode = self.workers - c.prefill;
        if disagg {
            Deployment::Disaggregated {
                prefill: c.prefill,
                decode,
            }
        } else {
            Deployment::Conditional {
                prefill: c.prefill,
                decode,
                policy: c.policy.clone(),
            }
        }
    }

    /// The tuned router settings a `--router-param` did not fix, with their
    /// grids.
    fn tuned_router_params(&self) -> impl Iterator<Item = (&'static str, &'static [f64])> + '_ {
        router::TUNED_PARAMS.iter().copied().filter(|(name, _)| {
            !self
                .scenarios
                .iter()
                .any(|s| s.config.router_params.iter().any(|(n, _)| n == name))
        })
    }

    /// Every combination of the tuned router settings' grids (one empty
    /// combination when none is tuned).
    fn router_grid(&self) -> Vec<Vec<(String, f64)>> {
        let mut grid = vec![Vec::new()];
        for (name, values) in self.tuned_router_params() {
            grid = grid
                .iter()
                .flat_map(|g: &Vec<(String, f64)>| {
                    values.iter().map(move |&v| {
                        let mut g = g.clone();
                        g.push((name.to_owned(), v));
                        g
                    })
                })
                .collect();
        }
        grid
    }

    /// One pass over each tuned router setting's grid from the best
    /// candidate so far, the others at their best (`stage` names the pass
    /// in the progress line).
    fn tune_router_params(
        &self,
        stage_name: &str,
        best: &mut Option<(Candidate, Measured)>,
        evaluate: &mut impl FnMut(
            Vec<Candidate>,
            &mut Option<(Candidate, Measured)>,
        ) -> Result<(), SimError>,
        stage: &(dyn Fn(&str) + Sync),
    ) -> Result<(), SimError> {
        for (name, values) in self.tuned_router_params() {
            stage(&format!("{stage_name}: {name}"));
            let (c, _) = best.clone().expect("evaluated");
            let candidates = values.iter().map(|&v| c.with_router(name, v)).collect();
            evaluate(candidates, best)?;
        }
        Ok(())
    }

    fn capacity(
        &self,
        deployment: &Deployment,
        router: &[(String, f64)],
        guess: f64,
        progress: &Progress,
    ) -> Result<Measured, SimError> {
        let s = Search {
            start: if guess > 0.0 {
                guess
            } else {
                self.search.start
            },
            ..self.search
        };
        let scenarios = with_router_params(self.scenarios, router);
        // Each load's TTFT p99s, to give the capacity's.
        let mut tails: Vec<(f64, Vec<f64>)> = Vec::new();
        let (capacity, _) = capacity::search(&s, &[], |load| {
            progress.runs.fetch_add(scenarios.len(), Ordering::Relaxed);
            let points = run_scenarios(&scenarios, deployment, load)?;
            tails.push((load, points.iter().map(|p| p.summary.ttft_ms.p99).collect()));
            Ok::<_, SimError>(outcome(&points))
        })?;
        progress.searches.fetch_add(1, Ordering::Relaxed);
        let tail = tails
            .into_iter()
            .find(|(load, _)| *load == capacity.load())
            .map(|(_, tail)| tail)
            .unwrap_or_default();
        Ok(Measured { capacity, tail })
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
        let mut best: Option<(Candidate, Measured)> = None;
        // Runs the candidates not tried yet (in parallel) and keeps the
        // best; ties keep the earlier best.
        let mut evaluate = |candidates: Vec<Candidate>,
                            best: &mut Option<(Candidate, Measured)>|
         -> Result<(), SimError> {
            let mut fresh: Vec<Candidate> = Vec::new();
            for c in candidates {
                if !tried.contains_key(&c.key()) && !fresh.iter().any(|f| f.key() == c.key()) {
                    fresh.push(c);
                }
            }
            let hint = best.as_ref().map_or(guess, |(_, c)| c.load());
            let results = parallel_map(&fresh, self.threads, &|_, _| {}, |c| {
                self.capacity(&self.deployment(c, disagg), &c.router, hint, progress)
            });
            for (c, r) in fresh.into_iter().zip(results) {
                let measured = r?;
                tried.insert(c.key(), measured.capacity);
                if best
                    .as_ref()
                    .is_none_or(|(_, b)| measured.load() > b.load())
                {
                    *best = Some((c, measured));
                }
            }
            Ok(())
        };
        // The split: a coarse grid, then halving steps around the best.
        let mut grid: Vec<u32> = vec![1, w / 4, w / 2, 3 * w / 4];
        grid.retain(|p| (1..w).contains(p));
        grid.dedup();
        stage(&format!("{family}: P:D split"));
        let first = Candidate {
            // Each coarse split replaces it.
            prefill: 0,
            policy: start.clone(),
            // Each tuned router setting at its default, the grid's first.
            router: self
                .tuned_router_params()
                .map(|(name, grid)| (name.to_owned(), grid[0]))
                .collect(),
        };
        evaluate(
            grid.iter().map(|&p| first.with_prefill(p)).collect(),
            &mut best,
        )?;
        // The router settings every family shares, at the best split; then
        // the coarse grid again with them (the best split moves with them).
        self.tune_router_params(family, &mut best, &mut evaluate, stage)?;
        let (c, _) = best.clone().expect("evaluated");
        evaluate(grid.iter().map(|&p| c.with_prefill(p)).collect(), &mut best)?;
        let mut step = (w / 8).max(1);
        loop {
            let (c, _) = best.clone().expect("the grid is not empty");
            evaluate(c.splits_around(step, w), &mut best)?;
            if step == 1 {
                break;
            }
            step /= 2;
        }
        // Each tunable parameter over its grid, the others at their best.
        let params: Vec<_> = start
            .spec()
            .params()
            .filter(|p| !p.tune.is_empty() && !self.fixed(p.name))
            .collect();
        for param in &params {
            stage(&format!("{family}: {}", param.name));
            let (c, _) = best.clone().expect("evaluated");
            let candidates = param
                .tune
                .iter()
                .filter_map(|&v| {
                    let mut q = c.clone();
                    q.policy.set(param.name, v).ok()?;
                    q.policy.validate().ok()?;
                    Some(q)
                })
                .collect();
            evaluate(candidates, &mut best)?;
        }
        if !params.is_empty() || self.tuned_router_params().next().is_some() {
            stage(&format!("{family}: P:D split again"));
            let (c, _) = best.clone().expect("evaluated");
            evaluate(c.splits_around(1, w), &mut best)?;
        }
        // The router settings again, where the split and thresholds ended.
        let again = format!("{family} again");
        self.tune_router_params(&again, &mut best, &mut evaluate, stage)?;
        let (candidate, measured) = best.expect("evaluated");
        Ok(Best {
            family: family.to_owned(),
            deployment: self.deployment(&candidate, disagg),
            capacity: measured.capacity,
            tail: measured.tail,
            router_params: candidate.router,
            tried: tried.len(),
        })
    }
}

/// A family's tuned settings, `name=value`: the router's
/// ([`Best::router_params`]), then its policy's tunable parameters (or
/// what says there are none).
pub fn tuned_params(best: &Best) -> String {
    let mut shown: Vec<String> = best
        .router_params
        .iter()
        .map(|(name, value)| format!("{name}={value}"))
        .collect();
    if let Deployment::Conditional { policy, .. } = &best.deployment {
        let spec = policy.spec();
        let before = shown.len();
        shown.extend(
            policy
                .params()
                .into_iter()
                .filter(|(name, _)| spec.param(name).is_some_and(|p| !p.tune.is_empty()))
                .map(|(name, value)| format!("{name}={value}")),
        );
        if shown.len() == before {
            shown.push("policy: nothing to tune".into());
        }
    }
    if shown.is_empty() {
        "-".into()
    } else {
        shown.join(" ")
    }
}
