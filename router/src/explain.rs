//! A decision and what it looked at, for people (text) and tools (JSON):
//! `/v1/route?explain=true` and `replay explain` print the same.

use std::fmt::Write as _;

use protocol::RouteDecision;
use serde_json::{json, Value};

use crate::core::{CandidateScore, Explanation, Side};

fn candidate_json(c: &CandidateScore, picked: bool, block_size: u32) -> Value {
    json!({
        "worker": c.worker.to_string(),
        "picked": picked,
        "overlap_blocks": {"device": c.depth.device, "host": c.depth.host, "disk": c.depth.disk},
        "overlap_tokens": c.depth.disk.saturating_mul(block_size),
        "weighted_overlap_blocks": c.overlap_blocks,
        "load": {
            "running": c.load.running,
            "waiting": c.load.waiting,
            "queued_prefill_tokens": c.load.queued_prefill_tokens,
            "active_decode_blocks": c.load.active_decode_blocks,
            "kv_blocks_used": c.load.kv_blocks_used,
            "reported_kv_blocks_used": c.load.reported_kv_blocks_used,
            "kv_capacity_blocks": c.load.kv_capacity_blocks,
            "recent_itl_us": c.load.recent_itl_us,
        },
        "busy": c.busy,
        "cost": c.cost,
    })
}

/// The candidate holding the longest prefix, if any.
fn holder(e: &Explanation) -> Option<(&'static str, &CandidateScore)> {
    e.holder.and_then(|(side, i)| match side {
        Side::Decode => e.decode.get(i).map(|c| ("decode", c)),
        Side::Prefill => e.prefill.get(i).map(|c| ("prefill", c)),
    })
}

/// The decision and its explanation as JSON.
pub fn to_json(decision: &RouteDecision, e: &Explanation, block_size: u32) -> Value {
    let list = |cs: &[CandidateScore], pick: Option<usize>| -> Vec<Value> {
        cs.iter()
            .enumerate()
            .map(|(i, c)| candidate_json(c, Some(i) == pick, block_size))
            .collect()
    };
    json!({
        "decision": decision.id.to_string(),
        "request_id": decision.request_id,
        "path": decision.path.as_str(),
        "decode": decision.decode.to_string(),
        "prefill": decision.prefill.as_ref().map(ToString::to_string),
        "fetch": decision.fetch.as_ref().map(|f| json!({
            "source": f.source.to_string(),
            "prefix_tokens": f.prefix_tokens,
            "pulled_tokens": f.pulled_tokens,
            "pulled_blocks": f.pulled_blocks(block_size),
        })),
        "isl_tokens": decision.isl_tokens,
        "request_blocks": e.request_blocks,
        "policy": decision.policy,
        "policy_params": e.policy_params.iter().map(|(k, v)| ((*k).to_owned(), json!(v))).collect::<serde_json::Map<_, _>>(),
        "decode_candidates": list(&e.decode, e.decode_pick),
        "prefill_candidates": list(&e.prefill, e.prefill_pick),
        "prefix_holder": holder(e).map(|(side, c)| json!({"worker": c.worker.to_string(), "side": side, "overlap_blocks": c.overlap_blocks})),
        "decode_holder": e.decode_holder.and_then(|i| e.decode.get(i)).map(|c| json!({"worker": c.worker.to_string(), "overlap_blocks": c.overlap_blocks})),
        "verdict": e.verdict.as_ref().map(|v| json!({"path": v.path.as_str(), "rule": v.rule, "reason": v.reason, "on_decode_holder": v.on_decode_holder})),
        "gate": e.gate.map(|g| json!({
            "used_blocks": g.used_blocks,
            "request_blocks": g.request_blocks,
            "budget_blocks": g.budget_blocks,
            "known": g.known,
            "fits": g.fits,
        })),
        "rule": decision.rule,
        "reason": decision.reason,
    })
}

