"""vLLM's side of the `eagle3 bench --peers vllm` rows: run by vLLM's own Python (a virtual
environment of its own, recipes/vllm/setup.sh), so it imports only the standard library and
vllm, never eagle3.

    VLLM_PYTHON vllm_worker.py '{"target": DIR, "head": DIR|null, "k": 3, "dtype": "float32",
                                 "max_tokens": 64, "stop_token_ids": [2], "threads": 2}'

It builds one `vllm.LLM` (batch 1, greedy), warms it up, prints {"ready": ..., "load_seconds":
...} and then answers one JSON line per request line {"ids": [...]} with {"tokens": [...],
"seconds": ..., "drafts": ..., "draft_tokens": ..., "accepted_tokens": ...}: the seconds of
`generate` alone (prompt + decode, as eagle3's rows), the speculation counters' increase over
the request. Protocol lines go to the stdout the worker was started with; everything else
vLLM prints goes to stderr. An empty line or end of input ends it.
"""

import json
import os
import sys
import time


def _counters(llm) -> dict:
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted_tokens"}
    out = dict.fromkeys(names.values(), 0)
    for m in llm.get_metrics():
        if m.name in names and hasattr(m, "value"):
            out[names[m.name]] = int(m.value)
    return out


def main() -> None:
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep it off the protocol
    try:
        serve(json.loads(sys.argv[1]), proto)
    except Exception as e:  # one line for eagle3's error message; the traceback to the log
        import traceback

        traceback.print_exc()
        proto.write(json.dumps({"error": f"{type(e).__name__}: {e}".splitlines()[0][:300]}) + "\n")
        sys.exit(1)


def serve(cfg: dict, proto) -> None:
    threads = int(cfg.get("threads", 2))
    # The settings that ran on 2 CPU cores (docs/weight-formats.md, "vLLM's CPU build"): no AOT compile
    # cache (reloading it fails), the first `threads` cores, none reserved, 2 GiB of KV cache.
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kw = {}
    if cfg.get("head"):
        kw["speculative_config"] = {"method": "eagle3", "model": cfg["head"],
                                    "num_speculative_tokens": int(cfg["k"])}
    t0 = time.time()
    llm = LLM(model=cfg["target"], dtype=cfg.get("dtype", "float32"),
              max_model_len=int(cfg.get("max_model_len", 2048)), disable_log_stats=False, **kw)
    params = SamplingParams(temperature=0, max_tokens=int(cfg["max_tokens"]),
                            stop_token_ids=list(cfg.get("stop_token_ids") or []))
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)  # compiles
    proto.write(json.dumps({"ready": True, "load_seconds": time.time() - t0}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            break
        ids = json.loads(line)["ids"]
        before = _counters(llm)
        t = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        seconds = time.perf_counter() - t
        after = _counters(llm)
        reply = {"tokens": list(out[0].outputs[0].token_ids), "seconds": seconds}
        reply.update({k: after[k] - before[k] for k in after})
        proto.write(json.dumps(reply) + "\n")


if __name__ == "__main__":
    main()
