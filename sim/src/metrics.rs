//! Per-request records and the figures of one run.

use std::collections::BTreeMap;

use protocol::Path;

/// Latency targets a request must meet to count as served well.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_ms: f64,
    pub itl_ms: f64,
}

/// What happened to one request.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    pub id: u64,
    /// Its conversation, and its turn there from 0.
    pub session: u64,
    pub turn: u32,
    pub arrival_us: u64,
    pub first_token_us: u64,
    pub finish_us: u64,
    pub prompt_tokens: u32,
    pub output_tokens: u32,
    pub path: Path,
    /// The router's rule that chose the path (`sla.local_saves_work`,
    /// `gate.kv_budget`, ...: the decision's `rule`).
    pub rule: String,
    /// Prompt tokens some earlier request held, and the least TTFT any
    /// router could have given it ([`crate::floor`]).
    pub reusable_tokens: u32,
    pub ttft_floor_ms: f64,
}

impl RequestRecord {
    pub fn ttft_ms(&self) -> f64 {
        (self.first_token_us - self.arrival_us) as f64 / 1e3
    }

    /// Mean inter-token latency; 0 for a single-token answer.
    pub fn itl_ms(&self) -> f64 {
        if self.output_tokens < 2 {
            return 0.0;
        }
        (self.finish_us - self.first_token_us) as f64 / 1e3 / f64::from(self.output_tokens - 1)
    }

    pub fn e2e_ms(&self) -> f64 {
        (self.finish_us - self.arrival_us) as f64 / 1e3
    }

    /// Whether the request is over the TTFT target and over the ITL
    /// target.
    pub fn over(&self, slo: &Slo) -> (bool, bool) {
        (self.ttft_ms() > slo.ttft_ms, self.itl_ms() > slo.itl_ms)
    }

    pub fn meets(&self, slo: &Slo) -> bool {
        self.over(slo) == (false, false)
    }
}

/// The measured requests of one path, and how many missed which SLO
/// target.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Misses {
    pub requests: u64,
    /// Over the TTFT target, within the ITL target.
    pub ttft_only: u64,
    /// Over the ITL target, within the TTFT target.
    pub itl_only: u64,
    /// Over both.
    pub both: u64,
}

impl Misses {
    /// Requests over either target.
    pub fn missed(&self) -> u64 {
        self.ttft_only + self.itl_only + self.both
    }

    fn count(&mut self, r: &RequestRecord, slo: &Slo) {
        self.requests += 1;
        match r.over(slo) {
            (true, true) => self.both += 1,
            (true, false) => self.ttft_only += 1,
            (false, true) => self.itl_only += 1,
            (false, false) => {}
        }
    }
}

impl std::ops::AddAssign<&Misses> for Misses {
    fn add_assign(&mut self, o: &Misses) {
        self.requests += o.requests;
        self.ttft_only += o.ttft_only;
        self.itl_only += o.itl_only;
        self.both += o.both;
    }
}

/// SLO misses by the path each request took: where a deployment loses
/// its requests. Local prefills that slow a decode worker show as ITL
/// misses on every path that decodes there; a queued prefill worker as
/// TTFT misses on the remote paths.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MissesByPath {
    /// Requests prefilled on their decode worker.
    pub bypass: Misses,
    /// Remote prefills from the prefill worker's own cache.
    pub remote: Misses,
    /// Remote prefills with the prefix fetched from a decode worker.
    pub fetch: Misses,
}

impl MissesByPath {
    /// Counts each record once, on its path, against `slo`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a RequestRecord>, slo: &Slo) -> Self {
        let mut m = Self::default();
        for r in records {
            match r.path {
                Path::Bypass => m.bypass.count(r, slo),
                Path::Remote => m.remote.count(r, slo),
                Path::RemoteFetch => m.fetch.count(r, slo),
            }
        }
        m
    }

    /// Every path's figures added up.
    pub fn total(&self) -> Misses {
        let mut t = self.bypass;
        t += &self.remote;
        t += &self.fetch;
        t
    }

    /// Shares of the requests over the TTFT target and over the ITL target
    /// (a request over both counts in each); zeros without requests.
    pub fn over_shares(&self) -> (f64, f64) {
        let t = self.total();
        let share = |n: u64| ratio(n, t.requests);
        (share(t.ttft_only + t.both), share(t.itl_only + t.both))
    }

    /// The paths with their names, in the order they are printed.
    pub fn named(&self) -> [(&'static str, &Misses); 3] {
        [
            ("bypass", &self.bypass),
            ("remote", &self.remote),
            ("remote with fetch", &self.fetch),
        ]
    }
}

