"""Launched by `trl-prefix-sharing kto` through `accelerate launch` (also runnable as `python -m
trl_prefix_sharing.cli.kto`)."""

from trl_prefix_sharing.cli.train import run_script


if __name__ == "__main__":
    run_script("kto")
