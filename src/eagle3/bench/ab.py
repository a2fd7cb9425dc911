"""The A/B benchmark's orchestration (`eagle3 bench` without --concurrency): load one speculator
per backend and weight format, gather the peers' arms (transformers in this process, llama.cpp
and vLLM as programs of their own), and run them interleaved (`harness.run_bench`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch

from ..errors import Eagle3Error, notice
from . import llamacpp, peers, vllm
from .harness import run_bench
from .prompts import encode_prompts

ENGINE_PEERS = ("llama.cpp", "vllm")  # other engines, run as separate programs


def run_ab(args: argparse.Namespace, backend_names: list[tuple[str, str]], formats: list[str | None],
           records: list[tuple[str, dict]], ks: list[int], auto: bool, trees: list,
           peer_names: list[str], notes: list[str],
           proposers: list[str | None] = (None,)) -> tuple[dict[str, Any], Any, list[list[int]]]:
    """Run the benchmark `args` describes (checked by the CLI); returns the report, the first
    speculator and the encoded prompts. `notes` gathers what was skipped and why."""
    import eagle3

    from ..targets import HFTarget, resolve_dtype
    from ..targets.default import default_target_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    backends = {}
    for name, backend in backend_names:
        if name == "executorch":
            backends[name] = eagle3.load(args.target, "none" if args.draft == "none" else None,
                                         backend="executorch", program=args.program)
            continue
        for fmt in formats:  # one eager backend per weight format, side by side
            key = name if len(formats) == 1 else f"{name}:{fmt or 'fp32'}"
            backends[key] = eagle3.load(args.target, args.draft, dtype=args.dtype, backend=backend,
                                        max_seq_len=args.max_seq_len, taps=args.taps,
                                        compile=args.compile, device=args.device, quantize=fmt)
    spec = next(iter(backends.values()))
    eager_key = next((k for k in backends if k.startswith("eager")), None)
    if spec.draft is None:
        notes.append("no draft head: measuring plain decoding and the peers only (pass --draft DIR)")
    prompts = encode_prompts(records, spec, args.max_new_tokens)
    arms = {}
    hf_names = [n for n in peer_names if n not in ENGINE_PEERS]  # transformers, in this process
    if hf_names and eager_key is None:
        if args.peers is not None:
            raise Eagle3Error("the transformers peers need the eager backend in --backend; add "
                              "eager or pass --peers none")
        notes.append("no eager backend: skipping the transformers peers")
        hf_names = []
    if "llama.cpp" in peer_names:
        arms.update(llamacpp.arms_for(args.target, args.draft, spec, args.max_new_tokens, ks, notes))
    if hf_names:
        tgt = backends[eager_key].target
        model = (tgt.model if isinstance(tgt, HFTarget) else
                 peers.load_model(default_target_dir() if args.target == "default" else args.target,
                                  resolve_dtype(args.dtype), tgt.embedding_weight.device, "target"))
        assistant = (peers.load_model(args.assistant, resolve_dtype(args.dtype), model.device, "assistant")
                     if "assisted" in hf_names else None)
        arms.update(peers.peer_arms(hf_names, model, args.max_new_tokens, tgt.config.eos_token_ids,
                                    assistant))
    workers = vllm.start_for(args, spec, ks, notes) if "vllm" in peer_names else {}
    for note in notes:
        notice(note)
    try:  # vLLM's engines run in processes of their own: stopped whatever happens
        arms.update({name: vllm.arm(w) for name, w in workers.items()})
        report = run_bench(spec, prompts, ks=ks, max_new_tokens=args.max_new_tokens,
                           repeats=args.repeats, peers=arms, auto=auto, trees=trees,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                           progress=sys.stderr.isatty(),
                           backends=backends, proposers=proposers)
    finally:
        vllm.close(workers)
    report["settings"].update(target=args.target, draft=args.draft, backend=args.backend,
                              compiled=args.compile,
                              dtype=str(resolve_dtype(args.dtype)).replace("torch.", ""),
                              device=str(spec.target.embedding_weight.device),
                              program=args.program,
                              weight_formats={k: getattr(b.target, "weight_format", None)
                                              for k, b in backends.items()})
    report["notes"] = notes
    for name, w in workers.items():
        report["peers"][name]["load_seconds"] = w.load_seconds
    return report, spec, prompts
