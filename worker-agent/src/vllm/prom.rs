//! The engine's Prometheus `/metrics` text, parsed into what the agent
//! reports as load. Pure.
//!
//! vLLM's names: `vllm:num_requests_running`, `vllm:num_requests_waiting`,
//! `vllm:kv_cache_usage_perc` (older builds: `vllm:gpu_cache_usage_perc`),
//! a fraction in 0..1 despite the name; `vllm:cache_config_info` carries
//! the cache configuration as labels (`block_size`, `num_gpu_blocks`).
//! SGLang's: `sglang:num_running_reqs`, `sglang:num_queue_reqs`,
//! `sglang:token_usage`. The inter-token latency histogram's totals
//! (`_sum`, `_count`), one observation per output token:
//! `vllm:inter_token_latency_seconds` (older builds:
//! `vllm:time_per_output_token_seconds`), `sglang:inter_token_latency_seconds`
//! (SGLang's `time_per_output_token_seconds` is not read: one observation
//! per finished request, its time to first token included). Every sample
//! carries a `model_name` label; with data parallelism an engine index
//! label (`engine`, or SGLang's `dp_rank`) tells the ranks apart.

use std::collections::BTreeMap;

/// One sample: name, labels, value.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub value: f64,
}

/// Parses Prometheus text exposition: comments skipped, malformed lines
/// skipped (counted in the second value).
pub fn parse(text: &str) -> (Vec<Sample>, usize) {
    let mut samples = Vec::new();
    let mut bad = 0;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_line(line) {
            Some(s) => samples.push(s),
            None => bad += 1,
        }
    }
    (samples, bad)
}

fn parse_line(line: &str) -> Option<Sample> {
    let name_end = line
        .find(|c: char| c == '{' || c.is_whitespace())
        .unwrap_or(line.len());
    let name = &line[..name_end];
    if name.is_empty() {
        return None;
    }
    let mut rest = &line[name_end..];
    let mut labels = BTreeMap::new();
    if let Some(after) = rest.strip_prefix('{') {
        let mut chars = after.char_indices().peekable();
        let end;
        loop {
            // Skip separators.
            while let Some(&(_, c)) = chars.peek() {
                if c == ',' || c.is_whitespace() {
                    chars.next();
                } else {
                    break;
                }
            }
            let (start, c) = *chars.peek()?;
            if c == '}' {
                end = start + 1;
                break;
            }
            let mut key_end = start;
            while let Some(&(i, c)) = chars.peek() {
                if c == '=' {
                    key_end = i;
                    break;
                }
                chars.next();
            }
            let key = after[start..key_end].trim().to_owned();
            chars.next(); // '='
            if chars.next()?.1 != '"' {
                return None;
            }
            let mut value = String::new();
            loop {
                let (_, c) = chars.next()?;
                match c {
                    '\\' => match chars.next()?.1 {
                        'n' => value.push('\n'),
                        other => value.push(other),
                    },
                    '"' => break,
                    other => value.push(other),
                }
            }
            labels.insert(key, value);
        }
        rest = &after[end..];
    }
    let value = rest.split_whitespace().next()?;
    let value = match value {
        "+Inf" => f64::INFINITY,
        "-Inf" => f64::NEG_INFINITY,
        v => v.parse().ok()?,
    };
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// What the engine's metrics say about its load.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ScrapedLoad {
    pub running: Option<f64>,
    pub waiting: Option<f64>,
    /// KV cache usage, 0..1.
    pub kv_usage: Option<f64>,
    /// `block_size` of `vllm:cache_config_info`.
    pub block_size: Option<u32>,
    /// `num_gpu_blocks` of `vllm:cache_config_info`.
    pub num_gpu_blocks: Option<u64>,
    /// The inter-token latency histogram's totals so far.
    pub itl: Option<LatencyTotals>,
    /// The mean inter-token latency lately, µs (0: unknown): not in one
    /// scrape, the scrape loop fills it from `itl` over time
    /// ([`super::recent::RecentLatency`]).
    pub recent_itl_us: u32,
}

/// A latency histogram's cumulative `_sum` (seconds) and `_count`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LatencyTotals {
    pub sum_s: f64,
    pub count: f64,
}

const RUNNING: [&str; 2] = ["vllm:num_requests_running", "sglang:num_running_reqs"];
const WAITING: [&str; 2] = ["vllm:num_requests_waiting", "sglang:num_queue_reqs"];
const KV_USAGE: [&str; 3] = [
    "vllm:kv_cache_usage_perc",
    "vllm:gpu_cache_usage_perc",
    "sglang:token_usage",
];
const RANK_LABELS: [&str; 3] = ["engine", "dp_rank", "engine_index"];
/// Newest first: an engine exporting two is read by the first.
const ITL: [&str; 3] = [
    "vllm:inter_token_latency_seconds",
    "sglang:inter_token_latency_seconds",
    "vllm:time_per_output_token_seconds",
];

