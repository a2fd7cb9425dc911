"""The vLLM peer (run with build/vllm/venv after setup.sh and prepare.py): batch-1 greedy
decoding of the prepared prompts, plain or EAGLE-3 with the default head, tokens/s and the
tokens themselves (compare with `compare.py`).

    LD_PRELOAD=build/vllm/venv/lib/libiomp5.so build/vllm/venv/bin/python recipes/vllm/run.py \
        float32|bfloat16 plain|eagle3 [N_PROMPTS] [K] > out.json
"""

import json
import os
import sys
import time

# The settings that worked on 2 CPU cores (issue 17): no AOT compile cache, both cores,
# none reserved, 2 GiB of KV cache.
os.environ.update(VLLM_USE_AOT_COMPILE="0", VLLM_CPU_OMP_THREADS_BIND="0-1",
                  VLLM_CPU_NUM_OF_RESERVED_CPU="0", VLLM_CPU_KVCACHE_SPACE="2")
from vllm import LLM, SamplingParams  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "build", "vllm")


def main() -> None:
    dtype, mode = sys.argv[1], sys.argv[2]
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 8
    k = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    prompts = json.load(open(os.path.join(ROOT, "prompts.json")))[:n]
    kw = {}
    if mode == "eagle3":
        kw["speculative_config"] = {"method": "eagle3", "model": os.path.join(ROOT, "head"),
                                    "num_speculative_tokens": k}
    t0 = time.time()
    llm = LLM(model=os.path.join(ROOT, "target"), dtype=dtype, max_model_len=2048,
              disable_log_stats=False, **kw)
    load = time.time() - t0
    sp = SamplingParams(temperature=0, max_tokens=64)
    llm.generate(prompts[:1], sp, use_tqdm=False)  # warm-up (compiles)
    runs = []
    for p in prompts:  # batch 1, end to end per prompt
        t = time.time()
        out = llm.generate([p], sp, use_tqdm=False)
        runs.append({"tokens": list(out[0].outputs[0].token_ids), "seconds": time.time() - t})
    counts = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:spec_decode_num_") and hasattr(m, "value"):
            counts[m.name] = m.value
    tokens = sum(len(r["tokens"]) for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    print(json.dumps({"dtype": dtype, "mode": mode, "k": k if mode == "eagle3" else None,
                      "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
                      "load_seconds": load, "spec_decode": counts,
                      "outputs": [r["tokens"] for r in runs]}))


if __name__ == "__main__":
    main()
