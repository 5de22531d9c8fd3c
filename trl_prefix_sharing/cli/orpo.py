"""Launched by `trl-prefix-sharing orpo` through `accelerate launch` (also runnable as `python -m
trl_prefix_sharing.cli.orpo`)."""

from trl_prefix_sharing.cli.train import run_script


if __name__ == "__main__":
    run_script("orpo")