/// `name` as `(index in ITL, is the sum)` when it is one of their totals.
fn itl_total(name: &str) -> Option<(usize, bool)> {
    ITL.iter()
        .enumerate()
        .find_map(|(i, base)| match name.strip_prefix(base)? {
            "_sum" => Some((i, true)),
            "_count" => Some((i, false)),
            _ => None,
        })
}

/// The load of the engine serving `model` (any model when `None`), of
/// data-parallel rank `rank` when the samples carry a rank label (samples
/// of other ranks are left out). Counts over several samples add up; the
/// usage is their mean.
pub fn load(samples: &[Sample], model: Option<&str>, rank: u32) -> ScrapedLoad {
    let rank = rank.to_string();
    let ours = |s: &Sample| {
        model.is_none_or(|m| s.labels.get("model_name").is_none_or(|n| n == m))
            && RANK_LABELS
                .iter()
                .all(|l| s.labels.get(*l).is_none_or(|r| *r == rank))
    };
    let mut out = ScrapedLoad::default();
    let mut usage = (0.0, 0u32);
    let mut usage_name: Option<&str> = None;
    // The totals of each ITL name, summed over the samples.
    let mut itl = [(None::<f64>, None::<f64>); ITL.len()];
    for s in samples.iter().filter(|s| ours(s)) {
        let name = s.name.as_str();
        if let Some((i, is_sum)) = itl_total(name) {
            let total = if is_sum { &mut itl[i].0 } else { &mut itl[i].1 };
            *total.get_or_insert(0.0) += s.value;
        } else if RUNNING.contains(&name) {
            *out.running.get_or_insert(0.0) += s.value;
        } else if WAITING.contains(&name) {
            *out.waiting.get_or_insert(0.0) += s.value;
        } else if KV_USAGE.contains(&name) {
            // The newest name wins when an engine exports two.
            let rank_of = |n: &str| KV_USAGE.iter().position(|k| *k == n);
            match usage_name {
                Some(u) if rank_of(u) < rank_of(name) => continue,
                Some(u) if u != name => usage = (0.0, 0),
                _ => {}
            }
            usage_name = Some(KV_USAGE[rank_of(name).unwrap_or(0)]);
            usage.0 += s.value;
            usage.1 += 1;
        } else if name == "vllm:cache_config_info" {
            out.block_size = s.labels.get("block_size").and_then(|v| v.parse().ok());
            out.num_gpu_blocks = s
                .labels
                .get("num_gpu_blocks")
                .and_then(|v| v.parse::<f64>().ok())
                .filter(|v| v.is_finite() && *v >= 0.0)
                .map(|v| v as u64);
        }
    }
    if usage.1 > 0 {
        out.kv_usage = Some((usage.0 / f64::from(usage.1)).clamp(0.0, 1.0));
    }
    out.itl = itl.iter().find_map(|&(sum, count)| {
        Some(LatencyTotals {
            sum_s: sum?,
            count: count?,
        })
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Captured from a vLLM 0.6-era server (older names).
    const OLD: &str = r#"# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",enable_prefix_caching="True",gpu_memory_utilization="0.9",num_cpu_blocks="2048",num_gpu_blocks="27702",sliding_window="None",swap_space_bytes="4294967296"} 1.0
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:num_requests_swapped Number of requests swapped to CPU.
# TYPE vllm:num_requests_swapped gauge
vllm:num_requests_swapped{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.25
# HELP vllm:prompt_tokens_total Number of prefill tokens processed.
# TYPE vllm:prompt_tokens_total counter
vllm:prompt_tokens_total{model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.2345e+04
vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
"#;

    /// Captured from a vLLM V1 server with two data-parallel engines (newer
    /// names, `engine` label).
    const NEW_DP: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="Llama-3.3-70B-Instruct-FP8"} 5.0
vllm:num_requests_running{engine="1",model_name="Llama-3.3-70B-Instruct-FP8"} 1.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Llama-3.3-70B-Instruct-FP8"} 0.0
vllm:num_requests_waiting{engine="1",model_name="Llama-3.3-70B-Instruct-FP8"} 4.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="Llama-3.3-70B-Instruct-FP8"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="Llama-3.3-70B-Instruct-FP8"} 0.125
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Llama-3.3-70B-Instruct-FP8"} 4096.0
vllm:prefix_cache_hits_total{engine="0",model_name="Llama-3.3-70B-Instruct-FP8"} 1024.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="29000"} 1.0
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="28000"} 1.0
"#;

    #[test]
    fn old_names() {
        let (samples, bad) = parse(OLD);
        assert_eq!(bad, 0);
        let l = load(&samples, Some("meta-llama/Llama-3.1-8B-Instruct"), 0);
        assert_eq!(l.running, Some(3.0));
        assert_eq!(l.waiting, Some(2.0));
        assert_eq!(l.kv_usage, Some(0.25));
        assert_eq!(l.block_size, Some(16));
        assert_eq!(l.num_gpu_blocks, Some(27702));
        let other = load(&samples, Some("another-model"), 0);
        assert_eq!(other.running, None);
    }

    #[test]
    fn new_names_per_data_parallel_rank() {
        let (samples, bad) = parse(NEW_DP);
        assert_eq!(bad, 0);
        let l0 = load(&samples, Some("Llama-3.3-70B-Instruct-FP8"), 0);
        assert_eq!(
            (l0.running, l0.waiting, l0.kv_usage, l0.num_gpu_blocks),
            (Some(5.0), Some(0.0), Some(0.5), Some(28000))
        );
        let l1 = load(&samples, None, 1);
        assert_eq!(
            (l1.running, l1.waiting, l1.kv_usage, l1.num_gpu_blocks),
            (Some(1.0), Some(4.0), Some(0.125), Some(29000))
        );
    }

    #[test]
    fn the_newer_usage_name_wins_and_garbage_is_skipped() {
        let text = "vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.3\nnot a sample\n{x=\"1\"} 2\nvllm:num_requests_running{a=\"b\\\"c\"} 7\nx{unterminated=\"1} 3\n";
        let (samples, bad) = parse(text);
        assert_eq!(bad, 3);
        let l = load(&samples, None, 0);
        assert_eq!(l.kv_usage, Some(0.3));
        assert_eq!(l.running, Some(7.0));
        assert_eq!(samples[2].labels["a"], "b\"c");
        let (samples, _) = parse("vllm:kv_cache_usage_perc 0.3\nvllm:gpu_cache_usage_perc 0.9\n");
        assert_eq!(load(&samples, None, 0).kv_usage, Some(0.3));
    }

    #[test]
    fn the_inter_token_latency_totals_of_the_newest_name() {
        let text = "\
vllm:time_per_output_token_seconds_sum{engine=\"0\",model_name=\"m\"} 99.0
vllm:time_per_output_token_seconds_count{engine=\"0\",model_name=\"m\"} 99.0
vllm:inter_token_latency_seconds_bucket{engine=\"0\",le=\"+Inf\",model_name=\"m\"} 1000.0
vllm:inter_token_latency_seconds_sum{engine=\"0\",model_name=\"m\"} 40.5
vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"m\"} 1000.0
vllm:inter_token_latency_seconds_sum{engine=\"1\",model_name=\"m\"} 7.0
vllm:inter_token_latency_seconds_count{engine=\"1\",model_name=\"m\"} 100.0
";
        let (samples, bad) = parse(text);
        assert_eq!(bad, 0);
        let totals = |rank| load(&samples, Some("m"), rank).itl;
        assert_eq!(
            totals(0),
            Some(LatencyTotals {
                sum_s: 40.5,
                count: 1000.0
            })
        );
        assert_eq!(totals(1).map(|t| t.count), Some(100.0));
        // An older build's name alone; a sum without its count is nothing.
        let (older, _) = parse("vllm:time_per_output_token_seconds_sum 3.0\nvllm:time_per_output_token_seconds_count 60\n");
        assert_eq!(load(&older, None, 0).itl.map(|t| t.sum_s), Some(3.0));
        let (half, _) = parse("sglang:inter_token_latency_seconds_sum 3.0\n");
        assert_eq!(load(&half, None, 0).itl, None);
        let (per_request, _) = parse("sglang:time_per_output_token_seconds_sum 3.0\nsglang:time_per_output_token_seconds_count 2\n");
        assert_eq!(load(&per_request, None, 0).itl, None);
        assert_eq!(load(&parse(OLD).0, None, 0).itl, None);
    }

    #[test]
    fn sglang_names() {
        let text = "sglang:num_running_reqs{model_name=\"m\",dp_rank=\"0\"} 2\nsglang:num_queue_reqs{model_name=\"m\",dp_rank=\"0\"} 1\nsglang:token_usage{model_name=\"m\",dp_rank=\"0\"} 0.4\n";
        let (samples, _) = parse(text);
        let l = load(&samples, Some("m"), 0);
        assert_eq!(
            (l.running, l.waiting, l.kv_usage),
            (Some(2.0), Some(1.0), Some(0.4))
        );
    }
}