impl std::ops::AddAssign<&MissesByPath> for MissesByPath {
    fn add_assign(&mut self, o: &MissesByPath) {
        self.bypass += &o.bypass;
        self.remote += &o.remote;
        self.fetch += &o.fetch;
    }
}

/// SLO misses by the rule that chose each request's path: which of a
/// policy's choices lose the requests (a rule that bypasses onto busy
/// decode workers shows ITL misses, one that queues on the prefill
/// workers TTFT misses), so that a policy can be judged on a workload
/// without reading its decisions one by one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MissesByRule(BTreeMap<String, Misses>);

impl MissesByRule {
    /// Counts each record once, under its rule, against `slo`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a RequestRecord>, slo: &Slo) -> Self {
        let mut m = Self::default();
        for r in records {
            match m.0.get_mut(&r.rule) {
                Some(misses) => misses.count(r, slo),
                None => m.0.entry(r.rule.clone()).or_default().count(r, slo),
            }
        }
        m
    }

    /// The rules with their figures, by name.
    pub fn by_name(&self) -> impl Iterator<Item = (&str, &Misses)> {
        self.0.iter().map(|(rule, m)| (rule.as_str(), m))
    }

    /// The rules with their figures, the one that missed most first (then
    /// the one that decided most; then by name).
    pub fn ranked(&self) -> Vec<(&str, &Misses)> {
        let mut rules: Vec<(&str, &Misses)> = self.by_name().collect();
        // Stable: equal figures keep their order by name.
        rules.sort_by_key(|(_, m)| std::cmp::Reverse((m.missed(), m.requests)));
        rules
    }
}

impl std::ops::AddAssign<&MissesByRule> for MissesByRule {
    fn add_assign(&mut self, o: &MissesByRule) {
        for (rule, m) in &o.0 {
            *self.0.entry(rule.clone()).or_default() += m;
        }
    }
}

/// p50, p90 and p99 of a sample.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Percentiles {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Percentiles {
    /// Nearest-rank percentiles; zeros for an empty sample.
    pub fn of(mut values: Vec<f64>) -> Self {
        if values.is_empty() {
            return Self::default();
        }
        values.sort_by(f64::total_cmp);
        let at =
            |p: f64| values[((p * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1];
        Self {
            p50: at(0.50),
            p90: at(0.90),
            p99: at(0.99),
        }
    }
}

/// What became of the decode workers' exports with a vLLM
/// [`crate::KvExport`], over the whole run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ExportFigures {
    /// Fetches that took an exported request.
    pub taken: u64,
    /// Fetches that found none (read already, or expired): the prefill
    /// worker computed the whole prompt.
    pub missing: u64,
    /// Exports whose TTL ended unread (a declined read's blocks among
    /// them: the source keeps them until then).
    pub expired: u64,
    /// Fetches whose read came less than vLLM's margin before the TTL, or
    /// after it (the prefill worker computed the prefix).
    pub declined: u64,
    /// Exports a source's engine made by a request of the fetched prefix
    /// (`--kv-export vllm-on-demand`), in time: the leg sent with them.
    pub made: u64,
    /// Exports of a fetched prefix not done within the agent's deadline
    /// (abandoned: the prefill worker computed the whole prompt).
    pub abandoned: u64,
    /// Fetches whose source ran as many exports as its agent allows (none
    /// made: the prefill worker computed the whole prompt).
    pub busy: u64,
}

impl ExportFigures {
    pub fn any(&self) -> bool {
        *self != Self::default()
    }
}

impl std::ops::AddAssign<&ExportFigures> for ExportFigures {
    fn add_assign(&mut self, other: &ExportFigures) {
        self.taken += other.taken;
        self.missing += other.missing;
        self.expired += other.expired;
        self.declined += other.declined;
        self.made += other.made;
        self.abandoned += other.abandoned;
        self.busy += other.busy;
    }
}

