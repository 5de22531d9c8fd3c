"""Launched by `trl-prefix-sharing grpo` through `accelerate launch` (also runnable as `python -m
trl_prefix_sharing.cli.grpo`)."""

from trl_prefix_sharing.cli.train import run_script


if __name__ == "__main__":
    run_script("grpo")
