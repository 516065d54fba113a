//! An engine's `/metrics` text, as the agent scrapes vLLM's and SGLang's
//! for the load it reports: samples parsed, malformed lines counted, the
//! load read for a model and rank. Nothing may panic.

use worker_agent::vllm::prom;

pub fn run(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let (samples, bad) = prom::parse(text);
    assert!(
        samples.len() + bad <= text.lines().count(),
        "more samples and bad lines than lines"
    );
    let _ = prom::load(&samples, Some("m"), 0);
    let _ = prom::load(&samples, None, 1);
}

pub fn seeds() -> Vec<Vec<u8>> {
    let text = concat!(
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n",
        "# TYPE vllm:num_requests_running gauge\n",
        "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0\n",
        "vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 1\n",
        "vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.25\n",
        "sglang:num_running_reqs{model_name=\"m\",dp_rank=\"0\"} 2 1700000000000\n",
        "sglang:token_usage{model_name=\"m\"} NaN\n",
        "bad line\n",
    );
    vec![text.as_bytes().to_vec()]
}