/// Counters the cluster keeps while it runs.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Counters {
    /// Output tokens produced inside the measurement window.
    pub window_tokens: u64,
    /// Prompt tokens prefilled by prefill workers, and how many of them
    /// were prefix-cache hits there.
    pub p_prompt_tokens: u64,
    pub p_cached_tokens: u64,
    /// Likewise for local prefills on decode (or aggregated) workers.
    pub d_prompt_tokens: u64,
    pub d_cached_tokens: u64,
    /// KV bytes moved P -> D, and pulled D -> P (the third path).
    pub kv_bytes_moved: u64,
    pub kv_bytes_pulled: u64,
    pub preemptions: u64,
    /// Requests routed on each path (`remote` counts both remote paths,
    /// `fetched` those of them with the prefix fetched from a decode
    /// worker).
    pub bypassed: u64,
    pub remote: u64,
    pub fetched: u64,
    /// Bypasses the decode gate turned into remote prefills.
    pub gate_vetoes: u64,
    /// Requests an engine refused (e.g. longer than its whole cache).
    pub refused: u64,
    /// What became of the decode workers' exports (a vLLM
    /// [`crate::KvExport`]).
    pub exports: ExportFigures,
    /// Decode-side saturation, sampled at every load tick inside the
    /// measurement window over the decode-capable workers: Σ KV usage
    /// (blocks held by requests / capacity), samples at or above 90%,
    /// Σ requests waiting for admission, and the samples.
    pub decode_kv_usage_sum: f64,
    pub decode_kv_full_samples: u64,
    pub decode_waiting_sum: u64,
    pub decode_samples: u64,
    /// Prompt tokens read back from the host tier (G2), every worker.
    pub host_read_tokens: u64,
    /// KV bytes written to and read back from the host tier.
    pub host_bytes_written: u64,
    pub host_bytes_read: u64,
}

/// The figures of one run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunSummary {
    /// Requests that arrived in the measurement window and finished.
    pub measured: usize,
    pub ttft_ms: Percentiles,
    /// TTFT of the measured requests that are a conversation's turn 2 or
    /// later (turn index >= 1): the turns whose history is cached somewhere.
    pub later_turn_ttft_ms: Percentiles,
    /// The same requests' TTFT floors ([`crate::floor`]): no router's
    /// `later_turn_ttft_ms` can be below them.
    pub later_turn_ttft_floor_ms: Percentiles,
    /// Share of the measured prompt tokens some earlier request held: the
    /// most any prefix cache, anywhere, could have saved.
    pub reusable_share: f64,
    pub itl_ms: Percentiles,
    pub e2e_ms: Percentiles,
    /// Output tokens per second per GPU over the measurement window.
    pub throughput_per_gpu: f64,
    /// Tokens per second per user at the median and the p90 ITL.
    pub interactivity_p50: f64,
    pub interactivity_p90: f64,
    /// Share of measured requests meeting both SLO targets.
    pub slo_attainment: f64,
    /// The measured requests' misses by path.
    pub misses: MissesByPath,
    /// And by the rule that chose their path.
    pub misses_by_rule: MissesByRule,
    pub bypass_share: f64,
    /// Share of the requests routed remote with the prefix fetched from a
    /// decode worker (the third path).
    pub fetch_share: f64,
    pub prefill_hit_rate_p: f64,
    pub prefill_hit_rate_d: f64,
    pub kv_gb_moved: f64,
    /// KV pulled D -> P by the third path.
    pub kv_gb_pulled: f64,
    pub preemptions: u64,
    pub gate_vetoes: u64,
    pub refused: u64,
    /// The decode workers' exports (a vLLM [`crate::KvExport`]).
    pub exports: ExportFigures,
    /// Decode workers' mean KV usage over the window (held by requests).
    pub decode_kv_usage: f64,
    /// Share of the samples with a decode worker at >= 90% KV usage.
    pub decode_kv_full_share: f64,
    /// Mean requests waiting for admission on a decode worker.
    pub decode_waiting: f64,
    /// KV read back from, and written to, the host tier (G2).
    pub host_gb_read: f64,
    pub host_gb_written: f64,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