/// The decision and its explanation for people.
pub fn to_text(decision: &RouteDecision, e: &Explanation, block_size: u32) -> String {
    let mut out = String::new();
    let params: Vec<String> = e
        .policy_params
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect();
    let _ = writeln!(
        out,
        "decision {} (request {}): {} on {}{}",
        decision.id,
        decision.request_id,
        decision.path,
        decision.decode,
        decision
            .prefill
            .as_ref()
            .map(|p| format!(", prefill on {p}"))
            .unwrap_or_default()
    );
    if let Some(f) = &decision.fetch {
        let _ = writeln!(
            out,
            "  prefix fetched from {}: {} of its {} prefix tokens pulled ({} blocks pinned there while read)",
            f.source,
            f.pulled_tokens,
            f.prefix_tokens,
            f.pulled_blocks(block_size)
        );
    }
    let _ = writeln!(
        out,
        "  prompt {} tokens ({} full blocks of {block_size}); the request occupies {} KV blocks",
        decision.isl_tokens,
        decision.isl_tokens / block_size.max(1),
        e.request_blocks
    );
    let _ = writeln!(out, "  policy {} ({})", decision.policy, params.join(", "));
    let mut table = |title: &str, cs: &[CandidateScore], pick: Option<usize>| {
        if cs.is_empty() {
            return;
        }
        let _ = writeln!(out, "  {title} (lower cost wins):");
        let _ = writeln!(
            out,
            "      {:<12} {:>21} {:>8} {:>8} {:>10} {:>16} {:>10} {:>10}",
            "worker",
            "overlap dev/host/any",
            "running",
            "waiting",
            "queued tk",
            "kv used/total",
            "ITL lately",
            "cost"
        );
        for (i, c) in cs.iter().enumerate() {
            let mark = if Some(i) == pick { "->" } else { "  " };
            let _ = writeln!(
                out,
                "    {mark}{:<12} {:>21} {:>8} {:>8} {:>10} {:>16} {:>10} {:>10.1}{}",
                c.worker.to_string(),
                format!(
                    "{}/{}/{} blocks",
                    c.depth.device, c.depth.host, c.depth.disk
                ),
                c.load.running,
                c.load.waiting,
                c.load.queued_prefill_tokens,
                format!("{}/{}", c.load.kv_blocks_used, c.load.kv_capacity_blocks),
                match c.load.recent_itl_us {
                    0 => "-".to_owned(),
                    us => format!("{:.1} ms", f64::from(us) / 1000.0),
                },
                c.cost,
                if c.busy { " busy" } else { "" }
            );
        }
    };
    table("decode candidates", &e.decode, e.decode_pick);
    table("prefill candidates", &e.prefill, e.prefill_pick);
    if let Some((side, c)) = holder(e) {
        let _ = writeln!(
            out,
            "  longest prefix held by {} ({side} candidate): {} weighted blocks",
            c.worker, c.overlap_blocks
        );
    }
    if let Some(c) = e.decode_holder.and_then(|i| e.decode.get(i)) {
        let _ = writeln!(
            out,
            "  a bypass could go to {} instead of the pick: it holds {} weighted blocks",
            c.worker, c.overlap_blocks
        );
    }
    if let Some(v) = &e.verdict {
        let on = if v.on_decode_holder {
            " on the decode holder"
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  policy says {}{on} ({}): {}",
            v.path, v.rule, v.reason
        );
    }
    if let Some(g) = e.gate {
        let _ = writeln!(
            out,
            "  decode gate: {} + {} = {} KV blocks {} budget {:.0}",
            g.used_blocks,
            g.request_blocks,
            g.used_blocks.saturating_add(g.request_blocks),
            match (g.known, g.fits) {
                (false, _) => "unknown capacity: no",
                (true, true) => "within",
                (true, false) => "over",
            },
            g.budget_blocks
        );
    }
    let _ = writeln!(
        out,
        "  => {} ({}): {}",
        decision.path, decision.rule, decision.reason
    );
    out
}
