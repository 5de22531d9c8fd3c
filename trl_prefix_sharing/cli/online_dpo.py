"""Launched by `trl-prefix-sharing online_dpo` through `accelerate launch` (also runnable as `python -m
trl_prefix_sharing.cli.online_dpo`)."""

from trl_prefix_sharing.cli.train import run_script


if __name__ == "__main__":
    run_script("online_dpo")