impl RunSummary {
    /// Summarises the records that arrived in `[from_us, to_us)`.
    pub fn new(
        records: &[RequestRecord],
        counters: &Counters,
        window: (u64, u64),
        gpus: u32,
        slo: &Slo,
    ) -> Self {
        let measured: Vec<&RequestRecord> = records
            .iter()
            .filter(|r| (window.0..window.1).contains(&r.arrival_us))
            .collect();
        let misses = MissesByPath::of(measured.iter().copied(), slo);
        let total = misses.total();
        let ttft = Percentiles::of(measured.iter().map(|r| r.ttft_ms()).collect());
        let later_turns = || measured.iter().filter(|r| r.turn > 0);
        let later_turn_ttft = Percentiles::of(later_turns().map(|r| r.ttft_ms()).collect());
        let later_turn_floor = Percentiles::of(later_turns().map(|r| r.ttft_floor_ms).collect());
        let tokens = |f: fn(&RequestRecord) -> u32| -> u64 {
            measured.iter().map(|r| u64::from(f(r))).sum()
        };
        let itl = Percentiles::of(
            measured
                .iter()
                .filter(|r| r.output_tokens > 1)
                .map(|r| r.itl_ms())
                .collect(),
        );
        let e2e = Percentiles::of(measured.iter().map(|r| r.e2e_ms()).collect());
        let seconds = (window.1 - window.0) as f64 / 1e6;
        let interactivity = |itl_ms: f64| if itl_ms > 0.0 { 1000.0 / itl_ms } else { 0.0 };
        Self {
            measured: measured.len(),
            ttft_ms: ttft,
            later_turn_ttft_ms: later_turn_ttft,
            later_turn_ttft_floor_ms: later_turn_floor,
            reusable_share: ratio(tokens(|r| r.reusable_tokens), tokens(|r| r.prompt_tokens)),
            itl_ms: itl,
            e2e_ms: e2e,
            throughput_per_gpu: counters.window_tokens as f64
                / seconds.max(1e-9)
                / f64::from(gpus.max(1)),
            interactivity_p50: interactivity(itl.p50),
            interactivity_p90: interactivity(itl.p90),
            slo_attainment: ratio(total.requests - total.missed(), total.requests),
            misses,
            misses_by_rule: MissesByRule::of(measured.iter().copied(), slo),
            bypass_share: ratio(counters.bypassed, counters.bypassed + counters.remote),
            fetch_share: ratio(counters.fetched, counters.bypassed + counters.remote),
            prefill_hit_rate_p: ratio(counters.p_cached_tokens, counters.p_prompt_tokens),
            prefill_hit_rate_d: ratio(counters.d_cached_tokens, counters.d_prompt_tokens),
            kv_gb_moved: counters.kv_bytes_moved as f64 / 1e9,
            kv_gb_pulled: counters.kv_bytes_pulled as f64 / 1e9,
            preemptions: counters.preemptions,
            gate_vetoes: counters.gate_vetoes,
            refused: counters.refused,
            exports: counters.exports,
            decode_kv_usage: counters.decode_kv_usage_sum / counters.decode_samples.max(1) as f64,
            decode_kv_full_share: ratio(counters.decode_kv_full_samples, counters.decode_samples),
            decode_waiting: ratio(counters.decode_waiting_sum, counters.decode_samples),
            host_gb_read: counters.host_bytes_read as f64 / 1e9,
            host_gb_written: counters.host_bytes_written as f64 / 1e9,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let p = Percentiles::of((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(Percentiles::of(vec![]), Percentiles::default());
        assert_eq!(Percentiles::of(vec![7.0]).p99, 7.0);
    }

    /// Targets the misses tests count against.
    const SLO: Slo = Slo {
        ttft_ms: 100.0,
        itl_ms: 20.0,
    };

    /// A request of 11 output tokens with the given TTFT and ITL (ms).
    fn record(id: usize, path: Path, rule: &str, ttft_ms: u64, itl_ms: u64) -> RequestRecord {
        RequestRecord {
            id: id as u64,
            session: 0,
            turn: 0,
            arrival_us: 0,
            first_token_us: ttft_ms * 1_000,
            finish_us: ttft_ms * 1_000 + itl_ms * 10_000,
            prompt_tokens: 10,
            output_tokens: 11,
            path,
            rule: rule.into(),
            reusable_tokens: 0,
            ttft_floor_ms: 0.0,
        }
    }

    /// A [`Misses`] from its four figures.
    fn misses(requests: u64, ttft_only: u64, itl_only: u64, both: u64) -> Misses {
        Misses {
            requests,
            ttft_only,
            itl_only,
            both,
        }
    }

    /// Each measured request counts once, on its path, under the targets
    /// it missed; sums over runs add up.
    #[test]
    fn misses_by_path() {
        // (path, TTFT ms, ITL ms)
        let cases = [
            (Path::Bypass, 100, 20),
            (Path::Bypass, 101, 20),
            (Path::Bypass, 50, 21),
            (Path::Remote, 150, 30),
            (Path::RemoteFetch, 10, 10),
            (Path::RemoteFetch, 10, 25),
        ];
        let records: Vec<RequestRecord> = cases
            .iter()
            .enumerate()
            .map(|(i, &(path, ttft, itl))| record(i, path, "r", ttft, itl))
            .collect();
        let m = MissesByPath::of(&records, &SLO);
        assert_eq!(m.bypass, misses(3, 1, 1, 0));
        assert_eq!(m.remote, misses(1, 0, 0, 1));
        assert_eq!(m.fetch, misses(2, 0, 1, 0));
        assert_eq!(m.total(), misses(6, 1, 2, 1));
        assert_eq!(m.over_shares(), (2.0 / 6.0, 3.0 / 6.0));
        let mut sum = m;
        sum += &m;
        assert_eq!(sum.bypass, misses(6, 2, 2, 0));
        assert_eq!(sum.fetch, misses(4, 0, 2, 0));
    }

    /// Each measured request counts once, under its rule; the rules rank
    /// by misses, then by requests, then by name; sums over runs add up,
    /// rules one run lacks included.
    #[test]
    fn misses_by_rule() {
        // (rule, TTFT ms, ITL ms); "e" and "a" tie on both figures.
        let cases = [
            ("e", 10, 10),
            ("a", 10, 10),
            ("b", 10, 10),
            ("b", 10, 10),
            ("c", 200, 10),
            ("c", 10, 30),
            ("d", 200, 30),
        ];
        let records: Vec<RequestRecord> = cases
            .iter()
            .enumerate()
            .map(|(i, &(rule, ttft, itl))| record(i, Path::Bypass, rule, ttft, itl))
            .collect();
        let m = MissesByRule::of(&records, &SLO);
        let (c, d, b, one) = (
            misses(2, 1, 1, 0),
            misses(1, 0, 0, 1),
            misses(2, 0, 0, 0),
            misses(1, 0, 0, 0),
        );
        assert_eq!(
            m.ranked(),
            vec![("c", &c), ("d", &d), ("b", &b), ("a", &one), ("e", &one)]
        );
        let mut sum = MissesByRule::of(&records[4..5], &SLO);
        sum += &m;
        let c2 = misses(3, 2, 1, 0);
        assert_eq!(
            sum.ranked(),
            vec![("c", &c2), ("d", &d), ("b", &b), ("a", &one), ("e", &one)]
        );
    }

    #[test]
    fn request_latencies() {
        let r = RequestRecord {
            id: 1,
            session: 1,
            turn: 0,
            arrival_us: 1_000,
            first_token_us: 101_000,
            finish_us: 301_000,
            prompt_tokens: 10,
            output_tokens: 11,
            path: Path::Bypass,
            rule: "isl.short_append".into(),
            reusable_tokens: 0,
            ttft_floor_ms: 50.0,
        };
        assert_eq!(r.ttft_ms(), 100.0);
        assert_eq!(r.itl_ms(), 20.0);
        assert!(r.meets(&Slo {
            ttft_ms: 100.0,
            itl_ms: 20.0
        }));
        assert!(!r.meets(&Slo {
            ttft_ms: 99.0,
            itl_ms: 20.0
        }));
    }
}
