"""Hyperparameter search (conf/search/): Optuna studies driven through Hydra's sweeper API.

- ``sweeper``: the study loop behind ``hydra/sweeper=runlab`` (pruning, resume, failure tolerance);
- ``trial``: the trainer's hook that reports each epoch to the study and asks whether to prune;
- ``report``: the sweep report (table, plots, optimization_results.yaml, best trials as experiment YAMLs);
- ``ray_launcher``: hydra-ray-launcher with clear errors and a safe cluster connection;
- ``reaper``: a script that ends a local Ray instance's processes with its sweep driver, a killed one included;
- ``slurm_launcher``: hydra-submitit-launcher's SLURM launcher (``launcher=slurm``), or the same jobs run locally.

The private Optuna, Hydra-plugin and Ray APIs these use are in framework/private_apis.py.
"""
