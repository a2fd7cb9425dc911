"""`eagle3 bench`: the A/B harness (harness.py), transformers peers (peers.py), the Markdown
report (report.py), plots (plots.py) and the command line (cli.py)."""

from .harness import Sample, cost_model, generate_arm, interleave, run_bench, summarize

__all__ = ["Sample", "cost_model", "generate_arm", "interleave", "run_bench", "summarize"]
