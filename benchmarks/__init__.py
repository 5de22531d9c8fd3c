"""The benchmarks of `trl_prefix_sharing`: stock TRL and this package side by side, in one process, as ratios.

One harness, run from the repository's root as `python -m benchmarks.<workload> ...`:

- `data.py`: the synthetic data (the paper's dataset profiles, lengths spread around a median, one-token words);
- `models.py`: the models (tiny from a config, ~0.5B on a GPU, SmolLM2-135M-Instruct) and the quiet set-up;
- `measure.py`: what is measured around a trainer (epoch time, positions, activation memory) and the interleaved
  rounds every comparison times its variants in;
- `results.py`: the one result schema (`<stem>.json` beside `<stem>.md`, with the command that made them);
- `plot.py`: the plots, from the recorded JSON;
- a workload per trainer family, each building stock TRL's and this package's trainers with one factory
  (`trl_prefix_sharing.testing.trainers.build_trainer`, from the table of trainers).

Every table in `docs/benchmarks` names the command that made it.
"""
