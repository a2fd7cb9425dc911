"""`eagle3 train-draft`: train an EAGLE-3 head for a target."""

from __future__ import annotations

import argparse

from .args import int_list


def cmd_train_draft(args: argparse.Namespace) -> int:
    from ..train.trainer import TrainArgs, train_draft

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    report = train_draft(TrainArgs(
        target=args.target, data=args.data, out=args.out, draft_vocab=args.draft_vocab,
        ttt_steps=args.ttt_steps, epochs=args.epochs, max_steps=args.max_steps, lr=args.lr,
        schedule=args.schedule, store_topk=args.store_topk, hard_loss=args.hard_loss,
        batch=args.batch, echo=args.echo, warmup=args.warmup, grad_clip=args.grad_clip, seed=args.seed,
        resume=args.resume, ckpt_every=args.ckpt_every, prompt_len=args.prompt_len,
        response_len=args.response_len, prompts_per_file=args.prompts_per_file,
        regen_batch=args.regen_batch, regen_chunk=args.regen_chunk,
        temperature=args.temperature, features=args.features,
        taps=tuple(args.taps) if args.taps else None, progress=not args.quiet,
        stop_after=args.stop_after, dtype=args.dtype, max_seq_len=args.max_seq_len,
        max_prompt_len=args.max_prompt_len, autocast=args.autocast, init_from=args.init_from,
        eval_every=args.eval_every, eval_tokens=args.eval_tokens,
        lm_head_from_target=args.lm_head_from_target, freeze_lm_head=args.freeze_lm_head,
        norm_before_fc=args.norm_before_fc))
    if report:
        acc = ", ".join(f"{a:.2f}" for a in report["final_acc_per_step"])
        tau = report.get("simulated_tau")
        sim = (f"; held-out simulated tau K=1..{len(tau)} [{', '.join(f'{x:.2f}' for x in tau)}]"
               if tau else "")
        print(f"eagle3: trained {report['steps']} steps; final loss {report['final_loss']:.3f}; "
              f"top-1 per step [{acc}]{sim}; head in {args.out}/head (official) and "
              f"{args.out}/head-speculators")
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train-draft", help="train an EAGLE-3 head for a target (training-time test)",
                       description="Train an EAGLE-3 head: the target regenerates responses to the "
                       "prompts (cached), the draft vocabulary is taken from them, and the head is "
                       "trained with training-time test (unrolled draft steps, loss 0.8^i). Saves "
                       "OUT/head (official; speculators with --norm-before-fc), OUT/head-speculators, "
                       "OUT/report.json and report.png. "
                       "Data-parallel under torchrun --nproc_per_node N -m eagle3 train-draft ...")
    t.add_argument("--target", required=True,
                   help="the frozen target: checkpoint directory, .gguf file or model name "
                        "(eagle3 models)")
    t.add_argument("--data", required=True,
                   help="sharegpt or sharegpt:N (ShareGPT's training split, N conversations, "
                        "chat-templated), a .jsonl with prompt / prompt_ids / messages per line, or a "
                        "text file or directory of text files to cut prompts from")
    t.add_argument("--out", required=True, help="output directory (data cache, checkpoints, head)")
    t.add_argument("--draft-vocab", type=int, default=2048,
                   help="draft vocabulary size: the most frequent response tokens (default 2048)")
    t.add_argument("--ttt-steps", type=int, default=7, help="unrolled draft steps (default 7)")
    t.add_argument("--epochs", type=int, default=1)
    t.add_argument("--max-steps", type=int, default=None, help="train this many optimizer steps in all")
    t.add_argument("--stop-after", type=int, default=None,
                   help="end this run after this step (checkpointed; --resume continues with the "
                        "same schedule)")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    t.add_argument("--echo", type=int, default=1, metavar="E",
                   help="optimizer steps on each batch's target features (data echoing): the "
                        "target's forward is most of an online step on a CPU, so E > 1 buys more "
                        "steps per hour for repeated data; an epoch becomes E times as many steps "
                        "(default 1: every step a fresh batch)")
    t.add_argument("--warmup", type=int, default=50, help="linear warmup steps before --schedule")
    t.add_argument("--schedule", choices=("cosine", "constant", "linear"), default="cosine",
                   help="the learning rate after warmup: cosine decay to 0 at the last step "
                        "(default), constant (a main run that can always be extended), or linear "
                        "decay to 0 (a short cool-down run --init-from a constant run's head)")
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--resume", action="store_true",
                   help="continue from OUT/checkpoint.pt (also after kill -9: every output is "
                        "written atomically, so the result equals an uninterrupted run's)")
    t.add_argument("--ckpt-every", type=int, default=100)
    t.add_argument("--lm-head-from-target", action="store_true",
                   help="initialise the head's lm_head from the target's output rows for the draft "
                        "vocabulary and its final norm from the target's (default: random, std 0.02)")
    t.add_argument("--freeze-lm-head", type=int, default=0, metavar="STEPS",
                   help="keep lm_head fixed for the first STEPS steps (its gradient is not computed)")
    t.add_argument("--norm-before-fc", action="store_true",
                   help="an RMSNorm over the concatenated taps before fc (as recent speculators heads "
                        "have; saved as norm_before_fc in the head's config)")
    t.add_argument("--eval-every", type=int, default=200,
                   help="every this many steps (and at the end) log the simulated tau of chains of "
                        "K = 1..6 on held-out samples: the share of rows whose first k drafts are all "
                        "the target's tokens, from the training-time-test unroll (seconds; 0: off)")
    t.add_argument("--eval-tokens", type=int, default=20000,
                   help="response tokens held out of training for it: whole samples, a seeded draw, "
                        "at most a tenth of them, none below 20 samples (default 20000)")
    t.add_argument("--prompt-len", type=int, default=64,
                   help="prompt length in tokens when cutting prompts from text files")
    t.add_argument("--prompts-per-file", type=int, default=4)
    t.add_argument("--response-len", type=int, default=96, help="tokens the target generates per prompt")
    t.add_argument("--regen-batch", type=int, default=32, help="prompts per regeneration batch")
    t.add_argument("--regen-chunk", type=int, default=256,
                   help="prompts per cached regeneration chunk: a killed run redoes at most one "
                        "(default 256)")
    t.add_argument("--temperature", type=float, default=0.0,
                   help="regenerate by sampling at this temperature (default 0: greedy)")
    t.add_argument("--features", choices=("online", "offline"), default="online",
                   help="capture target taps per step (online) or once into memory-mapped files")
    t.add_argument("--hard-loss", type=float, default=0.0, metavar="W",
                   help="share of the loss that is the plain cross-entropy to the token the "
                        "sequence holds (on greedily regenerated data: the target's own greedy pick) "
                        "instead of the soft cross-entropy to its distribution; rows whose token is "
                        "outside the draft vocabulary keep only the soft part (default 0)")
    t.add_argument("--store-topk", type=int, default=0, metavar="K",
                   help="--features offline: keep only each token's K largest draft-vocab logits "
                        "(the loss then targets the renormalised top-K distribution; K = 64 stores "
                        "~5x fewer bytes for an 8k draft vocabulary); 0 keeps all (default)")
    t.add_argument("--init-from", default=None, metavar="HEAD",
                   help="start from this head's weights and draft vocabulary (a head directory this "
                        "target's training wrote) with a new schedule, e.g. to train a head further "
                        "on more data")
    t.add_argument("--taps", type=int_list, default=None, help="target taps (default 2,L//2,L-3)")
    t.add_argument("--max-prompt-len", type=int, default=384,
                   help="--data sharegpt: skip prompts longer than this many tokens (default 384)")
    t.add_argument("--dtype", default=None,
                   help="the frozen target's dtype for regeneration and features: float32 (default) "
                        "or bfloat16 (faster; the data need not be bit-exact)")
    t.add_argument("--autocast", action="store_true",
                   help="train the head under bf16 autocast (fp32 master weights): several times "
                        "faster on CPUs with AMX / AVX-512 BF16, slower elsewhere")
    t.add_argument("--max-seq-len", type=int, default=None,
                   help="the target's context while training (default: its own, at most 4096)")
    t.add_argument("--threads", type=int, default=None, help="torch threads per process")
    t.add_argument("--quiet", action="store_true", help="no progress bars")
    t.set_defaults(func=cmd_train_draft)
