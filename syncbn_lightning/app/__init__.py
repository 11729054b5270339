"""The training service built on the library: Hydra configs, detector and COCO-format data, the
DDP rank launcher, W&B/CSV logging and the PNG report. Needs the ``[app]`` extra
(``pip install "syncbn_lightning[app]"``); ``import syncbn_lightning`` never imports it.

Modules:
    train: one job (``syncbn-train``, ``python train.py``): validate, launch ranks, fit, evaluate.
    config: composing and validating the config (``ConfigError``), building config groups.
    launch: starting a job's other DDP processes from its resolved config.
    loggers: W&B and CSV loggers and what rank 0 adds to a W&B run.
    checkpoint: checkpoint IO that never leaves a truncated file.
    report: the PNG report of a run directory (``syncbn-report``).
    tasks: the models (CenterNet detector, classifier) and the COCO-format data.
"""
