"""GuideLLM and AIPerf smoke runs against a running router, each in its
default (chat) mode with nothing beyond the URL, the model, the tokenizer
and a request count.

Usage: smoke_clients.py ROUTER_URL MODEL TOKENIZER_DIR OUT_DIR [REQUESTS]

Runs with the python of a venv holding guidellm and aiperf
(scripts/requirements-clients.txt; scripts/clients makes it). Prints each
tool's summary and exits non-zero on the first failure: a tool's non-zero
exit, fewer successful requests than sent, any errored request, a request
not sent to /v1/chat/completions, or a warning that the router's usage
disagrees with the client's counts (both tools exit 0 on failed requests,
so their reports are read).
"""

import glob
import json
import os
import subprocess
import sys
from pathlib import Path


def fail(what):
    sys.exit(f"FAIL: {what}")


def run(cmd, cwd, log):
    print("$", " ".join(cmd), flush=True)
    with open(log, "w") as out:
        code = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                              timeout=600).returncode
    text = Path(log).read_text(errors="replace")
    if code != 0:
        print(text[-4000:])
        fail(f"{cmd[0]} exited with {code}")
    return text


def guidellm(bindir, url, model, tokenizer, out, requests):
    work = out / "guidellm"
    work.mkdir(parents=True, exist_ok=True)
    text = run([
        str(bindir / "guidellm"), "run",
        "--backend", f"kind=openai_http,target={url},model={model}",
        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
        "--data", "kind=synthetic_text,prompt_tokens=256,output_tokens=32",
        "--profile", "kind=synchronous",
        "--constraint", f"kind=max_requests,count={requests}",
        "--disable-console-interactive",
    ], work, work / "guidellm.log")
    report = json.loads((work / "benchmarks.json").read_text())
    bench = report["benchmarks"][0]
    totals = bench["metrics"]["request_totals"]
    fmt = bench["config"]["backend"].get("request_format") if isinstance(bench["config"].get("backend"), dict) else None
    print(f"guidellm: {totals} (request format {fmt or 'default'})")
    if "/v1/chat/completions" not in text:
        fail("guidellm did not use /v1/chat/completions")
    if totals["successful"] != requests or totals["errored"] or totals["incomplete"]:
        fail(f"guidellm: {totals}")
    ttft = bench["metrics"]["time_to_first_token_ms"]["successful"]
    print(f"guidellm: TTFT median {ttft['median']:.1f} ms, "
          f"output tokens/request median {bench['metrics']['output_token_count']['successful']['median']}")


def aiperf(bindir, url, model, tokenizer, out, requests):
    work = out / "aiperf"
    work.mkdir(parents=True, exist_ok=True)
    text = run([
        str(bindir / "aiperf"), "profile",
        "--model", model, "--url", url, "--tokenizer", str(tokenizer),
        "--request-count", str(requests), "--ui-type", "none",
    ], work, work / "aiperf.log")
    [export] = glob.glob(str(work / "artifacts/*/profile_export_aiperf.json"))
    report = json.loads(Path(export).read_text())
    count = report["request_count"]["avg"]
    errors = report.get("error_summary") or []
    print(f"aiperf: {count:.0f} requests, errors {errors}, endpoint {Path(export).parent.name}")
    if "openai-chat" not in Path(export).parent.name:
        fail("aiperf did not run in chat mode")
    if count != requests or errors:
        fail(f"aiperf: {count} requests, errors {errors}")
    for warning in ("Token Count Discrepancy", "cached_tokens"):
        if warning in text:
            fail(f"aiperf warned: {warning}")
    for metric in ("request_latency", "input_sequence_length", "output_sequence_length"):
        m = report[metric]
        print(f"aiperf: {metric} p50 {m['p50']:.1f} {m['unit']}")


def main():
    url, model, tokenizer, out = sys.argv[1:5]
    requests = int(sys.argv[5]) if len(sys.argv) > 5 else 30
    bindir = Path(sys.executable).parent
    out = Path(out).resolve()
    tokenizer = Path(tokenizer).resolve()
    # The tokenizer is a local directory (an absolute path: both tools then
    # load it without asking a hub; AIPerf's HF_HUB_OFFLINE mode would look
    # for a hub cache instead). No usage telemetry.
    os.environ.setdefault("DO_NOT_TRACK", "1")
    guidellm(bindir, url, model, tokenizer, out, requests)
    aiperf(bindir, url, model, tokenizer, out, requests)
    print("all checks passed")


if __name__ == "__main__":
    main()
