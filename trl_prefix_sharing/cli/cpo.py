"""Launched by `trl-prefix-sharing cpo` through `accelerate launch` (also runnable as `python -m
trl_prefix_sharing.cli.cpo`)."""

from trl_prefix_sharing.cli.train import run_script


if __name__ == "__main__":
    run_script("cpo")
