"""Launched by `trl-prefix-sharing rloo` through `accelerate launch` (also runnable as `python -m
trl_prefix_sharing.cli.rloo`)."""

from trl_prefix_sharing.cli.train import run_script


if __name__ == "__main__":
    run_script("rloo")
