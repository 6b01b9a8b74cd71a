"""lm-evaluation-harness against `pdserve serve`: the same multiple-choice task scored through the OpenAI
completions API (lm-eval's `local-completions` backend: echo + logprobs, max_tokens 1, token-id prompts) and
by lm-eval's own `hf` backend on the same weights; per-item loglikelihoods must agree within 1e-3 and the
accuracies exactly. Exit status 0 when they do.

    pip install -e '.[eval]'   # lm-eval[api,hf], pinned; ~200 MB (datasets, scipy, scikit-learn, ...)
    python benchmarks/lm_eval_compare.py [--model DIR] [--out DIR]

Without --model it builds the tests' tiny random Llama (SmolLM2's vocabulary and tokenizer) in a temporary
folder. The task (benchmarks/lm_eval_task/: a YAML and a JSONL of 24 questions) is local files: nothing is
downloaded. The server runs at its defaults (float32 on CPU, prefix caching on: prompt-logprob requests
compute their whole prompt regardless).
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASK_DIR = ROOT / "benchmarks" / "lm_eval_task"
TASK = "pdserve_mc"
TOLERANCE = 1e-3


def require_lm_eval() -> None:
    if importlib.util.find_spec("lm_eval") is None:
        sys.exit("lm-eval is not installed: pip install -e '.[eval]' (the pinned lm-eval[api,hf])")


def run_lm_eval(model: str, model_args: str, out: Path) -> tuple[float, list[dict]]:
    """(accuracy, the logged samples) of one lm-eval run of the task."""
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", TASK,
           "--include_path", str(TASK_DIR), "--output_path", str(out), "--log_samples", "--batch_size", "1",
           "--device", "cpu"]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=TASK_DIR, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if proc.returncode != 0:
        sys.exit(f"lm_eval --model {model} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    results = sorted(glob.glob(str(out / "**" / "results_*.json"), recursive=True))
    samples = sorted(glob.glob(str(out / "**" / f"samples_{TASK}_*.jsonl"), recursive=True))
    acc = json.loads(Path(results[-1]).read_text())["results"][TASK]["acc,none"]
    return acc, [json.loads(line) for line in Path(samples[-1]).read_text().splitlines()]


def loglikelihoods(samples: list[dict]) -> dict[tuple[int, int], float]:
    """(doc id, choice index) -> the choice's loglikelihood."""
    out = {}
    for s in samples:
        for i, resp in enumerate(s["resps"]):
            out[(s["doc_id"], i)] = float(resp[0][0])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="an HF model folder with a tokenizer (default: the tests' tiny model)")
    parser.add_argument("--out", help="where lm-eval writes its results (default: a temporary folder)")
    parser.add_argument("--pd", action="store_true",
                        help="score through `pdserve proxy` in front of a prefill and a decode instance (NIXL)")
    args = parser.parse_args()
    require_lm_eval()
    sys.path.insert(0, str(ROOT / "tests"))
    from server_utils import MODEL, PdserveProcess, ServerProcess, all_ready, free_port, make_model_dir

    work = Path(args.out or tempfile.mkdtemp(prefix="lm-eval-"))
    work.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model) if args.model else make_model_dir(work)
    if args.pd:
        def kv(role: str) -> str:
            return json.dumps({"kv_connector": "NixlConnector", "kv_role": role})

        servers: dict[str, PdserveProcess] = {
            "prefill": ServerProcess(model_dir, work / "prefill.log", "--kv-transfer-config", kv("kv_producer"),
                                     "--side-channel-port", "0"),
            "decode": ServerProcess(model_dir, work / "decode.log", "--kv-transfer-config", kv("kv_consumer"))}
    else:
        servers = {"serve": ServerProcess(model_dir, work / "serve.log")}
    with all_ready(servers):
        if args.pd:
            port = free_port()
            servers["proxy"] = PdserveProcess(work / "proxy.log", port, [
                "proxy", "--host", "127.0.0.1", "--port", str(port), "--prefill", servers["prefill"].url,
                "--decode", servers["decode"].url])
            servers["proxy"].wait_ready()
        url = servers["proxy" if args.pd else "serve"].url
        api_acc, api = run_lm_eval(
            "local-completions",
            f"model={MODEL},base_url={url}/v1/completions,tokenizer_backend=huggingface,"
            f"tokenizer={model_dir},num_concurrent=1,max_retries=1,tokenized_requests=True",
            work / "local-completions")
        routed = None
        if args.pd:  # how the proxy served the scoring requests (all whole on the prefill instance)
            import httpx
            from server_utils import metric_value

            routed = {p: metric_value(httpx.get(f"{url}/metrics").text, f'pdserve_proxy_requests_total{{path="{p}"}}')
                      for p in ("prefill_local", "conditional_local", "disagg")}
    hf_acc, hf = run_lm_eval("hf", f"pretrained={model_dir},dtype=float32", work / "hf")
    a, b = loglikelihoods(api), loglikelihoods(hf)
    assert a.keys() == b.keys(), "the two runs scored different items"
    worst = max(abs(a[k] - b[k]) for k in a)
    print(json.dumps({"task": TASK, "served_by": "proxy (1P1D)" if args.pd else "pdserve serve", "items": len(api), "choices": len(a), "accuracy_pdserve": api_acc,
                      "accuracy_hf": hf_acc, "max_abs_loglikelihood_diff": worst,
                      "proxy_paths": routed,
                      "example": {str(k): [a[k], b[k]] for k in list(a)[:3]}}, indent=2))
    ok = worst <= TOLERANCE and api_acc == hf_acc
    print("PASS" if ok else f"FAIL (tolerance {TOLERANCE}, accuracies must be equal)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
